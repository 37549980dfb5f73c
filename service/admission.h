// TenantAdmission: the per-tenant limits a call meets before any of its work is queued
// (docs/OPERATIONS.md "Limits on streams and calls"): calls in flight
// (limits.max_calls_per_tenant, open Ingest streams included) and open Ingest streams
// (limits.max_streams_per_tenant). A call over a limit is refused with RESOURCE_EXHAUSTED
// naming the limit and the tenant; an admitted call holds a Ticket until it has ended.
//
// Transport-free and thread-safe; one per daemon (the Server's), which the gRPC service
// and the UCX data plane both admit into, so that a tenant's caps hold across both.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvshade::service {

class TenantAdmission {
 public:
  // 0: no cap.
  TenantAdmission(uint32_t max_calls, uint32_t max_streams)
      : max_calls_(max_calls), max_streams_(max_streams) {}
  TenantAdmission(const TenantAdmission&) = delete;
  TenantAdmission& operator=(const TenantAdmission&) = delete;

  // A call's slots: one call, and one stream for an Ingest stream. Given back when the
  // ticket is destroyed or reset. Must not outlive its TenantAdmission.
  class Ticket {
   public:
    Ticket() = default;
    Ticket(Ticket&& o) noexcept { *this = std::move(o); }
    Ticket& operator=(Ticket&& o) noexcept;
    ~Ticket() { Reset(); }
    void Reset();
    bool held() const { return owner_ != nullptr; }

   private:
    friend class TenantAdmission;
    TenantAdmission* owner_ = nullptr;
    std::string tenant_;
    bool stream_ = false;
  };

  // Takes a call slot of `tenant` (and a stream slot when `stream`), or RESOURCE_EXHAUSTED
  // naming the limit that is reached ("<method>: tenant 'x' already has N calls in flight
  // (limits.max_calls_per_tenant)..."); the call cap is checked first.
  absl::StatusOr<Ticket> Admit(std::string_view method, std::string_view tenant, bool stream);

  // What `tenant` holds now.
  uint32_t calls(std::string_view tenant) const;
  uint32_t streams(std::string_view tenant) const;
  // Calls in flight over every tenant, both transports.
  uint32_t calls() const;

 private:
  struct Held {
    uint32_t calls = 0, streams = 0;
  };
  void Release(const std::string& tenant, bool stream);

  const uint32_t max_calls_, max_streams_;
  mutable std::mutex mu_;
  std::map<std::string, Held, std::less<>> held_;
};

}  // namespace kvshade::service
