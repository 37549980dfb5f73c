// kvshade-server configuration: YAML loading (yaml-cpp), byte-size parsing, tenant tokens
// and validation. Every key the loader accepts is documented in deploy/kvshade.yaml and
// docs/OPERATIONS.md ("Configuration"); an unknown key is an error so that a typo never
// silently falls back to a default. yaml-cpp reports errors by exception; they are
// converted to Status here and never leave this file.
#include "kvshade/service/config.h"

#include <arpa/inet.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>

#include <yaml-cpp/yaml.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/devices.h"

namespace kvshade::service {
namespace {

std::string Where(const YAML::Node& node, std::string_view key) {
  const YAML::Mark m = node.Mark();
  if (m.line < 0) return std::string(key);
  return absl::StrCat(std::string(key), " (line ", m.line + 1, ")");
}

// Reads a scalar of type T; the caller catches YAML exceptions.
template <typename T>
absl::Status ReadScalar(const YAML::Node& node, std::string_view key, T* out) {
  if (!node.IsScalar()) {
    return absl::InvalidArgumentError(absl::StrCat("config: ", Where(node, key), " must be a scalar"));
  }
  try {
    if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, std::string> ||
                  std::is_floating_point_v<T>) {
      *out = node.as<T>();
    } else {
      // Integers: reject negatives and overflow explicitly (yaml-cpp wraps unsigned).
      const std::string text = node.as<std::string>();
      uint64_t v = 0;
      if (!absl::SimpleAtoi(text, &v) || v > std::numeric_limits<T>::max()) {
        return absl::InvalidArgumentError(
            absl::StrCat("config: ", Where(node, key), " must be an integer in [0, ",
                         static_cast<uint64_t>(std::numeric_limits<T>::max()), "], got '", text, "'"));
      }
      *out = static_cast<T>(v);
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: ", Where(node, key), ": ", e.what()));
  }
  return absl::OkStatus();
}

absl::Status ReadBytes(const YAML::Node& node, std::string_view key, uint64_t* out) {
  if (!node.IsScalar()) {
    return absl::InvalidArgumentError(absl::StrCat("config: ", Where(node, key), " must be a size"));
  }
  auto v = ParseByteSize(node.Scalar());
  if (!v.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: ", Where(node, key), ": ", v.status().message()));
  }
  *out = *v;
  return absl::OkStatus();
}

// A reader stores one key's value into the object being loaded (Target); `path` names the
// key in errors (limits.max_batch). The tables of readers are built once (static) and take
// that object as an argument, so loading a config builds no table.
template <typename Target>
using KeyReader = std::function<absl::Status(const YAML::Node&, std::string_view path, Target&)>;
template <typename Target>
using Readers = std::map<std::string, KeyReader<Target>>;

// A map of key -> reader; keys not in the table are rejected.
template <typename Target>
absl::Status ReadMap(const YAML::Node& node, std::string_view section, const Readers<Target>& readers,
                     Target& into) {
  if (!node.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: ", Where(node, section), " must be a mapping"));
  }
  for (const auto& kv : node) {
    const std::string key = kv.first.as<std::string>();
    auto it = readers.find(key);
    if (it == readers.end()) {
      std::vector<std::string> known;
      for (const auto& [k, _] : readers) known.push_back(k);
      return absl::InvalidArgumentError(absl::StrCat(
          "config: unknown key '", section.empty() ? "" : absl::StrCat(std::string(section), "."),
          key, "' (line ", kv.first.Mark().line + 1, "); known keys: ", absl::StrJoin(known, ", ")));
    }
    if (kv.second.IsNull()) continue;  // "key:" with no value keeps the default
    const std::string path = section.empty() ? key : absl::StrCat(std::string(section), ".", key);
    absl::Status s = it->second(kv.second, path, into);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Readers of a field: `field` of C (the loaded object or one of its bases) or, with
// `section`, `field` of the member `section` of C. kBytes reads a byte size (512MiB),
// otherwise a scalar of the field's type.
template <bool kBytes, typename T>
absl::Status ReadValue(const YAML::Node& n, std::string_view path, T* out) {
  if constexpr (kBytes) {
    return ReadBytes(n, path, out);
  } else {
    return ReadScalar(n, path, out);
  }
}
template <bool kBytes, typename C, typename T>
struct Field {
  T C::*field;
  template <typename Target>
  absl::Status operator()(const YAML::Node& n, std::string_view path, Target& t) const {
    return ReadValue<kBytes>(n, path, &(static_cast<C&>(t).*field));
  }
};
template <bool kBytes, typename C, typename S, typename T>
struct SectionField {
  S C::*section;
  T S::*field;
  template <typename Target>
  absl::Status operator()(const YAML::Node& n, std::string_view path, Target& t) const {
    return ReadValue<kBytes>(n, path, &((static_cast<C&>(t).*section).*field));
  }
};
template <typename C, typename T>
Field<false, C, T> Scalar(T C::*field) {
  return {field};
}
template <typename C, typename S, typename T>
SectionField<false, C, S, T> Scalar(S C::*section, T S::*field) {
  return {section, field};
}
template <typename C>
Field<true, C, uint64_t> Bytes(uint64_t C::*field) {
  return {field};
}
template <typename C, typename S>
SectionField<true, C, S, uint64_t> Bytes(S C::*section, uint64_t S::*field) {
  return {section, field};
}

bool ValidTenantName(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) {
      return false;
    }
  }
  return true;
}

absl::Status AddToken(std::string name, std::string token, ServerConfig* config) {
  if (!ValidTenantName(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tenant name '", name, "' must be 1-64 characters of [A-Za-z0-9._-]"));
  }
  if (token.size() < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("token of tenant '", name, "' must be at least 8 characters, got ", token.size()));
  }
  for (char c : token) {
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(absl::StrCat(
          "token of tenant '", name, "' must be printable ASCII without spaces"));
    }
  }
  auto [it, inserted] = config->tenant_tokens.emplace(token, name);
  if (!inserted && it->second != name) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the same token is given to tenants '", it->second, "' and '", name, "'"));
  }
  return absl::OkStatus();
}

