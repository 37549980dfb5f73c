// Compression profiles as strategies (docs/ALGORITHM.md, per profile). Each profile kind
// (v1::ProfileKind) is one ProfileStrategy, in a file of its own:
//   profile_shadow.cc  low-rank keys, selectable chunks, static set, exact tail
//   profile_mini.cc    recent window + heavy hitters, INT2 (KIVI), bf16 residual
//   profile_exact.cc   post-RoPE K and V as given
// and profile.cc holds the registry (ProfileOf) and the AUTO rule. What differs between
// profiles is asked of the strategy; the engine's files hold what every profile shares.
// Adding a profile: a v1::ProfileKind value, a file defining its strategy, and its line in
// the registry (profile.cc).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/service/config.h"
#include "kvshade/service/model.h"
#include "kvshade/service/session.h"
#include "kvshade/storage/types.h"
#include "kvshade/v1/kvshade.pb.h"

namespace kvshade::service {

class EngineImpl;
class Metrics;

// What ResolveProfile has read of a request before the profile's own resolution: the
// request, the server's defaults, the model and the options the profile may refuse.
struct ProfileRequest {
  const v1::Profile& proto;
  const ProfileDefaults& defaults;
  const ModelInfo& model;
  uint64_t n_tokens = 0;
  // The request left the kind to AUTO (options a profile does not take are then dropped
  // instead of refused).
  bool auto_kind = false;
};

// One range of an ingest stream: the prompt's rows between two segment ends, which the
// commit makes one segment (ingest.cc).
struct IngestRange {
  int64_t first = 0;   // its first token's position
  int64_t offset = 0;  // its first row in the stream's layers (first - the stream's first)
  int n = 0;
  storage::SegmentId id;
  storage::SegmentValueLayout layout;
  bool store_created = false;
  std::vector<LayerData> out;  // [L]
};

// Rows of an ingest stream's layer as a profile compresses them: the whole layer once it
// is complete, or one range's rows compressed before the layer is complete
// (ProfileIngest::CompressRange).
struct IngestLayer {
  DeviceBlock kd, vd;       // [n - base, h, d] backend memory; kd is post-RoPE when direct
  int64_t base = 0;         // the stream's row that kd's and vd's first row holds
  std::vector<kernels::bf16> qobs;   // [w, hq, d] observation queries
  int w = 0;
};

// What an ingest stream offers the profile that compresses its layers (ingest.cc).
class IngestContext {
 public:
  virtual ~IngestContext() = default;
  virtual EngineImpl& engine() = 0;
  virtual const Session& session() const = 0;
  virtual int64_t first() const = 0;  // the first new token's position
  virtual int n() const = 0;          // new tokens
  virtual size_t range_count() const = 0;
  virtual IngestRange& range(size_t r) = 0;
  virtual IngestLayer& layer(int l) = 0;
  // Reserves the range's value block in the store (every profile: it is also where a
  // durable segment is written through).
  virtual absl::Status EnsureStoreSegment(IngestRange& rg, int n_chunks) = 0;
  // The layer's keys [n, h, d], and a range's rows of b.kd or b.vd (`block`).
  virtual absl::Span<const kernels::bf16> Keys(const IngestLayer& b) const = 0;
  virtual absl::Span<const kernels::bf16> Rows(const IngestLayer& b, const DeviceBlock& block,
                                               const IngestRange& rg) const = 0;
  // The range's K and V rows of b as blocks of their own.
  virtual absl::Status TakeRows(IngestLayer& b, const IngestRange& rg, DeviceBlock* k,
                                DeviceBlock* v) = 0;
  // Rotates keys [n, h, d] at positions [first, first + n) in place.
  virtual absl::Status RopeInPlace(DeviceBlock& k, int64_t first, int n) = 0;
  // Residual of projecting k [n, h, d] onto `basis` (optionally keeping the coordinates).
  virtual absl::StatusOr<double> Project(absl::Span<const kernels::bf16> k, const Basis& basis,
                                         DeviceBlock* a_out) = 0;
  // A range of `tokens` projected onto a cached basis: the layer reports its largest
  // residual.
  virtual void NoteResidual(int l, double residual, int tokens) = 0;
  virtual double residual(int l) const = 0;
  // The projected ranges' residual energy as a share of the whole session's keys (each
  // range's residual weighted by its tokens over the session's tokens, keys of like
  // energy assumed): what a refactorization would win back. A short question after a long
  // document leaves the session's approximation nearly whole however far its own keys
  // lie from the document's basis, and refitting the whole session for it would cost
  // O(session) per question.
  virtual double session_residual(int l) const = 0;
  virtual void set_captured(int l, double energy) = 0;
  // Keeps pre-RoPE keys of layer l for a background refactorization.
  virtual absl::Status KeepForRefactor(int l, absl::Span<const kernels::bf16> k) = 0;
  // The most device bytes one layer's compression held.
  virtual void NoteCompressionPeak(size_t bytes) = 0;
  // Keys were rotated part by part as they arrived (ProfileStrategy::rotates_parts on a
  // host-memory backend): the layer's blocks are already the segment's rows.
  virtual bool direct() const = 0;
};

// A profile's part of one ingest stream (state it keeps across the stream's layers).
class ProfileIngest {
 public:
  virtual ~ProfileIngest() = default;
  // Compresses complete layer l into out[l] of the ranges from first_range on (the
  // compression thread); the ranges before it were compressed by CompressRange.
  virtual absl::Status CompressLayer(int l, size_t first_range) = 0;
  // Whether a range that is not the stream's last may be compressed as soon as its rows
  // are in, before the layer's later ranges arrive (a document's segment during the
  // chunked prefill of the question after it). Range r of a layer follows range r - 1.
  virtual bool compresses_ranges_early() const { return false; }
  // Compresses range r of layer l into its out[l] from `rows` (that range's rows alone, of
  // the compression thread); r is not the last range.
  virtual absl::Status CompressRange(IngestLayer& /*rows*/, int /*l*/, size_t /*r*/) {
    return absl::UnimplementedError("this profile compresses whole layers only");
  }
  // At the commit: the layers' reporting in the response and the metrics.
  virtual void Report(Metrics*, v1::IngestResponse*, absl::Span<const double> /*captured*/,
                      absl::Span<const double> /*residual*/, bool /*projected*/) const {}
};

class ProfileStrategy {
 public:
  virtual ~ProfileStrategy() = default;
  virtual v1::ProfileKind kind() const = 0;

