// HostValueStore: the encoded values of every live segment, in host-visible memory
// (Backend::AllocateHostVisible: pinned and mapped when the backend is CUDA, so decode
// kernels read misses straight over PCIe), under a byte budget, with LRU spill to a
// SpillTier and page-in on access.
//
// Layout. The values of one (segment, layer) are ONE contiguous block
//   [h, n_chunks, chunk_stride] bytes (SegmentValueLayout)
// so chunk j of head hh is at base + hh*head_stride + j*chunk_stride, which is what
// kernels::SegmentView (values, value_head_stride, value_chunk_stride) addresses. Blocks are
// sub-allocated from large slabs (slab_bytes each, made lazily or up front); a block above
// slab_bytes/8 gets a dedicated buffer, which is kept for reuse by the next block of the
// same size when freed. Nothing is allocated per chunk. Host-visible memory held never
// exceeds budget_bytes + slab_bytes (or the preallocation): spare buffers and empty slabs
// are released first, then LRU segments spilled.
//
// Life of a segment
//   Create      -> building: memory reserved for every layer, not spillable
//   WriteLayer  -> fill layers (or write in place through MutableLayer)
//   Seal        -> resident: immutable; a durable segment is written through to the spill
//                  tier (synced) before Seal returns
//   (budget)    -> spilled: least-recently-used unpinned segments are written to the spill
//                  tier (once; a durable one is already there) and their memory is freed
//   Pin/Gather  -> resident again (page-in), most recently used
//   Erase       -> gone from memory and from the spill tier
//
// Contract
// - Thread-safe. Pointers from a SegmentPin stay valid and unchanged while the pin lives
//   (a pinned segment is never spilled). Spill and page-in I/O run without the lock held.
// - The budget counts the bytes of resident blocks (after alignment). A request that does
//   not fit spills LRU segments, least recent first, until it fits, and nothing more; when
//   nothing is spillable (no spill tier, or everything pinned or building) it asks the
//   owner to free something (options.reclaim, e.g. evict a cached segment nobody uses) and
//   retries while that frees anything; otherwise it fails with ResourceExhausted and
//   changes nothing.
// - The store must outlive its pins and its prefetch callbacks; the spill tier must outlive
//   the store.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/storage/spill_tier.h"
#include "kvshade/storage/types.h"

namespace kvshade::storage {

struct HostValueStoreOptions {
  size_t budget_bytes = size_t{1} << 30;  // resident value bytes
  size_t slab_bytes = size_t{64} << 20;   // host-visible memory is allocated in slabs this big
  size_t preallocate_bytes = 0;           // slabs made at start-up (rounded up to slabs)
  size_t block_alignment = 256;           // of every (segment, layer) block
  bool prefetch_thread = true;            // a background thread serving Prefetch
  // Called, without the store's lock, when a reservation of `need` bytes does not fit and
  // nothing is spillable; returns whether it released anything (e.g. Erased segments), in
  // which case the reservation is tried again. May call Erase; must not reserve.
  std::function<bool(size_t need)> reclaim;
};

// One chunk to gather: chunk `chunk` of head `head` of layer `layer` of segment `segment`.
struct ChunkRef {
  SegmentId segment;
  int32_t layer = 0;
  int32_t head = 0;
  int32_t chunk = 0;
};

// Where one layer's values are, as kernels::SegmentView wants them.
struct LayerValues {
  const std::byte* base = nullptr;  // [h, n_chunks, chunk_stride] bytes, host-visible
  int64_t head_stride = 0;          // bytes
  int64_t chunk_stride = 0;         // bytes
  size_t chunk_bytes = 0;           // encoded bytes at the start of each chunk
  int h = 0;
  int n_chunks = 0;
  const std::byte* chunk(int head, int j) const {
    return base + head * head_stride + j * chunk_stride;
  }
  // Fills values / value_head_stride / value_chunk_stride of a kernels::SegmentView.
  void FillView(kernels::SegmentView* view) const {
    view->values = base;
    view->value_head_stride = head_stride;
    view->value_chunk_stride = chunk_stride;
  }
};

enum class SegmentState { kBuilding, kResident, kSpilling, kSpilled, kPagingIn };
std::string_view SegmentStateName(SegmentState s);

// Per-segment accounting.
struct SegmentUsage {
  SegmentState state = SegmentState::kBuilding;
  size_t value_bytes = 0;     // layout.total_bytes()
  size_t resident_bytes = 0;  // bytes of host memory held now (blocks after alignment)
  bool durable = false;
  bool on_spill_tier = false;  // a valid copy is in the spill tier
  int pins = 0;
  uint64_t last_access = 0;    // store-wide access counter at the last touch
  SegmentValueLayout layout;
};

struct HostStoreStats {
  size_t budget_bytes = 0;
  size_t resident_bytes = 0;      // resident blocks (after alignment)
  size_t physical_bytes = 0;      // host-visible memory held: slabs + dedicated buffers
  size_t segments = 0;
  size_t resident_segments = 0;
  size_t spilled_segments = 0;
  // Value bytes (layout.total_bytes()) of the known segments with a copy on the spill tier
  // now: durable ones (written through at Seal, or restored by RestoreDurable) and spilled
  // ones (also after a page-in, which keeps the copy). Erase takes a segment's bytes off.
  size_t spill_tier_bytes = 0;
  size_t spill_tier_segments = 0;
  uint64_t spills = 0;            // segments moved out of memory
  uint64_t spill_writes = 0;      // of those, written to the spill tier (others were there)
  uint64_t spill_bytes_written = 0;  // running total of those writes (durable seals excluded)
  uint64_t page_ins = 0;
  uint64_t page_in_bytes = 0;
  uint64_t gathered_chunks = 0;
  uint64_t failed_reservations = 0;
};

struct SealOptions {
  bool durable = false;            // write through (synced) to the spill tier now
  std::string_view user_metadata;  // stored with the segment on the spill tier
  std::vector<FactorBlob> factors; // host copies of the factors, written with a durable seal
};

class HostValueStore;

// Keeps one segment resident and its blocks in place. Move-only; unpins on destruction.
class SegmentPin {
 public:
  SegmentPin() = default;
  SegmentPin(SegmentPin&& o) noexcept;
  SegmentPin& operator=(SegmentPin&& o) noexcept;
  SegmentPin(const SegmentPin&) = delete;
  SegmentPin& operator=(const SegmentPin&) = delete;
  ~SegmentPin();