absl::Status ReadTenants(const YAML::Node& node, ServerConfig* config) {
  if (!node.IsSequence()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: ", Where(node, "tenants"), " must be a list of {name, token} or {name, token_file}"));
  }
  struct Tenant {
    std::string name, token, token_file;
  };
  static const Readers<Tenant>* const kTenantKeys = new Readers<Tenant>{
      {"name", Scalar(&Tenant::name)},
      {"token", Scalar(&Tenant::token)},
      {"token_file", Scalar(&Tenant::token_file)}};
  for (const auto& item : node) {
    Tenant tenant;
    absl::Status s = ReadMap(item, "tenants[]", *kTenantKeys, tenant);
    if (!s.ok()) return s;
    auto& [name, token, token_file] = tenant;
    if (!token.empty() == !token_file.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config: tenant '", name, "' (line ", item.Mark().line + 1,
          ") needs exactly one of token or token_file"));
    }
    if (!token_file.empty()) {
      std::ifstream in(token_file);
      if (!in) {
        return absl::InvalidArgumentError(
            absl::StrCat("config: cannot read token_file '", token_file, "' of tenant '", name, "'"));
      }
      std::getline(in, token);
      token = std::string(absl::StripAsciiWhitespace(token));
    }
    s = AddToken(name, token, config);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("config: ", s.message()));
  }
  return absl::OkStatus();
}

bool Readable(const std::string& path) { return access(path.c_str(), R_OK) == 0; }

// Whether a file can be created in the directory `dir`: a probe file is created and removed
// at once. access(W_OK) alone says yes to root where new files are refused anyway (sysfs,
// procfs), and RocksDB needs to create its files there.
absl::Status CanCreateIn(const std::string& dir) {
  std::string probe = dir + "/.kvshade-write-check-XXXXXX";
  const int fd = mkstemp(probe.data());
  if (fd < 0) return absl::PermissionDeniedError(std::strerror(errno));
  close(fd);
  unlink(probe.c_str());
  return absl::OkStatus();
}

// The spill tier's RocksDB directory must be usable: an existing directory this process can
// create files in, or a path RocksDB can create (it makes only the last component), i.e.
// one whose parent is such a directory.
absl::Status CheckSpillPath(const std::string& spill_path) {
  std::string p = spill_path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  struct stat st;
  if (stat(p.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("spill_path '", spill_path, "' exists and is not a directory"));
    }
    if (absl::Status w = CanCreateIn(p); !w.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spill_path '", spill_path, "' is not writable (", w.message(),
          "): the spill tier (RocksDB) creates its files there"));
    }
    return absl::OkStatus();
  }
  if (errno == ENOTDIR) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spill_path '", spill_path, "': a component of the path is not a directory"));
  }
  if (errno != ENOENT) {
    return absl::InvalidArgumentError(
        absl::StrCat("spill_path '", spill_path, "' cannot be examined: ", std::strerror(errno)));
  }
  const size_t slash = p.rfind('/');
  const std::string parent = slash == std::string::npos ? "." : slash == 0 ? "/" : p.substr(0, slash);
  if (stat(parent.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spill_path '", spill_path, "' does not exist and its parent directory '", parent,
        "' does not exist (only the last component is created); create it first"));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spill_path '", spill_path, "': its parent '", parent, "' is not a directory"));
  }
  if (absl::Status w = CanCreateIn(parent); !w.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spill_path '", spill_path, "' does not exist and its parent directory '", parent,
        "' is not writable (", w.message(), "), so it cannot be created"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> ParseByteSize(std::string_view text) {
  std::string t = absl::AsciiStrToLower(absl::StripAsciiWhitespace(std::string(text)));
  size_t i = 0;
  while (i < t.size() && (std::isdigit(static_cast<unsigned char>(t[i])) || t[i] == '.')) ++i;
  const std::string number = t.substr(0, i);
  const std::string unit(absl::StripAsciiWhitespace(t.substr(i)));
  double value = 0;
  if (number.empty() || !absl::SimpleAtod(number, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte size '", std::string(text), "' must look like 4096, 512MiB or 8GiB"));
  }
  static const std::map<std::string, double> kUnits = {
      {"", 1},           {"b", 1},
      {"k", 1024.0},     {"kb", 1024.0},     {"kib", 1024.0},
      {"m", 1048576.0},  {"mb", 1048576.0},  {"mib", 1048576.0},
      {"g", 1073741824.0}, {"gb", 1073741824.0}, {"gib", 1073741824.0},
      {"t", 1099511627776.0}, {"tb", 1099511627776.0}, {"tib", 1099511627776.0}};
  auto it = kUnits.find(unit);
  if (it == kUnits.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "byte size '", std::string(text), "': unknown unit '", unit, "' (use B, KiB, MiB, GiB or TiB)"));
  }
  const double bytes = value * it->second;
  if (!(bytes < 1.8e19)) {
    return absl::InvalidArgumentError(absl::StrCat("byte size '", std::string(text), "' is too large"));
  }
  return static_cast<uint64_t>(std::llround(bytes));
}