  // --- resolution (model.cc ResolveProfile) ---
  // Everything of `o` that depends on the profile: the value codec, key signatures,
  // selection units and the profile's own checks (common fields are resolved and their
  // ranges of the request checked before; o.kind is this profile).
  virtual absl::Status Resolve(const ProfileRequest& r, ProfileInfo& o) const = 0;

  // --- properties ---
  // Per-query chunk selection (sparse_budget chunks or units per head, slots, selection
  // options): select, export and slot layouts ask.
  virtual bool selects() const { return false; }
  // Every token is kept exact in the segments' tk/tv (no static set, no separate tail):
  // the working set is the segments' rows.
  virtual bool all_exact() const { return false; }
  // Segments are content-addressed (prefix reuse, registration).
  virtual bool reusable() const { return true; }
  // Slots per KV head of a session's slot buffers (slot_layout.h).
  virtual int SlotsPerHead(const ProfileInfo&) const { return 0; }
  // The fewest tokens of a segment that a segment end closes (sessions.cc).
  virtual int64_t MinClosedSegment(const ProfileInfo&) const { return 1; }

  // --- sessions (sessions.cc CreateSession) ---
  // The profile's checks of a new session once its reusable prefix is known.
  virtual absl::Status CheckSession(const ModelInfo&, const ProfileInfo&, uint64_t /*reused*/,
                                    size_t /*prompt_tokens*/) const {
    return absl::OkStatus();
  }

  // --- ingest (ingest.cc) ---
  // Keys are rotated part by part as they arrive and the layer's block becomes the
  // segment's own (on a host-memory backend).
  virtual bool rotates_parts() const { return false; }
  // The profile's part of a new ingest stream (the stream outlives it).
  virtual std::unique_ptr<ProfileIngest> StartIngest(IngestContext& cx) const = 0;

