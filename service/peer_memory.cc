// Worker GPU memory mapped into the daemon by CUDA IPC handle (same-node ingest): one
// mapping per handle for the whole process, shared by every stream that names it
// (cudaIpcOpenMemHandle maps an allocation once per process), closed with its last user.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "engine_impl.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {

absl::StatusOr<kernels::PeerBuffer> EngineImpl::AcquirePeer(const std::string& handle) {
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto it = peers_.find(handle);
  if (it == peers_.end()) {
    KVSHADE_ASSIGN_OR_RETURN(kernels::PeerBuffer b, backend_->OpenPeerBuffer(handle));
    it = peers_.emplace(handle, MappedPeer{b, 0}).first;
  }
  ++it->second.refs;
  return it->second.buffer;
}

void EngineImpl::ReleasePeer(const std::string& handle) {
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto it = peers_.find(handle);
  if (it == peers_.end()) return;
  if (--it->second.refs == 0) {
    (void)backend_->ClosePeerBuffer(it->second.buffer);
    peers_.erase(it);
  }
}

absl::StatusOr<absl::Span<const kernels::bf16>> EngineImpl::PeerTensor(
    const v1::Tensor& t, absl::Span<const int64_t> shape, const std::string& what,
    std::vector<std::string>* held) {
  if (backend_->space() != kernels::MemorySpace::kDevice) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": cuda_ipc tensors need a daemon on a GPU backend (this one runs on ",
        std::string(backend_->name()), "); send the bytes inline"));
  }
  if (!t.data().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": give either data or cuda_ipc, not both"));
  }
  if (t.dtype() != v1::DTYPE_BF16) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": cuda_ipc tensors must be bf16"));
  }
  if (t.shape_size() != static_cast<int>(shape.size())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": shape has ", t.shape_size(),
                                                   " dimensions, expected ", shape.size()));
  }
  size_t elements = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (t.shape(static_cast<int>(i)) != shape[i]) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": shape[", i, "] must be ", shape[i],
                                                     ", got ", t.shape(static_cast<int>(i))));
    }
    elements *= size_t(shape[i]);
  }
  const std::string& handle = t.cuda_ipc().handle();
  if (std::find(held->begin(), held->end(), handle) == held->end()) {
    KVSHADE_RETURN_IF_ERROR(AcquirePeer(handle).status());
    held->push_back(handle);
  }
  kernels::PeerBuffer b;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    b = peers_.at(handle).buffer;
  }
  const size_t bytes = elements * sizeof(kernels::bf16);
  const uint64_t off = t.cuda_ipc().offset();
  if (off > b.bytes || bytes > b.bytes - off) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": cuda_ipc offset ", off, " + ", bytes, " bytes is outside the ", b.bytes,
        "-byte allocation the handle names"));
  }
  if (off % alignof(kernels::bf16) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": cuda_ipc offset ", off, " is not ",
                                                   alignof(kernels::bf16), "-byte aligned"));
  }
  return absl::MakeConstSpan(
      reinterpret_cast<const kernels::bf16*>(static_cast<const char*>(b.base) + off), elements);
}

absl::Status EngineImpl::CopyFromPeerTensor(const v1::Tensor& t, absl::Span<const int64_t> shape,
                                            const std::string& what, absl::Span<kernels::bf16> dst,
                                            std::vector<std::string>* held) {
  KVSHADE_ASSIGN_OR_RETURN(absl::Span<const kernels::bf16> src, PeerTensor(t, shape, what, held));
  if (src.size() != dst.size()) {
    return absl::InternalError(absl::StrCat(what, ": ", src.size(), " elements for a ", dst.size(),
                                            "-element destination"));
  }
  KVSHADE_RETURN_IF_ERROR(backend_->Copy(dst.data(), src.data(), src.size() * sizeof(kernels::bf16)));
  return backend_->Synchronize();
}

}  // namespace kvshade::service
