// Bearer-token authentication. Every RPC names its tenant through the metadata
// "authorization: Bearer <token>"; the tenant's salt scopes its sessions and prefix keys.
// The salt is derived from the tenant name (and the server's prefix_secret), never taken
// from a request, so one tenant can never address another's prefix entries.
#pragma once

#include <map>
#include <string>

#include <grpcpp/server_context.h>

#include "absl/status/statusor.h"
#include "kvshade/service/config.h"

namespace kvshade::service {

struct Tenant {
  std::string name;
  std::string salt;  // derived from name (+ prefix_secret), never from requests
};

class Authenticator {
 public:
  explicit Authenticator(const ServerConfig& config);

  // Reads "authorization: Bearer <token>" metadata. No tenants configured -> tenant
  // "default" (a token, if sent, is ignored). Unauthenticated on failure.
  absl::StatusOr<Tenant> Authenticate(const grpc::ServerContextBase& ctx) const;

  // Same check from a raw metadata value (tests, and transports other than gRPC).
  absl::StatusOr<Tenant> AuthenticateHeader(std::string_view authorization) const;

  bool open() const { return tenants_.empty(); }

 private:
  std::map<std::string, Tenant> tenants_;  // token -> tenant
  Tenant default_tenant_;
};

// The salt of a tenant: a keyed hash of its name. Stable across restarts for the same
// prefix_secret, so durable prefix keys stay valid.
std::string TenantSalt(std::string_view tenant, std::string_view prefix_secret);

}  // namespace kvshade::service
