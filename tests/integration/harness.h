// Integration-test harness: runs the REAL kvshade-server binary as a child process on a
// loopback port, waits for grpc.health.v1 SERVING with a deadline, and stops it with
// SIGTERM (or SIGKILL, for crash tests). Also: free ports, scratch directories, a tiny
// HTTP GET for /metrics, and small-model helpers shared by the tests.
//
// Ports are picked by binding port 0 and releasing it; the server refuses to share a port
// (SO_REUSEPORT off), so a rare collision shows up as a start failure, which Start()
// retries with a new port.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvshade/client/client.h"
#include "kvshade/kernels/types.h"
#include "kvshade/v1/kvshade.grpc.pb.h"
#include "synthetic.h"

namespace kvshade::integration {

// A free TCP port on 127.0.0.1 (bound to port 0, then released).
int FreePort();

// A fresh directory under $TEST_TMPDIR or /tmp, removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class ServerProcess {
 public:
  ServerProcess() = default;
  ~ServerProcess();  // SIGKILL if still running

  // Starts kvshade-server with `args` plus --listen 127.0.0.1:<free port>, and unless given
  // --metrics-port <free port>, --grace 0.5 and --port-file (in the log's directory); waits up
  // to `ready` for the port file, then for SERVING. Extra client options (TLS, token) are
  // used for the health poll.
  absl::Status Start(std::vector<std::string> args,
                     const client::ClientOptions& health_options = {},
                     absl::Duration ready = absl::Seconds(30));
  // SIGTERM, then wait up to `grace` for exit; returns the exit code (SIGKILL and -1 on
  // timeout).
  int Stop(absl::Duration grace = absl::Seconds(20));
  // SIGTERM without waiting (the drain runs while the caller watches it).
  void Terminate();
  // Waits up to `grace` for the process to exit: its exit code (SIGKILL and -1 on timeout).
  int WaitExit(absl::Duration grace = absl::Seconds(20));
  // SIGKILL and reap.
  void Kill9();
  bool running() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }

  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  std::string log() const;  // the server's stdout+stderr so far
  const std::vector<std::string>& args() const { return args_; }

  // A client of this server with `options` (target filled in).
  std::unique_ptr<client::Client> Connect(client::ClientOptions options = {}) const;

 private:
  absl::Status StartOnce(const std::vector<std::string>& args, const client::ClientOptions& health,
                         absl::Duration ready);
  pid_t pid_ = -1;
  int port_ = 0;
  int metrics_port_ = 0;
  std::vector<std::string> args_;
  std::unique_ptr<TempDir> log_dir_;
  std::string log_path_;
};

// Path of the kvshade-server binary under test.
std::string ServerBinary();

// A command line run to completion through the shell: its exit status (-1 when it did not
// exit normally or could not start) and what it wrote to stdout (add "2>&1" to the command
// for stderr too).
struct CommandRun {
  int exit_code = -1;
  std::string output;
  bool Has(const std::string& s) const { return output.find(s) != std::string::npos; }
};
CommandRun RunCommand(const std::string& command);

// GET http://127.0.0.1:<port><path>; returns the body.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);

// Writes <dir>/ucx.yaml: the UCX data plane on, over `transports` (UCX_TLS; "" = UCX's
// choice), followed by `extra` YAML; returns its path (for "-c").
std::string UcxConfig(const TempDir& dir, const std::string& transports,
                      const std::string& extra = "");
// Client options that use the UCX data plane over `transports`.
client::ClientOptions UcxClientOptions(const std::string& transports);

// A small model and profile every test can afford on 2 cores.
synthetic::DocSpec SmallDoc(int64_t tokens = 1024, uint64_t seed = 7);
v1::Profile ShadowProfile(int rank = 16, int budget = 8, int outliers = 4);

// Creates a session for `question` (-1 = the document alone) and ingests what is not
// reused; returns the CreateSessionResponse.
absl::StatusOr<v1::CreateSessionResponse> CreateAndIngest(client::Client& c,
                                                          const synthetic::Document& doc,
                                                          const v1::Profile& profile, int question,
                                                          bool durable = false);

// Decode helpers shared by the same-node and daemon-path tests.
// The synthetic query of (layer, question, step) at `pos` as bf16 [hq, d].
std::vector<kernels::bf16> QueryBf16(const synthetic::Document& doc, int layer, int question, int step,
                                     int64_t pos);
// A bf16 [hq, d] tensor of `q`.
v1::Tensor Bf16Tensor(const std::vector<kernels::bf16>& q, int hq, int d);
// The daemon's Attend of one query of one attachment: [hq, d] fp32 (empty on failure,
// which is also reported as a test failure).
std::vector<float> AttendRpc(client::Client& c, const std::string& attachment, int layer,
                             const std::vector<kernels::bf16>& q, int hq, int d);
// max |a - b| / max |a| over the first n values.
double MaxRelDiff(const std::vector<float>& a, const float* b, size_t n);

// A SelectAndReconstruct request of one query per attachment (query of `question`, step).
v1::SelectAndReconstructRequest MakeSelect(const synthetic::Document& doc, uint32_t layer,
                                           const std::vector<std::string>& attachments,
                                           int question, int step, int64_t position);


// One gRPC Ingest stream opened over `stub` (with `token` as its bearer token when not
// empty) and its header sent when `session_id` is not empty; then the test drives it:
// nothing more (an idle stream), parts (LayerPart), a cancel (ctx.TryCancel) or Finish.
struct IdleStream {
  grpc::ClientContext ctx;
  v1::IngestResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::IngestRequest>> writer;
};
std::unique_ptr<IdleStream> OpenIdleStream(v1::KvShade::Stub& stub, const std::string& session_id,
                                           const std::string& token = "");

// An Ingest message carrying tokens [t0, t1) of `layer` of `doc` (the document alone, its
// timeline from token 0) as one part, the layer's last when `last`.
v1::IngestRequest LayerPart(const synthetic::Document& doc, uint32_t layer, int64_t t0, int64_t t1,
                            bool last);

// kvshade_rpc_total{method=`method`, code=`code`} on the server's /metrics (0 when absent).
double RpcCount(const ServerProcess& server, const std::string& method, const std::string& code);
// The sum of every series of metric `name` on the server's /metrics (0 when absent).
double MetricSum(const ServerProcess& server, const std::string& name);

}  // namespace kvshade::integration

#define KV_ASSERT_OK(expr)                          \
  do {                                              \
    const absl::Status _kv_status = (expr);         \
    ASSERT_TRUE(_kv_status.ok()) << _kv_status;     \
  } while (0)
#define KV_ASSERT_OK_AND_ASSIGN(lhs, expr)                              \
  auto lhs##_or = (expr);                                               \
  ASSERT_TRUE(lhs##_or.ok()) << lhs##_or.status();                      \
  auto lhs = *std::move(lhs##_or)
