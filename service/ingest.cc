// The ingest pipeline (docs/ALGORITHM.md, per profile): one Ingest stream receives a session's
// prompt K/V (after the reused prefix) layer by layer, compresses each layer as soon as it
// is complete, and commits a new immutable segment at the end. How a layer is compressed
// is the profile's (ProfileStrategy::StartIngest, profile.h; the stream is its
// IngestContext):
//
// shadow : profile_shadow.cc: kernels::CompressShadowLayer, a suffix after a reused prefix
//          projected onto the prefix's basis (a background refactorization past
//          refactor_threshold); at the commit the exact tail gives its oldest whole chunks
//          to the open segment (SettleTail).
// mini   : profile_mini.cc: recent window + heavy hitters by observation mass, INT2 (KIVI).
// exact  : profile_exact.cc: post-RoPE K and V as given.
//
// Segment ends (docs/DESIGN.md "Segment ends"): a session created with segment ends
// commits one segment per range between them. Each range is built as if it had been
// ingested alone after the ranges before it had been reused from the cache: the first as
// any ingest (its own basis, or projected onto a reused prefix's), each later one projected
// onto the basis of the one before it; observation queries serve the last range only. So a
// later session that reuses the first ranges and ingests the rest gets the same segments,
// bit for bit, as this one holds.
//
// Nothing is visible to other calls before the commit, and the commit takes effect only
// when the stream has ended cleanly (Finish, after the commit message): a stream that
// fails anywhere, a message after the commit included, or that is abandoned, frees what it
// built and leaves the session "ingesting".
//
// Overlap: a completed layer is compressed on the stream's own compression thread while
// the next layer's parts keep arriving on the caller's thread. At most one layer is being
// compressed at a time and the caller waits for it before handing over the next, so a
// stream holds at most two layers of raw K/V (the one compressing and the one arriving);
// when the device budget cannot hold both, the arriving layer waits for the compressing
// one to free its memory. A compression error fails the stream at its next message (or at
// the commit), naming the layer. On a device backend the parts go up on the stream's own
// non-blocking device stream, so they do not queue behind the compression's kernels.
//
// Ranges apart: with segment ends, a range that is not the last compresses as soon as its
// rows are in, before the layer's later ranges arrive, when the profile allows it
// (ProfileIngest::compresses_ranges_early: shadow, whose range needs only its own rows and
// the basis of the range before it). Its rows are copied into blocks of their own
// (LayerBuf::apart) and handed to the compression thread like a layer; the layer's blocks,
// when it gets them, then start at the first range not yet compressed (IngestLayer::base).
// So the chunked prefill of a document and a question after it compresses each layer's
// document range while the document's last chunk is computed, not after the question.
//
// Interleaved layers (chunked prefill: every layer's part for one chunk of tokens, then the
// next chunk's): at most one incomplete layer holds device memory. A part of another layer
// moves that layer's received rows to host memory (outside the device arena: page-locked
// buffers of the engine's staging pool, kept for the next streams) and frees its blocks; a
// layer on the host takes its later parts there, and goes up to freshly allocated blocks
// only when its last part arrives (that part then lands on the device as in sequential
// order). So such a stream still holds at most two layers of raw K/V in device
// memory, the one compressing and the one arriving, with the other incomplete layers'
// received rows in host memory, instead of the whole prompt's raw K/V on the device.
// Layers sent one after another never take this path (no host copy, no extra copy).
//
// Copies: a part's tensors are decoded (checked) straight into the slice of the layer they
// fill, never through a temporary; on a device backend a bf16 part is copied up unread
// and its values are checked on the device. For the exact profile on a backend whose memory is host
// memory (CPU), that slice is the segment's own block: keys are rotated part by part as
// they arrive and the completed layer is handed over without another copy. A part of a
// layer waiting in host memory is decoded (checked) into that host copy instead (or, from
// the worker's GPU memory, its values checked there and then copied down), and rotated there
// in the exact profile on a host-memory backend, so the rows that go up at the end are in
// the state the block's own rows would be.
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <atomic>
#include <memory>
#include <mutex>
#include <new>
#include <numeric>
#include <system_error>
#include <optional>
#include <thread>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine_impl.h"
#include "profile.h"
#include "kvshade/service/log.h"
#include "kvshade/kernels/pyramid.h"
#include "kvshade/kernels/shadow_layer.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {

namespace {

using kernels::bf16;
using storage::ArenaKind;

class IngestStreamImpl final : public Engine::IngestStream, public IngestContext {
 public:
  IngestStreamImpl(EngineImpl& e, Tenant tenant, std::shared_ptr<Session> s)
      : e_(e), tenant_(std::move(tenant)), s_(std::move(s)) {
    const Session& s_ref = *s_;
    first_ = static_cast<int64_t>(s_ref.reused_tokens);
    n_ = static_cast<int>(s_ref.prompt.size() - s_ref.reused_tokens);
    L_ = s_ref.model.layers;
    bufs_.resize(L_);
    int64_t start = first_;
    std::vector<uint64_t> ends = s_ref.segment_ends;
    ends.push_back(s_ref.prompt.size());
    for (uint64_t end : ends) {
      Range& rg = ranges_.emplace_back();
      rg.first = start;
      rg.offset = start - first_;
      rg.n = static_cast<int>(int64_t(end) - start);
      rg.id = *storage::Id128::FromHex(SessionManager::NewId());
      rg.out.resize(L_);
      start = int64_t(end);
    }
    captured_.assign(L_, 0.0);
    residual_.assign(L_, 0.0);
    weighted_residual_.assign(L_, 0.0);
    refactor_keys_.resize(L_);
    const ProfileStrategy& profile = ProfileOf(s_ref.profile.kind);
    profile_ = profile.StartIngest(*this);
    direct_ = profile.rotates_parts() && e_.backend().space() == kernels::MemorySpace::kHost;
    host_space_ = e_.backend().space() == kernels::MemorySpace::kHost;
  }

  ~IngestStreamImpl() override {
    StopCompressor();
    if (upload_created_) {
      // Nothing of this stream may still be in flight when its memory is freed.
      e_.backend().Synchronize(upload_).IgnoreError();
      e_.backend().DestroyStream(upload_).IgnoreError();
    }
    for (const std::string& h : peers_) e_.ReleasePeer(h);
    for (const Range& rg : ranges_) {
      if (!committed_ && rg.store_created) e_.store().Erase(rg.id).IgnoreError();
    }
    if (!committed_) {
      log::Event e(spdlog::level::warn, "ingest_failed");
      e.Str("session", s_->id).Int("layers_received", s_->layers_ingested.load());
      if (!failed_.ok()) {
        e.Status(failed_);
      } else {
        e.Str("error", "the stream ended without a commit (cancelled, idle, or the client went away)");
      }
    }
    s_->layers_ingested = 0;
    s_->ingest_parts_taken = 0;
    s_->ingest_active = false;
  }

