// kvshade-server configuration: the YAML file (deploy/kvshade.yaml documents every key) and
// the structs the rest of the service reads. Flags (main.cc) override the file. A config is
// checked once by ValidateConfig before the server starts; nothing re-reads it afterwards.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvshade::service {

// gRPC transport security. All empty: plaintext. cert_file + key_file: TLS.
// client_ca_file additionally verifies client certificates (mTLS when require_client_cert).
struct TlsConfig {
  std::string cert_file, key_file, client_ca_file;
  bool require_client_cert = false;
};

// Per-request and per-tenant limits; a request over a limit gets RESOURCE_EXHAUSTED or
// INVALID_ARGUMENT naming the limit.
struct LimitsConfig {
  uint64_t max_tokens_per_session = 1 << 20;
  uint32_t max_sessions_per_tenant = 1024;
  uint64_t max_message_bytes = 512 << 20;  // gRPC max receive/send message size
  uint32_t max_batch = 256;                // queries per SelectAndReconstruct / Attend
  uint32_t max_attachments_per_session = 64;
  uint32_t default_lease_ms = 30000;
  uint32_t max_lease_ms = 600000;
  uint32_t max_layers = 256;
  uint32_t max_head_dim = 256;
  // Sessions no call has touched for this long and with no live attachment are closed by
  // the engine's maintenance (durable ones with their record); 0 = never.
  uint32_t session_idle_ttl_s = 0;
  // Limits on Ingest streams, gRPC and UCX (docs/OPERATIONS.md "Limits on streams and
  // calls"). An open stream holds no thread while it waits for the client; it holds its
  // tenant's stream and call slots and what it has received. A stream that sends no message
  // for this long is ended with DEADLINE_EXCEEDED; 0 = never.
  uint32_t stream_idle_timeout_ms = 30000;
  // Minimum progress: a stream that, over a window of stream_progress_window_ms spent
  // waiting for its messages, received fewer than stream_min_bytes_per_s times that window
  // is ended with DEADLINE_EXCEEDED (a stream that trickles, never idle for long). The
  // clock runs only while the server waits for the client. 0 = no minimum.
  uint64_t stream_min_bytes_per_s = 1024;
  uint32_t stream_progress_window_ms = 30000;
  // Open Ingest streams per tenant, over gRPC and UCX together; one more gets
  // RESOURCE_EXHAUSTED. 0 = automatic: half of the call thread cap when worker_threads is
  // set, else 64, and never above the call cap (EffectiveMaxStreamsPerTenant).
  uint32_t max_streams_per_tenant = 0;
  // Calls a tenant may have in flight at once, over gRPC and UCX together, Ingest streams
  // included; one more gets RESOURCE_EXHAUSTED before it takes a thread. 0 = automatic:
  // with worker_threads set and tenants configured, the call thread cap minus one (one
  // thread always left to the other tenants); otherwise no cap (EffectiveMaxCallsPerTenant).
  uint32_t max_calls_per_tenant = 0;
};

// Server-side defaults for every Profile field a request leaves at zero.
struct ProfileDefaults {
  uint32_t rank = 160, chunk_size = 8, sparse_budget = 256, outliers = 48, local_window = 32,
           heavy_chunks = 0, min_tokens = 8192, kivi_group = 32;
  // kivi_group: KIVI's own group size. A request that leaves it at 0 gets it where it
  // divides the model's head dim, else the largest power of two below it that does, down
  // to 16 (ResolveProfile): head dims of 80 or 48 get 16; a mini request at most 16.
  // value_codec "auto": int4 for shadow sessions whose prompt has at least this many
  // tokens (host RAM per 128K Llama-3-8B sequence: 2.5 GiB instead of 8 GiB), bf16 below.
  uint32_t int4_from_tokens = 32768;
  // Shadow factorization: 0 = full eigendecomposition of the key Gram matrix; q > 0 = the
  // top rank eigenpairs by q steps of subspace iteration (docs/ALGORITHM.md).
  uint32_t factorize_iterations = 4;
  // Backends with a device: the subspace iteration runs on the host for a layer of at least
  // this many tokens (leaving the GPU to a model prefilling on it), on the device below;
  // 0 = always on the device (docs/ALGORITHM.md, step 1).
  uint32_t factorize_host_min_tokens = 65536;
  bool keep_sink = true;
  float refactor_threshold = 0.05f, mini_recent_ratio = 0.1f, mini_heavy_ratio = 0.1f;
  // Selection options (docs/ALGORITHM.md "Selection options"): two-stage re-ranking
  // (rerank_factor x k candidates; 1 = one stage), budgets by attention mass (mass_top_p,
  // 0 = fixed k; floor mass_min_chunks) and the recall guard (recall_sample_rate of decode
  // steps checked against the oracle, 0 = off; recall_floor; recall_action report | widen |
  // exact).
  uint32_t rerank_factor = 1, mass_min_chunks = 32;
  // Key signatures of shadow sessions (docs/ALGORITHM.md "Key signatures"): 0 = none, 2, 4 or 8
  // bits per channel.
  uint32_t key_signature_bits = 0;
  // Selection units of shadow sessions (docs/ALGORITHM.md "Selection units"): tokens per
  // unit, 0 = whole chunks; must divide chunk_size (and needs rerank_factor > 1) per session.
  uint32_t selection_unit = 0;
  float mass_top_p = 0.0f, recall_sample_rate = 0.0f, recall_floor = 0.5f;
  std::string recall_action = "widen";
  std::string value_codec = "auto";  // auto | bf16 | fp8 | int4 | int2
};

