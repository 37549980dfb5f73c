// Bearer-token authentication and tenant salts. Tokens are compared in constant time over
// every configured token (no early exit on the first matching byte or entry), so response
// timing does not reveal how much of a guessed token was right.
#include "kvshade/service/auth.h"

#include <cctype>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "kvshade/service/log.h"

namespace kvshade::service {
namespace {

// std::string_view helpers (Debian's Abseil has its own string_view type).
std::string_view Strip(std::string_view v) {
  while (!v.empty() && std::isspace(static_cast<unsigned char>(v.front()))) v.remove_prefix(1);
  while (!v.empty() && std::isspace(static_cast<unsigned char>(v.back()))) v.remove_suffix(1);
  return v;
}

bool ConsumeBearer(std::string_view* v) {
  if (v->size() < 7) return false;
  std::string_view scheme = v->substr(0, 7);
  if (scheme != "Bearer " && scheme != "bearer ") return false;
  v->remove_prefix(7);
  return true;
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  // Length is not secret (tokens have a public minimum length); the bytes are.
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

std::string TenantSalt(std::string_view tenant, std::string_view prefix_secret) {
  // HMAC-SHA256(key = prefix_secret, "kvshade/v1/tenant-salt/" + tenant), hex. Versioned
  // input so that a future change of derivation cannot collide with this one.
  const std::string msg = absl::StrCat("kvshade/v1/tenant-salt/", std::string(tenant));
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int mac_len = 0;
  static const char kEmptyKey[1] = {0};
  const void* key = prefix_secret.empty() ? static_cast<const void*>(kEmptyKey) : prefix_secret.data();
  HMAC(EVP_sha256(), key, static_cast<int>(prefix_secret.size()),
       reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), mac, &mac_len);
  return absl::BytesToHexString(
      std::string(reinterpret_cast<const char*>(mac), static_cast<size_t>(mac_len)));
}

Authenticator::Authenticator(const ServerConfig& config) {
  for (const auto& [token, name] : config.tenant_tokens) {
    tenants_[token] = Tenant{name, TenantSalt(name, config.prefix_secret)};
  }
  default_tenant_ = Tenant{"default", TenantSalt("default", config.prefix_secret)};
}

absl::StatusOr<Tenant> Authenticator::AuthenticateHeader(std::string_view authorization) const {
  if (tenants_.empty()) return default_tenant_;
  if (authorization.empty()) {
    return absl::UnauthenticatedError(
        "missing 'authorization: Bearer <token>' metadata (this server requires a tenant token)");
  }
  std::string_view v = Strip(authorization);
  if (!ConsumeBearer(&v)) {
    return absl::UnauthenticatedError("authorization metadata must be 'Bearer <token>'");
  }
  v = Strip(v);
  const Tenant* found = nullptr;
  for (const auto& [token, tenant] : tenants_) {
    if (ConstantTimeEquals(token, v)) found = &tenant;
  }
  if (found == nullptr) return absl::UnauthenticatedError("unknown bearer token");
  return *found;
}

absl::StatusOr<Tenant> Authenticator::Authenticate(const grpc::ServerContextBase& ctx) const {
  if (tenants_.empty()) return default_tenant_;
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  absl::StatusOr<Tenant> t =
      it == md.end() ? AuthenticateHeader("")
      : md.count("authorization") > 1
          ? absl::StatusOr<Tenant>(absl::UnauthenticatedError("more than one authorization metadata entry"))
          : AuthenticateHeader(std::string_view(it->second.data(), it->second.size()));
  if (!t.ok()) {
    // Never the token itself: the peer and the reason.
    log::Event(spdlog::level::warn, "auth_failed")
        .Str("peer", ctx.peer())
        .Str("reason", std::string(t.status().message()));
  }
  return t;
}

}  // namespace kvshade::service