  absl::Status Add(const v1::IngestRequest& msg) override {
    if (!failed_.ok()) return Failed();
    absl::Status st = CompressorStatus();
    if (!st.ok()) {
      // a layer handed over earlier failed to compress
    } else if (commit_accepted_) {
      st = AfterCommit();
    } else {
      switch (msg.body_case()) {
        case v1::IngestRequest::kHeader:
          st = absl::InvalidArgumentError(
              "Ingest: the IngestHeader may only be the first message of the stream");
          break;
        case v1::IngestRequest::kLayer: st = AddPart(msg.layer()); break;
        case v1::IngestRequest::kCommit: st = AcceptCommit(); break;
        default: st = absl::InvalidArgumentError("Ingest: a message has no body");
      }
    }
    if (!st.ok()) failed_ = st;
    return st;
  }

  absl::Status AddLayer(const IngestLayerView& part) override {
    if (!failed_.ok()) return Failed();
    absl::Status st = CompressorStatus();
    if (st.ok()) st = commit_accepted_ ? AfterCommit() : AddPart(part, nullptr);
    if (!st.ok()) failed_ = st;
    return st;
  }

  absl::StatusOr<v1::IngestResponse> Finish() override {
    if (!failed_.ok()) return Failed();
    if (committed_) {
      return absl::FailedPreconditionError("Ingest: the stream is already finished");
    }
    if (!commit_accepted_) {
      return absl::InvalidArgumentError(
          "Ingest: the stream ended without an IngestCommit; nothing was committed");
    }
    if (absl::Status st = Commit(); !st.ok()) {
      failed_ = st;
      return st;
    }
    log::Event(spdlog::level::info, "ingest_committed")
        .Str("session", s_->id)
        .Uint("tokens", resp_.tokens())
        .Uint("ingested_tokens", n_)
        .Uint("segments", ranges_.size())
        .Int("layers", L_);
    return resp_;
  }

 private:
  // A layer of the stream: kd, vd [n, h, d] backend memory (kd is post-RoPE when direct_),
  // the observation queries (IngestLayer), and where its parts stand.
  struct LayerBuf : IngestLayer {
    // An incomplete layer that gave its blocks up to another layer's part (see "Overlap"):
    // its rows [0, received) in page-locked host memory of the engine's staging pool,
    // [n, h, d] bf16 (k post-RoPE when direct_, like kd), until its last part arrives.
    // Never set together with kd.
    storage::StagingPool::Lease hk, hv;
    int received = 0;
    bool done = false;        // every part arrived (caller's thread)
    // Ranges of this layer handed to the compression thread before the layer was complete
    // ("Ranges apart"; caller's thread), the last one's rows in `apart` (blocks lent by
    // an apart_slots_ entry) while it compresses.
    size_t ranges_done = 0;
    IngestLayer apart;
  };

  // The compression thread's work: a complete layer from range `range` on, or (apart)
  // range `range` of a layer from its rows in LayerBuf::apart.
  struct Work {
    int layer = -1;
    int range = 0;
    bool apart = false;
    int slot = 0;  // apart: the apart_slots_ entry its rows are in
  };
  // A pair of blocks for a range's K and V rows (HandRangeApart).
  struct ApartSlot {
    DeviceBlock k, v;
  };

  // One segment the commit adds: the range of the prompt between two of the session's
  // segment ends (or its reused prefix's end, or the prompt's end).
  using Range = IngestRange;

  static absl::Status AfterCommit() {
    return absl::InvalidArgumentError(
        "Ingest: no message may follow the IngestCommit; the stream failed and nothing was "
        "committed");
  }