// The UCX data plane (docs/API.md "UCX data plane"). Off by default: then Attach
// hands out no data-plane address and gRPC is the only transport.
struct UcxConfig {
  bool enable = false;
  std::string transports;       // UCX_TLS value, e.g. "tcp,self" or "shm,self"; "" = UCX's choice
  uint32_t engine_threads = 2;  // threads that run data-plane requests on the engine
  // SELECT and ATTEND frames of at most this many queries run on the progress thread
  // itself (no hand-off to an engine thread and back); 0: every request is handed off.
  uint32_t inline_max_batch = 8;
  // The progress thread keeps polling this long after its last message before it sleeps:
  // longer saves each decode call a wake-up and costs a busy core while calls keep coming.
  uint32_t busy_poll_us = 50;
  // Rendezvous payloads (ingest parts) land in these pre-faulted buffers, mapped at
  // start-up (receive_buffers x receive_buffer_bytes of resident memory); a payload that
  // finds none free, or is larger, gets an allocation of its own. 0 buffers: none.
  uint32_t receive_buffers = 8;
  uint64_t receive_buffer_bytes = uint64_t{16} << 20;
};

// Same-node decode (docs/DESIGN.md "Same-node decode"). Export hands a worker the
// daemon's arena and host value memory, which hold every tenant's sessions: turn it off on
// a node whose workers are not trusted like the daemon's own user.
struct SameNodeConfig {
  bool export_state = true;  // ExportSession allowed; memory allocated shareable
  // How shareable host memory is made: "auto" (CUDA: pinned host memory of the driver,
  // exported by descriptor, where the GPU supports it; else memory files) or "file".
  std::string host_memory = "auto";
  // Where workers take the descriptors of shared host memory (kernels DescriptorBroker):
  // "auto" (an abstract Unix socket named after the process), "off" (workers use
  // /proc/<pid>/fd or pidfd_getfd), "@name" (that abstract socket) or a socket path.
  std::string descriptor_broker = "auto";
};

// The daemon's log (docs/OPERATIONS.md "Logs"): spdlog on stderr.
struct LogConfig {
  std::string level = "info";   // trace | debug | info | warn | error | critical | off
  std::string format = "text";  // text | json (one JSON object per line)
};

// KV-events for cache-aware routers (docs/API.md "KV-events"): the prefix index
// published over ZMQ in vLLM's KV-events format. Off while endpoint is empty.
struct KvEventsConfig {
  std::string endpoint;  // e.g. "tcp://*:5557" (bind) or "tcp://indexer:5557" (connect)
  std::string topic;     // first frame of each message, e.g. "kv@<pod>@<model>" for llm-d
};

struct ServerConfig {
  std::string listen = "127.0.0.1:50551";  // gRPC host:port
  // One device: cpu | cuda | cuda:N | auto. Several (docs/OPERATIONS.md "Devices"), an engine
  // each: a list of cuda:N (cuda:0,cuda:1), cuda:all (every visible GPU, counted at start),
  // or a list of cpu:N (independent CPU devices, for tests and CPU-only hosts).
  std::string backend = "cpu";
  // device_budget is each device's; host_budget and spill_budget are the daemon's, divided
  // evenly between its devices.
  uint64_t device_budget_bytes = 8ull << 30, host_budget_bytes = 32ull << 30,
           spill_budget_bytes = 0;         // 0 = unbounded spill tier
  // The device tier holds memory on demand, in steps of this many bytes (capped at the
  // budget), and returns steps no data uses; 0 reserves the whole budget at start.
  uint64_t device_growth_bytes = 1ull << 30;
  std::string spill_path;                  // RocksDB directory; empty = no spill, no durability
  // When appends of durable sessions reach the disk (sessions may ask otherwise at create):
  // "no" (at the next commit or drain), "everysec" (written before the acknowledgement,
  // synced once a second), "always" (synced before the acknowledgement).
  std::string append_fsync = "no";
  // Damage found at start (docs/OPERATIONS.md "Damage"): "serve_rest" starts without the
  // damaged data and reports the sessions that lost data as damaged; "refuse" fails the
  // start instead, before anything on disk is changed where it can (a damaged WAL).
  std::string spill_on_damage = "serve_rest";
  // Runs RocksDB's RepairDB on spill_path before opening it (a MANIFEST or CURRENT file
  // RocksDB cannot open); an explicit, one-off operator request.
  bool spill_repair = false;
  TlsConfig tls;
  std::map<std::string, std::string> tenant_tokens;  // token -> tenant name
  std::string prefix_secret;  // mixed into tenant salts; keep stable across restarts
  LimitsConfig limits;
  ProfileDefaults profile;
  uint16_t metrics_port = 0;  // 0 = no /metrics endpoint
  std::string metrics_listen = "127.0.0.1";
  // Threads that run the work of gRPC calls (CallThreadCap); 0 = no cap (started on demand).
  uint32_t worker_threads = 0;
  UcxConfig ucx;
  SameNodeConfig same_node;
  LogConfig log;
  KvEventsConfig kv_events;
};

