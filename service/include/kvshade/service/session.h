// Sessions and segments: the in-memory state of kvshade's cache (docs/DESIGN.md
// "Sessions").
//
// A Segment is the compressed state of a token range for every layer. Once sealed it is
// immutable and shared (std::shared_ptr<const Segment>) by every session whose chain holds
// it: a cached document prefix, a fork's shared part. A Session is a chain of sealed
// segments (shared prefix first), an open segment that whole chunks move into, and one
// small exact tail at its end: the remainder rows of its last segments (LayerData::n_tail)
// that no chunk covers yet, then the appended tokens not yet in whole chunks (TailLayer).
//
// Memory: "device" blocks come from the storage DeviceArena (backend memory: device memory
// for CUDA, host memory for the CPU backend). Values of sealed shadow segments live in the
// storage HostValueStore under the segment id (pinned per call; spilled when cold); the
// open segment's values live in a growable host-visible buffer of its own (the store's
// blocks have a fixed size).
//
// Locking: Session::mu is a reader/writer lock. Select, Attend and GetStaticSet hold it
// shared; Ingest commit, AppendTokens, Fork sealing and the refactorization swap hold it
// exclusively. Segment contents never change after sealing, so no lock guards them.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "kvshade/kernels/backend.h"
#include "kvshade/service/model.h"
#include "kvshade/service/selection_guard.h"
#include "kvshade/storage/device_arena.h"
#include "kvshade/storage/prefix_index.h"
#include "kvshade/storage/types.h"

namespace kvshade::service {

// Backend memory owned by the session state: a block of the storage DeviceArena, or a
// Buffer made by a kernel composite (whose memory comes from the arena too, through
// ArenaAllocator in ingest.cc).
class DeviceBlock {
 public:
  DeviceBlock() = default;
  DeviceBlock(storage::ArenaBlock b) : block_(std::move(b)) {}  // NOLINT: implicit by design
  DeviceBlock(kernels::Buffer b) : buffer_(std::move(b)) {}     // NOLINT
  void* data() const { return block_ ? block_.data() : buffer_.data(); }
  size_t bytes() const { return block_ ? block_.bytes() : buffer_.bytes(); }
  explicit operator bool() const { return data() != nullptr; }

 private:
  storage::ArenaBlock block_;
  kernels::Buffer buffer_;
};

// A layer's shared key basis B [h, r, d] bf16 (device), with the rank r.
struct Basis {
  int r = 0;
  DeviceBlock b;
};

// INT2 (KIVI) K and V of `rows` tokens per head for every head of a layer:
// keys [h*rows, d] in per-channel groups of G rows (rows % G == 0, so groups never cross
// heads), values [h*rows, d] in per-token groups of G channels. Only the first `valid`
// rows of each head are tokens; the rest repeat the last token (padding that leaves the
// group minima and maxima unchanged) and are never attended.
struct KiviBlock {
  int rows = 0;
  int valid = 0;
  DeviceBlock k_codes, k_scale, k_min;
  DeviceBlock v_codes, v_scale, v_min;
};

// Growable host-visible value chunks of an open segment: [h, cap_chunks, chunk_stride].
struct OpenValues {
  kernels::Buffer buffer;
  int cap_chunks = 0;
  int64_t chunk_stride = 0;
  int64_t head_stride() const { return int64_t(cap_chunks) * chunk_stride; }
};

// One layer of one segment.
struct LayerData {
  // --- selectable chunks (shadow) ---
  int n_chunks = 0;    // chunks covering tokens [0, n_chunks*C) of the segment
  int cap_chunks = 0;  // capacity of a, landmarks, sig (== n_chunks once sealed)
  std::shared_ptr<const Basis> basis;
  // [cap_chunks*C, r] bf16 token coordinates; shared so that a refactorized copy of a
  // segment can keep the layers it did not change.
  std::shared_ptr<DeviceBlock> a;
  DeviceBlock landmarks;  // [cap_chunks, h, d] bf16 post-RoPE chunk means
  // Key signatures of the chunked tokens (docs/ALGORITHM.md "Key signatures"):
  // [cap_chunks*C, h, SignatureRecordBytes(sig_bits, d)] bytes, token-major like the
  // landmarks; empty (sig_bits 0) when the profile keeps none or the segment was written
  // before signatures existed.
  int sig_bits = 0;
  DeviceBlock sig;
  DeviceBlock excluded;   // [h, n_chunks] u8 (1 = static for that head), or empty
  OpenValues open_values; // open segments only; sealed ones use the HostValueStore
  // --- always-attended pieces ---
  int s_cap = 0;                // static rows per head (capacity)
  std::vector<int32_t> s_len;   // [h] valid static rows per head (host)
  std::vector<int64_t> s_pos;   // [h, s_cap] absolute token position of each static row
                                // (host; -1 past s_len, or all -1 when a record written
                                // before positions were kept was restored)
  DeviceBlock sk, sv;           // [h, s_cap, d] bf16 post-RoPE K / V: sink, outlier and
                                // (dequantized) heavy chunks; mini: the retained tokens
                                // (dequantized from their KIVI codes)
  std::vector<KiviBlock> int2;  // the INT2 codes behind the dequantized rows (resident
                                // compressed form; what durability writes)
  int n_tail = 0;         // exact tokens shared by all heads
  int cap_tail = 0;
  DeviceBlock tk, tv;     // [cap_tail, h, d] bf16 post-RoPE K / V (the segment's local
                          // remainder, tokens [n_chunks*C, n_chunks*C + n_tail); exact
                          // profile: every token). Shadow: `a` keeps the remainder's
                          // coordinates too (rows n_chunks*C ..), so that its tokens can
                          // leave a session's tail as chunks of an open segment; the rows
                          // such chunks cover are no longer exact (CoveredRemainderRows).
  // --- reporting ---
  double captured_energy = 0;
  double residual_energy = 0;
  int static_chunks_per_head = 0;
};

// Frees a segment's values in the HostValueStore when the segment dies (unless the
// engine is shutting down: durable segments must survive in the spill tier).
struct StoreLink;

struct Segment {
  ~Segment();
  storage::SegmentId id;
  v1::ProfileKind kind = v1::PROFILE_KIND_SHADOW;
  int64_t first_position = 0;
  // Tokens the segment adds at the end of the chain: an ingested segment holds tokens
  // [first_position, +n_tokens); an open segment's chunks start at the first token of the
  // exact tail, which may be inside the remainder of the segment before it, so it adds
  // only the tokens past that segment's end (0 when its chunks end inside it). The sum
  // over a chain is the chain's end.
  int64_t n_tokens = 0;
  int chunk_size = 8;
  std::vector<int32_t> tokens;  // token ids of [first_position, +n_tokens) (ingested segments)
  std::vector<LayerData> layers;
  // Values are in the HostValueStore under `id` (sealed shadow segments with chunks).
  bool values_in_store = false;
  storage::SegmentValueLayout value_layout;
  // Registered in the prefix index under this key (ingested segments of a prompt).
  std::optional<storage::PrefixKey> prefix_key;
  bool durable = false;  // written through to the spill tier
  std::shared_ptr<StoreLink> store;  // set when values_in_store
  // A refactorized segment: every layer's a/basis are its own; all other fields are read
  // from `base` (the segment it replaces), which it keeps alive.
  std::shared_ptr<const Segment> base;
  const LayerData& data(int layer) const { return base ? base->data(layer) : layers[layer]; }
  const Segment& values_owner() const { return base ? base->values_owner() : *this; }

