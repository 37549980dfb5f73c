// Durability (background refactorization is in refactor.cc).
//
// Durable sessions are written through to the spill tier (RocksDB) at every commit: each
// of their segments is sealed in the HostValueStore with durable = true (values, every
// layer's factors and a metadata record, in one atomic batch), and the session itself is a
// small record (model, profile, prompt, chain of segment ids, exact tail) written as a
// value-less durable spill segment. Engine::Create restores them: segments first (values
// page in on first use), then sessions, re-registering their prefixes.
//
// Record formats (user_metadata, little-endian: durable_codec.h; versioned by the magic):
//   segment "KVSHSEG1": kind, first_position, n_tokens, C, L, tokens, prefix key, base id
//            (refactorized segments), then per layer: n_chunks, a_rows, r, s_cap, s_len[h],
//            n_tail, int2 blocks (rows, valid), energies; then per layer the static rows'
//            positions s_pos[h*s_cap] (absent in records written before them: restored
//            as unknown, -1).
//            Factors per layer: kA, kB, kLandmarks, kExcluded, kSignatures (the chunked
//            tokens' key signatures; their width follows from the blob's size, absent in
//            records written without them: restored without, selection reconstructs
//            keys), kStatic (sk, sv, tk, tv, then each INT2 block's k codes, scale, min, v
//            codes, scale, min).
//   session "KVSHSES1": id, tenant, version, ModelSpec, Profile, label, prompt, reused,
//            tokens, created, chain ids, appended tokens, tail length, append_fsync (one
//            byte; absent in records written before it: the config's), then, for a
//            tensor-parallel shard only, "KVSHTP01", its logical session's id, ranks, rank,
//            kv_head_begin, kv_head_end and the whole model's num_kv_heads (uint32 each;
//            ModelSpec is the shard's slice); factors kOther per layer: tail k_pre, k, v.
//   logged append "KVSHAPP1": append_log.cc.
// The exact tail needs nothing more: its remainder part is the chain's remainder rows that
// no chunk covers (implied by the segments' first_position and n_chunks, a sealed open
// segment's included), and those rows' coordinates are the segment's A rows after its
// chunks (kA holds every token's; a segment without chunks written by a version that did
// not keep them has none, and its remainder then stays exact). Formats are unchanged.
#include <algorithm>
#include <cstring>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "durable_codec.h"
#include "engine_impl.h"
#include "profile.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {

namespace {

using kernels::bf16;
using storage::ArenaKind;
using storage::FactorKind;

using durable::kSegmentMagic;
using durable::kSessionMagic;
using durable::kTensorParallelMagic;

using durable::Reader;
using durable::Writer;

// Host copy of `bytes` of a device block (empty block -> nothing).
absl::Status Fetch(EngineImpl& e, const DeviceBlock& b, size_t bytes, std::vector<std::byte>* out) {
  const size_t at = out->size();
  out->resize(at + bytes);
  if (bytes == 0) return absl::OkStatus();
  return e.Download(out->data() + at, b.data(), bytes);
}

absl::StatusOr<DeviceBlock> Put(EngineImpl& e, const std::byte* src, size_t bytes, ArenaKind kind) {
  if (bytes == 0) return DeviceBlock();
  return e.Upload(src, bytes, kind);
}

}  // namespace

std::string EngineImpl::SegmentMetadata(const Segment& seg, const ModelInfo& m) const {
  Writer w;
  w.out().append(kSegmentMagic);
  w.Put<int32_t>(seg.kind);
  w.Put<int64_t>(seg.first_position);
  w.Put<int64_t>(seg.n_tokens);
  w.Put<int32_t>(seg.chunk_size);
  w.Put<int32_t>(m.layers);
  w.Vec(seg.tokens);
  w.Put<uint8_t>(seg.prefix_key ? 1 : 0);
  w.Id(seg.prefix_key.value_or(storage::Id128{}));
  w.Put<uint8_t>(seg.base ? 1 : 0);
  w.Id(seg.base ? seg.base->id : storage::Id128{});
  for (int l = 0; l < m.layers; ++l) {
    const LayerData& d = seg.data(l);
    const LayerData& own = seg.layers[l];
    const int r = own.basis ? own.basis->r : 0;
    w.Put<int32_t>(d.n_chunks);
    w.Put<int64_t>(own.a && r > 0 ? int64_t(own.a->bytes() / Bf16Bytes(r)) : 0);
    w.Put<int32_t>(r);
    w.Put<int32_t>(d.s_cap);
    w.Vec(d.s_len);
    w.Put<int32_t>(d.n_tail);
    w.Put<uint32_t>(static_cast<uint32_t>(d.int2.size()));
    for (const KiviBlock& kb : d.int2) {
      w.Put<int32_t>(kb.rows);
      w.Put<int32_t>(kb.valid);
      for (const DeviceBlock* b : {&kb.k_codes, &kb.k_scale, &kb.k_min, &kb.v_codes,
                                   &kb.v_scale, &kb.v_min}) {
        w.Put<uint64_t>(b->bytes());
      }
    }
    w.Put<double>(d.captured_energy);
    w.Put<double>(d.residual_energy);
  }
  for (int l = 0; l < m.layers; ++l) w.Vec(seg.data(l).s_pos);
  return w.out();
}