absl::Status AddTenantToken(std::string_view name_colon_token, ServerConfig* config) {
  const size_t colon = name_colon_token.find(':');
  if (colon == std::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tenant token must be NAME:TOKEN, got a value without ':' (", name_colon_token.size(),
        " characters)"));
  }
  return AddToken(std::string(name_colon_token.substr(0, colon)),
                  std::string(name_colon_token.substr(colon + 1)), config);
}

absl::Status LoadTokensFile(const std::string& path, ServerConfig* config) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read tokens file '", path, "'"));
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    const std::string l(absl::StripAsciiWhitespace(line));
    if (l.empty() || l[0] == '#') continue;
    absl::Status s = AddTenantToken(l, config);
    if (!s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens file '", path, "' line ", line_no, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

namespace {

// What a load fills: the config, and two values that are read into pending fields and
// applied after every source has been read (a tokens file is loaded once; the port is
// range-checked once).
struct Loading : ServerConfig {
  std::string pending_tokens_file;
  uint32_t pending_metrics_port = 0;
};

// One entry of the configuration schema: a leaf key with its reader, or a section (tls,
// limits, ...) with a reader per key. The YAML loader and the environment overlay both
// walk this one table, so a key added here is at once a YAML key and a KVSHADE_* variable.
struct SchemaEntry {
  KeyReader<Loading> read;  // leaf keys
  Readers<Loading> section;   // sections
};
using Schema = std::map<std::string, SchemaEntry>;

// The schema, built once. `top` reads the root mapping: a leaf's reader, or for a section
// one that reads the section's mapping with the section's readers.
struct ConfigSchema {
  Schema entries;
  Readers<Loading> top;
};

const ConfigSchema& TheSchema() {
  static const ConfigSchema* const kSchema = [] {
    using C = ServerConfig;
    using L = LimitsConfig;
    using P = ProfileDefaults;
    auto* s = new ConfigSchema;
    s->entries = {
        {"listen", {Scalar(&C::listen), {}}},
        {"backend", {Scalar(&C::backend), {}}},
        {"device_budget", {Bytes(&C::device_budget_bytes), {}}},
        {"device_growth", {Bytes(&C::device_growth_bytes), {}}},
        {"host_budget", {Bytes(&C::host_budget_bytes), {}}},
        {"spill_budget", {Bytes(&C::spill_budget_bytes), {}}},
        {"spill_path", {Scalar(&C::spill_path), {}}},
        {"append_fsync", {Scalar(&C::append_fsync), {}}},
        {"spill_on_damage", {Scalar(&C::spill_on_damage), {}}},
        {"spill_repair", {Scalar(&C::spill_repair), {}}},
        {"prefix_secret", {Scalar(&C::prefix_secret), {}}},
        {"metrics_port", {Scalar(&Loading::pending_metrics_port), {}}},
        {"metrics_listen", {Scalar(&C::metrics_listen), {}}},
        {"worker_threads", {Scalar(&C::worker_threads), {}}},
        {"tokens_file", {Scalar(&Loading::pending_tokens_file), {}}},
        {"tenants",
         {[](const YAML::Node& n, std::string_view, Loading& d) { return ReadTenants(n, &d); }, {}}},
        {"tls",
         {nullptr,
          {{"cert_file", Scalar(&C::tls, &TlsConfig::cert_file)},
           {"key_file", Scalar(&C::tls, &TlsConfig::key_file)},
           {"client_ca_file", Scalar(&C::tls, &TlsConfig::client_ca_file)},
           {"require_client_cert", Scalar(&C::tls, &TlsConfig::require_client_cert)}}}},
        {"ucx",
         {nullptr,
          {{"enable", Scalar(&C::ucx, &UcxConfig::enable)},
           {"transports", Scalar(&C::ucx, &UcxConfig::transports)},
           {"engine_threads", Scalar(&C::ucx, &UcxConfig::engine_threads)},
           {"inline_max_batch", Scalar(&C::ucx, &UcxConfig::inline_max_batch)},
           {"busy_poll_us", Scalar(&C::ucx, &UcxConfig::busy_poll_us)},
           {"receive_buffers", Scalar(&C::ucx, &UcxConfig::receive_buffers)},
           {"receive_buffer_bytes", Bytes(&C::ucx, &UcxConfig::receive_buffer_bytes)}}}},
        {"same_node",
         {nullptr,
          {{"export", Scalar(&C::same_node, &SameNodeConfig::export_state)},
           {"host_memory", Scalar(&C::same_node, &SameNodeConfig::host_memory)},
           {"descriptor_broker", Scalar(&C::same_node, &SameNodeConfig::descriptor_broker)}}}},
        {"limits",
         {nullptr,
          {{"max_tokens_per_session", Scalar(&C::limits, &L::max_tokens_per_session)},
           {"max_sessions_per_tenant", Scalar(&C::limits, &L::max_sessions_per_tenant)},
           {"max_message_bytes", Bytes(&C::limits, &L::max_message_bytes)},
           {"max_batch", Scalar(&C::limits, &L::max_batch)},
           {"max_attachments_per_session", Scalar(&C::limits, &L::max_attachments_per_session)},
           {"default_lease_ms", Scalar(&C::limits, &L::default_lease_ms)},
           {"max_lease_ms", Scalar(&C::limits, &L::max_lease_ms)},
           {"max_layers", Scalar(&C::limits, &L::max_layers)},
           {"max_head_dim", Scalar(&C::limits, &L::max_head_dim)},
           {"session_idle_ttl_s", Scalar(&C::limits, &L::session_idle_ttl_s)},
           {"stream_idle_timeout_ms", Scalar(&C::limits, &L::stream_idle_timeout_ms)},
           {"stream_min_bytes_per_s", Bytes(&C::limits, &L::stream_min_bytes_per_s)},
           {"stream_progress_window_ms", Scalar(&C::limits, &L::stream_progress_window_ms)},
           {"max_streams_per_tenant", Scalar(&C::limits, &L::max_streams_per_tenant)},
           {"max_calls_per_tenant", Scalar(&C::limits, &L::max_calls_per_tenant)}}}},
        {"profile",
         {nullptr,
          {{"rank", Scalar(&C::profile, &P::rank)},
           {"chunk_size", Scalar(&C::profile, &P::chunk_size)},
           {"sparse_budget", Scalar(&C::profile, &P::sparse_budget)},
           {"outliers", Scalar(&C::profile, &P::outliers)},
           {"local_window", Scalar(&C::profile, &P::local_window)},
           {"heavy_chunks", Scalar(&C::profile, &P::heavy_chunks)},
           {"min_tokens", Scalar(&C::profile, &P::min_tokens)},
           {"kivi_group", Scalar(&C::profile, &P::kivi_group)},
           {"keep_sink", Scalar(&C::profile, &P::keep_sink)},
           {"refactor_threshold", Scalar(&C::profile, &P::refactor_threshold)},
           {"mini_recent_ratio", Scalar(&C::profile, &P::mini_recent_ratio)},
           {"mini_heavy_ratio", Scalar(&C::profile, &P::mini_heavy_ratio)},
           {"value_codec", Scalar(&C::profile, &P::value_codec)},
           {"int4_from_tokens", Scalar(&C::profile, &P::int4_from_tokens)},
           {"rerank_factor", Scalar(&C::profile, &P::rerank_factor)},
           {"key_signature_bits", Scalar(&C::profile, &P::key_signature_bits)},
           {"selection_unit", Scalar(&C::profile, &P::selection_unit)},
           {"mass_top_p", Scalar(&C::profile, &P::mass_top_p)},
           {"mass_min_chunks", Scalar(&C::profile, &P::mass_min_chunks)},
           {"recall_sample_rate", Scalar(&C::profile, &P::recall_sample_rate)},
           {"recall_floor", Scalar(&C::profile, &P::recall_floor)},
           {"recall_action", Scalar(&C::profile, &P::recall_action)},
           {"factorize_iterations", Scalar(&C::profile, &P::factorize_iterations)},
           {"factorize_host_min_tokens", Scalar(&C::profile, &P::factorize_host_min_tokens)}}}},
        {"log",
         {nullptr,
          {{"level", Scalar(&C::log, &LogConfig::level)},
           {"format", Scalar(&C::log, &LogConfig::format)}}}},
        {"kv_events",
         {nullptr,
          {{"endpoint", Scalar(&C::kv_events, &KvEventsConfig::endpoint)},
           {"topic", Scalar(&C::kv_events, &KvEventsConfig::topic)}}}},
    };
    for (const auto& [key, entry] : s->entries) {
      if (entry.read) {
        s->top.emplace(key, entry.read);
      } else {
        const Readers<Loading>* section = &entry.section;
        s->top.emplace(key, [section](const YAML::Node& n, std::string_view path, Loading& d) {
          return ReadMap(n, path, *section, d);
        });
      }
    }
    return s;
  }();
  return *kSchema;
}

absl::Status ReadTree(const YAML::Node& root, Loading& into) {
  return ReadMap(root, "", TheSchema().top, into);
}

std::string EnvNameOf(absl::string_view key_path) {
  std::string name = "KVSHADE_";
  for (char ch : key_path) name += ch == '.' ? '_' : absl::ascii_toupper(static_cast<unsigned char>(ch));
  return name;
}

// The prefixes of the sections: a KVSHADE_* variable under one of them that names no key
// is a typo and is refused, as an unknown YAML key is. Other KVSHADE_* variables (the
// CLI's KVSHADE_TARGET, test settings) are not the daemon's and are left alone.
bool UnderASection(absl::string_view name) {
  for (const auto& [key, entry] : TheSchema().entries) {
    if (!entry.read && absl::StartsWith(name, EnvNameOf(key) + "_")) return true;
  }
  return false;
}

// Each configuration key's KVSHADE_* variable, from the schema, built once.
const std::vector<std::pair<std::string, std::string>>& EnvironmentVariables() {
  static const auto* const kVariables = [] {
    auto* out = new std::vector<std::pair<std::string, std::string>>;
    for (const auto& [key, entry] : TheSchema().entries) {
      if (entry.read) {
        out->emplace_back(key, EnvNameOf(key));
      } else {
        for (const auto& [sub, _] : entry.section) {
          const std::string path = absl::StrCat(key, ".", sub);
          out->emplace_back(path, EnvNameOf(path));
        }
      }
    }
    return out;
  }();
  return *kVariables;
}

// The key path of each variable's name.
const std::map<std::string, std::string>& KeyOfVariable() {
  static const auto* const kKeys = [] {
    auto* by_name = new std::map<std::string, std::string>;
    for (const auto& [key_path, name] : EnvironmentVariables()) by_name->emplace(name, key_path);
    return by_name;
  }();
  return *kKeys;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> ConfigEnvironmentVariables() {
  return EnvironmentVariables();
}

std::vector<std::pair<std::string, std::string>> ProcessEnvironment() {
  std::vector<std::pair<std::string, std::string>> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const absl::string_view entry(*e);
    if (!absl::StartsWith(entry, "KVSHADE_")) continue;
    const size_t eq = entry.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace_back(std::string(entry.substr(0, eq)), std::string(entry.substr(eq + 1)));
  }
  return env;
}

absl::StatusOr<ServerConfig> LoadConfig(const std::string& path,
                                        const std::vector<std::pair<std::string, std::string>>& env) {
  Loading c;
  c.pending_metrics_port = c.metrics_port;

  // 1. The YAML file, when there is one.
  if (!path.empty()) {
    YAML::Node root;
    try {
      root = YAML::LoadFile(path);
    } catch (const YAML::BadFile&) {
      return absl::NotFoundError(absl::StrCat("config: cannot read '", path, "'"));
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("config: '", path, "' is not valid YAML: ", e.what()));
    }
    if (!root.IsNull()) {  // an empty file keeps every default
      try {
        if (absl::Status s = ReadTree(root, c); !s.ok()) return s;
      } catch (const YAML::Exception& e) {
        return absl::InvalidArgumentError(absl::StrCat("config: '", path, "': ", e.what()));
      }
    }
  }

  // 2. KVSHADE_* variables over it, one key each, read by the same readers as the file's
  // values (so sizes, booleans and ranges parse alike). An empty value counts as unset.
  const std::map<std::string, std::string>& by_name = KeyOfVariable();
  for (const auto& [name, value] : env) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      if (UnderASection(name)) {
        std::vector<std::string> known;
        for (const auto& [n, _] : by_name) known.push_back(n);
        return absl::InvalidArgumentError(absl::StrCat(
            "environment: unknown variable ", name, " (it names no configuration key); known: ",
            absl::StrJoin(known, ", ")));
      }
      continue;
    }
    if (value.empty()) continue;
    const std::string& key_path = it->second;
    const size_t dot = key_path.find('.');
    try {
      // tenants is a list: its variable holds YAML flow text, [{name: a, token_file: /f}].
      YAML::Node leaf = key_path == "tenants" ? YAML::Load(value) : YAML::Node(value);
      YAML::Node root;
      if (dot == std::string::npos) {
        root[key_path] = leaf;
      } else {
        root[key_path.substr(0, dot)][key_path.substr(dot + 1)] = leaf;
      }
      if (absl::Status s = ReadTree(root, c); !s.ok()) {
        absl::string_view message = s.message();
        absl::ConsumePrefix(&message, "config: ");
        return absl::InvalidArgumentError(absl::StrCat("environment: ", name, ": ", message));
      }
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("environment: ", name, ": ", e.what()));
    }
  }

  if (c.pending_metrics_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: metrics_port must be in [0, 65535], got ", c.pending_metrics_port));
  }
  c.metrics_port = static_cast<uint16_t>(c.pending_metrics_port);
  if (!c.pending_tokens_file.empty()) {
    absl::Status s = LoadTokensFile(c.pending_tokens_file, &c);
    if (!s.ok()) return s;
  }
  return static_cast<ServerConfig&&>(c);
}

