// Helpers shared by the kernel tests: seeded random inputs (a fixed seed unless
// KVSHADE_TEST_SEED=<n> picks another, seed logged), and moving host vectors in and out of a
// backend's memory.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"

namespace kvshade::kernels::testing {

// The seed of this test run: KVSHADE_TEST_SEED if set, else kDefaultTestSeed, so that the
// thresholds CI checks meet the same inputs on every run (scripts/seed-sweep.sh runs them
// over many seeds and reports the failure rate). Logged once per test (as a gtest property
// and on stdout) so that a failure can be replayed.
inline constexpr uint64_t kDefaultTestSeed = 20261201;
uint64_t TestSeed();

// An engine seeded from TestSeed() mixed with `stream` (so that different inputs of one
// test differ).
std::mt19937_64 MakeRng(uint64_t stream = 0);

// Uniform in [-scale, scale], never all zeros.
std::vector<float> RandomFloats(size_t n, std::mt19937_64& rng, float scale = 1.0f);
// Normal(0, stddev) rounded to bf16.
std::vector<bf16> RandomBf16(size_t n, std::mt19937_64& rng, float stddev = 1.0f);
std::vector<float> ToFloat(const std::vector<bf16>& x);
std::vector<bf16> ToBf16(const std::vector<float>& x);

// The CPU backend (always present).
std::unique_ptr<Backend> Cpu();
// KVSHADE_REQUIRE_GPU=1 (scripts/gpu-run.sh sets it on the GPU machine): a GPU test that
// cannot reach CUDA fails instead of skipping.
bool GpuRequired();

// The CUDA backend, or nullptr when this build has none or it does not start (no device
// visible, driver or runtime error); `why` gets the reason. With GpuRequired() a nullptr
// also records a test failure. GPU tests use KVSHADE_CUDA_OR_SKIP.
std::unique_ptr<Backend> CudaOrNull(std::string* why = nullptr);

// `var` = the CUDA backend; without one the test skips, or, with KVSHADE_REQUIRE_GPU=1,
// fails (CudaOrNull recorded the failure) and returns.
#define KVSHADE_CUDA_OR_SKIP(var)                                                      \
  std::string var##_why_no_cuda;                                                       \
  auto var = ::kvshade::kernels::testing::CudaOrNull(&var##_why_no_cuda);              \
  if (!var && ::kvshade::kernels::testing::GpuRequired()) return;                      \
  if (!var)                                                                            \
    GTEST_SKIP() << "no CUDA device visible (or CUDA backend not built): " << var##_why_no_cuda

// Copies a host vector into a new buffer of `backend`.
template <typename T>
Buffer Upload(Backend& backend, const std::vector<T>& host) {
  auto buf = backend.Allocate(std::max<size_t>(host.size() * sizeof(T), 1));
  EXPECT_TRUE(buf.ok()) << buf.status();
  if (!host.empty()) {
    auto st = backend.CopyFromHost(buf->data(), host.data(), host.size() * sizeof(T));
    EXPECT_TRUE(st.ok()) << st;
  }
  return std::move(buf).value();
}

// A buffer of `count` elements filled with 0xFF bytes (so that
// untouched outputs are visible as NaN / -1).
template <typename T>
Buffer Scratch(Backend& backend, size_t count) {
  auto buf = backend.Allocate(std::max<size_t>(count * sizeof(T), 1));
  EXPECT_TRUE(buf.ok()) << buf.status();
  EXPECT_TRUE(backend.Fill(buf->data(), 0xFF, count * sizeof(T)).ok());
  return std::move(buf).value();
}

// Copies `count` elements of a backend buffer to the host (synchronizing first).
template <typename T>
std::vector<T> Download(Backend& backend, const void* src, size_t count) {
  std::vector<T> out(count);
  EXPECT_TRUE(backend.Synchronize().ok());
  auto st = backend.CopyToHost(out.data(), src, count * sizeof(T));
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_TRUE(backend.Synchronize().ok());
  return out;
}

// Relative Frobenius error ||a - b|| / ||b||.
double RelativeError(const std::vector<float>& a, const std::vector<float>& b);
// Max |a - b|.
double MaxAbsError(const std::vector<float>& a, const std::vector<float>& b);

}  // namespace kvshade::kernels::testing
