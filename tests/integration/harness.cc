// Integration-test harness (see harness.h).
#include "harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kvshade/client/tensor.h"

extern char** environ;

namespace kvshade::integration {

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    socklen_t len = sizeof(addr);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

TempDir::TempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string tmpl = absl::StrCat(base != nullptr && *base ? base : "/tmp", "/kvshade-it-XXXXXX");
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) != nullptr) path_ = buf.data();
}

TempDir::~TempDir() {
  if (path_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string ServerBinary() {
  if (const char* env = std::getenv("KVSHADE_SERVER"); env != nullptr && *env) return env;
  return KVSHADE_SERVER_PATH;  // compile definition: $<TARGET_FILE:kvshade-server>
}

CommandRun RunCommand(const std::string& command) {
  CommandRun r;
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) Kill9();
}

absl::Status ServerProcess::Start(std::vector<std::string> args, const client::ClientOptions& health,
                                  absl::Duration ready) {
  absl::Status last;
  for (int attempt = 0; attempt < 3; ++attempt) {
    last = StartOnce(args, health, ready);
    // Only a lost port race (the gRPC or the metrics port, both picked free just before the
    // spawn, taken by another process in between) is retried; anything else is the answer.
    const bool lost_port = absl::StrContains(log(), "cannot listen") ||
                           absl::StrContains(log(), "cannot serve /metrics");
    if (last.ok() || !lost_port) return last;
  }
  return last;
}

absl::Status ServerProcess::StartOnce(const std::vector<std::string>& given,
                                      const client::ClientOptions& health, absl::Duration ready) {
  if (pid_ > 0) return absl::FailedPreconditionError("server already running");
  std::vector<std::string> args = given;
  // A flag's value as given ("--flag value" or "--flag=value"), if it is.
  auto value_of = [&](std::string_view flag) -> std::optional<std::string> {
    const std::string eq = absl::StrCat(std::string(flag), "=");
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i] == flag && i + 1 < args.size()) return args[i + 1];
      if (absl::StartsWith(args[i], eq)) return args[i].substr(eq.size());
    }
    return std::nullopt;
  };
  auto has = [&](std::string_view flag) { return value_of(flag).has_value(); };
  port_ = FreePort();
  args.push_back("--listen");
  args.push_back(absl::StrCat("127.0.0.1:", port_));
  if (!has("--metrics-port")) {
    metrics_port_ = FreePort();
    args.push_back("--metrics-port");
    args.push_back(std::to_string(metrics_port_));
  }
  if (!has("--backend")) {
    args.push_back("--backend");
    args.push_back("cpu");
  }
  if (!has("--grace")) {
    // A SIGTERM serves reads while attachments are live, up to the grace: keep stops short
    // (a test of the drain gives its own).
    args.push_back("--grace");
    args.push_back("0.5");
  }
  if (!log_dir_) log_dir_ = std::make_unique<TempDir>();
  log_path_ = log_dir_->path() + "/server.log";
  // The port file is written once the server listens: the health poll waits for it, since a
  // gRPC channel whose first connect is refused backs off for a second before its next.
  std::string port_file = value_of("--port-file").value_or(log_dir_->path() + "/port");
  if (!has("--port-file")) {
    args.push_back("--port-file");
    args.push_back(port_file);
  }
  unlink(port_file.c_str());
  args_ = args;

  // Passive OpenMP waiting: tests share 2 cores with other work, where spinning OpenMP
  // barriers make the CPU backend many times slower (see deploy/README.md).
  setenv("OMP_WAIT_POLICY", "passive", /*overwrite=*/0);
  const std::string bin = ServerBinary();
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(bin.c_str()));
  for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, bin.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return absl::InternalError(absl::StrCat("cannot spawn ", bin, ": ", strerror(rc)));
  pid_ = pid;

  client::ClientOptions o = health;
  o.target = target();
  o.timeout = absl::Seconds(2);
  auto c = client::Client::Connect(o);
  if (!c.ok()) return c.status();
  const absl::Time end = absl::Now() + ready;
  absl::Duration backoff = absl::Milliseconds(5);
  std::string seen = "no answer";
  while (absl::Now() < end) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::UnavailableError(absl::StrCat("kvshade-server exited during start-up (status ", status,
                                                 "); log:\n", log()));
    }
    if (access(port_file.c_str(), F_OK) == 0) {
      auto h = (*c)->CheckHealth();
      if (h.ok() && *h == client::HealthStatus::kServing) return absl::OkStatus();
      seen = h.ok() ? std::string(client::HealthStatusName(*h)) : h.status().ToString();
    } else {
      seen = "not listening yet (no port file)";
    }
    std::this_thread::sleep_for(absl::ToChronoMilliseconds(std::min(backoff, end - absl::Now())));
    backoff = std::min(backoff * 2, absl::Milliseconds(25));
  }
  Kill9();
  return absl::DeadlineExceededError(absl::StrCat("kvshade-server not SERVING within ", absl::FormatDuration(ready),
                                                  " (last: ", seen, "); log:\n", log()));
}