  // Convention: `layers[l].a` and `layers[l].basis` are always this segment's own (a
  // refactorized segment replaces them); every other field is read through data(l).
  size_t DeviceBytes() const;
  size_t HostBytes() const;
};

// Appended tokens not yet in whole chunks, per layer (host copies; shadow and mini). In a
// shadow session they follow the chain's uncovered remainder rows in the exact tail.
struct TailLayer {
  std::vector<kernels::bf16> k_pre;  // [t, h, d] pre-RoPE (shadow: projected when chunked)
  std::vector<kernels::bf16> k;      // [t, h, d] post-RoPE
  std::vector<kernels::bf16> v;      // [t, h, d]
};

// The attention working set of one layer, built from a session's state when first needed
// and rebuilt after it changes (versions below).
struct StaticCache {
  uint64_t static_version = ~0ull;
  uint64_t tail_version = ~0ull;
  int s = 0;                   // static rows per head (max over heads)
  std::vector<int32_t> host_lengths;  // [h] valid rows per head
  // The rows in backend memory, shared with the export generations that name them: a
  // rebuild allocates new blocks and never writes these in place.
  std::shared_ptr<const DeviceBlock> k, v;  // [h, s, d] bf16 (null when s = 0)
  std::shared_ptr<const DeviceBlock> lengths;  // [h] int32
  // Host copies of the rows for GetStaticSet, made when it asks (GetCache's host_rows):
  // current while host_static_rows / host_tail_rows hold.
  std::vector<kernels::bf16> host_k, host_v;
  bool host_static_rows = false;
  std::vector<int64_t> host_pos;               // [h, s] positions of the static rows (-1: none)
  int t = 0;                   // exact tokens (uncovered segment remainders + appended tail)
  std::shared_ptr<const DeviceBlock> tk, tv;  // [t, h, d] bf16 (null when t = 0)
  std::vector<kernels::bf16> host_tk, host_tv;
  bool host_tail_rows = false;
  std::vector<int64_t> host_tail_pos;  // [t] positions of the tail rows
};

enum class SessionState { kIngesting, kReady, kClosed };
const char* SessionStateName(SessionState s);

// A tensor-parallel shard's membership (docs/DESIGN.md "Tensor-parallel sessions"): the
// logical session it is rank `rank` of `ranks` of. Its head range is its model's slice
// (ModelInfo::tp_*).
struct TensorParallelMembership {
  std::string logical_id;
  int ranks = 0;
  int rank = 0;
};

struct Session {
  std::string id;
  std::string tenant;
  ModelInfo model;
  // Set for a tensor-parallel shard (at create, fork or restore; never changed after).
  std::optional<TensorParallelMembership> tp;
  ProfileInfo profile;
  bool durable = false;
  std::string label;
  std::vector<int32_t> prompt;   // token ids given at create (for prefix registration)
  uint64_t reused_tokens = 0;
  // Where the ingest cuts the prompt's new tokens into segments (absolute positions,
  // strictly increasing, inside (reused_tokens, prompt.size()); set at create).
  std::vector<uint64_t> segment_ends;
  int64_t created_unix_ms = 0;
  // The recall guard's samples and fallbacks (own mutex: decode runs under the shared lock).
  SelectionGuard selection;

