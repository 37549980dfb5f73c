// Shared by the loopback benchmarks: starts kvshade-server as a child process on a
// kernel-chosen loopback port (reading the port back from its --port-file), stops it, and
// takes percentiles of the measured round trips.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

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
inline double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const double idx = p * (v.size() - 1);
  const size_t lo = static_cast<size_t>(idx), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (idx - lo);
}

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

}  // namespace kvshade::bench