  const SegmentId& id() const;
  const SegmentValueLayout& layout() const;
  // Values of layer `layer` (0 <= layer < layout().n_layers; unchecked).
  LayerValues layer(int layer) const;
  explicit operator bool() const { return entry_ != nullptr; }
  void Reset();

  struct Entry;

 private:
  friend class HostValueStore;
  SegmentPin(HostValueStore* store, Entry* entry) : store_(store), entry_(entry) {}
  HostValueStore* store_ = nullptr;
  Entry* entry_ = nullptr;
};

class HostValueStore {
 public:
  // `spill` may be null (then the budget is a hard limit). InvalidArgument on bad options.
  static absl::StatusOr<std::unique_ptr<HostValueStore>> Create(kernels::DeviceRuntime& backend,
                                                                const HostValueStoreOptions& options,
                                                                SpillTier* spill);
  ~HostValueStore();
  HostValueStore(const HostValueStore&) = delete;
  HostValueStore& operator=(const HostValueStore&) = delete;

  // Reserves memory for every layer of a new segment (spilling LRU segments if needed).
  // AlreadyExists for a known id; ResourceExhausted when it cannot fit.
  absl::Status Create(const SegmentId& id, const SegmentValueLayout& layout);
  // Copies layer values packed as [h, n_chunks, chunk_bytes] (Backend::EncodeValueChunks'
  // output) into the segment's block. Only while building.
  absl::Status WriteLayer(const SegmentId& id, int layer, absl::Span<const std::byte> encoded);
  // The block of a layer being built, for writing in place ([h, n_chunks, chunk_stride]).
  absl::StatusOr<absl::Span<std::byte>> MutableLayer(const SegmentId& id, int layer);
  // Makes the segment immutable and spillable; durable: writes it through first (a failed
  // write leaves it building, so Seal can be retried). FailedPrecondition when not building
  // or when durable without a spill tier.
  absl::Status Seal(const SegmentId& id, const SealOptions& options);
  // Drops the segment from memory and from the spill tier. FailedPrecondition when pinned.
  // NotFound for an unknown id.
  absl::Status Erase(const SegmentId& id);

  // Pins a sealed segment, paging it in first when spilled (synchronous I/O), and marks it
  // most recently used. NotFound, FailedPrecondition (still building), or the page-in error.
  absl::StatusOr<SegmentPin> Pin(const SegmentId& id);
  // Copies chunks[i]'s chunk_bytes encoded bytes to dst + i*dst_stride (dst_stride 0 =
  // the chunk_bytes of the first chunk), paging in spilled segments. InvalidArgument for an
  // out-of-range reference or a dst too small; chunk sizes must fit dst_stride.
  absl::Status Gather(absl::Span<const ChunkRef> chunks, absl::Span<std::byte> dst,
                      size_t dst_stride = 0);
  // Pages the segments in on the background thread (or inline when prefetch_thread is
  // off) and then calls done with OK or the first error. Returns at once.
  void Prefetch(std::vector<SegmentId> ids, std::function<void(absl::Status)> done);

  // Spills one sealed, unpinned segment now (e.g. under device pressure or at shutdown).
  absl::Status Spill(const SegmentId& id);
  // Registers every durable segment of the spill tier (not already known) as spilled, so
  // that it pages in on access; returns their metadata (the service rebuilds sessions
  // from user_metadata).
  absl::StatusOr<std::vector<SegmentMeta>> RestoreDurable();

  absl::StatusOr<SegmentUsage> Usage(const SegmentId& id) const;
  HostStoreStats Stats() const;
  // Known segments, least recently used first.
  std::vector<SegmentId> SegmentsByRecency() const;

  struct Impl;

 private:
  friend class SegmentPin;
  explicit HostValueStore(std::unique_ptr<Impl> impl);
  void Unpin(SegmentPin::Entry* entry);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvshade::storage
