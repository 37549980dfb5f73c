// The CUDA backend's device context: device binding, cuBLAS/cuSOLVER handles, memory and
// streams. The ops live in cuda_<op>.cu.
//
// Streams. Stream{} (handle == nullptr) is CUDA's legacy default stream of the device: it
// orders itself against every blocking stream, so code that never creates a stream gets
// plain sequential semantics (tests, tools). CreateStream() makes NON-BLOCKING streams
// (cudaStreamNonBlocking): work on them does not wait for the default stream and vice
// versa, so a caller mixing the two orders them itself (Synchronize, or keep a request on
// one stream). The backend does not create a private default stream: the context's own
// default already is one, and a private one would need state CudaBackend does not have.
//
// Thread safety. Memory, copy, stream and kernel-only ops may be called from any thread
// concurrently (on different streams). Ops that use cuBLAS/cuSOLVER (Factorize,
// ProjectKeys, ObservationMass) serialize on one lock while they run (cuda_check.h,
// ScopedLibraryStream); they are synchronous ingest-time ops anyway.
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_backend_impl.h"
#include "kvshade/kernels/shared_memory.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_host_vmm.h"

namespace kvshade::kernels {

namespace cuda {
namespace {
std::mutex fault_mu;
std::string* fault = nullptr;  // the first sticky error (never freed: process lifetime)
std::atomic<bool> faulted{false};  // lets the check on every call skip the lock
}  // namespace

void RecordDeviceFault(const std::string& message) {
  std::lock_guard<std::mutex> lock(fault_mu);
  if (fault == nullptr) fault = new std::string(message);
  faulted.store(true, std::memory_order_release);
}

absl::Status RecordedDeviceFault() {
  if (!faulted.load(std::memory_order_acquire)) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(fault_mu);
  if (fault == nullptr) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("CUDA device fault: ", *fault));
}
}  // namespace cuda

absl::Status CudaBackend::DeviceFault() const { return cuda::RecordedDeviceFault(); }

using cuda::ToCudaStream;
using cuda::UseDevice;

CudaBackend::~CudaBackend() {
  // Destruction must not fail; errors here mean the context is already gone.
  if (cudaSetDevice(device_) != cudaSuccess) return;
  if (cusolver_ != nullptr) cusolverDnDestroy(cusolver_);
  if (cublas_ != nullptr) cublasDestroy(cublas_);
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the non-sticky error so later calls start clean
    return absl::UnavailableError(absl::StrCat("cuda backend: no usable CUDA driver/device (",
                                               cudaGetErrorName(e), ": ",
                                               cudaGetErrorString(e), ")"));
  }
  if (device < 0 || device >= count) {
    return absl::UnavailableError(
        absl::StrCat("cuda backend: device ", device, " not present (", count, " visible)"));
  }
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  // Create the context now, so a broken device fails here rather than in the first op.
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaFree(nullptr));

  cublasHandle_t blas = nullptr;
  KVSHADE_CUBLAS_RETURN_IF_ERROR(cublasCreate(&blas));
  cuda::UniqueCublasHandle blas_owner(blas);
  // Plain fp32 compute: no TF32 down-conversion of fp32 operands (ingest accuracy).
  KVSHADE_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH));
  KVSHADE_CUBLAS_RETURN_IF_ERROR(cublasSetPointerMode(blas, CUBLAS_POINTER_MODE_HOST));
  KVSHADE_CUBLAS_RETURN_IF_ERROR(cublasSetStream(blas, nullptr));

  cusolverDnHandle_t solver = nullptr;
  KVSHADE_CUSOLVER_RETURN_IF_ERROR(cusolverDnCreate(&solver));
  cuda::UniqueCusolverHandle solver_owner(solver);
  KVSHADE_CUSOLVER_RETURN_IF_ERROR(cusolverDnSetStream(solver, nullptr));

  std::unique_ptr<CudaBackend> backend(new CudaBackend(device));
  backend->cublas_ = blas_owner.release();
  backend->cusolver_ = solver_owner.release();
  return backend;
}

absl::StatusOr<Buffer> CudaBackend::Allocate(size_t bytes) {
  if (bytes == 0) return Buffer();
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  void* p = nullptr;
  absl::Status st = KVSHADE_CUDA_STATUS(cudaMalloc(&p, bytes));
  if (!st.ok()) {
    cudaGetLastError();  // an out-of-memory error is not sticky; clear it
    return absl::Status(st.code(), absl::StrCat("Allocate(", bytes, " bytes): ", st.message()));
  }
  int device = device_;
  {
    std::lock_guard<std::mutex> lock(allocs_->mu);
    allocs_->by_base[reinterpret_cast<uintptr_t>(p)] = {bytes, allocs_->next_id++};
  }
  return Buffer(p, bytes, [device, allocs = allocs_](void* q) {
    {
      std::lock_guard<std::mutex> lock(allocs->mu);
      allocs->by_base.erase(reinterpret_cast<uintptr_t>(q));
    }
    cudaSetDevice(device);
    cudaFree(q);
  });
}