  // Guards everything below (see the file comment).
  mutable std::shared_mutex mu;
  SessionState state = SessionState::kIngesting;
  std::vector<std::shared_ptr<const Segment>> chain;
  std::shared_ptr<Segment> open;        // whole chunks that left the tail (created lazily)
  std::vector<TailLayer> tail;          // [L] the tail's appended tokens
  std::vector<int32_t> appended_tokens; // token ids appended after the prompt
  uint64_t tokens = 0;                  // committed tokens (chain + open + tail)
  uint64_t static_version = 0;          // bumped when chain/open static parts change
  uint64_t tail_version = 0;            // bumped when the tail changes
  std::vector<double> captured_energy;  // per layer, of the last ingest
  std::vector<double> residual_energy;
  std::vector<double> drift;            // per layer: worst residual since the last factorization
  bool refactor_pending = false;
  uint64_t durable_record_version = 0;
  storage::Id128 record_id;  // the spill-tier record of a durable session
  // Durable sessions: when appends reach the disk (resolved: never UNSPECIFIED), the
  // append records written since the session record (append.cc "Logged appends") and the
  // next one's sequence number.
  v1::AppendFsync append_fsync = v1::APPEND_FSYNC_NO;
  std::vector<storage::Id128> append_records;
  uint64_t append_seq = 0;
  // Durable sessions: segments that a compaction (append.cc "Compaction") replaced in the
  // chain, kept (and with them their records on the spill tier) until the session record
  // that names their replacement is written (PersistSession), so that the record on disk
  // always names segments that exist.
  std::vector<std::shared_ptr<const Segment>> retired;
  // References that keep this session's registered (prefix) segments from eviction.
  std::vector<storage::SegmentRef> prefix_refs;
  // Refactorization input: exact pre-RoPE keys of the last suffix ingest per layer
  // ([n, h, d] bf16 host; empty for layers under the threshold), kept until it runs.
  std::vector<std::vector<kernels::bf16>> refactor_keys;
  int64_t refactor_first_position = 0;

  // Ingest stream in progress (at most one at a time).
  std::atomic<bool> ingest_active{false};
  std::atomic<int> layers_ingested{0};
  std::atomic<uint64_t> ingest_parts_taken{0};  // parts the open Ingest stream placed

  // The attention working set per layer, under its own lock (readers share `mu`).
  std::mutex cache_mu;
  std::vector<StaticCache> cache;  // [L]

  // Damage (docs/OPERATIONS.md "Damage"): set once the session is known to have lost
  // acknowledged data, or to hold records that fail their checksums or cannot be read;
  // from then on every read of it fails DATA_LOSS and GetSession reports it. Under
  // damage_mu (not `mu`: a read that meets the damage holds `mu` shared). Mutable: a read
  // through a const session that finds damage records it.
  mutable std::atomic<bool> damaged{false};
  mutable std::mutex damage_mu;
  mutable std::string damage;        // what was lost and where
  mutable uint64_t tokens_lost = 0;  // acknowledged tokens lost, where known (else 0)
  mutable std::optional<storage::Id128> damage_record;  // its durable damage marker
  // A restored session that could not be built whole: the segments that could, kept (and
  // with them their records on disk, for inspection) until the session is closed.
  std::vector<std::shared_ptr<const Segment>> quarantined;

  // Attachments: guarded by the SessionManager's registry lock.
  int attachments = 0;
  std::string writer_attachment;  // id of the live writer attachment, or empty
};

// Leading rows of `seg`'s exact remainder at `layer` (LayerData::n_tail) that chunks of
// another segment of `s` (chain or open) cover: tokens that left the session's exact tail
// as chunks. The rest are exact; a shadow session's working set holds them.
inline int CoveredRemainderRows(const Session& s, const Segment& seg, int layer) {
  const LayerData& d = seg.data(layer);
  if (d.n_tail == 0) return 0;
  const int64_t start = seg.first_position + int64_t(d.n_chunks) * seg.chunk_size;
  const int64_t end = start + d.n_tail;
  int64_t at = start;
  auto cover = [&](const Segment& o) {
    if (&o == &seg) return false;
    const int64_t first = o.first_position;
    const int64_t last = first + int64_t(o.data(layer).n_chunks) * o.chunk_size;
    if (first > at || at >= last) return false;
    at = last;
    return true;
  };
  for (bool moved = true; moved && at < end;) {
    moved = false;
    for (const auto& o : s.chain) moved = cover(*o) || moved;
    if (s.open) moved = cover(*s.open) || moved;
  }
  return static_cast<int>(std::min(at, end) - start);
}

}  // namespace kvshade::service