  // --- the exact tail (s.mu held exclusively) ---
  // After the chain gained segments (an ingest commit, a restore): the tail settles as
  // appends keep it. A failure leaves the session as it was.
  virtual absl::Status SettleTail(EngineImpl&, Session&) const { return absl::OkStatus(); }

  // --- append (append.cc ApplyAppend; s.mu held exclusively) ---
  // Appends n tokens at position `first` to layer l: k pre-RoPE and kr post-RoPE [n, h, d].
  virtual absl::Status AppendLayer(EngineImpl& e, Session& s, int l, int64_t first, int n,
                                   const std::vector<kernels::bf16>& k,
                                   const std::vector<kernels::bf16>& kr,
                                   const std::vector<kernels::bf16>& v) const = 0;
  // After every layer took its tokens and s.tokens counts them: on an error the append
  // does not happen (the strategy undoes its part, the caller s.tokens). By default the open
  // segment's token count follows its exact rows (profile.cc).
  virtual absl::Status FinishAppend(EngineImpl& e, Session& s, int n) const;
};

// The strategy of a resolved kind (ResolveProfile's; AUTO or UNSPECIFIED abort).
const ProfileStrategy& ProfileOf(v1::ProfileKind kind);
// The strategy of a kind read from elsewhere (a record), or null when none is.
const ProfileStrategy* FindProfile(v1::ProfileKind kind);
// The kind AUTO resolves to for a prompt of n_tokens.
v1::ProfileKind AutoProfileKind(uint64_t n_tokens, const ProfileInfo& o);

// The strategies (one file each), for the registry.
const ProfileStrategy& ShadowProfile();
const ProfileStrategy& MiniProfile();
const ProfileStrategy& ExactProfile();

// Helpers of the strategies' Resolve (profile.cc), in the order ResolveProfile has always
// checked a request.
// The value codec: the request's, the server's, or (both "auto") `automatic`.
absl::Status ResolveValueCodec(const ProfileRequest& r, kernels::ValueCodec automatic,
                               ProfileInfo& o);
// Key signature bits (request or server default); `takes`: the profile keeps them, else a
// request naming the profile may not ask for them and they resolve to 0.
absl::Status ResolveKeySignatureBits(const ProfileRequest& r, bool takes, ProfileInfo& o);
// chunk_size, sparse_budget and local_window in range.
absl::Status CheckWindowRanges(const ProfileInfo& o);
// The selection unit asked for (or the server's default) and whether it was asked.
uint32_t RequestedSelectionUnit(const ProfileRequest& r, bool* asked);
// Refuses a selection unit asked of a profile that takes none (a request naming it).
absl::Status RefuseSelectionUnit(const ProfileRequest& r);
// InvalidArgument naming the profile field (model.cc's form).
absl::Status BadProfileField(std::string_view field, std::string_view what);

// Shared by the profiles' append and tail code (append.cc).
// A new device block of `new_bytes` holding the first `used` bytes of `blk`.
absl::StatusOr<DeviceBlock> Grown(EngineImpl& e, const DeviceBlock& blk, size_t used,
                                  size_t new_bytes, storage::ArenaKind kind);
// Grows a device block to `new_bytes`, keeping its first `used` bytes.
absl::Status GrowDevice(EngineImpl& e, DeviceBlock& blk, size_t used, size_t new_bytes,
                        storage::ArenaKind kind);
// A new open segment of `s` starting at first_position.
std::shared_ptr<Segment> NewOpen(EngineImpl& e, const Session& s, int64_t first_position);
// Appends `n` post-RoPE/value tokens [n, h, d] to a layer's exact token buffer.
absl::Status AppendExactTokens(EngineImpl& e, LayerData& ld, const kernels::bf16* k,
                               const kernels::bf16* v, int n, size_t tok);
// Moves the oldest whole chunks out of a shadow session's exact tail while it holds more
// than local_window + C tokens (profile_shadow.cc).
absl::Status TrimShadowTail(EngineImpl& e, Session& s);

}  // namespace kvshade::service
