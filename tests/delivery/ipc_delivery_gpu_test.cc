// CUDA IPC delivery, two processes on one GPU: kvshade-server (CUDA backend) writes the
// reconstructed keys and fetched values of every miss straight into this process's GPU
// slot buffers. A twin attachment with inline delivery gets the same queries in the same
// batch; applying its deltas to host copies of the slot buffers must give, bit for bit,
// what the daemon wrote into the GPU buffers, over several steps (hits and misses) and
// every layer. Also: the delivered deltas carry no K/V bytes; Detach unmaps the buffers.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace {

// Whether a CUDA device is visible; `why` says why not.
bool HaveGpu(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e);
    cudaGetLastError();
    return false;
  }
  if (n == 0) *why = "no CUDA device visible";
  return n > 0;
}

// KVSHADE_REQUIRE_GPU=1 (scripts/gpu-run.sh): no GPU is a failure, not a skip.
bool GpuRequired() {
  const char* v = std::getenv("KVSHADE_REQUIRE_GPU");
  return v != nullptr && *v != 0 && std::strcmp(v, "0") != 0;
}

#define CUDA_ASSERT(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

TEST(IpcDelivery, DaemonWritesMissesIntoThisProcessesGpuSlotBuffers) {
  std::string why;
  if (!HaveGpu(&why)) {
    if (GpuRequired()) FAIL() << "KVSHADE_REQUIRE_GPU=1 but CUDA is not reachable: " << why;
    GTEST_SKIP() << why;
  }
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--backend", "cuda"}));
  auto c = server.Connect();
  ASSERT_NE(c, nullptr);

  synthetic::DocSpec spec;
  spec.layers = 4;
  spec.kv_heads = 2;
  spec.q_heads = 8;
  spec.head_dim = 64;
  spec.doc_tokens = 4096;
  spec.seed = 5;
  synthetic::Document doc(spec);
  v1::Profile profile = ShadowProfile(/*rank=*/32, /*budget=*/24, /*outliers=*/4);
  KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*c, doc, profile, -1));

  v1::AttachRequest inline_req;
  inline_req.set_session_id(created.session_id());
  inline_req.set_worker_id("inline-twin");
  KV_ASSERT_OK_AND_ASSIGN(twin, c->Attach(inline_req));
  const uint64_t bytes = twin.slot_buffer_bytes();
  const int K = static_cast<int>(twin.slots_per_head()), C = static_cast<int>(twin.chunk_size());
  ASSERT_GT(bytes, 0u);
  const size_t row = size_t(C) * spec.head_dim;  // bf16 elements per slot
  ASSERT_EQ(bytes, uint64_t(spec.layers) * spec.kv_heads * K * row * 2);

  // One allocation holds K then V (the shared-handle path); a byte pattern marks rows
  // nobody has written.
  const uint64_t v_offset = (bytes + 255) / 256 * 256;
  void* gpu = nullptr;
  CUDA_ASSERT(cudaMalloc(&gpu, v_offset + bytes));
  CUDA_ASSERT(cudaMemset(gpu, 0xA5, v_offset + bytes));
  CUDA_ASSERT(cudaDeviceSynchronize());
  cudaIpcMemHandle_t handle;
  CUDA_ASSERT(cudaIpcGetMemHandle(&handle, gpu));
  std::vector<uint16_t> want_k(bytes / 2, 0xA5A5), want_v(bytes / 2, 0xA5A5);

  v1::AttachRequest ipc_req = inline_req;
  ipc_req.set_worker_id("ipc-worker");
  ipc_req.set_delivery(v1::DELIVERY_MODE_CUDA_IPC);
  auto* b = ipc_req.mutable_cuda_ipc();
  b->set_k_handle(std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
  b->set_v_handle(b->k_handle());
  b->set_k_offset(0);
  b->set_v_offset(v_offset);
  b->set_bytes(bytes);
  KV_ASSERT_OK_AND_ASSIGN(ipc, c->Attach(ipc_req));
  EXPECT_EQ(ipc.delivery(), v1::DELIVERY_MODE_CUDA_IPC);

  uint64_t misses = 0, hits = 0;
  const int steps = 5;
  for (int step = 0; step < steps; ++step) {
    for (int layer = 0; layer < spec.layers; ++layer) {
      // Steps 2 and 4 repeat earlier queries: hits.
      const int qstep = step % 2 == 0 && step > 0 ? step - 2 : step;
      auto req = MakeSelect(doc, layer, {twin.attachment_id(), ipc.attachment_id()}, -1, qstep,
                            spec.doc_tokens + step);
      KV_ASSERT_OK_AND_ASSIGN(resp, c->SelectAndReconstruct(req));
      ASSERT_EQ(resp.deltas_size(), 2);
      const v1::SlotDelta& in = resp.deltas(0);
      const v1::SlotDelta& out = resp.deltas(1);
      ASSERT_FALSE(in.delivered());
      ASSERT_TRUE(out.delivered());
      EXPECT_TRUE(out.keys().data().empty());
      EXPECT_TRUE(out.values().data().empty());
      ASSERT_EQ(out.keys().shape_size(), 3);
      EXPECT_EQ(out.keys().shape(0), in.head_size());
      // Same history, same queries: same slot-table deltas.
      ASSERT_EQ(in.head_size(), out.head_size());
      for (int i = 0; i < in.head_size(); ++i) {
        ASSERT_EQ(in.head(i), out.head(i));
        ASSERT_EQ(in.slot(i), out.slot(i));
        ASSERT_EQ(in.chunk(i), out.chunk(i));
        const size_t at = ((size_t(layer) * spec.kv_heads + in.head(i)) * K + in.slot(i)) * row;
        std::memcpy(&want_k[at], in.keys().data().data() + i * row * 2, row * 2);
        std::memcpy(&want_v[at], in.values().data().data() + i * row * 2, row * 2);
      }
      misses += in.head_size();
      hits += in.hits();
    }
    std::vector<uint16_t> got_k(bytes / 2), got_v(bytes / 2);
    CUDA_ASSERT(cudaMemcpy(got_k.data(), gpu, bytes, cudaMemcpyDeviceToHost));
    CUDA_ASSERT(cudaMemcpy(got_v.data(), static_cast<char*>(gpu) + v_offset, bytes,
                           cudaMemcpyDeviceToHost));
    size_t diff_k = 0, diff_v = 0;
    for (size_t i = 0; i < got_k.size(); ++i) {
      diff_k += got_k[i] != want_k[i];
      diff_v += got_v[i] != want_v[i];
    }
    EXPECT_EQ(diff_k, 0u) << "step " << step;
    EXPECT_EQ(diff_v, 0u) << "step " << step;
  }
  std::printf("[ipc delivery] %d steps x %d layers: %llu misses delivered, %llu hits; slot "
              "buffers bit-identical to the inline twin\n",
              steps, spec.layers, static_cast<unsigned long long>(misses),
              static_cast<unsigned long long>(hits));
  EXPECT_GT(misses, 0u);
  EXPECT_GT(hits, 0u);

  KV_ASSERT_OK(c->Detach(ipc.attachment_id()));
  KV_ASSERT_OK(c->Detach(twin.attachment_id()));
  CUDA_ASSERT(cudaFree(gpu));
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

}  // namespace
}  // namespace kvshade::integration