absl::StatusOr<ServerConfig> LoadConfigFile(const std::string& path) { return LoadConfig(path, {}); }

absl::Status ValidateConfig(const ServerConfig& c) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  // listen: host:port, [v6]:port, or unix:path.
  if (!absl::StartsWith(c.listen, "unix:")) {
    const size_t colon = c.listen.rfind(':');
    int port = -1;
    if (colon == std::string::npos || colon == 0 ||
        !absl::SimpleAtoi(c.listen.substr(colon + 1), &port) || port < 0 || port > 65535) {
      return bad("listen must be HOST:PORT (port 0-65535) or unix:PATH, got '", c.listen, "'");
    }
  }
  // One device, or several (docs/OPERATIONS.md "Devices"); cuda:all is counted at start.
  absl::StatusOr<std::vector<kernels::DeviceName>> devices =
      kernels::ParseDeviceList(c.backend, /*count_devices=*/false);
  if (!devices.ok()) {
    return bad("backend must be cpu, cuda, cuda:N, auto, a list of cuda:N or of cpu:N "
               "(cuda:0,cuda:1; cpu:0,cpu:1) or cuda:all; ", devices.status().message());
  }
  if (devices->size() > 1 || c.backend == "cuda:all") {
    // Each device's engine would open these for itself, and only one can.
    const std::string& kv = c.kv_events.endpoint;
    if (kv.find('*') != std::string::npos || kv.find("::") != std::string::npos ||
        absl::StartsWith(kv, "ipc://")) {
      return bad("backend '", c.backend, "' has several devices, each publishing its own "
                 "KV-events, and kv_events.endpoint '", kv, "' binds (only one could); connect "
                 "to the indexer instead (tcp://HOST:PORT)");
    }
    if (c.same_node.descriptor_broker != "auto" && c.same_node.descriptor_broker != "off") {
      return bad("backend '", c.backend, "' has several devices, each with its own descriptor "
                 "broker, and same_node.descriptor_broker '", c.same_node.descriptor_broker,
                 "' names one socket; leave it auto (a socket per device) or off");
    }
  }
  if (c.device_budget_bytes == 0) return bad("device_budget must be > 0");
  if (c.host_budget_bytes == 0) return bad("host_budget must be > 0");
  if (c.spill_budget_bytes != 0 && c.spill_path.empty()) {
    return bad("spill_budget is set but spill_path is empty");
  }
  if (!c.spill_path.empty()) {
    if (absl::Status s = CheckSpillPath(c.spill_path); !s.ok()) return s;
  }
  if (c.append_fsync != "no" && c.append_fsync != "everysec" && c.append_fsync != "always") {
    return bad("append_fsync must be no, everysec or always, got '", c.append_fsync, "'");
  }
  if (c.spill_on_damage != "serve_rest" && c.spill_on_damage != "refuse") {
    return bad("spill_on_damage must be serve_rest or refuse, got '", c.spill_on_damage, "'");
  }
  if (c.spill_repair && c.spill_path.empty()) return bad("spill_repair is set but spill_path is empty");
  // TLS
  const TlsConfig& t = c.tls;
  if (t.cert_file.empty() != t.key_file.empty()) {
    return bad("tls.cert_file and tls.key_file must be given together");
  }
  if (!t.cert_file.empty() && !Readable(t.cert_file)) return bad("tls.cert_file '", t.cert_file, "' is not readable");
  if (!t.key_file.empty() && !Readable(t.key_file)) return bad("tls.key_file '", t.key_file, "' is not readable");
  if (!t.client_ca_file.empty()) {
    if (t.cert_file.empty()) return bad("tls.client_ca_file needs tls.cert_file and tls.key_file");
    if (!Readable(t.client_ca_file)) return bad("tls.client_ca_file '", t.client_ca_file, "' is not readable");
  }
  if (t.require_client_cert && t.client_ca_file.empty()) {
    return bad("tls.require_client_cert needs tls.client_ca_file");
  }
  for (const auto& [token, name] : c.tenant_tokens) {
    if (!ValidTenantName(name)) return bad("tenant name '", name, "' must be 1-64 characters of [A-Za-z0-9._-]");
    if (token.size() < 8) return bad("token of tenant '", name, "' is shorter than 8 characters");
  }
  // Limits
  const LimitsConfig& l = c.limits;
  if (l.max_tokens_per_session == 0) return bad("limits.max_tokens_per_session must be > 0");
  if (l.max_tokens_per_session > (uint64_t{1} << 31)) {
    return bad("limits.max_tokens_per_session must be <= 2^31, got ", l.max_tokens_per_session);
  }
  if (l.max_sessions_per_tenant == 0) return bad("limits.max_sessions_per_tenant must be > 0");
  if (l.max_message_bytes < (1u << 20) || l.max_message_bytes > (uint64_t{2047} << 20)) {
    return bad("limits.max_message_bytes must be in [1MiB, 2047MiB], got ", l.max_message_bytes);
  }
  if (l.max_batch == 0) return bad("limits.max_batch must be > 0");
  if (l.max_attachments_per_session == 0) return bad("limits.max_attachments_per_session must be > 0");
  if (l.default_lease_ms == 0) return bad("limits.default_lease_ms must be > 0");
  if (l.default_lease_ms > l.max_lease_ms) {
    return bad("limits.default_lease_ms (", l.default_lease_ms, ") must be <= limits.max_lease_ms (",
               l.max_lease_ms, ")");
  }
  if (l.max_layers == 0) return bad("limits.max_layers must be > 0");
  if (l.max_head_dim == 0 || l.max_head_dim % 2 != 0) {
    return bad("limits.max_head_dim must be a positive even number, got ", l.max_head_dim);
  }
  if (l.stream_idle_timeout_ms != 0 &&
      (l.stream_idle_timeout_ms < 100 || l.stream_idle_timeout_ms > 86400000)) {
    return bad("limits.stream_idle_timeout_ms must be 0 (never) or in [100, 86400000], got ",
               l.stream_idle_timeout_ms);
  }
  if (l.stream_min_bytes_per_s > (uint64_t{1} << 30)) {
    return bad("limits.stream_min_bytes_per_s must be at most 1GiB (per second), got ",
               l.stream_min_bytes_per_s);
  }
  if (l.stream_progress_window_ms < 100 || l.stream_progress_window_ms > 86400000) {
    return bad("limits.stream_progress_window_ms must be in [100, 86400000], got ",
               l.stream_progress_window_ms);
  }
  if (l.max_streams_per_tenant > 65536) {
    return bad("limits.max_streams_per_tenant must be <= 65536, got ", l.max_streams_per_tenant);
  }
  if (l.max_calls_per_tenant > 65536) {
    return bad("limits.max_calls_per_tenant must be <= 65536, got ", l.max_calls_per_tenant);
  }
  // The guarantee of the call cap: one tenant's calls, however slow or stuck, leave a
  // thread to the others. A cap at or above the thread cap would not.
  if (const uint32_t cap = CallThreadCap(c); cap != 0 && l.max_calls_per_tenant >= cap) {
    return bad("limits.max_calls_per_tenant (", l.max_calls_per_tenant,
               ") must be below the call thread cap (worker_threads, at least 4: ", cap,
               "), or one tenant's calls can hold every thread; the automatic value (0) is ", cap - 1);
  }
  // Profile defaults
  const ProfileDefaults& p = c.profile;
  if (p.rank == 0 || p.rank % 8 != 0) return bad("profile.rank must be a positive multiple of 8, got ", p.rank);
  if (p.chunk_size == 0 || p.chunk_size > 256) return bad("profile.chunk_size must be in [1, 256], got ", p.chunk_size);
  if (p.sparse_budget == 0) return bad("profile.sparse_budget must be > 0");
  if (p.rerank_factor == 0 || p.rerank_factor > 64) {
    return bad("profile.rerank_factor must be in [1, 64] (1 = one stage), got ", p.rerank_factor);
  }
  if (p.key_signature_bits != 0 && !kernels::ValidSignatureBits(static_cast<int>(p.key_signature_bits))) {
    return bad("profile.key_signature_bits must be 0 (none), ", kernels::kSignatureBitsText, ", got ",
               p.key_signature_bits);
  }
  if (p.selection_unit > 0 && p.selection_unit < p.chunk_size &&
      (p.chunk_size % p.selection_unit != 0 || p.rerank_factor < 2)) {
    return bad("profile.selection_unit must divide chunk_size (", p.chunk_size,
               ") and needs rerank_factor > 1 (", p.rerank_factor, "), got ", p.selection_unit);
  }
  if (p.selection_unit > p.chunk_size) {
    return bad("profile.selection_unit must be at most chunk_size (", p.chunk_size, "), got ",
               p.selection_unit);
  }
  if (!(p.mass_top_p >= 0 && p.mass_top_p <= 1)) {
    return bad("profile.mass_top_p must be in [0, 1] (0 = fixed budget), got ", p.mass_top_p);
  }
  if (!(p.recall_sample_rate >= 0 && p.recall_sample_rate <= 1)) {
    return bad("profile.recall_sample_rate must be in [0, 1] (0 = off), got ", p.recall_sample_rate);
  }
  if (!(p.recall_floor > 0 && p.recall_floor <= 1)) {
    return bad("profile.recall_floor must be in (0, 1], got ", p.recall_floor);
  }
  if (p.recall_action != "report" && p.recall_action != "widen" && p.recall_action != "exact") {
    return bad("profile.recall_action must be report, widen or exact, got '", p.recall_action, "'");
  }
  if (p.factorize_iterations > 64) {
    return bad("profile.factorize_iterations must be in [0, 64], got ", p.factorize_iterations);
  }
  if (p.factorize_host_min_tokens > uint32_t(std::numeric_limits<int>::max())) {
    return bad("profile.factorize_host_min_tokens must be at most ", std::numeric_limits<int>::max(),
               ", got ", p.factorize_host_min_tokens);
  }
  if (p.kivi_group == 0 || (p.kivi_group & (p.kivi_group - 1)) != 0) {
    return bad("profile.kivi_group must be a power of two, got ", p.kivi_group);
  }
  static const std::set<std::string> kCodecs = {"auto", "bf16", "fp8", "int4", "int2"};
  if (!kCodecs.count(p.value_codec)) {
    return bad("profile.value_codec must be auto, bf16, fp8, int4 or int2, got '", p.value_codec, "'");
  }
  if (!(p.refactor_threshold > 0 && p.refactor_threshold <= 1)) {
    return bad("profile.refactor_threshold must be in (0, 1], got ", p.refactor_threshold);
  }
  if (!(p.mini_recent_ratio > 0 && p.mini_recent_ratio < 1)) {
    return bad("profile.mini_recent_ratio must be in (0, 1), got ", p.mini_recent_ratio);
  }
  if (!(p.mini_heavy_ratio >= 0 && p.mini_heavy_ratio < 1)) {
    return bad("profile.mini_heavy_ratio must be in [0, 1), got ", p.mini_heavy_ratio);
  }
  if (c.metrics_listen.empty()) return bad("metrics_listen must not be empty");
  static const std::set<std::string> kLevels = {"trace", "debug", "info", "warn", "error", "critical", "off"};
  if (!kLevels.count(c.log.level)) {
    return bad("log.level must be trace, debug, info, warn, error, critical or off, got '", c.log.level, "'");
  }
  if (const std::string& b = c.same_node.descriptor_broker;
      b.empty() || (b[0] == '@' && (b.size() < 2 || b.size() > 100)) ||
      (b[0] != '@' && b != "auto" && b != "off" && (b[0] != '/' || b.size() > 107))) {
    return bad("same_node.descriptor_broker must be auto, off, @name (1 to 99 characters) or "
               "an absolute socket path (at most 107 characters), got '", b, "'");
  }
  if (c.same_node.host_memory != "auto" && c.same_node.host_memory != "file") {
    return bad("same_node.host_memory must be auto or file, got '", c.same_node.host_memory, "'");
  }
  if (c.log.format != "text" && c.log.format != "json") {
    return bad("log.format must be text or json, got '", c.log.format, "'");
  }
  if (!c.kv_events.endpoint.empty() && c.kv_events.endpoint.find("://") == std::string::npos) {
    return bad("kv_events.endpoint must be a ZMQ endpoint (tcp://HOST:PORT, tcp://*:PORT, ipc://PATH), got '",
               c.kv_events.endpoint, "'");
  }
  if (c.worker_threads > 1024) return bad("worker_threads must be <= 1024, got ", c.worker_threads);
  if (c.ucx.engine_threads < 1 || c.ucx.engine_threads > 256) {
    return bad("ucx.engine_threads must be in [1, 256], got ", c.ucx.engine_threads);
  }
  if (c.ucx.busy_poll_us > 1000000) {
    return bad("ucx.busy_poll_us must be <= 1000000 (1 s), got ", c.ucx.busy_poll_us);
  }
  if (c.ucx.receive_buffers > 1024) {
    return bad("ucx.receive_buffers must be <= 1024, got ", c.ucx.receive_buffers);
  }
  if (c.ucx.receive_buffer_bytes < (uint64_t{64} << 10) ||
      c.ucx.receive_buffer_bytes > (uint64_t{1} << 30)) {
    return bad("ucx.receive_buffer_bytes must be in [64KiB, 1GiB], got ",
               c.ucx.receive_buffer_bytes);
  }
  if (c.ucx.receive_buffers * c.ucx.receive_buffer_bytes > (uint64_t{16} << 30)) {
    return bad("ucx.receive_buffers x ucx.receive_buffer_bytes must be <= 16 GiB, got ",
               c.ucx.receive_buffers * c.ucx.receive_buffer_bytes);
  }
  return absl::OkStatus();
}

