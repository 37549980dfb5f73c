// `kvshade demo`: the synthetic prefix-cached document-QA workload against a running
// server (see synthetic.h for the data). One document is ingested once; N question
// sessions reuse it (CreateSession over the same tokens) or fork it (ForkSession +
// AppendTokens); each is attached and decoded for S steps with SelectAndReconstruct (and
// Attend), batching all sessions per layer. Prints reuse, chunk hit ratios, compression,
// per-needle selection, latencies, and the transport of the decode path: with `ucx` (the
// default) the client must be connected with ClientOptions::use_ucx, and a run that fell
// back to gRPC inline fails (exit 4) instead of passing silently.
#pragma once

#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

#include "kvshade/client/client.h"

namespace kvshade::cli {

struct DemoOptions {
  int64_t doc_tokens = 16384;
  int layers = 4;
  int kv_heads = 2;
  int q_heads = 8;
  int head_dim = 64;
  int questions = 8;
  int question_tokens = 64;
  int steps = 16;
  int needles = 4;
  std::string mode = "mixed";  // reuse | fork | mixed
  std::string profile = "shadow";
  int rank = 32;
  int chunk_size = 8;
  int sparse_budget = 32;
  int outliers = 8;
  int local_window = 32;
  bool attend = true;
  bool ucx = true;            // decode over the UCX data plane (ClientOptions::use_ucx)
  bool keep = false;          // leave the sessions open at the end
  bool progress = true;
  uint64_t seed = 1;
};

void AddDemoOptions(CLI::App* app, DemoOptions* options);

// Returns the process exit code: 0 done, 1 an RPC failed, 4 UCX was asked for and the
// client fell back to gRPC.
int RunDemo(client::Client& client, const DemoOptions& options);

}  // namespace kvshade::cli