absl::Status EngineImpl::SealSegmentValues(Segment& seg, bool durable, const ModelInfo& m) {
  storage::SealOptions o;
  o.durable = durable;
  std::string meta;
  std::vector<std::vector<std::byte>> blobs;
  if (durable) {
    StageTimer timer(metrics_, "spill");
    meta = SegmentMetadata(seg, m);
    o.user_metadata = meta;
    const int h = m.shape.h, d = m.shape.d, D = m.shape.D();
    for (int l = 0; l < m.layers; ++l) {
      const LayerData& own = seg.layers[l];
      const LayerData& ld = seg.data(l);
      if (own.a && own.basis) {
        std::vector<std::byte> a, b;
        KVSHADE_RETURN_IF_ERROR(Fetch(*this, *own.a, own.a->bytes(), &a));
        KVSHADE_RETURN_IF_ERROR(Fetch(*this, own.basis->b, Bf16Bytes(size_t(h) * own.basis->r * d), &b));
        blobs.push_back(std::move(a));
        o.factors.push_back({l, FactorKind::kA, {}});
        blobs.push_back(std::move(b));
        o.factors.push_back({l, FactorKind::kB, {}});
      }
      if (seg.base) continue;  // everything else is the base segment's
      if (ld.n_chunks > 0) {
        std::vector<std::byte> lm, ex;
        KVSHADE_RETURN_IF_ERROR(Fetch(*this, ld.landmarks, Bf16Bytes(size_t(ld.n_chunks) * D), &lm));
        blobs.push_back(std::move(lm));
        o.factors.push_back({l, FactorKind::kLandmarks, {}});
        if (ld.excluded) {
          KVSHADE_RETURN_IF_ERROR(Fetch(*this, ld.excluded, size_t(h) * ld.n_chunks, &ex));
          blobs.push_back(std::move(ex));
          o.factors.push_back({l, FactorKind::kExcluded, {}});
        }
        if (ld.sig && ld.sig_bits > 0) {
          std::vector<std::byte> sg;
          KVSHADE_RETURN_IF_ERROR(Fetch(*this, ld.sig,
                                        size_t(ld.n_chunks) * seg.chunk_size * h *
                                            kernels::SignatureRecordBytes(ld.sig_bits, d),
                                        &sg));
          blobs.push_back(std::move(sg));
          o.factors.push_back({l, FactorKind::kSignatures, {}});
        }
      }
      std::vector<std::byte> st;
      KVSHADE_RETURN_IF_ERROR(Fetch(*this, ld.sk, Bf16Bytes(size_t(h) * ld.s_cap * d), &st));
      KVSHADE_RETURN_IF_ERROR(Fetch(*this, ld.sv, Bf16Bytes(size_t(h) * ld.s_cap * d), &st));
      KVSHADE_RETURN_IF_ERROR(Fetch(*this, ld.tk, Bf16Bytes(size_t(ld.n_tail) * D), &st));
      KVSHADE_RETURN_IF_ERROR(Fetch(*this, ld.tv, Bf16Bytes(size_t(ld.n_tail) * D), &st));
      for (const KiviBlock& kb : ld.int2) {
        for (const DeviceBlock* b : {&kb.k_codes, &kb.k_scale, &kb.k_min, &kb.v_codes,
                                     &kb.v_scale, &kb.v_min}) {
          KVSHADE_RETURN_IF_ERROR(Fetch(*this, *b, b->bytes(), &st));
        }
      }
      if (!st.empty()) {
        blobs.push_back(std::move(st));
        o.factors.push_back({l, FactorKind::kStatic, {}});
      }
    }
    for (size_t i = 0; i < blobs.size(); ++i) o.factors[i].bytes = blobs[i];
  }
  absl::Status st = store_->Seal(seg.id, o);
  if (st.ok() && durable) seg.durable = true;
  return st;
}

// ---------------------------------------------------------------------------------------
// Session records

// A value-less layout with `layers` layers (factor blobs are per layer).
static storage::SegmentValueLayout EmptyLayout(int layers) {
  return *storage::SegmentValueLayout::Make(layers, 1, 0, 1, 1, kernels::ValueCodecSpec{});
}