int ServerProcess::Stop(absl::Duration grace) {
  if (pid_ <= 0) return -1;
  kill(pid_, SIGTERM);
  return WaitExit(grace);
}

void ServerProcess::Terminate() {
  if (pid_ > 0) kill(pid_, SIGTERM);
}

int ServerProcess::WaitExit(absl::Duration grace) {
  if (pid_ <= 0) return -1;
  const absl::Time end = absl::Now() + grace;
  absl::Duration backoff = absl::Milliseconds(2);
  while (absl::Now() < end) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(absl::ToChronoMilliseconds(backoff));
    backoff = std::min(backoff * 2, absl::Milliseconds(50));
  }
  Kill9();
  return -1;
}

void ServerProcess::Kill9() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  int status = 0;
  waitpid(pid_, &status, 0);  // SIGKILL cannot be caught: this returns promptly
  pid_ = -1;
}

std::string ServerProcess::log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::unique_ptr<client::Client> ServerProcess::Connect(client::ClientOptions options) const {
  options.target = target();
  auto c = client::Client::Connect(options);
  return c.ok() ? *std::move(c) : nullptr;
}

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket failed");
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to 127.0.0.1:", port));
  }
  const std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: localhost\r\n\r\n");
  if (send(fd, req.data(), req.size(), 0) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return absl::UnavailableError("send failed");
  }
  std::string resp;
  char buf[8192];
  ssize_t r;
  while ((r = recv(fd, buf, sizeof(buf), 0)) > 0) resp.append(buf, static_cast<size_t>(r));
  close(fd);
  const size_t body = resp.find("\r\n\r\n");
  if (body == std::string::npos) return absl::DataLossError("no HTTP body");
  if (!absl::StartsWith(resp, "HTTP/1.1 200") && !absl::StartsWith(resp, "HTTP/1.0 200")) {
    return absl::UnavailableError(absl::StrCat("HTTP status: ", resp.substr(0, resp.find("\r\n"))));
  }
  return resp.substr(body + 4);
}

synthetic::DocSpec SmallDoc(int64_t tokens, uint64_t seed) {
  synthetic::DocSpec s;
  s.layers = 2;
  s.kv_heads = 2;
  s.q_heads = 4;
  s.head_dim = 32;
  s.doc_tokens = tokens;
  s.question_tokens = 16;
  s.needles = 2;
  s.needle_span = 16;
  s.latent_rank = 8;
  s.seed = seed;
  return s;
}

std::vector<kernels::bf16> QueryBf16(const synthetic::Document& doc, int layer, int question, int step,
                                     int64_t pos) {
  std::vector<float> q = doc.Query(layer, question, step, pos);
  std::vector<kernels::bf16> out(q.size());
  for (size_t i = 0; i < q.size(); ++i) out[i] = kernels::FloatToBf16(q[i]);
  return out;
}

v1::Tensor Bf16Tensor(const std::vector<kernels::bf16>& q, int hq, int d) {
  v1::Tensor t;
  t.add_shape(hq);
  t.add_shape(d);
  t.set_dtype(v1::DTYPE_BF16);
  t.set_data(std::string(reinterpret_cast<const char*>(q.data()), q.size() * 2));
  return t;
}

std::vector<float> AttendRpc(client::Client& c, const std::string& attachment, int layer,
                             const std::vector<kernels::bf16>& q, int hq, int d) {
  v1::AttendRequest at;
  at.set_layer(layer);
  auto* aq = at.add_queries();
  aq->set_attachment_id(attachment);
  *aq->mutable_q() = Bf16Tensor(q, hq, d);
  auto r = c.Attend(at);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return {};
  auto f = client::TensorToFloats(r->outputs(0));
  EXPECT_TRUE(f.ok());
  return f.ok() ? *f : std::vector<float>();
}

double MaxRelDiff(const std::vector<float>& a, const float* b, size_t n) {
  double mx = 0, diff = 0;
  for (size_t i = 0; i < n && i < a.size(); ++i) {
    mx = std::max(mx, double(std::fabs(a[i])));
    diff = std::max(diff, double(std::fabs(a[i] - b[i])));
  }
  return diff / std::max(mx, 1e-30);
}