bool IsLoopbackListen(std::string_view address) {
  absl::string_view listen(address.data(), address.size());
  if (absl::StartsWith(listen, "unix:") || absl::StartsWith(listen, "unix-abstract:")) return true;
  for (absl::string_view scheme : {"ipv4:", "ipv6:", "dns:"}) {
    if (absl::ConsumePrefix(&listen, scheme)) break;
  }
  absl::ConsumePrefix(&listen, "///");
  const size_t colon = listen.rfind(':');
  std::string host(listen.substr(0, colon == absl::string_view::npos ? listen.size() : colon));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (absl::AsciiStrToLower(host) == "localhost") return true;
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;  // a wildcard (0.0.0.0, ::), another interface's address or a host name
}

std::string InsecureListenWarning(const ServerConfig& c) {
  if (IsLoopbackListen(c.listen) || !c.tls.cert_file.empty() || !c.tenant_tokens.empty()) return "";
  return absl::StrCat(
      "listen address ", c.listen,
      " is not a loopback address and the server has neither TLS nor tenant tokens: anyone who "
      "can reach it can read, change and close every session. Set tenant tokens (tenants or "
      "tokens_file in the config; --tenant-token NAME:TOKEN or --tokens-file) and TLS "
      "(tls.cert_file and tls.key_file; --tls-cert and --tls-key), or listen on 127.0.0.1");
}

