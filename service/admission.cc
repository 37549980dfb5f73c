// TenantAdmission (admission.h): per-tenant call and stream slots.
#include "admission.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvshade::service {

TenantAdmission::Ticket& TenantAdmission::Ticket::operator=(Ticket&& o) noexcept {
  if (this != &o) {
    Reset();
    owner_ = std::exchange(o.owner_, nullptr);
    tenant_ = std::move(o.tenant_);
    stream_ = o.stream_;
  }
  return *this;
}

void TenantAdmission::Ticket::Reset() {
  if (owner_ == nullptr) return;
  std::exchange(owner_, nullptr)->Release(tenant_, stream_);
}

absl::StatusOr<TenantAdmission::Ticket> TenantAdmission::Admit(std::string_view method,
                                                               std::string_view tenant,
                                                               bool stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(tenant);
  const Held now = it == held_.end() ? Held{} : it->second;
  if (max_calls_ != 0 && now.calls >= max_calls_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(std::string(method), ": tenant '", std::string(tenant), "' already has ", max_calls_,
                     " calls in flight (limits.max_calls_per_tenant); retry when one has ended"));
  }
  if (stream && max_streams_ != 0 && now.streams >= max_streams_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        std::string(method), ": tenant '", std::string(tenant), "' already has ", max_streams_,
        " open Ingest streams (limits.max_streams_per_tenant); finish or cancel one, or retry "
        "later"));
  }
  if (it == held_.end()) it = held_.emplace(std::string(tenant), Held{}).first;
  ++it->second.calls;
  if (stream) ++it->second.streams;
  Ticket t;
  t.owner_ = this;
  t.tenant_ = std::string(tenant);
  t.stream_ = stream;
  return t;
}

void TenantAdmission::Release(const std::string& tenant, bool stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(tenant);
  if (it == held_.end()) return;
  --it->second.calls;
  if (stream) --it->second.streams;
  if (it->second.calls == 0) held_.erase(it);
}

uint32_t TenantAdmission::calls(std::string_view tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(tenant);
  return it == held_.end() ? 0 : it->second.calls;
}

uint32_t TenantAdmission::calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t n = 0;
  for (const auto& [tenant, held] : held_) n += held.calls;
  return n;
}

uint32_t TenantAdmission::streams(std::string_view tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(tenant);
  return it == held_.end() ? 0 : it->second.streams;
}

}  // namespace kvshade::service
