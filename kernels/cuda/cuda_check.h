// Shared plumbing of the CUDA backend (kernels/cuda only; never included outside it):
//   - CUDA / cuBLAS / cuSOLVER error codes -> absl::Status with file:line and the library's
//     own error string (the lowest wrapper; nothing here aborts);
//   - RAII owners and a stream binding for the backend's cuBLAS/cuSOLVER handles;
//   - workspace carving (one planning routine serves both the *WorkspaceBytes query and
//     the op, so the two can never disagree);
//   - device helpers: bf16 loads/stores through __nv_bfloat16 (layout-compatible with
//     kvshade::kernels::bf16), warp reductions, and RoPE as a kernel parameter.
// Compiles under g++ (cuda_backend.cc) and nvcc (*.cu); device code is under __CUDACC__.
//
// API stability: other CUDA sources include this header; names here only get added.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <type_traits>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/rope.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/kernels/types.h"

namespace kvshade::kernels::cuda {

// ---------------------------------------------------------------------------------------
// Errors

// CUDA's sticky errors: after one, the process's context on the device is unusable and
// every later call fails (only a new process recovers).
inline bool IsStickyCudaError(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable:
    case cudaErrorAssert:
      return true;
    default:
      return false;
  }
}

// The first sticky error this process met (cuda_backend.cc); Backend::DeviceFault reports
// it from then on.
void RecordDeviceFault(const std::string& message);
absl::Status RecordedDeviceFault();

