// Same-node sharing of the CUDA backend's host-visible memory (shared_memory.h,
// kernels/cuda/cuda_host_vmm.h): with SharedHostMemory::kAuto a GPU that supports host NUMA
// virtual memory management exports pinned driver memory by descriptor (kHostVmm); with
// kFile, or without that support, memory files (kHostFile). Either way another mapping of
// the region (here: imported into this same process, as a worker would) sees the bytes the
// CPU wrote, and the device's writes through it land in the exporter's buffer.
#include <dlfcn.h>

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace shared_memory_gpu_test {
namespace {

// What the driver says about device 0, asked directly (not through the backend).
bool DriverSupportsHostVmm() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return false;
  using InitFn = int (*)(unsigned);
  using GetFn = int (*)(int*, int);
  using AttrFn = int (*)(int*, int, int);
  auto init = reinterpret_cast<InitFn>(dlsym(lib, "cuInit"));
  auto get = reinterpret_cast<GetFn>(dlsym(lib, "cuDeviceGet"));
  auto attr = reinterpret_cast<AttrFn>(dlsym(lib, "cuDeviceGetAttribute"));
  int dev = 0;
  if (init == nullptr || get == nullptr || attr == nullptr || init(0) != 0 || get(&dev, 0) != 0) {
    return false;
  }
  // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (102),
  // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED (103),
  // CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (141).
  for (int a : {102, 103, 141}) {
    int v = 0;
    if (attr(&v, a, dev) != 0 || v == 0) return false;
  }
  return true;
}

// Exports a shared host-visible buffer, imports it again and checks both directions.
void RoundTrip(Backend& be, ExportedMemory::Kind expected) {
  const size_t bytes = (3u << 20) + 123;  // not a multiple of any granularity
  auto buf = be.AllocateHostVisible(bytes);
  ASSERT_TRUE(buf.ok()) << buf.status();
  auto* host = static_cast<unsigned char*>(buf->data());
  for (size_t i = 0; i < bytes; ++i) host[i] = static_cast<unsigned char>(i * 7 + 1);

  const size_t at = 4096 + 5;
  auto m = be.ExportMemory(host + at);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->kind, expected);
  EXPECT_EQ(m->offset, at);
  EXPECT_GE(m->region_bytes, bytes);
  EXPECT_GE(m->fd, 0);
  auto again = be.ExportMemory(host + 17);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->region_id, m->region_id) << "one allocation is one region";

  auto im = be.ImportMemory(*m);
  ASSERT_TRUE(im.ok()) << im.status();
  EXPECT_EQ(im->kind, expected);
  ASSERT_NE(im->base, nullptr);
  EXPECT_NE(im->base, buf->data()) << "a second mapping of the same pages";

  // The device reads the CPU's bytes through the imported mapping...
  auto dev = be.Allocate(bytes);
  ASSERT_TRUE(dev.ok()) << dev.status();
  ASSERT_TRUE(be.Copy(dev->data(), im->base, bytes, Stream{}).ok());
  std::vector<unsigned char> back(bytes);
  ASSERT_TRUE(be.CopyToHost(back.data(), dev->data(), bytes, Stream{}).ok());
  ASSERT_TRUE(be.Synchronize(Stream{}).ok());
  EXPECT_EQ(std::memcmp(back.data(), host, bytes), 0);

  // ...and writes through it land in the exporter's buffer.
  ASSERT_TRUE(be.Fill(static_cast<char*>(im->base) + at, 0xA5, 1000, Stream{}).ok());
  ASSERT_TRUE(be.Synchronize(Stream{}).ok());
  for (size_t i = at; i < at + 1000; ++i) ASSERT_EQ(host[i], 0xA5) << i;
  EXPECT_EQ(host[at - 1], static_cast<unsigned char>((at - 1) * 7 + 1));
  EXPECT_EQ(host[at + 1000], static_cast<unsigned char>((at + 1000) * 7 + 1));

  EXPECT_TRUE(be.ReleaseImported(*im).ok());
}

TEST(SharedHostMemoryGpu, AutoExportsDriverHostMemoryWhereTheGpuSupportsIt) {
  KVSHADE_CUDA_OR_SKIP(be);
  be->EnableSharedMemory(SharedHostMemory::kAuto);
  const bool vmm = DriverSupportsHostVmm();
  std::printf("[shared host memory] host NUMA VMM %s: expecting %s\n", vmm ? "supported" : "absent",
              vmm ? "kHostVmm" : "kHostFile");
  RoundTrip(*be, vmm ? ExportedMemory::Kind::kHostVmm : ExportedMemory::Kind::kHostFile);
}

TEST(SharedHostMemoryGpu, FileModeExportsMemoryFiles) {
  KVSHADE_CUDA_OR_SKIP(be);
  be->EnableSharedMemory(SharedHostMemory::kFile);
  RoundTrip(*be, ExportedMemory::Kind::kHostFile);
}

// Staging memory (a data plane's receive buffers) stays private while every host-visible
// allocation is shared, and copies to the device and back are exact.
TEST(SharedHostMemoryGpu, StagingMemoryIsNeverExported) {
  KVSHADE_CUDA_OR_SKIP(be);
  be->EnableSharedMemory(SharedHostMemory::kAuto);
  const size_t bytes = (3u << 20) + 123;
  auto buf = be->AllocateStaging(bytes);
  ASSERT_TRUE(buf.ok()) << buf.status();
  auto* host = static_cast<unsigned char*>(buf->data());
  for (size_t i = 0; i < bytes; ++i) host[i] = static_cast<unsigned char>(i * 13 + 5);
  EXPECT_FALSE(be->ExportMemory(host + 100).ok()) << "staging memory must not be exported";
  auto dev = be->Allocate(bytes);
  ASSERT_TRUE(dev.ok()) << dev.status();
  ASSERT_TRUE(be->CopyFromHost(dev->data(), host, bytes).ok());
  std::vector<unsigned char> back(bytes);
  ASSERT_TRUE(be->CopyToHost(back.data(), dev->data(), bytes).ok());
  ASSERT_TRUE(be->Synchronize().ok());
  EXPECT_EQ(std::memcmp(back.data(), host, bytes), 0);
  // The shared kind is still what host-visible memory gets.
  auto shared = be->AllocateHostVisible(4096);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_TRUE(be->ExportMemory(shared->data()).ok());
}

TEST(SharedHostMemoryGpu, ADescriptorOfAMissingProcessIsRefusedClearly) {
  KVSHADE_CUDA_OR_SKIP(be);
  ExportedMemory m;
  m.kind = ExportedMemory::Kind::kHostVmm;
  m.pid = 0x3fffffff;  // no such process
  m.fd = 3;
  m.region_bytes = 1 << 20;
  auto im = be->ImportMemory(m);
  ASSERT_FALSE(im.ok());
  EXPECT_EQ(im.status().code(), absl::StatusCode::kFailedPrecondition) << im.status();
  // Where the driver can map such memory the import gets as far as the daemon's process
  // and says so; elsewhere it says the daemon must share memory files instead.
  const std::string want = DriverSupportsHostVmm() ? "pidfd_open" : "same_node.host_memory: file";
  EXPECT_NE(im.status().message().find(want), std::string::npos) << im.status();
}

}  // namespace
}  // namespace shared_memory_gpu_test
}  // namespace kvshade::kernels