// Parses a YAML config file. Unknown keys are an error (a typo must not silently fall back
// to a default). Missing keys keep the defaults above.
absl::StatusOr<ServerConfig> LoadConfigFile(const std::string& path);

// The configuration from its sources, later ones winning: the defaults above, the YAML file
// at `path` (none when empty), then the environment. Every key has a variable named
// KVSHADE_ + the key's path in upper case with '.' as '_' (limits.session_idle_ttl_s ->
// KVSHADE_LIMITS_SESSION_IDLE_TTL_S), whose value is read as the file's would be; an empty
// value counts as unset; KVSHADE_TENANTS holds a YAML flow list and adds to the file's
// tenants. A variable under a section's prefix (KVSHADE_LIMITS_..., KVSHADE_TLS_...) that
// names no key is an error; other KVSHADE_* names are not the daemon's and are ignored.
// Command-line flags (main.cc) are applied over the result.
absl::StatusOr<ServerConfig> LoadConfig(const std::string& path,
                                        const std::vector<std::pair<std::string, std::string>>& env);
// Every configuration key path ("limits.max_batch") with its variable
// ("KVSHADE_LIMITS_MAX_BATCH"), sorted by key path.
std::vector<std::pair<std::string, std::string>> ConfigEnvironmentVariables();
// This process's KVSHADE_* variables as NAME, VALUE pairs.
std::vector<std::pair<std::string, std::string>> ProcessEnvironment();

// Checks ranges and cross-field rules (TLS files readable, budgets non-zero, spill_path a
// directory this process can create files in, or can create, ...).
absl::Status ValidateConfig(const ServerConfig&);

// The cap on the threads that run the work of gRPC calls (docs/OPERATIONS.md "Limits on
// streams and calls"): worker_threads with a floor of 4; 0 when uncapped.
uint32_t CallThreadCap(const ServerConfig& config);
// limits.max_streams_per_tenant, or its automatic value when 0: half of CallThreadCap (at
// least 1), or 64 without a cap; an automatic value never exceeds the call cap.
uint32_t EffectiveMaxStreamsPerTenant(const ServerConfig& config);
// limits.max_calls_per_tenant, or its automatic value when 0: CallThreadCap - 1 when the
// threads are capped and tenants are configured, else 0 (no cap).
uint32_t EffectiveMaxCallsPerTenant(const ServerConfig& config);

// Helpers shared by the YAML loader and the command-line flags.
// "8GiB", "512MiB", "64M", "1G", "4096" (bytes). K/M/G/T are powers of 1024 too.
absl::StatusOr<uint64_t> ParseByteSize(std::string_view text);
// Adds one "NAME:TOKEN" pair (a flag value or a tokens-file line).
absl::Status AddTenantToken(std::string_view name_colon_token, ServerConfig* config);
// Reads a tokens file: one "NAME:TOKEN" per line; blank lines and '#' comments skipped.
absl::Status LoadTokensFile(const std::string& path, ServerConfig* config);
// A one-line summary for the start-up log; never prints tokens or secrets.
std::string DescribeConfig(const ServerConfig& config);
// Whether a listen address reaches only this host: loopback (127.0.0.0/8, ::1,
// "localhost") or a unix socket. Wildcards (0.0.0.0, [::]) and host names are not.
bool IsLoopbackListen(std::string_view listen);
// The start-up warning for a server that listens beyond loopback with neither TLS nor
// tenant tokens (what is exposed and what to set), or "" when there is nothing to warn of.
std::string InsecureListenWarning(const ServerConfig& config);

}  // namespace kvshade::service