  // A v1 layer message: its tensors as views; parts in the worker's GPU memory (cuda_ipc)
  // are read from the message itself.
  absl::Status AddPart(const v1::IngestLayer& m) {
    // Views hold at most kMaxRank dimensions: a longer shape is refused here, naming it.
    for (const auto& [t, what] : {std::pair{&m.k(), "k"}, std::pair{&m.v(), "v"},
                                  std::pair{&m.observation_queries(), "observation_queries"}}) {
      if (t->shape_size() > TensorView::kMaxRank) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer ", m.layer(), " ", what, ".shape must have 3 dimensions, got [",
            absl::StrJoin(t->shape(), ", "), "]"));
      }
    }
    IngestLayerView v;
    v.layer = m.layer();
    v.token_offset = m.token_offset();
    v.last_part = m.last_part();
    v.k = ViewOf(m.k());
    v.v = ViewOf(m.v());
    if (!TensorEmpty(m.observation_queries())) v.observation_queries = ViewOf(m.observation_queries());
    const bool peer = m.k().has_cuda_ipc() || m.v().has_cuda_ipc();
    return AddPart(v, peer ? &m : nullptr);
  }

  absl::Status AddPart(const IngestLayerView& m, const v1::IngestLayer* peer) {
    const ModelInfo& model = s_->model;
    const int h = model.shape.h, d = model.shape.d, hq = model.shape.query_heads();
    if (m.layer >= static_cast<uint32_t>(L_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer must be < num_layers = ", L_, ", got ", m.layer));
    }
    const int l = static_cast<int>(m.layer);
    LayerBuf& b = bufs_[l];
    const std::string name = absl::StrCat("layer ", l);
    if (b.done) return absl::InvalidArgumentError(absl::StrCat(name, " is already complete"));
    if (m.token_offset != static_cast<uint64_t>(b.received)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": token_offset must be ", b.received,
                       " (parts of a layer arrive in order), got ", m.token_offset));
    }
    if (m.k.rank != 3 || m.k.shape[0] < 1 || m.k.shape[0] > int64_t(n_) - b.received) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": k.shape must be [n_part, h, d] = [1..", int64_t(n_) - b.received, ", ", h,
          ", ", d, "] (", n_, " tokens to ingest, ", b.received, " received), got [",
          absl::StrJoin(m.k.dims(), ", "), "]"));
    }
    const int64_t n_part = m.k.shape[0];
    const std::vector<int64_t> shape = {n_part, h, d};
    const bool completes = b.received + n_part == n_;
    if (m.last_part && !completes) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": last_part is set but the layer has ", b.received + n_part, " of ", n_,
          " tokens"));
    }
    if (!m.observation_queries.empty()) {
      if (!completes) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, ": observation_queries must come with the layer's final part"));
      }
      const TensorView& q = m.observation_queries;
      if (q.rank != 3 || q.shape[0] < 1 || q.shape[0] > n_) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, ": observation_queries.shape must be [w, hq, d] with 1 <= w <= ", n_,
            ", got [", absl::StrJoin(q.dims(), ", "), "]"));
      }
      const int64_t w = q.shape[0];
      b.qobs.resize(size_t(w) * hq * d);
      KVSHADE_RETURN_IF_ERROR(DecodeTensorInto(q, {w, hq, d}, model.dtype,
                                               absl::StrCat(name, " observation_queries"),
                                               absl::MakeSpan(b.qobs)));
      b.w = static_cast<int>(w);
    }
    // The part's slice of the layer (a failed part fails the stream, so a half-written slice
    // is never read).
    const size_t row = size_t(h) * d, len = size_t(n_part) * row;
    // At most one incomplete layer in device memory ("Overlap"): another one that holds
    // blocks goes down to host memory first, which also makes room for this layer's.
    if (device_partial_ >= 0 && device_partial_ != l) {
      KVSHADE_RETURN_IF_ERROR(MoveToHost(device_partial_));
    }
    if (!b.kd && (!b.hk || completes)) {
      // The rows of ranges already compressed apart are not needed again.
      b.base = ranges_[b.ranges_done].offset;
      KVSHADE_RETURN_IF_ERROR(AllocRows(&b.kd, &b.vd, Bf16Bytes(size_t(n_ - b.base) * row)));
      // A layer that waited in host memory: its rows go up beside its last part.
      if (b.hk) KVSHADE_RETURN_IF_ERROR(MoveToDevice(l));
    }
    // Only a layer that waits in host memory still has a host copy here (its part is not
    // the last one).
    const bool on_host = static_cast<bool>(b.hk);
    device_partial_ = (on_host || completes) ? -1 : l;
    // The host copy holds every row of the layer; its blocks, the rows from b.base on.
    const size_t off = size_t(b.received - (on_host ? 0 : b.base)) * row;
    bf16* const kbase = on_host ? reinterpret_cast<bf16*>(b.hk.get()) : static_cast<bf16*>(b.kd.data());
    bf16* const vbase = on_host ? reinterpret_cast<bf16*>(b.hv.get()) : static_cast<bf16*>(b.vd.data());
    const absl::Span<bf16> kdst(kbase + off, len);
    const absl::Span<bf16> vdst(vbase + off, len);
    std::optional<StageTimer> parts_timer(std::in_place, e_.metrics(), "ingest_parts");
    // Every part lands in the layer's backend-memory block: decoded in place on a host-space
    // backend, through a part-sized host staging copy on a device, and copied device to
    // device when the worker shares its GPU memory (cuda_ipc). A part of a layer waiting in
    // host memory lands in its host copy: decoded there, or checked where it is (the
    // worker's GPU memory, by a kernel: nothing checks those rows on the device later, and
    // a scan on the host would cost a CPU pass over every part) and then copied down.
    if (on_host) {
      if (peer != nullptr) {
        KVSHADE_ASSIGN_OR_RETURN(absl::Span<const bf16> ks,
                                 e_.PeerTensor(peer->k(), shape, absl::StrCat(name, " k"), &peers_));
        KVSHADE_ASSIGN_OR_RETURN(absl::Span<const bf16> vs,
                                 e_.PeerTensor(peer->v(), shape, absl::StrCat(name, " v"), &peers_));
        KVSHADE_RETURN_IF_ERROR(CheckFiniteOnDevice(name, ks, vs, kernels::Stream{}));
        KVSHADE_RETURN_IF_ERROR(e_.backend().Copy(kdst.data(), ks.data(), Bf16Bytes(len)));
        KVSHADE_RETURN_IF_ERROR(e_.backend().Copy(vdst.data(), vs.data(), Bf16Bytes(len)));
        KVSHADE_RETURN_IF_ERROR(e_.backend().Synchronize());
      } else {
        KVSHADE_RETURN_IF_ERROR(DecodeTensorInto(m.k, shape, model.dtype, absl::StrCat(name, " k"), kdst));
        KVSHADE_RETURN_IF_ERROR(DecodeTensorInto(m.v, shape, model.dtype, absl::StrCat(name, " v"), vdst));
      }
    } else if (peer != nullptr) {
      // Same node: the part is in the worker's GPU memory (docs/DESIGN.md "Ingest").
      KVSHADE_RETURN_IF_ERROR(e_.CopyFromPeerTensor(peer->k(), shape, absl::StrCat(name, " k"), kdst, &peers_));
      KVSHADE_RETURN_IF_ERROR(e_.CopyFromPeerTensor(peer->v(), shape, absl::StrCat(name, " v"), vdst, &peers_));
      KVSHADE_RETURN_IF_ERROR(CheckFiniteOnDevice(name, kdst, vdst, kernels::Stream{}));
    } else if (host_space_) {
      KVSHADE_RETURN_IF_ERROR(DecodeTensorInto(m.k, shape, model.dtype, absl::StrCat(name, " k"), kdst));
      KVSHADE_RETURN_IF_ERROR(DecodeTensorInto(m.v, shape, model.dtype, absl::StrCat(name, " v"), vdst));
    } else {
      // On the stream's own device stream, so that neither waits for the compression's
      // kernels (AllocRows orders it after earlier users of the layer's memory). bf16
      // parts go up unread and their values are checked on the device. The caller's bytes
      // (and the staging buffers) may be reused once this returns, an error included.
      absl::Status st = UploadPart(m.k, shape, absl::StrCat(name, " k"), kdst, &staging_);
      if (st.ok()) st = UploadPart(m.v, shape, absl::StrCat(name, " v"), vdst, &staging_v_);
      if (st.ok()) st = CheckFiniteOnDevice(name, kdst, vdst, upload_);
      if (!st.ok()) e_.backend().Synchronize(upload_).IgnoreError();
      KVSHADE_RETURN_IF_ERROR(st);
    }
    parts_timer.reset();  // placed; RoPE and the hand-over are timed on their own
    if (direct_) {
      // Rotated now, while the part is fresh in cache; RoPE is per token, so part by part
      // equals the whole layer at once. The backend's memory is host memory here, so the
      // same holds for a part in a layer's host copy (its rows go up rotated).
      StageTimer timer(e_.metrics(), "ingest_rope");
      const std::vector<int64_t> pos = Positions(first_ + b.received, n_part);
      KVSHADE_RETURN_IF_ERROR(e_.backend().ApplyRope(model.rope, pos, h, d, kdst));
      KVSHADE_RETURN_IF_ERROR(e_.backend().Synchronize());
    }
    b.received += static_cast<int>(n_part);
    // The part has been read from where it was (a peer's GPU memory included: its copies
    // are synchronized above): GetSession's ingest_parts_taken lets the worker free it.
    ++s_->ingest_parts_taken;
    if (!completes) {
      // A range (not the last) whose rows are all in compresses now, apart from the layer.
      while (profile_->compresses_ranges_early() && b.ranges_done + 1 < ranges_.size() &&
             b.received >= ranges_[b.ranges_done].offset + ranges_[b.ranges_done].n) {
        KVSHADE_RETURN_IF_ERROR(HandRangeApart(l));
      }
      return absl::OkStatus();
    }
    b.done = true;
    return HandToCompressor(l);
  }

  // Hands range ranges_done of incomplete layer l to the compression thread, with a copy
  // of its rows taken from where the layer's rows are (its blocks or its host copy), so
  // that the layer's later parts and a move of the layer to or from host memory never
  // touch what the compression reads. The copies take turns in two pairs of blocks the
  // stream keeps (apart_slots_): the rows of this layer's range go up into one while the
  // previous layer's range compresses from the other, which the compression before that
  // one left idle (it synchronizes its device work before it ends). So the copy does not
  // wait for the compressing layer, as blocks fresh from the arena would (AllocRows).
  absl::Status HandRangeApart(int l) {
    LayerBuf& b = bufs_[l];
    const size_t r = b.ranges_done;
    const Range& rg = ranges_[r];
    const size_t row = size_t(s_->model.shape.D());
    const size_t bytes = Bf16Bytes(size_t(rg.n) * row);
    const int slot = apart_next_;
    apart_next_ ^= 1;
    ApartSlot& as = apart_slots_[slot];
    {
      StageTimer timer(e_.metrics(), "ingest_parts");
      if (as.k.bytes() < bytes) {
        as = ApartSlot{};
        // (The first use of a slot, or one whose blocks a short range took, or a longer
        // range than the slot holds.)
        KVSHADE_RETURN_IF_ERROR(AllocRows(&as.k, &as.v, bytes));
      }
      absl::Status st;
      if (b.hk) {
        const size_t at = Bf16Bytes(size_t(rg.offset) * row);
        st = e_.backend().CopyFromHost(as.k.data(), b.hk.get() + at, bytes, upload_);
        if (st.ok()) st = e_.backend().CopyFromHost(as.v.data(), b.hv.get() + at, bytes, upload_);
      } else {
        const size_t at = Bf16Bytes(size_t(rg.offset - b.base) * row);
        const auto* kb = static_cast<const std::byte*>(b.kd.data());
        const auto* vb = static_cast<const std::byte*>(b.vd.data());
        st = e_.backend().Copy(as.k.data(), kb + at, bytes, upload_);
        if (st.ok()) st = e_.backend().Copy(as.v.data(), vb + at, bytes, upload_);
      }
      // The parts' uploads on upload_ came first; the compression runs on another stream.
      absl::Status sync = e_.backend().Synchronize(upload_);
      if (st.ok()) st = sync;
      KVSHADE_RETURN_IF_ERROR(st);
    }
    KVSHADE_RETURN_IF_ERROR(WaitCompressorIdle());  // b.apart is free again
    b.apart.kd = std::move(as.k);
    b.apart.vd = std::move(as.v);
    b.apart.base = rg.offset;
    b.ranges_done = r + 1;
    return Hand(Work{l, static_cast<int>(r), /*apart=*/true, slot});
  }

  // The layer's raw K and V blocks. While a layer is being compressed they are taken only
  // if the device arena keeps room for the most the compression took so far in this
  // stream (not known before the first layer is done: then the caller waits); otherwise,
  // and when the allocation fails for the budget, the compressing layer is waited for (its
  // raw blocks are freed when it is done). So a tight budget ingests one layer at a time.
  absl::Status AllocRows(DeviceBlock* kd, DeviceBlock* vd, size_t bytes) {
    {
      std::unique_lock lock(cmu_);
      const bool busy = pending_.layer >= 0 || compressing_;
      // Before a layer is done: the working copy of the keys, the factors and the rest.
      const size_t reserve = peak_known_ ? compression_peak_ : 3 * bytes;
      if (busy && e_.DeviceFreeBytes() < 2 * bytes + reserve) {
        lock.unlock();
        KVSHADE_RETURN_IF_ERROR(WaitCompressorIdle());
      }
    }
    absl::StatusOr<DeviceBlock> k = e_.Alloc(bytes, ArenaKind::kOther);
    absl::StatusOr<DeviceBlock> v = k.ok() ? e_.Alloc(bytes, ArenaKind::kStatic) : k.status();
    if (!v.ok() && absl::IsResourceExhausted(v.status())) {
      k = DeviceBlock();
      KVSHADE_RETURN_IF_ERROR(WaitCompressorIdle());
      KVSHADE_ASSIGN_OR_RETURN(k, e_.Alloc(bytes, ArenaKind::kOther));
      v = e_.Alloc(bytes, ArenaKind::kStatic);
    }
    if (!v.ok()) return v.status();
    *kd = *std::move(k);
    *vd = *std::move(v);
    if (!host_space_) {
      if (!finite_) {
        KVSHADE_ASSIGN_OR_RETURN(finite_, e_.Alloc(2 * sizeof(int64_t), ArenaKind::kOther));
      }
      if (!upload_created_) {
        KVSHADE_ASSIGN_OR_RETURN(upload_, e_.backend().CreateStream());
        upload_created_ = true;
      }
      // Whoever used this memory before may still have work queued on the default stream;
      // the upload stream does not wait for it, so the layer starts after it (once per
      // layer, not per part).
      StageTimer timer(e_.metrics(), "ingest_wait");
      KVSHADE_RETURN_IF_ERROR(e_.backend().Synchronize());
    }
    return absl::OkStatus();
  }

  // Moves incomplete layer l's received rows from its blocks to a host copy of the layer
  // and frees the blocks (see "Overlap": another layer's part arrived). The part uploads
  // on upload_ (and, direct_, the rotation) are done before the rows are read.
  absl::Status MoveToHost(int l) {
    LayerBuf& b = bufs_[l];
    StageTimer timer(e_.metrics(), "ingest_parts");
    const size_t row = size_t(s_->model.shape.h) * s_->model.shape.d;
    const size_t layer_bytes = Bf16Bytes(size_t(n_) * row);
    const size_t at = Bf16Bytes(size_t(b.base) * row), bytes = Bf16Bytes(size_t(b.received - b.base) * row);
    // Host memory for every row, so that the later parts land there and the layer goes up
    // in one copy; uninitialized, since only received rows are ever read. Page-locked and
    // kept for reuse (the staging pool): copies to and from it run at full rate, and a
    // chunked prefill after the first allocates nothing here.
    absl::StatusOr<storage::StagingPool::Lease> hk = e_.staging().Take(layer_bytes);
    absl::StatusOr<storage::StagingPool::Lease> hv =
        hk.ok() ? e_.staging().Take(layer_bytes) : hk.status();
    if (!hv.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "layer ", l, ": no host memory (", 2 * layer_bytes, " bytes) to hold its ", b.received,
          " received tokens while another layer's parts arrive: ", hv.status().message()));
    }
    b.hk = *std::move(hk);
    b.hv = *std::move(hv);
    KVSHADE_RETURN_IF_ERROR(e_.backend().Synchronize(upload_));
    absl::Status st = e_.backend().CopyToHost(b.hk.get() + at, b.kd.data(), bytes, upload_);
    if (st.ok()) st = e_.backend().CopyToHost(b.hv.get() + at, b.vd.data(), bytes, upload_);
    // Nothing may still read the blocks once they are freed, an error included.
    absl::Status sync = e_.backend().Synchronize(upload_);
    if (st.ok()) st = sync;
    KVSHADE_RETURN_IF_ERROR(st);
    b.kd = DeviceBlock();
    b.vd = DeviceBlock();
    device_partial_ = -1;
    return absl::OkStatus();
  }

  // Copies the received rows of layer l's host copy from b.base on into its new blocks
  // (AllocRows) and frees the host copy. Those rows were checked when they arrived
  // (decoded on the host, or peer rows checked on the device before their copy down), so
  // they are not checked again.
  absl::Status MoveToDevice(int l) {
    LayerBuf& b = bufs_[l];
    StageTimer timer(e_.metrics(), "ingest_parts");
    const size_t row = size_t(s_->model.shape.h) * s_->model.shape.d;
    const size_t at = Bf16Bytes(size_t(b.base) * row), bytes = Bf16Bytes(size_t(b.received - b.base) * row);
    absl::Status st = e_.backend().CopyFromHost(b.kd.data(), b.hk.get() + at, bytes, upload_);
    if (st.ok()) st = e_.backend().CopyFromHost(b.vd.data(), b.hv.get() + at, bytes, upload_);
    // The host copy is freed only once the copies have read it, an error included.
    absl::Status sync = e_.backend().Synchronize(upload_);
    if (st.ok()) st = sync;
    KVSHADE_RETURN_IF_ERROR(st);
    b.hk.reset();
    b.hv.reset();
    return absl::OkStatus();
  }

  // --- the compression thread (see "Overlap" above) ---

  // Waits until no layer is being compressed; returns the compressor's first error.
  absl::Status WaitCompressorIdle() {
    StageTimer timer(e_.metrics(), "ingest_wait");
    std::unique_lock lock(cmu_);
    ccv_.wait(lock, [&] { return pending_.layer < 0 && !compressing_; });
    return compressor_status_;
  }

  void NoteCompressionPeak(size_t bytes) override {
    std::lock_guard lock(cmu_);
    compression_peak_ = std::max(compression_peak_, bytes);
    peak_known_ = true;
  }

  absl::Status CompressorStatus() {
    std::lock_guard lock(cmu_);
    return compressor_status_;
  }

  // Hands a complete layer over once the previous work is done: its ranges from the
  // first one not compressed apart (HandRangeApart).
  absl::Status HandToCompressor(int l) {
    KVSHADE_RETURN_IF_ERROR(WaitCompressorIdle());
    return Hand(Work{l, static_cast<int>(bufs_[l].ranges_done), /*apart=*/false});
  }

  // Gives the compression thread its next work (the thread is idle), starting it at the
  // first.
  absl::Status Hand(Work w) {
    if (!compressor_.joinable()) {
      try {
        compressor_ = std::thread([this] { CompressLoop(); });
      } catch (const std::system_error& e) {
        // No thread to be had (a process or memory limit): this work, and the later one,
        // is done on the caller's thread.
        spdlog::warn("session '{}': ingest compresses inline, no compression thread: {}", s_->id, e.what());
        return CompressInline(w);
      }
    }
    {
      std::lock_guard lock(cmu_);
      pending_ = w;
    }
    ccv_.notify_all();
    return absl::OkStatus();
  }

  void CompressLoop() {
    for (;;) {
      Work w;
      {
        std::unique_lock lock(cmu_);
        ccv_.wait(lock, [&] { return stop_ || pending_.layer >= 0; });
        if (stop_) return;
        w = pending_;
        pending_ = Work{};
        compressing_ = true;
      }
      absl::Status st = Compress(w);
      {
        std::lock_guard lock(cmu_);
        compressing_ = false;
        if (compressor_status_.ok()) compressor_status_ = st;
      }
      ccv_.notify_all();
    }
  }

  // Compresses the work's rows and frees them: range w.range of layer w.layer apart, or
  // the complete layer's ranges from w.range on. An error names the layer.
  absl::Status Compress(const Work& w) {
    const int l = w.layer;
    LayerBuf& b = bufs_[l];
    absl::Status st;
    if (w.apart) {
      st = profile_->CompressRange(b.apart, l, static_cast<size_t>(w.range));
      // The blocks go back to their slot (unless a short range took them as its tail).
      if (b.apart.kd) {
        apart_slots_[w.slot].k = std::move(b.apart.kd);
        apart_slots_[w.slot].v = std::move(b.apart.vd);
      }
      b.apart.kd = DeviceBlock();
      b.apart.vd = DeviceBlock();
    } else {
      st = profile_->CompressLayer(l, static_cast<size_t>(w.range));
      b.kd = DeviceBlock();
      b.vd = DeviceBlock();
      std::vector<bf16>().swap(b.qobs);
    }
    if (!st.ok()) return absl::Status(st.code(), absl::StrCat("layer ", l, ": ", st.message()));
    if (!w.apart) ++s_->layers_ingested;
    return absl::OkStatus();
  }

  absl::Status CompressInline(const Work& w) {
    absl::Status st = Compress(w);
    std::lock_guard lock(cmu_);
    if (compressor_status_.ok()) compressor_status_ = st;
    return st;
  }

  // Stops the thread after the layer it is compressing (a waiting one is dropped).
  void StopCompressor() {
    {
      std::lock_guard lock(cmu_);
      stop_ = true;
    }
    ccv_.notify_all();
    if (compressor_.joinable()) compressor_.join();
  }

  // Starts copying a host part into the layer's device slice (the caller synchronizes):
  // bf16 (the model's dtype) goes up straight from the caller's bytes, its layout checked
  // here and its values on the device (CheckFiniteOnDevice); other dtypes are converted
  // and checked through a part-sized host staging buffer.
  absl::Status UploadPart(const TensorView& t, absl::Span<const int64_t> shape,
                          const std::string& what, absl::Span<bf16> dst,
                          std::vector<bf16>* staging) {
    const ModelInfo& model = s_->model;
    if (model.dtype == v1::DTYPE_BF16) {
      KVSHADE_RETURN_IF_ERROR(CheckTensorLayout(t, shape, model.dtype, what));
      return e_.backend().CopyFromHost(dst.data(), t.data.data(), Bf16Bytes(dst.size()), upload_);
    }
    staging->resize(dst.size());
    KVSHADE_RETURN_IF_ERROR(DecodeTensorInto(t, shape, model.dtype, what, absl::MakeSpan(*staging)));
    return e_.backend().CopyFromHost(dst.data(), staging->data(), Bf16Bytes(dst.size()), upload_);
  }

  // Waits for the part's uploads (or peer copies) on `stream` and checks that every value
  // of its bf16 k and v slices is finite, on the device. Converted dtypes were already
  // checked on the host; checking them again costs one pass over device memory.
  absl::Status CheckFiniteOnDevice(const std::string& name, absl::Span<const bf16> k,
                                   absl::Span<const bf16> v, kernels::Stream stream) {
    const absl::Span<int64_t> first(static_cast<int64_t*>(finite_.data()), 2);
    KVSHADE_RETURN_IF_ERROR(e_.backend().FirstNonFinite(k, first.subspan(0, 1), stream));
    KVSHADE_RETURN_IF_ERROR(e_.backend().FirstNonFinite(v, first.subspan(1, 1), stream));
    int64_t host[2];
    KVSHADE_RETURN_IF_ERROR(e_.DownloadOn(stream, host, finite_.data(), sizeof(host)));
    if (size_t(host[0]) < k.size()) return NonFiniteError(absl::StrCat(name, " k"), size_t(host[0]));
    if (size_t(host[1]) < v.size()) return NonFiniteError(absl::StrCat(name, " v"), size_t(host[1]));
    return absl::OkStatus();
  }

  // Reserves the segment's value block in the store (every profile: the store is also
  // where a durable segment is written through, factors included).
  absl::Status EnsureStoreSegment(Range& rg, int n_chunks) override {
    if (rg.store_created) return absl::OkStatus();
    const ModelInfo& m = s_->model;
    const ProfileInfo& p = s_->profile;
    KVSHADE_ASSIGN_OR_RETURN(rg.layout, storage::SegmentValueLayout::Make(
                                            L_, m.shape.h, n_chunks, p.chunk_size, m.shape.d, p.codec));
    KVSHADE_RETURN_IF_ERROR(e_.store().Create(rg.id, rg.layout));
    rg.store_created = true;
    return absl::OkStatus();
  }

  // The layer's keys [n, h, d] in backend memory, as a span.
  absl::Span<const bf16> Keys(const IngestLayer& b) const override {
    return absl::Span<const bf16>(static_cast<const bf16*>(b.kd.data()), b.kd.bytes() / sizeof(bf16));
  }

  // A range's rows [rg.n, h, d] of the layer's keys or values.
  absl::Span<const bf16> Rows(const IngestLayer& b, const DeviceBlock& block,
                              const Range& rg) const override {
    const size_t row = size_t(s_->model.shape.D());
    return absl::Span<const bf16>(static_cast<const bf16*>(block.data()) + size_t(rg.offset - b.base) * row,
                                  size_t(rg.n) * row);
  }

  // The range's K and V rows as blocks of their own: b's blocks themselves when they hold
  // the range's rows and nothing else, else copies.
  absl::Status TakeRows(IngestLayer& b, const Range& rg, DeviceBlock* k, DeviceBlock* v) override {
    const size_t bytes = Bf16Bytes(size_t(rg.n) * s_->model.shape.D());
    if (b.base == rg.offset && b.kd.bytes() == bytes) {
      *k = std::move(b.kd);
      *v = std::move(b.vd);
      return absl::OkStatus();
    }
    KVSHADE_ASSIGN_OR_RETURN(*k, e_.Alloc(bytes, ArenaKind::kOther));
    KVSHADE_ASSIGN_OR_RETURN(*v, e_.Alloc(bytes, ArenaKind::kStatic));
    KVSHADE_RETURN_IF_ERROR(e_.backend().Copy(k->data(), Rows(b, b.kd, rg).data(), bytes));
    KVSHADE_RETURN_IF_ERROR(e_.backend().Copy(v->data(), Rows(b, b.vd, rg).data(), bytes));
    return e_.backend().Synchronize();
  }

  // Rotates keys [n, h, d] at positions [first, first + n) in place (they are not needed
  // pre-RoPE afterwards).
  absl::Status RopeInPlace(DeviceBlock& k, int64_t first, int n) override {
    const ModelInfo& m = s_->model;
    StageTimer timer(e_.metrics(), "ingest_rope");
    KVSHADE_ASSIGN_OR_RETURN(DeviceBlock posd, e_.DevicePositions(first, n));
    KVSHADE_RETURN_IF_ERROR(e_.backend().ApplyRope(
        m.rope, absl::Span<const int64_t>(static_cast<const int64_t*>(posd.data()), size_t(n)),
        m.shape.h, m.shape.d,
        absl::Span<bf16>(static_cast<bf16*>(k.data()), size_t(n) * m.shape.D())));
    return e_.backend().Synchronize();
  }

  // Keeps pre-RoPE keys for a background refactorization (host copy; rare: only when the
  // projection residual is past refactor_threshold).
  absl::Status KeepForRefactor(int l, absl::Span<const bf16> k) override {
    std::vector<bf16>& keys = refactor_keys_[l];
    keys.resize(k.size());
    return e_.Download(keys.data(), k.data(), Bf16Bytes(k.size()));
  }

  // Residual of projecting k [n, h, d] onto `basis` (optionally keeping the coordinates).
  absl::StatusOr<double> Project(absl::Span<const bf16> k, const Basis& basis,
                                 DeviceBlock* a_out) override {
    const ModelInfo& m = s_->model;
    const int n = static_cast<int>(k.size() / m.shape.D());
    StageTimer timer(e_.metrics(), "ingest_project");
    KVSHADE_ASSIGN_OR_RETURN(DeviceBlock a, e_.Alloc(Bf16Bytes(size_t(n) * basis.r), ArenaKind::kA));
    const size_t wsb = e_.backend().ProjectWorkspaceBytes(n, m.shape, basis.r);
    KVSHADE_ASSIGN_OR_RETURN(DeviceBlock ws, e_.Alloc(wsb, ArenaKind::kOther));
    KVSHADE_ASSIGN_OR_RETURN(
        kernels::ProjectionResult pr,
        e_.backend().ProjectKeys(
            k, n, m.shape,
            absl::Span<const bf16>(static_cast<const bf16*>(basis.b.data()),
                                   size_t(m.shape.h) * basis.r * m.shape.d),
            basis.r, absl::Span<bf16>(static_cast<bf16*>(a.data()), size_t(n) * basis.r),
            kernels::Workspace{ws.data(), wsb}));
    KVSHADE_RETURN_IF_ERROR(e_.backend().Synchronize());
    if (a_out != nullptr) *a_out = std::move(a);
    return pr.residual_energy;
  }

  // A range projected onto a cached basis: the layer reports the largest residual of its
  // projected ranges.
  void NoteResidual(int l, double residual, int tokens) override {
    residual_[l] = std::max(residual_[l], residual);
    weighted_residual_[l] += residual * tokens;
    projected_ = true;
  }
  double residual(int l) const override { return residual_[l]; }
  double session_residual(int l) const override {
    const int64_t total = first_ + n_;  // the session's tokens after this ingest
    return total > 0 ? weighted_residual_[l] / static_cast<double>(total) : 0.0;
  }
  void set_captured(int l, double energy) override { captured_[l] = energy; }

  // The rest of IngestContext (profile.h).
  EngineImpl& engine() override { return e_; }
  const Session& session() const override { return *s_; }
  int64_t first() const override { return first_; }
  int n() const override { return n_; }
  size_t range_count() const override { return ranges_.size(); }
  IngestRange& range(size_t r) override { return ranges_[r]; }
  IngestLayer& layer(int l) override { return bufs_[l]; }
  bool direct() const override { return direct_; }

  absl::Status Failed() const {
    return absl::FailedPreconditionError(absl::StrCat(
        "Ingest: an earlier message of this stream failed, so nothing is committed: ",
        failed_.message()));
  }

  // The commit message: checked now, applied by Finish once the stream has ended.
  absl::Status AcceptCommit() {
    // Every layer compressed (or the compressor's error).
    KVSHADE_RETURN_IF_ERROR(WaitCompressorIdle());
    for (ApartSlot& slot : apart_slots_) slot = ApartSlot{};
    std::vector<int> missing;
    for (int l = 0; l < L_; ++l) {
      if (!bufs_[l].done) missing.push_back(l);
    }
    if (!missing.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "IngestCommit before every layer was complete; incomplete layers: [",
          absl::StrJoin(missing.begin(), missing.begin() + std::min<size_t>(missing.size(), 16), ", "),
          missing.size() > 16 ? ", ..." : "", "]"));
    }
    commit_accepted_ = true;
    return absl::OkStatus();
  }

  // Seals the segments (one per range) and makes them the session's: all of them, or (on
  // an error) none of them.
  absl::Status Commit() {
    const ModelInfo& m = s_->model;
    const ProfileInfo& p = s_->profile;
    const ProfileStrategy& profile = ProfileOf(p.kind);
    // Content-addressed registration (reusable profiles: shadow, exact): later sessions
    // with the same tokens reuse these segments. The keys are known before sealing so that
    // a durable segment's record carries its own.
    std::optional<storage::PrefixHasher> hasher;
    std::vector<storage::PrefixKey> keys;
    if (profile.reusable()) {
      if (auto h = e_.Hasher(tenant_, m, p); h.ok()) {
        hasher = *h;
        keys = hasher->Chain(s_->prompt);
      }
    }
    std::vector<std::shared_ptr<Segment>> segs;
    for (Range& rg : ranges_) {
      KVSHADE_RETURN_IF_ERROR(EnsureStoreSegment(rg, 0));
      auto seg = std::make_shared<Segment>();
      seg->id = rg.id;
      seg->kind = p.kind;
      seg->first_position = rg.first;
      seg->n_tokens = rg.n;
      seg->chunk_size = p.chunk_size;
      seg->tokens.assign(s_->prompt.begin() + rg.first, s_->prompt.begin() + rg.first + rg.n);
      seg->layers = std::move(rg.out);
      seg->values_in_store = true;
      seg->value_layout = rg.layout;
      seg->store = e_.store_link();
      seg->durable = s_->durable;
      if (hasher) {
        const int64_t end_block = (rg.first + rg.n) / hasher->block_tokens();
        if (end_block > 0 && size_t(end_block) <= keys.size()) seg->prefix_key = keys[end_block - 1];
      }
      KVSHADE_RETURN_IF_ERROR(e_.SealSegmentValues(*seg, s_->durable, m));
      rg.store_created = false;  // the segment owns its values now
      segs.push_back(std::move(seg));
    }
    // Each range is registered under the one before it (or the session's reused prefix).
    std::vector<storage::SegmentRef> refs;
    std::optional<storage::SegmentId> parent;
    {
      std::shared_lock lock(s_->mu);
      if (!s_->chain.empty()) parent = s_->chain.back()->id;
    }
    for (const std::shared_ptr<Segment>& seg : segs) {
      storage::SegmentRef ref;
      if (hasher && seg->prefix_key) {
        ref = e_.RegisterPrefix(seg, keys, hasher->block_tokens(), parent);
        if (!ref) seg->prefix_key.reset();
      }
      if (ref) refs.push_back(std::move(ref));
      parent = seg->id;
    }

    bool scheduled = false;
    {
      std::unique_lock lock(s_->mu);
      if (s_->state != SessionState::kIngesting) {
        return absl::NotFoundError(absl::StrCat("session '", s_->id, "' was closed"));
      }
      const size_t n_refs = refs.size();
      s_->chain.insert(s_->chain.end(), segs.begin(), segs.end());
      for (storage::SegmentRef& ref : refs) s_->prefix_refs.push_back(std::move(ref));
      s_->tokens += n_;
      s_->state = SessionState::kReady;
      ++s_->static_version;
      ++s_->tail_version;
      if (s_->durable) {
        if (absl::Status st = e_.PersistSession(*s_); !st.ok()) {
          // Not committed after all: the session is as it was before the commit.
          s_->chain.resize(s_->chain.size() - segs.size());
          s_->prefix_refs.resize(s_->prefix_refs.size() - n_refs);
          s_->tokens -= n_;
          s_->state = SessionState::kIngesting;
          ++s_->static_version;
          ++s_->tail_version;
          return st;
        }
      }
      // Shadow: the prompt's remainder may join an earlier segment's (a short suffix):
      // whole chunks leave the tail now. The commit stands either way (a failure only
      // leaves the tail longer until the next append).
      if (absl::Status st = profile.SettleTail(e_, *s_); !st.ok()) {
        spdlog::warn("session '{}': the exact tail was not cut at the commit: {}", s_->id,
                     std::string(st.message()));
      }
      s_->captured_energy = captured_;
      s_->residual_energy = residual_;
      bool any = false;
      for (int l = 0; l < L_; ++l) any = any || !refactor_keys_[l].empty();
      if (any) {
        s_->refactor_keys = std::move(refactor_keys_);
        s_->refactor_first_position = ranges_.back().first;  // the keys are the last range's
        s_->refactor_pending = true;
        scheduled = true;
      }
    }
    committed_ = true;
    if (scheduled) e_.ScheduleRefactor(s_);
    e_.metrics()->IngestedTokens(n_);
    profile_->Report(e_.metrics(), &resp_, captured_, residual_, projected_);
    e_.UpdateGauges();
    resp_.set_tokens(s_->tokens);
    resp_.set_refactorization_scheduled(scheduled);
    return absl::OkStatus();
  }

  EngineImpl& e_;
  Tenant tenant_;
  std::shared_ptr<Session> s_;
  int64_t first_ = 0;
  int n_ = 0;
  int L_ = 0;
  std::vector<LayerBuf> bufs_;
  std::vector<Range> ranges_;  // the segments the commit adds
  bool projected_ = false;  // a range was projected onto a cached basis (residual_ is set)
  std::vector<double> captured_, residual_;
  std::vector<double> weighted_residual_;  // sum over projected ranges of residual * tokens
  std::vector<std::vector<bf16>> refactor_keys_;
  std::vector<std::string> peers_;  // CUDA IPC handles this stream mapped (same-node parts)
  std::unique_ptr<ProfileIngest> profile_;  // the profile's part (compresses the layers)
  bool commit_accepted_ = false;  // the commit message arrived (and every layer was complete)
  bool committed_ = false;        // Finish applied it
  absl::Status failed_;           // the stream's first error
  bool host_space_ = false;  // the backend's memory is host memory (cpu)
  std::vector<bf16> staging_, staging_v_;  // one part's k and v on their way to device memory
  DeviceBlock finite_;  // [2] int64: CheckFiniteOnDevice's results for k and v
  kernels::Stream upload_;       // device backends: this stream's parts go up on it
  bool upload_created_ = false;
  bool direct_ = false;  // exact profile on a host-memory backend: parts land in the segment
  int device_partial_ = -1;  // the incomplete layer that holds blocks, if any (caller's thread)
  v1::IngestResponse resp_;
  // The compression thread and what it shares with the caller's thread (under cmu_).
  std::thread compressor_;
  std::mutex cmu_;
  std::condition_variable ccv_;
  Work pending_;               // work waiting for the thread (layer -1: none)
  // HandRangeApart's two pairs of blocks (caller's thread, but for the compression
  // thread's giving back the pair of the work it ends) and which one it takes next.
  ApartSlot apart_slots_[2];
  int apart_next_ = 0;
  bool compressing_ = false;  // the thread is at work
  bool stop_ = false;
  absl::Status compressor_status_;  // its first error
  size_t compression_peak_ = 0;     // the most device bytes one layer's compression held
  bool peak_known_ = false;         // (known once a layer is done; mini: never)
};

}  // namespace