absl::Status EngineImpl::PersistSession(Session& s) {
  if (!spill_ || !s.durable) return absl::OkStatus();
  if (s.open) KVSHADE_RETURN_IF_ERROR(SealOpen(s));
  StageTimer timer(metrics_, "spill");
  // Segments of the chain written through (a reused non-durable segment is not possible:
  // durable sessions only reuse durable prefixes; a refactorized one is written here).
  for (const auto& seg : s.chain) {
    if (seg->durable) continue;
    auto* mut = const_cast<Segment*>(seg.get());
    if (seg->base) {
      // A refactorized segment: its own A and B as a value-less durable segment.
      storage::SegmentWrite w;
      w.id = seg->id;
      w.layout = EmptyLayout(s.model.layers);
      w.durability = storage::Durability::kDurable;
      const std::string meta = SegmentMetadata(*seg, s.model);
      w.user_metadata = meta;
      std::vector<std::vector<std::byte>> blobs;
      for (int l = 0; l < s.model.layers; ++l) {
        const LayerData& own = seg->layers[l];
        if (!own.a || !own.basis) continue;
        std::vector<std::byte> a, b;
        KVSHADE_RETURN_IF_ERROR(Fetch(*this, *own.a, own.a->bytes(), &a));
        KVSHADE_RETURN_IF_ERROR(Fetch(*this, own.basis->b,
                                      Bf16Bytes(size_t(s.model.shape.h) * own.basis->r * s.model.shape.d), &b));
        blobs.push_back(std::move(a));
        w.factors.push_back({l, FactorKind::kA, {}});
        blobs.push_back(std::move(b));
        w.factors.push_back({l, FactorKind::kB, {}});
      }
      for (size_t i = 0; i < blobs.size(); ++i) w.factors[i].bytes = blobs[i];
      absl::Status st = spill_->WriteSegment(w);
      if (!st.ok() && !absl::IsAlreadyExists(st)) return st;
      mut->durable = true;
      continue;
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "durable session '", s.id, "' holds a segment that is not durable"));
  }
  Writer w;
  w.out().append(kSessionMagic);
  w.Str(s.id);
  w.Str(s.tenant);
  // The version advances only once the record is written: logged appends name the record
  // they follow (append_log.cc), and one that names a record never written would be taken
  // for folded in and dropped at the next start.
  const uint64_t version = s.durable_record_version + 1;
  w.Put<uint64_t>(version);
  w.Str(s.model.spec.SerializeAsString());
  w.Str(s.profile.ToProto().SerializeAsString());
  w.Str(s.label);
  w.Vec(s.prompt);
  w.Put<uint64_t>(s.reused_tokens);
  w.Put<uint64_t>(s.tokens);
  w.Put<int64_t>(s.created_unix_ms);
  w.Put<uint32_t>(static_cast<uint32_t>(s.chain.size()));
  for (const auto& seg : s.chain) w.Id(seg->id);
  w.Vec(s.appended_tokens);
  const size_t tok = size_t(s.model.shape.h) * s.model.shape.d;
  const uint32_t t = s.tail.empty() ? 0 : static_cast<uint32_t>(s.tail[0].k.size() / tok);
  w.Put<uint32_t>(t);
  w.Put<uint8_t>(static_cast<uint8_t>(s.append_fsync));  // absent in older records: config's
  if (s.tp) {  // a tensor-parallel shard: its logical session, rank and heads
    w.out().append(kTensorParallelMagic);
    w.Str(s.tp->logical_id);
    w.Put<uint32_t>(static_cast<uint32_t>(s.tp->ranks));
    w.Put<uint32_t>(static_cast<uint32_t>(s.tp->rank));
    w.Put<uint32_t>(static_cast<uint32_t>(s.model.tp_kv_begin));
    w.Put<uint32_t>(static_cast<uint32_t>(s.model.tp_kv_end));
    w.Put<uint32_t>(static_cast<uint32_t>(s.model.tp_kv_heads));
  }
  storage::SegmentWrite rec;
  rec.id = *storage::Id128::FromHex(SessionManager::NewId());
  rec.layout = EmptyLayout(s.model.layers);
  rec.durability = storage::Durability::kDurable;
  rec.user_metadata = w.out();
  std::vector<std::vector<std::byte>> blobs;
  for (int l = 0; l < s.model.layers && t > 0; ++l) {
    const TailLayer& tl = s.tail[l];
    std::vector<std::byte> b(Bf16Bytes(tl.k_pre.size() + tl.k.size() + tl.v.size()));
    std::byte* p = b.data();
    for (const auto* v : {&tl.k_pre, &tl.k, &tl.v}) {
      if (!v->empty()) std::memcpy(p, v->data(), Bf16Bytes(v->size()));
      p += Bf16Bytes(v->size());
    }
    blobs.push_back(std::move(b));
    rec.factors.push_back({l, FactorKind::kOther, {}});
  }
  for (size_t i = 0; i < blobs.size(); ++i) rec.factors[i].bytes = blobs[i];
  KVSHADE_RETURN_IF_ERROR(spill_->WriteSegment(rec));
  // The new record is in; the previous one (if any) can go (a failed delete leaves an older
  // version, which the next start deletes).
  if (s.durable_record_version != 0) {
    spill_->DeleteSegment(s.record_id).IgnoreError();
  }
  s.durable_record_version = version;
  s.record_id = rec.id;
  // The logged appends are in the record now, and segments a compaction replaced are no
  // longer named by it.
  DropAppendRecords(s, &s.append_records);
  s.retired.clear();
  return absl::OkStatus();
}