v1::Profile ShadowProfile(int rank, int budget, int outliers) {
  v1::Profile p;
  p.set_kind(v1::PROFILE_KIND_SHADOW);
  p.set_rank(rank);
  p.set_chunk_size(8);
  p.set_sparse_budget(budget);
  p.set_outliers(outliers);
  p.set_local_window(32);
  return p;
}

absl::StatusOr<v1::CreateSessionResponse> CreateAndIngest(client::Client& c, const synthetic::Document& doc,
                                                          const v1::Profile& profile, int question,
                                                          bool durable) {
  auto created = c.CreateSession(synthetic::MakeCreate(doc, profile, question, durable));
  if (!created.ok()) return created.status();
  if (created->tokens_to_ingest() > 0) {
    const int64_t total = static_cast<int64_t>(created->reused_tokens() + created->tokens_to_ingest());
    auto ing = synthetic::IngestRange(c, doc, created->session_id(), question,
                                      static_cast<int64_t>(created->reused_tokens()), total);
    if (!ing.ok()) return ing.status();
  }
  return created;
}

std::string UcxConfig(const TempDir& dir, const std::string& transports, const std::string& extra) {
  const std::string path = dir.path() + "/ucx.yaml";
  std::ofstream(path) << "ucx:\n  enable: true\n  transports: \"" << transports << "\"\n" << extra;
  return path;
}

client::ClientOptions UcxClientOptions(const std::string& transports) {
  client::ClientOptions o;
  o.use_ucx = true;
  o.ucx_transports = transports;
  return o;
}

v1::SelectAndReconstructRequest MakeSelect(const synthetic::Document& doc, uint32_t layer,
                                           const std::vector<std::string>& attachments, int question,
                                           int step, int64_t position) {
  v1::SelectAndReconstructRequest r;
  r.set_layer(layer);
  const auto q = doc.Query(static_cast<int>(layer), question, step, position);
  for (const auto& a : attachments) {
    auto* sq = r.add_queries();
    sq->set_attachment_id(a);
    *sq->mutable_q() = client::MakeBf16Tensor({doc.spec().q_heads, doc.spec().head_dim}, absl::MakeConstSpan(q));
  }
  return r;
}

std::unique_ptr<IdleStream> OpenIdleStream(v1::KvShade::Stub& stub, const std::string& session_id,
                                           const std::string& token) {
  auto s = std::make_unique<IdleStream>();
  if (!token.empty()) s->ctx.AddMetadata("authorization", "Bearer " + token);
  s->writer = stub.Ingest(&s->ctx, &s->resp);
  if (!session_id.empty()) {
    v1::IngestRequest header;
    header.mutable_header()->set_session_id(session_id);
    s->writer->Write(header);
  }
  return s;
}

v1::IngestRequest LayerPart(const synthetic::Document& doc, uint32_t layer, int64_t t0, int64_t t1,
                            bool last) {
  const auto& s = doc.spec();
  std::vector<uint16_t> k, v;
  doc.KeysValues(static_cast<int>(layer), -1, t0, t1, &k, &v);
  v1::IngestRequest msg;
  auto* part = msg.mutable_layer();
  part->set_layer(layer);
  part->set_token_offset(static_cast<uint64_t>(t0));
  *part->mutable_k() = client::MakeBf16Tensor({t1 - t0, s.kv_heads, s.head_dim}, absl::MakeConstSpan(k));
  *part->mutable_v() = client::MakeBf16Tensor({t1 - t0, s.kv_heads, s.head_dim}, absl::MakeConstSpan(v));
  part->set_last_part(last);
  return msg;
}

double RpcCount(const ServerProcess& server, const std::string& method, const std::string& code) {
  auto body = HttpGet(server.metrics_port(), "/metrics");
  if (!body.ok()) return 0;
  const std::string key = "kvshade_rpc_total{code=\"" + code + "\",method=\"" + method + "\"} ";
  const size_t at = body->find(key);
  return at == std::string::npos ? 0 : std::atof(body->c_str() + at + key.size());
}

double MetricSum(const ServerProcess& server, const std::string& name) {
  auto body = HttpGet(server.metrics_port(), "/metrics");
  if (!body.ok()) return 0;
  double sum = 0;
  for (absl::string_view line : absl::StrSplit(*body, '\n')) {
    if (!absl::StartsWith(line, name) || line.size() == name.size()) continue;
    const char next = line[name.size()];
    if (next != '{' && next != ' ') continue;  // another metric whose name starts the same
    const size_t space = line.rfind(' ');
    sum += std::atof(std::string(line.substr(space + 1)).c_str());
  }
  return sum;
}

}  // namespace kvshade::integration