// Allocation failures are ResourceExhausted (the caller may free and retry), a missing
// device or driver is Unavailable, everything else Internal (device errors are bugs or
// sticky faults; a sticky one is recorded, and the service stops serving on it).
inline absl::Status CudaErrorToStatus(cudaError_t e, const char* expr, const char* file,
                                      int line) {
  if (e == cudaSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat(file, ":", line, ": ", expr, " failed: ", cudaGetErrorName(e),
                                 " (", cudaGetErrorString(e), ")");
  if (IsStickyCudaError(e)) {
    RecordDeviceFault(msg);
    return absl::InternalError(absl::StrCat(msg, "; the device context is lost"));
  }
  switch (e) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

inline absl::Status CublasErrorToStatus(cublasStatus_t s, const char* expr, const char* file,
                                        int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  std::string msg =
      absl::StrCat(file, ":", line, ": ", expr, " failed: ", cublasGetStatusString(s));
  if (s == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

inline const char* CusolverStatusName(cusolverStatus_t s) {
  switch (s) {
    case CUSOLVER_STATUS_SUCCESS: return "CUSOLVER_STATUS_SUCCESS";
    case CUSOLVER_STATUS_NOT_INITIALIZED: return "CUSOLVER_STATUS_NOT_INITIALIZED";
    case CUSOLVER_STATUS_ALLOC_FAILED: return "CUSOLVER_STATUS_ALLOC_FAILED";
    case CUSOLVER_STATUS_INVALID_VALUE: return "CUSOLVER_STATUS_INVALID_VALUE";
    case CUSOLVER_STATUS_ARCH_MISMATCH: return "CUSOLVER_STATUS_ARCH_MISMATCH";
    case CUSOLVER_STATUS_MAPPING_ERROR: return "CUSOLVER_STATUS_MAPPING_ERROR";
    case CUSOLVER_STATUS_EXECUTION_FAILED: return "CUSOLVER_STATUS_EXECUTION_FAILED";
    case CUSOLVER_STATUS_INTERNAL_ERROR: return "CUSOLVER_STATUS_INTERNAL_ERROR";
    case CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED:
      return "CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED";
    case CUSOLVER_STATUS_NOT_SUPPORTED: return "CUSOLVER_STATUS_NOT_SUPPORTED";
    case CUSOLVER_STATUS_ZERO_PIVOT: return "CUSOLVER_STATUS_ZERO_PIVOT";
    case CUSOLVER_STATUS_INVALID_LICENSE: return "CUSOLVER_STATUS_INVALID_LICENSE";
    case CUSOLVER_STATUS_INVALID_WORKSPACE: return "CUSOLVER_STATUS_INVALID_WORKSPACE";
    default: return "CUSOLVER_STATUS_(other)";
  }
}

inline absl::Status CusolverErrorToStatus(cusolverStatus_t s, const char* expr,
                                          const char* file, int line) {
  if (s == CUSOLVER_STATUS_SUCCESS) return absl::OkStatus();
  std::string msg = absl::StrCat(file, ":", line, ": ", expr, " failed: ",
                                 CusolverStatusName(s), " (", static_cast<int>(s), ")");
  if (s == CUSOLVER_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

}  // namespace kvshade::kernels::cuda

// `KVSHADE_CUDA_STATUS(cudaFoo(...))` evaluates to an absl::Status.
#define KVSHADE_CUDA_STATUS(expr) \
  ::kvshade::kernels::cuda::CudaErrorToStatus((expr), #expr, __FILE__, __LINE__)
#define KVSHADE_CUBLAS_STATUS(expr) \
  ::kvshade::kernels::cuda::CublasErrorToStatus((expr), #expr, __FILE__, __LINE__)
#define KVSHADE_CUSOLVER_STATUS(expr) \
  ::kvshade::kernels::cuda::CusolverErrorToStatus((expr), #expr, __FILE__, __LINE__)

// Return the converted status from the enclosing function when the call failed.
#define KVSHADE_CUDA_RETURN_IF_ERROR(expr)                                   \
  do {                                                                       \
    ::absl::Status kvshade_cuda_status_ = KVSHADE_CUDA_STATUS(expr);         \
    if (!kvshade_cuda_status_.ok()) return kvshade_cuda_status_;             \
  } while (0)
#define KVSHADE_CUBLAS_RETURN_IF_ERROR(expr)                                 \
  do {                                                                       \
    ::absl::Status kvshade_cuda_status_ = KVSHADE_CUBLAS_STATUS(expr);       \
    if (!kvshade_cuda_status_.ok()) return kvshade_cuda_status_;             \
  } while (0)
#define KVSHADE_CUSOLVER_RETURN_IF_ERROR(expr)                               \
  do {                                                                       \
    ::absl::Status kvshade_cuda_status_ = KVSHADE_CUSOLVER_STATUS(expr);     \
    if (!kvshade_cuda_status_.ok()) return kvshade_cuda_status_;             \
  } while (0)

// After a <<<...>>> launch: reports a bad launch configuration (and clears it).
#define KVSHADE_CUDA_LAUNCH_CHECK() KVSHADE_CUDA_RETURN_IF_ERROR(cudaGetLastError())

namespace kvshade::kernels::cuda {

// ---------------------------------------------------------------------------------------
// Streams and library handles

inline cudaStream_t ToCudaStream(Stream s) { return static_cast<cudaStream_t>(s.handle); }

// Makes `device` current on the calling thread (ops may be called from threads that last
// used another device). A no-op when it already is.
inline absl::Status UseDevice(int device) {
  int current = -1;
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
  if (current != device) KVSHADE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  return absl::OkStatus();
}

template <typename T>
constexpr T CeilDiv(T a, T b) {
  return (a + b - 1) / b;
}

struct CublasHandleDeleter {
  void operator()(cublasContext* h) const {
    if (h != nullptr) cublasDestroy(h);
  }
};
struct CusolverHandleDeleter {
  void operator()(cusolverDnContext* h) const {
    if (h != nullptr) cusolverDnDestroy(h);
  }
};
using UniqueCublasHandle = std::unique_ptr<cublasContext, CublasHandleDeleter>;
using UniqueCusolverHandle = std::unique_ptr<cusolverDnContext, CusolverHandleDeleter>;

// An owned CUDA event (timing, cross-stream ordering).
struct CudaEventDeleter {
  void operator()(CUevent_st* e) const {
    if (e != nullptr) cudaEventDestroy(e);
  }
};
using UniqueCudaEvent = std::unique_ptr<CUevent_st, CudaEventDeleter>;
inline absl::StatusOr<UniqueCudaEvent> MakeCudaEvent(unsigned flags = cudaEventDisableTiming) {
  cudaEvent_t e = nullptr;
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, flags));
  return UniqueCudaEvent(e);
}

// One lock for every backend's cuBLAS/cuSOLVER handles. A handle's stream and workspace
// are shared state: an op that uses a library handle holds this lock (through
// ScopedLibraryStream) from binding the stream until its last library call is enqueued,
// and hands cuBLAS a workspace carved from the op's own Workspace, so work in flight on
// different streams never shares library scratch. (Factorize and ProjectKeys also
// synchronize before returning, since they return host values.) These are ingest ops; one
// process-wide lock keeps CudaBackend's layout as is. Per-stream handles would let layers
// factorize concurrently (see cuda_lowrank.cu).
inline std::mutex& LibraryHandleMutex() {
  static std::mutex mu;
  return mu;
}

// cuBLAS workspace handed to the handle from the op's Workspace (cuBLAS's recommendation
// for Hopper), so that no library call allocates device memory on the request path.
inline constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

// Holds LibraryHandleMutex and binds the handles to a stream (and cuBLAS to a workspace
// the caller owns); on destruction rebinds them to the legacy default stream (0), which
// also drops the borrowed workspace, so an idle handle never points at freed memory or a
// destroyed stream.
class ScopedLibraryStream {
 public:
  ScopedLibraryStream(cublasHandle_t blas, cusolverDnHandle_t solver)
      : lock_(LibraryHandleMutex()), blas_(blas), solver_(solver) {}
  ScopedLibraryStream(const ScopedLibraryStream&) = delete;
  ScopedLibraryStream& operator=(const ScopedLibraryStream&) = delete;
  ~ScopedLibraryStream() {
    if (blas_ != nullptr) cublasSetStream(blas_, nullptr);
    if (solver_ != nullptr) cusolverDnSetStream(solver_, nullptr);
  }
  // `blas_workspace` (device, >= kCublasWorkspaceBytes when not null) stays in use until
  // the work enqueued through the handle has completed (it is the op's workspace, which
  // the caller keeps until then).
  absl::Status Bind(cudaStream_t stream, void* blas_workspace = nullptr,
                    size_t blas_workspace_bytes = 0) {
    if (blas_ != nullptr) {
      // cublasSetStream resets the workspace, so the workspace is set after it.
      KVSHADE_CUBLAS_RETURN_IF_ERROR(cublasSetStream(blas_, stream));
      if (blas_workspace != nullptr) {
        KVSHADE_CUBLAS_RETURN_IF_ERROR(
            cublasSetWorkspace(blas_, blas_workspace, blas_workspace_bytes));
      }
    }
    if (solver_ != nullptr) KVSHADE_CUSOLVER_RETURN_IF_ERROR(cusolverDnSetStream(solver_, stream));
    return absl::OkStatus();
  }

 private:
  std::lock_guard<std::mutex> lock_;
  cublasHandle_t blas_;
  cusolverDnHandle_t solver_;
};

// ---------------------------------------------------------------------------------------
// Workspace carving. Plan with a null base to size, then with the real base to carve:
//   WorkspaceCarver c(ws.data);  float* g = c.Take<float>(D * D);  ...  c.bytes()
// Every piece starts on a 256-byte boundary (cuBLAS/cuSOLVER and 16-byte vector loads),
// whatever the base: the base is rounded up and bytes() includes that slack.
class WorkspaceCarver {
 public:
  static constexpr size_t kAlign = 256;
  explicit WorkspaceCarver(void* base = nullptr)
      : base_(base == nullptr ? nullptr
                              : reinterpret_cast<std::byte*>(
                                    (reinterpret_cast<uintptr_t>(base) + kAlign - 1) / kAlign *
                                    kAlign)) {}
  template <typename T>
  T* Take(size_t count) {
    size_t offset = used_;
    used_ += (count * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    return base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + offset);
  }
  size_t bytes() const { return used_ + kAlign; }  // + base alignment slack

 private:
  std::byte* base_;
  size_t used_ = 0;
};

// ---------------------------------------------------------------------------------------
// bf16: kvshade::kernels::bf16 and __nv_bfloat16 are both one uint16_t of bf16 bits.
static_assert(sizeof(__nv_bfloat16) == sizeof(bf16) && alignof(__nv_bfloat16) == alignof(bf16),
              "bf16 must be layout-compatible with __nv_bfloat16");

inline __nv_bfloat16* AsNv(bf16* p) { return reinterpret_cast<__nv_bfloat16*>(p); }
inline const __nv_bfloat16* AsNv(const bf16* p) {
  return reinterpret_cast<const __nv_bfloat16*>(p);
}

// ---------------------------------------------------------------------------------------
// RoPE as a kernel parameter: pass `const __grid_constant__ DeviceRope rope` and call the
// device helpers with it (no device allocation, no copy per launch beyond the parameter).
// Angles follow the reference (common/rope_math.h): pos * position_scale * inv_freq[i]
// in double, cos/sin times magnitude in double, rounded once to float.
inline constexpr int kMaxRopePairs = 256;  // rotary_dim <= 512

struct DeviceRope {
  int rotary_dim = 0;   // even, <= d; dims >= rotary_dim pass through
  int interleaved = 0;  // 1: pair (2i, 2i+1); 0: pair (i, i + rotary_dim/2)
  float position_scale = 1.0f;
  float magnitude = 1.0f;
  float inv_freq[kMaxRopePairs] = {};
};

// Builds the parameter block from a validated spec (MakeRopeTable's checks, plus the
// rotary_dim limit of this backend).
inline absl::StatusOr<DeviceRope> MakeDeviceRope(const RopeSpec& spec, int d) {
  absl::StatusOr<RopeTable> table = MakeRopeTable(spec, d);
  if (!table.ok()) return table.status();
  if (table->rotary_dim / 2 > kMaxRopePairs ||
      table->inv_freq.size() != static_cast<size_t>(table->rotary_dim / 2)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope: rotary_dim ", table->rotary_dim, " is above the CUDA backend's limit ",
                     2 * kMaxRopePairs, " (or the table has ", table->inv_freq.size(),
                     " frequencies)"));
  }
  DeviceRope r;
  r.rotary_dim = table->rotary_dim;
  r.interleaved = spec.pairing == RopePairing::kInterleaved ? 1 : 0;
  r.position_scale = table->position_scale;
  r.magnitude = table->magnitude;
  for (int i = 0; i < r.rotary_dim / 2; ++i) r.inv_freq[i] = table->inv_freq[i];
  return r;
}

#ifdef __CUDACC__

// Channel indices (first, second) of rotary pair `i` in [0, rotary_dim/2).
__device__ __forceinline__ int2 RopePairDims(const DeviceRope& rope, int i) {
  return rope.interleaved ? make_int2(2 * i, 2 * i + 1) : make_int2(i, i + rope.rotary_dim / 2);
}

// cos and sin (times magnitude) of pair `i` at absolute position `pos`, exactly as
// common/rope_math.h: angle and the magnitude product in double, one rounding to float.
// The explicit _rn intrinsics keep nvcc from fusing multiplies (FMA contraction would
// change the bits relative to the CPU backend).
__device__ __forceinline__ void RopeCosSin(const DeviceRope& rope, long long pos, int i,
                                           float* c, float* s) {
  const double angle = __dmul_rn(__dmul_rn(static_cast<double>(pos),
                                           static_cast<double>(rope.position_scale)),
                                 static_cast<double>(rope.inv_freq[i]));
  double sd, cd;
  sincos(angle, &sd, &cd);
  const double m = static_cast<double>(rope.magnitude);
  *c = static_cast<float>(__dmul_rn(cd, m));
  *s = static_cast<float>(__dmul_rn(sd, m));
}

// Rotates one pair: (x0, x1) -> (x0 c - x1 s, x1 c + x0 s), each product rounded to fp32
// before the sum (no FMA), matching the CPU backend bit for bit.
__device__ __forceinline__ void RopeRotate(float c, float s, float* x0, float* x1) {
  const float a = *x0, b = *x1;
  *x0 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  *x1 = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

__device__ __forceinline__ float LoadBf16(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void StoreBf16(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16_rn(x);
}

// Eight consecutive bf16 (16 bytes, p 16-byte aligned) <-> floats.
__device__ __forceinline__ void LoadBf16x8(const __nv_bfloat16* p, float out[8]) {
  uint4 v = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void StoreBf16x8(__nv_bfloat16* p, const float in[8]) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = v;
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float WarpMin(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fminf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ double WarpSumD(double x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

#endif  // __CUDACC__

}  // namespace kvshade::kernels::cuda