uint32_t CallThreadCap(const ServerConfig& c) {
  return c.worker_threads == 0 ? 0 : std::max<uint32_t>(c.worker_threads, 4);
}

uint32_t EffectiveMaxStreamsPerTenant(const ServerConfig& c) {
  if (c.limits.max_streams_per_tenant != 0) return c.limits.max_streams_per_tenant;
  const uint32_t cap = CallThreadCap(c);
  const uint32_t automatic = cap == 0 ? 64 : std::max<uint32_t>(cap / 2, 1);
  const uint32_t calls = EffectiveMaxCallsPerTenant(c);
  return calls == 0 ? automatic : std::min(automatic, calls);
}

uint32_t EffectiveMaxCallsPerTenant(const ServerConfig& c) {
  if (c.limits.max_calls_per_tenant != 0) return c.limits.max_calls_per_tenant;
  const uint32_t cap = CallThreadCap(c);
  return cap == 0 || c.tenant_tokens.empty() ? 0 : cap - 1;
}

std::string DescribeConfig(const ServerConfig& c) {
  std::set<std::string> tenants;
  for (const auto& [_, name] : c.tenant_tokens) tenants.insert(name);
  return absl::StrFormat(
      "listen=%s backend=%s device_budget=%d device_growth=%d host_budget=%d spill=%s append_fsync=%s tls=%s mtls=%s tenants=[%s] "
      "metrics=%s ucx=%s session_idle_ttl=%s streams_per_tenant=%d calls_per_tenant=%s "
      "stream_idle_timeout=%s stream_min_progress=%s",
      c.listen, c.backend, c.device_budget_bytes, c.device_growth_bytes, c.host_budget_bytes,
      c.spill_path.empty() ? "off" : c.spill_path, c.append_fsync, c.tls.cert_file.empty() ? "off" : "on",
      c.tls.require_client_cert ? "required" : (c.tls.client_ca_file.empty() ? "off" : "optional"),
      tenants.empty() ? "open" : absl::StrJoin(tenants, ","),
      c.metrics_port ? absl::StrCat(c.metrics_listen, ":", c.metrics_port) : "off",
      c.ucx.enable ? (c.ucx.transports.empty() ? std::string("auto") : c.ucx.transports)
                   : std::string("off"),
      c.limits.session_idle_ttl_s ? absl::StrCat(c.limits.session_idle_ttl_s, "s") : std::string("off"),
      EffectiveMaxStreamsPerTenant(c),
      EffectiveMaxCallsPerTenant(c) ? absl::StrCat(EffectiveMaxCallsPerTenant(c)) : std::string("off"),
      c.limits.stream_idle_timeout_ms ? absl::StrCat(c.limits.stream_idle_timeout_ms, "ms")
                                      : std::string("off"),
      c.limits.stream_min_bytes_per_s
          ? absl::StrCat(c.limits.stream_min_bytes_per_s, "B/s over ",
                         c.limits.stream_progress_window_ms, "ms")
          : std::string("off"));
}

}  // namespace kvshade::service