absl::StatusOr<Buffer> CudaBackend::AllocateHostVisible(size_t bytes) {
  if (bytes == 0) return Buffer();
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  if (shared_ && shared_how_ == SharedHostMemory::kAuto && HostVmmSupported(device_)) {
    // Pinned host memory of the driver, exported by descriptor (cuda_host_vmm.h).
    absl::StatusOr<Buffer> buf = AllocateHostVmm(device_, bytes);
    if (!buf.ok()) {
      return absl::Status(buf.status().code(), absl::StrCat("AllocateHostVisible(", bytes,
                                                            " shared bytes): ",
                                                            buf.status().message()));
    }
    return buf;
  }
  if (shared_) {
    // A shared memory file, registered (pinned + mapped) so kernels read it over PCIe; a
    // worker process maps the same pages and registers them in its own context.
    KVSHADE_ASSIGN_OR_RETURN(Buffer buf, AllocateSharedHost(bytes, [](void* q) {
      cudaHostUnregister(q);
    }));
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t reg = (bytes + page - 1) / page * page;
    absl::Status st = KVSHADE_CUDA_STATUS(
        cudaHostRegister(buf.data(), reg, cudaHostRegisterMapped | cudaHostRegisterPortable));
    if (!st.ok()) {
      cudaGetLastError();
      return absl::Status(st.code(), absl::StrCat("AllocateHostVisible(", bytes,
                                                  " shared bytes): ", st.message()));
    }
    return buf;
  }
  void* p = nullptr;
  // Mapped: kernels read it directly (with UVA the host pointer is the device pointer).
  // Portable: every context/device in the process sees it as pinned.
  absl::Status st =
      KVSHADE_CUDA_STATUS(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  if (!st.ok()) {
    cudaGetLastError();
    return absl::Status(st.code(),
                        absl::StrCat("AllocateHostVisible(", bytes, " bytes): ", st.message()));
  }
  return Buffer(p, bytes, [](void* q) { cudaFreeHost(q); });
}

absl::StatusOr<Buffer> CudaBackend::AllocateStaging(size_t bytes) {
  if (bytes == 0) return Buffer();
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  void* p = nullptr;
  // Portable: pinned for every context of the process; page-locked memory is resident.
  absl::Status st = KVSHADE_CUDA_STATUS(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
  if (!st.ok()) {
    cudaGetLastError();
    return absl::Status(st.code(), absl::StrCat("AllocateStaging(", bytes, " bytes): ", st.message()));
  }
  return Buffer(p, bytes, [](void* q) { cudaFreeHost(q); });
}

absl::Status CudaBackend::CopyFromHost(void* dst, const void* src_host, size_t bytes,
                                       Stream stream) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr || src_host == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("CopyFromHost: null ",
                                                   dst == nullptr ? "dst" : "src_host",
                                                   " with bytes = ", bytes));
  }
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  // cudaMemcpyDefault: the runtime infers the direction (UVA), which also covers
  // host-visible buffers on either side.
  KVSHADE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyDefault, ToCudaStream(stream)));
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyToHost(void* dst_host, const void* src, size_t bytes,
                                     Stream stream) {
  if (bytes == 0) return absl::OkStatus();
  if (dst_host == nullptr || src == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CopyToHost: null ", dst_host == nullptr ? "dst_host" : "src", " with bytes = ", bytes));
  }
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  KVSHADE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDefault, ToCudaStream(stream)));
  return absl::OkStatus();
}

absl::Status CudaBackend::Copy(void* dst, const void* src, size_t bytes, Stream stream) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr || src == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("Copy: null ", dst == nullptr ? "dst" : "src",
                                                   " with bytes = ", bytes));
  }
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  KVSHADE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, ToCudaStream(stream)));
  return absl::OkStatus();
}

absl::Status CudaBackend::Copy2D(void* dst, size_t dst_pitch, const void* src,
                                 size_t src_pitch, size_t width, size_t height, Stream stream) {
  if (width == 0 || height == 0) return absl::OkStatus();
  if (dst == nullptr || src == nullptr) return absl::InvalidArgumentError("Copy2D: null pointer");
  if (dst_pitch < width || src_pitch < width) {
    return absl::InvalidArgumentError(absl::StrCat("Copy2D: pitches (", dst_pitch, ", ", src_pitch,
                                                   ") must be >= width = ", width));
  }
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height,
                                                 cudaMemcpyDefault, ToCudaStream(stream)));
  return absl::OkStatus();
}

absl::Status CudaBackend::Fill(void* dst, uint8_t byte, size_t bytes, Stream stream) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("Fill: null dst with bytes = ", bytes));
  }
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, byte, bytes, ToCudaStream(stream)));
  return absl::OkStatus();
}

absl::StatusOr<Stream> CudaBackend::CreateStream() {
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  cudaStream_t s = nullptr;
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return Stream{s};
}

absl::Status CudaBackend::DestroyStream(Stream stream) {
  if (stream.handle == nullptr) {
    return absl::InvalidArgumentError("DestroyStream: the default stream cannot be destroyed");
  }
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  // Work already enqueued still completes (CUDA semantics); the handle is gone at once.
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaStreamDestroy(ToCudaStream(stream)));
  return absl::OkStatus();
}

absl::Status CudaBackend::Synchronize(Stream stream) {
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ToCudaStream(stream)));
  return absl::OkStatus();
}

}  // namespace kvshade::kernels