absl::Status EngineImpl::DeleteDurableRecord(const Session& s) {
  if (!spill_) return absl::OkStatus();
  // The session record first: a crash between the two deletes then leaves logged appends of
  // no session (deleted at the next start), never the session without its acknowledged
  // appends (an older state brought back).
  if (s.durable_record_version != 0) {
    absl::Status st = store_->Erase(s.record_id);
    if (!st.ok()) st = spill_->DeleteSegment(s.record_id);  // not (or no longer) in the store
    KVSHADE_RETURN_IF_ERROR(st);
  }
  std::optional<storage::Id128> marker;
  {
    std::lock_guard<std::mutex> lock(s.damage_mu);
    marker = s.damage_record;
  }
  if (marker) spill_->DeleteSegment(*marker).IgnoreError();  // a leftover goes at a start
  if (!s.append_records.empty()) {
    if (absl::Status st = spill_->DeleteSegments(s.append_records); !st.ok()) {
      // Harmless: appends of no session record, deleted at the next start.
      spdlog::warn("session {}: logged append records not deleted yet: {}", s.id,
                   std::string(st.message()));
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------
// Restore

namespace {

struct SegRecord {
  storage::SegmentMeta meta;
  int kind = 0;
  int64_t first = 0, n_tokens = 0;
  int C = 8, L = 0;
  std::vector<int32_t> tokens;
  bool has_key = false, has_base = false;
  storage::Id128 key, base;
  struct Layer {
    int32_t n_chunks = 0, r = 0, s_cap = 0, n_tail = 0;
    int64_t a_rows = 0;
    std::vector<int32_t> s_len;
    std::vector<int64_t> s_pos;  // empty: a record written before positions were kept
    struct Int2 {
      int32_t rows = 0, valid = 0;
      uint64_t bytes[6] = {};
    };
    std::vector<Int2> int2;
    double captured = 0, residual = 0;
  };
  std::vector<Layer> layers;
};

bool ParseSegment(const storage::SegmentMeta& meta, SegRecord* r) {
  Reader rd(meta.user_metadata);
  if (!rd.Magic(kSegmentMagic)) return false;
  r->meta = meta;
  uint8_t hk = 0, hb = 0;
  rd.Get(&r->kind);
  rd.Get(&r->first);
  rd.Get(&r->n_tokens);
  rd.Get(&r->C);
  rd.Get(&r->L);
  rd.Vec(&r->tokens);
  rd.Get(&hk);
  rd.Id(&r->key);
  rd.Get(&hb);
  rd.Id(&r->base);
  r->has_key = hk != 0;
  r->has_base = hb != 0;
  if (!rd.ok() || r->L < 1 || r->L > 4096) return false;
  r->layers.resize(r->L);
  for (auto& l : r->layers) {
    uint32_t nb = 0;
    rd.Get(&l.n_chunks);
    rd.Get(&l.a_rows);
    rd.Get(&l.r);
    rd.Get(&l.s_cap);
    rd.Vec(&l.s_len);
    rd.Get(&l.n_tail);
    rd.Get(&nb);
    if (!rd.ok() || nb > 1024) return false;
    for (uint32_t i = 0; i < nb; ++i) {
      SegRecord::Layer::Int2 b;
      rd.Get(&b.rows);
      rd.Get(&b.valid);
      for (auto& x : b.bytes) rd.Get(&x);
      l.int2.push_back(b);
    }
    rd.Get(&l.captured);
    rd.Get(&l.residual);
  }
  if (rd.ok() && rd.left() > 0) {
    for (auto& l : r->layers) rd.Vec(&l.s_pos);
  }
  return rd.ok();
}

// What makes a parsed segment record unusable for model `m` (nullptr when nothing does).
// Records pass their checksum, so these are the bytes some writer put there; the restore
// indexes the prompt's prefix keys by the positions and sizes its blobs by the counts, so
// every position, count and per-head length is checked here instead of trusted.
const char* SegmentRecordProblem(const SegRecord& r, const ModelInfo& m) {
  constexpr int64_t kMaxTokens = int64_t{1} << 40;
  if (r.first < 0 || r.first > kMaxTokens || r.n_tokens < 0 || r.n_tokens > kMaxTokens) {
    return "token range out of bounds";
  }
  if (r.C < 1 || r.C > 65536) return "chunk size out of bounds";
  const int h = m.shape.h, d = m.shape.d;
  for (const SegRecord::Layer& l : r.layers) {
    if (l.n_chunks < 0 || l.r < 0 || l.r > h * d || l.s_cap < 0 || l.n_tail < 0 || l.a_rows < 0) {
      return "negative or oversized layer count";
    }
    // A layer without static rows (an appended segment's) may carry no lengths at all.
    if (l.s_len.size() != size_t(h) && (l.s_cap > 0 || !l.s_len.empty())) {
      return "static lengths do not match the KV heads";
    }
    for (int32_t len : l.s_len) {
      if (len < 0 || len > l.s_cap) return "static length outside the static capacity";
    }
    if (!l.s_pos.empty() && l.s_pos.size() != size_t(h) * size_t(l.s_cap)) {
      return "static positions do not match the static capacity";
    }
    for (int64_t p : l.s_pos) {
      if (p < -1 || p > kMaxTokens) return "static position out of bounds";
    }
    for (const auto& b : l.int2) {
      if (b.rows < 0 || b.valid < 0) return "negative INT2 block size";
    }
  }
  return nullptr;
}

// A session record, parsed: the session it describes (ready and durable, not registered
// yet), the ids of its chain's segments, and its exact tail's length.
struct SesRecord {
  std::shared_ptr<Session> s;
  std::vector<storage::Id128> chain;
  uint64_t version = 0;
  storage::Id128 record;
  uint32_t tail = 0;
};

}  // namespace

// RestoreRecords' first step: the records, parsed.
struct ParsedRecords {
  std::vector<SegRecord> segments;                         // base segments first
  std::vector<const storage::SegmentMeta*> session_metas;  // every session record
  absl::flat_hash_map<std::string, SesRecord> sessions;    // the newest record of each
  std::vector<storage::Id128> stale;  // session records to delete: older or unparsable
};

// Its second: the segments of the sessions' chains, rebuilt.
struct RebuiltSegments {
  absl::flat_hash_map<storage::Id128, std::shared_ptr<const Segment>> built;
  // The model each built segment's layers were sized and checked for.
  absl::flat_hash_map<storage::Id128, const ModelInfo*> built_for;
  // Why a segment record was not built (sessions that need it are damaged).
  absl::flat_hash_map<storage::Id128, std::string> problem;
};

namespace {

// Reads a segment record's factors into `seg`'s layers (for model `m`, against which the
// record was checked): A and B; and, for a segment that owns its state (not a refactorized
// one, which shares its base's), landmarks, excluded chunks, key signatures, static rows
// and INT2 blocks.
absl::Status ReadSegmentLayers(EngineImpl& e, const SegRecord& r, const ModelInfo& m, Segment& seg,
                               const EngineImpl::FactorReader& read_factor) {
  const int h = m.shape.h, d = m.shape.d, D = m.shape.D();
  auto read = [&](int l, FactorKind kind, std::vector<std::byte>* out) -> absl::Status {
    const storage::SegmentMeta::Factor* f = r.meta.FindFactor(l, kind);
    out->clear();
    if (f == nullptr) return absl::OkStatus();
    out->resize(f->bytes);
    return read_factor(r.meta.id, l, kind, absl::MakeSpan(*out));
  };
  for (int l = 0; l < r.L; ++l) {
    const SegRecord::Layer& lr = r.layers[l];
    LayerData& ld = seg.layers[l];
    std::vector<std::byte> buf;
    if (lr.r > 0) {
      KVSHADE_RETURN_IF_ERROR(read(l, FactorKind::kA, &buf));
      auto a = std::make_shared<DeviceBlock>();
      KVSHADE_ASSIGN_OR_RETURN(*a, Put(e, buf.data(), buf.size(), ArenaKind::kA));
      ld.a = std::move(a);
      KVSHADE_RETURN_IF_ERROR(read(l, FactorKind::kB, &buf));
      auto basis = std::make_shared<Basis>();
      basis->r = lr.r;
      KVSHADE_ASSIGN_OR_RETURN(basis->b, Put(e, buf.data(), buf.size(), ArenaKind::kB));
      ld.basis = std::move(basis);
    }
    if (r.has_base) continue;
    ld.n_chunks = ld.cap_chunks = lr.n_chunks;
    ld.s_cap = lr.s_cap;
    ld.s_len = lr.s_len;
    ld.s_pos = lr.s_pos.empty() ? std::vector<int64_t>(size_t(m.shape.h) * lr.s_cap, -1) : lr.s_pos;
    ld.n_tail = ld.cap_tail = lr.n_tail;
    ld.captured_energy = lr.captured;
    ld.residual_energy = lr.residual;
    if (lr.n_chunks > 0) {
      KVSHADE_RETURN_IF_ERROR(read(l, FactorKind::kLandmarks, &buf));
      KVSHADE_ASSIGN_OR_RETURN(ld.landmarks, Put(e, buf.data(), buf.size(), ArenaKind::kLandmarks));
      KVSHADE_RETURN_IF_ERROR(read(l, FactorKind::kExcluded, &buf));
      KVSHADE_ASSIGN_OR_RETURN(ld.excluded, Put(e, buf.data(), buf.size(), ArenaKind::kLandmarks));
      KVSHADE_RETURN_IF_ERROR(read(l, FactorKind::kSignatures, &buf));
      if (!buf.empty()) {
        // The width from the size: rows * h * (d*bits/8 + 4) bytes.
        const size_t rows = size_t(lr.n_chunks) * r.C * h;
        int bits = 0;
        for (int b : kernels::kSignatureBits) {
          if (buf.size() == rows * kernels::SignatureRecordBytes(b, d)) bits = b;
        }
        if (bits == 0) {
          return absl::DataLossError(absl::StrCat("key signatures of layer ", l, " hold ", buf.size(),
                                                  " bytes, not a record of ", kernels::kSignatureBitsText, " bits per channel for ",
                                                  lr.n_chunks, " chunks"));
        }
        KVSHADE_ASSIGN_OR_RETURN(ld.sig, Put(e, buf.data(), buf.size(), ArenaKind::kSignatures));
        ld.sig_bits = bits;
      }
    }
    KVSHADE_RETURN_IF_ERROR(read(l, FactorKind::kStatic, &buf));
    size_t off = 0;
    auto take = [&](size_t bytes, ArenaKind kind, DeviceBlock* out) -> absl::Status {
      if (off + bytes > buf.size()) return absl::DataLossError("static blob too short");
      KVSHADE_ASSIGN_OR_RETURN(*out, Put(e, buf.data() + off, bytes, kind));
      off += bytes;
      return absl::OkStatus();
    };
    const size_t srows = Bf16Bytes(size_t(h) * lr.s_cap * d);
    const size_t trows = Bf16Bytes(size_t(lr.n_tail) * D);
    KVSHADE_RETURN_IF_ERROR(take(srows, ArenaKind::kStatic, &ld.sk));
    KVSHADE_RETURN_IF_ERROR(take(srows, ArenaKind::kStatic, &ld.sv));
    KVSHADE_RETURN_IF_ERROR(take(trows, ArenaKind::kStatic, &ld.tk));
    KVSHADE_RETURN_IF_ERROR(take(trows, ArenaKind::kStatic, &ld.tv));
    for (const auto& ib : lr.int2) {
      KiviBlock kb;
      kb.rows = ib.rows;
      kb.valid = ib.valid;
      DeviceBlock* parts[6] = {&kb.k_codes, &kb.k_scale, &kb.k_min, &kb.v_codes, &kb.v_scale, &kb.v_min};
      for (int x = 0; x < 6; ++x) KVSHADE_RETURN_IF_ERROR(take(ib.bytes[x], ArenaKind::kStatic, parts[x]));
      ld.int2.push_back(std::move(kb));
    }
  }
  return absl::OkStatus();
}

// Puts the rebuilt segments of `rec`'s chain into its session's chain, in order. Returns
// what keeps the session from being restored whole (a segment missing, unreadable or
// written for another model shape), or an empty string.
std::string RestoreChain(SesRecord& rec, const RebuiltSegments& segs,
                         const storage::SpillDamage& damage) {
  Session& s = *rec.s;
  for (const auto& id : rec.chain) {
    auto it = segs.built.find(id);
    if (it == segs.built.end()) {
      auto p = segs.problem.find(id);
      return p != segs.problem.end() ? p->second
             : damage.MetaUnreadable(id)
                 ? absl::StrCat("the record of its segment ", id.ToHex(),
                                " lies in a damaged table block of the spill tier")
                 : absl::StrCat("its segment ", id.ToHex(), " is missing from the spill tier");
    }
    if (damage.PiecesUnreadable(id)) {
      return absl::StrCat("records of its segment ", id.ToHex(),
                          " lie in a damaged table block of the spill tier");
    }
    // Records sharing a segment must agree on its shape: a chain built for another
    // model's layers or heads is not this session's (the records are inconsistent).
    const ModelInfo& bm = *segs.built_for.at(id);
    if (bm.layers != s.model.layers || bm.shape.h != s.model.shape.h || bm.shape.d != s.model.shape.d) {
      return absl::StrCat("its segment ", id.ToHex(), " was written for another model shape");
    }
    s.chain.push_back(it->second);
  }
  return "";
}

// Reads a session's exact tail (`tail` tokens per layer: k pre-RoPE when the record has it,
// k, v) from its session record `meta` into s.tail (sized). Returns what keeps it from
// being read (the factor missing, unreadable or of another length), or an empty string.
std::string ReadExactTail(const storage::SegmentMeta* meta, uint32_t tail, Session& s,
                          const EngineImpl::FactorReader& read_factor) {
  const size_t tok = size_t(s.model.shape.h) * s.model.shape.d;
  for (int l = 0; l < s.model.layers && tail > 0 && meta != nullptr; ++l) {
    const storage::SegmentMeta::Factor* f = meta->FindFactor(l, FactorKind::kOther);
    if (f == nullptr) return absl::StrCat("its session record has no exact tail for layer ", l);
    std::vector<std::byte> buf(f->bytes);
    if (absl::Status st = read_factor(meta->id, l, FactorKind::kOther, absl::MakeSpan(buf)); !st.ok()) {
      return absl::StrCat("its exact tail (layer ", l, ") could not be read (", st.message(), ")");
    }
    const size_t n = size_t(tail) * tok;
    const bool has_pre = buf.size() == Bf16Bytes(3 * n);
    if (!has_pre && buf.size() != Bf16Bytes(2 * n)) {
      // The tail's rows and the record's tail length disagree: an inconsistent record.
      spdlog::error("restore: session {} skipped: layer {} tail holds {} bytes, not the {} or {} "
                    "its {} tokens need", s.id, l, buf.size(), Bf16Bytes(2 * n), Bf16Bytes(3 * n), tail);
      return absl::StrCat("its exact tail (layer ", l, ") does not match its length");
    }
    TailLayer& tl = s.tail[l];
    const bf16* p = reinterpret_cast<const bf16*>(buf.data());
    if (has_pre) {
      tl.k_pre.assign(p, p + n);
      p += n;
    }
    tl.k.assign(p, p + n);
    tl.v.assign(p + n, p + 2 * n);
  }
  return "";
}

}  // namespace

absl::Status EngineImpl::RestoreDurable() {
  KVSHADE_ASSIGN_OR_RETURN(std::vector<storage::SegmentMeta> metas, store_->RestoreDurable());
  return RestoreRecords(metas, [this](const storage::SegmentId& id, int layer, FactorKind kind,
                                      absl::Span<std::byte> dst) {
    return spill_->ReadFactor(id, layer, kind, dst);
  });
}

absl::Status EngineImpl::RestoreRecords(const std::vector<storage::SegmentMeta>& metas,
                                        const FactorReader& read_stored_factor) {
  // A record that fails its checks (DataLoss) is skipped, and so are the sessions that need
  // it: it is never served. Any other read error (an I/O error) fails the restore, and so
  // the start: skipping would leave acknowledged sessions out of this process (and their
  // logged appends dropped) for a fault that the next start may not meet.
  absl::Status read_error = absl::OkStatus();
  const FactorReader read_factor = [&](const storage::SegmentId& id, int layer, FactorKind kind,
                                       absl::Span<std::byte> dst) -> absl::Status {
    absl::Status st = read_stored_factor(id, layer, kind, dst);
    if (!st.ok() && !absl::IsDataLoss(st) && read_error.ok()) {
      read_error = absl::Status(st.code(), absl::StrCat("restore: reading durable record ",
                                                        id.ToHex(), " failed, the start is "
                                                        "refused so that nothing stored is "
                                                        "dropped: ", st.message()));
    }
    return st;
  };
  // What the spill tier's open found unreadable (table ranges, damaged metadata records):
  // the sessions with records there are restored damaged, and while a metadata range is
  // unreadable nothing is deleted as an orphan (its session record may be the unreadable
  // one).
  const storage::SpillDamage damage = spill_ ? spill_->Damage() : storage::SpillDamage();
  ParsedRecords records = ParseRecords(metas);
  for (const auto& id : records.stale) DeleteSegmentRecord(id);
  const RebuiltSegments segments = RebuildSegments(records, damage, read_factor);
  absl::Status st = read_error;
  if (st.ok()) st = RebuildSessions(records, segments, damage, read_factor, read_error);
  if (!st.ok()) {
    // Refusing: the segments built so far must not take their stored values with them when
    // they go (Segment::~Segment erases unless the store link is kept).
    store_link_->keep = true;
    return st;
  }
  UpdateGauges();
  return absl::OkStatus();
}

ParsedRecords EngineImpl::ParseRecords(const std::vector<storage::SegmentMeta>& metas) const {
  ParsedRecords out;
  for (const auto& m : metas) {
    SegRecord r;
    if (ParseSegment(m, &r)) {
      out.segments.push_back(std::move(r));
    } else if (m.user_metadata.rfind(kSessionMagic, 0) == 0) {
      out.session_metas.push_back(&m);
    }
  }
  // Base segments before the refactorized ones that reference them.
  std::sort(out.segments.begin(), out.segments.end(), [](const SegRecord& a, const SegRecord& b) {
    return a.has_base < b.has_base;
  });
  // Session records (they carry the model geometry the segments need); the newest record
  // of each session wins.
  for (const storage::SegmentMeta* m : out.session_metas) {
    Reader rd(m->user_metadata);
    rd.Magic(kSessionMagic);
    auto s = std::make_shared<Session>();
    SesRecord rec;
    std::string spec, prof;
    rd.Str(&s->id);
    rd.Str(&s->tenant);
    rd.Get(&rec.version);
    rd.Str(&spec);
    rd.Str(&prof);
    rd.Str(&s->label);
    rd.Vec(&s->prompt);
    rd.Get(&s->reused_tokens);
    rd.Get(&s->tokens);
    rd.Get(&s->created_unix_ms);
    uint32_t nchain = 0;
    rd.Get(&nchain);
    for (uint32_t i = 0; i < nchain && rd.ok(); ++i) {
      storage::Id128 id;
      rd.Id(&id);
      rec.chain.push_back(id);
    }
    rd.Vec(&s->appended_tokens);
    rd.Get(&rec.tail);
    uint8_t fsync = 0;  // a trailing byte since append_fsync; older records: the config's
    if (rd.ok() && !rd.empty()) rd.Get(&fsync);
    // A tensor-parallel shard's membership (after append_fsync; absent for other sessions).
    std::optional<TensorParallelMembership> tp;
    uint32_t tp_begin = 0, tp_end = 0, tp_heads = 0;
    if (rd.ok() && rd.StartsWith(kTensorParallelMagic) && rd.Magic(kTensorParallelMagic)) {
      tp.emplace();
      uint32_t ranks = 0, rank = 0;
      rd.Str(&tp->logical_id);
      rd.Get(&ranks);
      rd.Get(&rank);
      rd.Get(&tp_begin);
      rd.Get(&tp_end);
      rd.Get(&tp_heads);
      tp->ranks = static_cast<int>(ranks);
      tp->rank = static_cast<int>(rank);
    }
    v1::ModelSpec ms;
    v1::Profile pp;
    if (!rd.ok() || !ms.ParseFromString(spec) || !pp.ParseFromString(prof)) {
      out.stale.push_back(m->id);
      continue;
    }
    auto model = ResolveModel(ms, config_->limits);
    if (!model.ok()) continue;
    if (tp) {
      if (tp_begin >= tp_end || tp_end > tp_heads || tp_end - tp_begin != ms.num_kv_heads() ||
          tp->rank >= tp->ranks) {
        continue;
      }
      MarkSlice(&*model, int(tp_begin), int(tp_end), int(tp_heads));
      s->tp = std::move(tp);
    }
    auto profile = ResolveProfile(pp, config_->profile, *model, s->prompt.size());
    if (!profile.ok()) continue;
    s->model = *model;
    s->profile = *profile;
    s->durable = true;
    s->append_fsync = ResolveAppendFsync(
        true, v1::AppendFsync_IsValid(fsync) ? static_cast<v1::AppendFsync>(fsync)
                                             : v1::APPEND_FSYNC_UNSPECIFIED);
    s->state = SessionState::kReady;
    s->durable_record_version = rec.version;
    s->record_id = m->id;
    rec.record = m->id;
    rec.s = s;
    auto it = out.sessions.find(s->id);
    if (it != out.sessions.end()) {
      if (it->second.version >= rec.version) {
        out.stale.push_back(m->id);
        continue;
      }
      out.stale.push_back(it->second.record);
    }
    out.sessions[s->id] = std::move(rec);
  }
  return out;
}

RebuiltSegments EngineImpl::RebuildSegments(const ParsedRecords& records,
                                            const storage::SpillDamage& damage,
                                            const FactorReader& read_factor) {
  RebuiltSegments out;
  // The model of each segment, from the sessions whose chains use it.
  absl::flat_hash_map<storage::Id128, const ModelInfo*> model_of;
  for (const auto& [sid, rec] : records.sessions) {
    for (const auto& id : rec.chain) model_of[id] = &rec.s->model;
  }
  for (const SegRecord& r : records.segments) {
    auto mit = model_of.find(r.meta.id);
    if (mit == model_of.end() && !r.has_base) {
      // Might be the base of a refactorized segment: find its user's model.
      for (const SegRecord& o : records.segments) {
        if (o.has_base && o.base == r.meta.id) {
          auto m2 = model_of.find(o.meta.id);
          if (m2 != model_of.end()) mit = m2;
        }
      }
    }
    if (mit == model_of.end()) {
      // An orphan of a crash between writes, unless its session record may be unreadable.
      if (!damage.AnyMetaUnreadable()) DeleteSegmentRecord(r.meta.id);
      continue;
    }
    const ModelInfo& m = *mit->second;
    if (r.L != m.layers) {
      out.problem[r.meta.id] = absl::StrCat("its segment ", r.meta.id.ToHex(), " has ", r.L,
                                            " layers, the model ", m.layers);
      continue;
    }
    if (const char* problem = SegmentRecordProblem(r, m)) {
      spdlog::error("restore: segment record {} skipped: {}", r.meta.id.ToHex(), problem);
      out.problem[r.meta.id] = absl::StrCat("its segment ", r.meta.id.ToHex(),
                                            "'s record is inconsistent (", problem, ")");
      continue;  // the sessions using it are damaged
    }
    auto seg = std::make_shared<Segment>();
    seg->id = r.meta.id;
    seg->kind = static_cast<v1::ProfileKind>(r.kind);
    seg->first_position = r.first;
    seg->n_tokens = r.n_tokens;
    seg->chunk_size = r.C;
    seg->tokens = r.tokens;
    seg->layers.resize(r.L);
    seg->values_in_store = !r.has_base;
    seg->value_layout = r.meta.layout;
    seg->store = store_link_;
    seg->durable = true;
    if (r.has_key) seg->prefix_key = r.key;
    if (r.has_base) {
      auto b = out.built.find(r.base);
      if (b == out.built.end()) {
        out.problem[r.meta.id] = absl::StrCat("the base segment ", r.base.ToHex(), " of its segment ",
                                              r.meta.id.ToHex(), " could not be restored");
        seg->values_in_store = false;
        continue;
      }
      seg->base = b->second;
      seg->values_in_store = false;
    }
    if (absl::Status st = ReadSegmentLayers(*this, r, m, *seg, read_factor); !st.ok()) {
      // The half-built segment must not erase its stored values as it goes: an I/O error
      // refuses the restore, a damaged record is kept for inspection.
      seg->values_in_store = false;
      out.problem[r.meta.id] = absl::StrCat("its segment ", r.meta.id.ToHex(),
                                            " could not be read (", st.message(), ")");
      continue;  // the sessions using it are damaged
    }
    out.built[seg->id] = seg;
    out.built_for[seg->id] = &m;
  }
  return out;
}

absl::Status EngineImpl::RebuildSessions(ParsedRecords& records, const RebuiltSegments& segments,
                                         const storage::SpillDamage& damage,
                                         const FactorReader& read_factor,
                                         const absl::Status& read_error) {
  // A session whose records cannot all be read or checked: restored as an empty shell,
  // damaged (damage.cc), its readable segments kept with it (and so on disk) until it is
  // closed; never served, never dropped silently.
  auto quarantine = [&](SesRecord& rec, const std::string& why) {
    Session& s = *rec.s;
    s.quarantined.clear();
    for (const auto& id : rec.chain) {
      if (auto it = segments.built.find(id); it != segments.built.end()) s.quarantined.push_back(it->second);
    }
    s.chain.clear();
    s.tail.clear();
    s.cache.clear();
    if (!sessions_.AddSession(rec.s).ok()) return;
    MarkDamaged(s, "record", why, 0, /*persist=*/false);
    ++damaged_at_start_;
  };
  for (auto& [sid, rec] : records.sessions) {
    Session& s = *rec.s;
    std::string problem = RestoreChain(rec, segments, damage);
    if (!problem.empty()) {
      quarantine(rec, problem);
      continue;
    }
    const int L = s.model.layers;
    s.tail.resize(L);
    s.cache.resize(L);
    s.captured_energy.assign(L, 0.0);
    s.residual_energy.assign(L, 0.0);
    s.drift.assign(L, 0.0);
    const storage::SegmentMeta* meta = nullptr;
    for (const auto* m : records.session_metas) {
      if (m->id == rec.record) meta = m;
    }
    problem = ReadExactTail(meta, rec.tail, s, read_factor);
    if (!read_error.ok()) return read_error;
    if (!problem.empty()) {
      quarantine(rec, problem);
      continue;
    }
    {
      // As at the commit (shadow): a record written then holds the prompt's whole
      // remainder, which may exceed local_window + C (a short suffix); its oldest chunks
      // leave the tail again, as they did before the restart (the same rows and
      // coordinates).
      std::unique_lock lock(s.mu);
      if (absl::Status st = ProfileOf(s.profile.kind).SettleTail(*this, s); !st.ok()) {
        spdlog::warn("restored session '{}': the exact tail was not cut: {}", s.id,
                     std::string(st.message()));
      }
    }
    if (!sessions_.AddSession(rec.s).ok()) continue;
    RegisterRestoredPrefixes(s);
  }
  return absl::OkStatus();
}

void EngineImpl::RegisterRestoredPrefixes(Session& s) {
  // In chain order, so that parents come first.
  const Tenant tenant{s.tenant, TenantSalt(s.tenant, config_->prefix_secret)};
  auto hasher = Hasher(tenant, s.model, s.profile);
  std::optional<storage::SegmentId> parent;
  for (const auto& seg : s.chain) {
    if (seg->prefix_key && hasher.ok()) {
      bool known = false;
      {
        base::MutexLock lock(&seg_mu_);
        known = registered_.contains(seg->id);
      }
      storage::SegmentRef ref;
      if (known) {
        auto acquired = prefix_.Acquire(seg->id);
        if (acquired.ok()) ref = std::move(acquired).value();
      } else {
        ref = RegisterPrefix(seg, hasher->Chain(s.prompt), hasher->block_tokens(), parent);
      }
      if (ref) s.prefix_refs.push_back(std::move(ref));
    }
    parent = seg->id;
  }
}

void EngineImpl::DeleteSegmentRecord(const storage::Id128& id) {
  if (!store_->Erase(id).ok() && spill_) spill_->DeleteSegment(id).IgnoreError();
}

}  // namespace kvshade::service