absl::Status QuantizeKivi(EngineImpl& e, int d, int G, const std::vector<bf16>& k,
                          const std::vector<bf16>& v, int rows, KiviBlock* kb,
                          std::vector<bf16>* dk, std::vector<bf16>* dv) {
  const kernels::KiviLayout kl{rows, d, 2, G, kernels::KiviAxis::kPerChannel};
  const kernels::KiviLayout vl{rows, d, 2, G, kernels::KiviAxis::kPerToken};
  const size_t n = size_t(rows) * d;
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock kd, e.Upload(k.data(), Bf16Bytes(n), ArenaKind::kOther));
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock vd, e.Upload(v.data(), Bf16Bytes(n), ArenaKind::kOther));
  KVSHADE_ASSIGN_OR_RETURN(kb->k_codes, e.Alloc(kl.code_words() * 4, ArenaKind::kStatic));
  KVSHADE_ASSIGN_OR_RETURN(kb->k_scale, e.Alloc(kl.n_groups() * 2, ArenaKind::kStatic));
  KVSHADE_ASSIGN_OR_RETURN(kb->k_min, e.Alloc(kl.n_groups() * 2, ArenaKind::kStatic));
  KVSHADE_ASSIGN_OR_RETURN(kb->v_codes, e.Alloc(vl.code_words() * 4, ArenaKind::kStatic));
  KVSHADE_ASSIGN_OR_RETURN(kb->v_scale, e.Alloc(vl.n_groups() * 2, ArenaKind::kStatic));
  KVSHADE_ASSIGN_OR_RETURN(kb->v_min, e.Alloc(vl.n_groups() * 2, ArenaKind::kStatic));
  auto u32 = [](const DeviceBlock& b, size_t c) {
    return absl::Span<uint32_t>(static_cast<uint32_t*>(b.data()), c);
  };
  auto f16 = [](const DeviceBlock& b, size_t c) {
    return absl::Span<kernels::fp16>(static_cast<kernels::fp16*>(b.data()), c);
  };
  KVSHADE_RETURN_IF_ERROR(e.backend().KiviQuantize(
      absl::Span<const bf16>(static_cast<const bf16*>(kd.data()), n), kl,
      u32(kb->k_codes, kl.code_words()), f16(kb->k_scale, kl.n_groups()), f16(kb->k_min, kl.n_groups())));
  KVSHADE_RETURN_IF_ERROR(e.backend().KiviQuantize(
      absl::Span<const bf16>(static_cast<const bf16*>(vd.data()), n), vl,
      u32(kb->v_codes, vl.code_words()), f16(kb->v_scale, vl.n_groups()), f16(kb->v_min, vl.n_groups())));
  // Dequantize in place of the inputs (they are scratch).
  KVSHADE_RETURN_IF_ERROR(e.backend().KiviDequantize(
      u32(kb->k_codes, kl.code_words()), f16(kb->k_scale, kl.n_groups()), f16(kb->k_min, kl.n_groups()),
      kl, absl::Span<bf16>(static_cast<bf16*>(kd.data()), n)));
  KVSHADE_RETURN_IF_ERROR(e.backend().KiviDequantize(
      u32(kb->v_codes, vl.code_words()), f16(kb->v_scale, vl.n_groups()), f16(kb->v_min, vl.n_groups()),
      vl, absl::Span<bf16>(static_cast<bf16*>(vd.data()), n)));
  dk->resize(n);
  dv->resize(n);
  KVSHADE_RETURN_IF_ERROR(e.Download(dk->data(), kd.data(), Bf16Bytes(n)));
  return e.Download(dv->data(), vd.data(), Bf16Bytes(n));
}

absl::StatusOr<std::unique_ptr<Engine::IngestStream>> EngineImpl::BeginIngest(
    const Tenant& t, const v1::IngestRequest& header) {
  if (header.body_case() != v1::IngestRequest::kHeader) {
    return absl::InvalidArgumentError(
        "Ingest: the first message of the stream must be an IngestHeader");
  }
  KVSHADE_RETURN_IF_ERROR(CheckNotDraining("Ingest"));
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Session> s,
                           sessions_.FindSession(t.name, header.header().session_id()));
  {
    std::shared_lock lock(s->mu);
    if (s->state != SessionState::kIngesting) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session '", s->id, "' is ", SessionStateName(s->state),
          "; it has nothing to ingest (its prompt is committed)"));
    }
  }
  bool expected = false;
  if (!s->ingest_active.compare_exchange_strong(expected, true)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", s->id, "' already has an Ingest stream in progress"));
  }
  return std::unique_ptr<Engine::IngestStream>(new IngestStreamImpl(*this, t, std::move(s)));
}

}  // namespace kvshade::service
