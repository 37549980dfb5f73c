// Device faults on the GPU: a sticky CUDA error (a kernel reading an illegal address) is
// recorded as the backend's DeviceFault, which the service turns into NOT_SERVING and an
// exit; a non-sticky error (an allocation the device cannot hold) is not. Each case runs in
// a re-executed child process (gtest death test, style "threadsafe"), since a sticky error
// leaves that process's CUDA context unusable for every later test.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kvshade/kernels/backend.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace device_fault_gpu_test {
namespace {

// In the child: exit 0 when the expectations hold, else a code naming the first that did not.
[[noreturn]] void IllegalAddressChild() {
  auto be = CreateBackend("cuda");
  if (!be.ok()) std::_Exit(20);
  Backend& b = **be;
  if (b.Allocate(size_t{1} << 50).ok()) std::_Exit(21);  // 1 PiB: must fail...
  if (!b.DeviceFault().ok()) std::_Exit(22);             // ...without a device fault
  const std::vector<int64_t> zero = {0};
  auto rows = b.Allocate(sizeof(int64_t));
  auto dst = b.Allocate(256);
  if (!rows.ok() || !dst.ok()) std::_Exit(23);
  if (!b.CopyFromHost(rows->data(), zero.data(), sizeof(int64_t)).ok()) std::_Exit(24);
  const auto* r = static_cast<const int64_t*>(rows->data());
  absl::Status st = b.CopyRows(reinterpret_cast<const void*>(uintptr_t{0x1000}), dst->data(), 256, 1, r, r);
  if (st.ok()) st = b.Synchronize();
  if (st.ok()) std::_Exit(25);  // the illegal read must fail
  const absl::Status fault = b.DeviceFault();
  std::fprintf(stderr, "copy: %s\nfault: %s\n", std::string(st.message()).c_str(),
               std::string(fault.message()).c_str());
  std::_Exit(fault.ok() ? 26 : 0);
}

TEST(DeviceFaultGpu, AnIllegalAddressIsADeviceFaultAndAFailedAllocationIsNot) {
  KVSHADE_CUDA_OR_SKIP(probe);
  probe.reset();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(IllegalAddressChild(), ::testing::ExitedWithCode(0), "fault: CUDA device fault");
}

}  // namespace
}  // namespace device_fault_gpu_test
}  // namespace kvshade::kernels
