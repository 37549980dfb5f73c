// Sharing 8 GiB of pinned host memory between two processes on one GPU node, two ways:
//   (a) CUDA driver host allocations (cuMemCreate on the host NUMA node) exported as file
//       descriptors, taken by the other process with pidfd_getfd and mapped for its device;
//   (b) memory files (memfd) opened by the other process through /proc/<pid>/fd and
//       registered with cudaHostRegister.
// Prints the import time of each, a kernel's check of the imported bytes, and the
// host-to-device copy rate from each. Behind bench/RESULTS.md "Ingest: time until a session
// is ready" (kvshade's own use of (a) is kernels/cuda/cuda_host_vmm.cc). Standalone; build
// and run on the GPU machine with
//   nvcc -O2 -arch=sm_90 -o host_share host_share.cu -lcuda && ./host_share
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <fcntl.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s; cuGetErrorString(r_, &s); printf("FAIL %s: %s\n", #x, s); fflush(stdout); return 1; } } while (0)
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
// Sums one byte of every 4 KiB page of p[0, n).
__global__ void sum(const unsigned char* p, size_t n, unsigned long long* out) {
  unsigned long long s = 0;
  for (size_t page = blockIdx.x * blockDim.x + threadIdx.x; page * 4096 < n; page += size_t(gridDim.x) * blockDim.x) s += p[page * 4096];
  atomicAdd(out, s);
}
const int kN = 32; const size_t kBytes = 256ull << 20;
int exporter(int wfd) {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  int a141=0,a103=0,numa=-1; cuDeviceGetAttribute(&a141, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  cuDeviceGetAttribute(&a103, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
  cuDeviceGetAttribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, dev);
  printf("exporter pid %d: host_numa_vmm %d posix_fd %d host_numa_id %d\n", getpid(), a141, a103, numa);
  fflush(stdout);
  CUmemAllocationProp prop{}; prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  prop.location.id = numa < 0 ? 0 : numa; prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 0; CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)); printf("granularity %zu\n", gran);
  std::string msg;
  double t0 = now();
  for (int i = 0; i < kN; ++i) {
    CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, kBytes, &prop, 0));
    CUdeviceptr va; CK(cuMemAddressReserve(&va, kBytes, 0, 0, 0)); CK(cuMemMap(va, kBytes, 0, h, 0));
    CUmemAccessDesc d[2]{}; d[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE; d[0].location.id = 0; d[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    d[1].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA; d[1].location.id = prop.location.id; d[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CK(cuMemSetAccess(va, kBytes, d, 2));
    memset(reinterpret_cast<void*>(va), i + 1, kBytes);  // CPU writes
    int fd = -1; CK(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    msg += std::to_string(fd) + " ";
  }
  printf("exporter: %d x 256 MiB created+mapped+cpu-written in %.3f s\n", kN, now() - t0);
  fflush(stdout);
  // memfd regions for the comparison
  for (int i = 0; i < 8; ++i) {
    int fd = memfd_create("cmp", 0); if (ftruncate(fd, kBytes) != 0) return 1;
    void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0); memset(p, 1, kBytes);
    msg += "m" + std::to_string(fd) + " ";
  }
  msg = std::to_string(getpid()) + " " + msg + "\n";
  if (write(wfd, msg.data(), msg.size()) < 0) return 1;
  close(wfd);
  pause();
  return 0;
}
int importer(pid_t pid, const std::vector<int>& fds, const std::vector<int>& mfds) {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  FILE* f = fopen("/proc/sys/kernel/yama/ptrace_scope", "r"); int sc = -1; if (f) { fscanf(f, "%d", &sc); fclose(f); }
  printf("importer pid %d, ptrace_scope %d, kernel: ", getpid(), sc); fflush(stdout); system("uname -r");
  int pfd = syscall(SYS_pidfd_open, pid, 0); if (pfd < 0) { perror("pidfd_open"); return 1; }
  unsigned long long* out; cudaMallocManaged(&out, 8);
  double t0 = now(); std::vector<CUdeviceptr> vas;
  for (int i = 0; i < (int)fds.size(); ++i) {
    int fd = syscall(SYS_pidfd_getfd, pfd, fds[i], 0); if (fd < 0) { perror("pidfd_getfd"); return 1; }
    CUmemGenericAllocationHandle h; CK(cuMemImportFromShareableHandle(&h, (void*)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(fd);
    CUdeviceptr va; CK(cuMemAddressReserve(&va, kBytes, 0, 0, 0)); CK(cuMemMap(va, kBytes, 0, h, 0)); CK(cuMemRelease(h));
    CUmemAccessDesc d{}; d.location.type = CU_MEM_LOCATION_TYPE_DEVICE; d.location.id = 0; d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CK(cuMemSetAccess(va, kBytes, &d, 1)); vas.push_back(va);
  }
  double t1 = now();
  printf("VMM import: %zu x 256 MiB in %.4f s (%.4f s/GiB)\n", fds.size(), t1 - t0, (t1 - t0) / (fds.size() / 4.0));
  bool ok = true;
  for (int i = 0; i < (int)vas.size(); ++i) { *out = 0; sum<<<1024, 256>>>((const unsigned char*)vas[i], kBytes, out); cudaDeviceSynchronize();
    const unsigned long long n = kBytes / 4096; if (*out != n * (i + 1)) { ok = false; printf("region %d sum %llu expected %llu\n", i, *out, n*(i+1)); } }
  printf("VMM kernel read: %s (%s)\n", ok ? "ok" : "WRONG", cudaGetErrorString(cudaGetLastError()));
  // read bandwidth from one VMM host region (whole pass)
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  void* dbuf; cudaMalloc(&dbuf, kBytes);
  cudaEventRecord(e0); cudaMemcpy(dbuf, (void*)vas[0], kBytes, cudaMemcpyDefault); cudaEventRecord(e1); cudaEventSynchronize(e1);
  float ms; cudaEventElapsedTime(&ms, e0, e1); printf("VMM host->device memcpy 256 MiB: %.3f ms (%.1f GB/s)\n", ms, kBytes / ms / 1e6);
  t0 = now(); std::vector<void*> ps;
  for (int m : mfds) { char p[64]; snprintf(p, 64, "/proc/%d/fd/%d", pid, m); int fd = open(p, O_RDWR); if (fd < 0) { perror("open"); return 1; }
    void* q = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0); close(fd);
    cudaError_t e = cudaHostRegister(q, kBytes, cudaHostRegisterMapped | cudaHostRegisterPortable); if (e) { printf("register: %s\n", cudaGetErrorString(e)); return 1; } ps.push_back(q); }
  t1 = now(); printf("memfd+cudaHostRegister: %zu x 256 MiB in %.4f s (%.4f s/GiB)\n", mfds.size(), t1 - t0, (t1 - t0) / (mfds.size() / 4.0));
  cudaEventRecord(e0); cudaMemcpy(dbuf, ps[0], kBytes, cudaMemcpyDefault); cudaEventRecord(e1); cudaEventSynchronize(e1);
  cudaEventElapsedTime(&ms, e0, e1); printf("registered host->device memcpy 256 MiB: %.3f ms (%.1f GB/s)\n", ms, kBytes / ms / 1e6);
  // teardown cost
  t0 = now(); for (auto va : vas) { cuMemUnmap(va, kBytes); cuMemAddressFree(va, kBytes); } printf("VMM unmap all: %.4f s\n", now() - t0);
  return 0;
}
int main(int argc, char** argv) {
  // importer is the parent (the worker launches the daemon), as in the bench
  int p[2]; if (pipe(p)) return 1;
  pid_t c = fork();
  if (c == 0) { close(p[0]); return exporter(p[1]); }
  close(p[1]);
  std::string s; char b[4096]; ssize_t n; while ((n = read(p[0], b, sizeof b)) > 0) s.append(b, n);
  if (s.empty()) { printf("exporter failed\n"); waitpid(c, nullptr, 0); return 1; }
  std::vector<int> fds, mfds; pid_t pid = 0; int k = 0;
  char* save; char* tok = strtok_r(s.data(), " \n", &save);
  while (tok) { if (k++ == 0) pid = atoi(tok); else if (tok[0] == 'm') mfds.push_back(atoi(tok + 1)); else fds.push_back(atoi(tok)); tok = strtok_r(nullptr, " \n", &save); }
  int rc = importer(pid, fds, mfds);
  kill(c, SIGKILL); waitpid(c, nullptr, 0);
  return rc;
}
