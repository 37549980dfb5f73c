// Shared by the loopback benchmarks: starts kvshade-server as a child process on a
// kernel-chosen loopback port (reading the port back from its --port-file), stops it,
// takes percentiles of the measured round trips, and reads the daemon's stage times from
// its /metrics.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kvshade/base/stats.h"

extern char** environ;

namespace kvshade::bench {

struct SpawnedServer {
  pid_t pid = -1;
  std::string target;  // "127.0.0.1:<port>"
  std::string dir;     // temporary directory holding the port file and server.log
  std::string log;
};

// Spawns `binary --listen 127.0.0.1:0 --port-file ... --log-level warn <extra_args>` with its
// output in <dir>/server.log and waits up to 30 s for the port. OpenMP threads that spin at
// barriers (libgomp's default) collapse throughput on shared cores (7x slower ingest was
// measured on a loaded 2-core VM), so the child waits passively unless the caller set
// OMP_WAIT_POLICY. Returns nullopt (after printing why, prefixed with `who`) on failure.
inline std::optional<SpawnedServer> SpawnServer(const std::string& binary,
                                                std::vector<std::string> extra_args,
                                                const char* who) {
  setenv("OMP_WAIT_POLICY", "passive", /*overwrite=*/0);
  char dir[] = "/tmp/kvshade-bench-XXXXXX";
  if (mkdtemp(dir) == nullptr) {
    std::fprintf(stderr, "%s: cannot create a temporary directory\n", who);
    return std::nullopt;
  }
  SpawnedServer s;
  s.dir = dir;
  s.log = s.dir + "/server.log";
  const std::string port_file = s.dir + "/port";
  std::vector<std::string> args = {binary,      "--listen",  "127.0.0.1:0", "--port-file",
                                   port_file,   "--log-level", "warn"};
  for (auto& a : extra_args) args.push_back(std::move(a));
  std::vector<char*> argv_c;
  for (auto& a : args) argv_c.push_back(a.data());
  argv_c.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, s.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  const int rc = posix_spawn(&s.pid, binary.c_str(), &fa, nullptr, argv_c.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    std::fprintf(stderr, "%s: cannot start %s\n", who, binary.c_str());
    return std::nullopt;
  }
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < end && access(port_file.c_str(), R_OK) != 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  FILE* f = std::fopen(port_file.c_str(), "r");
  int port = 0;
  const bool ok = f != nullptr && std::fscanf(f, "%d", &port) == 1;
  if (f != nullptr) std::fclose(f);
  if (!ok) {
    std::fprintf(stderr, "%s: server did not start (log %s)\n", who, s.log.c_str());
    kill(s.pid, SIGKILL);
    return std::nullopt;
  }
  s.target = "127.0.0.1:" + std::to_string(port);
  return s;
}

// The p-quantile (0 <= p <= 1) of `v`, linearly interpolated between order statistics.
using base::Percentile;

// Stops the server with SIGTERM (a graceful drain), waits for it, and removes its
// temporary directory. Returns the child's wait status.
inline int StopServer(const SpawnedServer& s) {
  kill(s.pid, SIGTERM);
  int status = 0;
  waitpid(s.pid, &status, 0);
  std::remove((s.dir + "/port").c_str());
  std::remove(s.log.c_str());
  rmdir(s.dir.c_str());
  return status;
}

// A free loopback TCP port (bound, read, released; the daemon binds it right after).
inline int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t n = sizeof(a);
  int port = 0;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) == 0) {
    port = ntohs(a.sin_port);
  }
  if (fd >= 0) close(fd);
  return port;
}

// Seconds summed so far per stage of kvshade_stage_duration_seconds, from the daemon's
// /metrics on 127.0.0.1:`port` (empty when it cannot be read).
inline std::map<std::string, double> StageSeconds(int port, bool with_rpcs = false) {
  std::map<std::string, double> out;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    if (fd >= 0) close(fd);
    return out;
  }
  const std::string req = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return out;
  }
  std::string body;
  char buf[65536];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) body.append(buf, static_cast<size_t>(n));
  close(fd);
  const std::string key = "kvshade_stage_duration_seconds_sum{stage=\"";
  for (size_t p = body.find(key); p != std::string::npos; p = body.find(key, p + 1)) {
    const size_t s = p + key.size(), e = body.find('"', s);
    const size_t v = body.find("} ", e);
    if (e == std::string::npos || v == std::string::npos) break;
    out[body.substr(s, e - s)] = std::strtod(body.c_str() + v + 2, nullptr);
  }
  // With `with_rpcs`: each method's kvshade_rpc_duration_seconds sum too, as "rpc:<method>"
  // (summed over its codes).
  const std::string rkey = "kvshade_rpc_duration_seconds_sum{";
  for (size_t p = with_rpcs ? body.find(rkey) : std::string::npos; p != std::string::npos;
       p = body.find(rkey, p + 1)) {
    const size_t m = body.find("method=\"", p), end = body.find("} ", p);
    if (m == std::string::npos || end == std::string::npos || m > end) continue;
    const size_t ms = m + 8, me = body.find('"', ms);
    out["rpc:" + body.substr(ms, me - ms)] += std::strtod(body.c_str() + end + 2, nullptr);
  }
  return out;
}

}  // namespace kvshade::bench
