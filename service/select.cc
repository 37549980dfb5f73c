// The decode paths: SelectAndReconstruct (per attachment, per layer, per KV head slot
// tables; batched Backend::Select then Reconstruct of the misses; SlotDelta responses),
// Attend (static set + selected chunks + exact tail through Backend::Attend) and
// GetStaticSet.
//
// Locking: ids are resolved under the registry lock (SessionManager::Use, which also
// renews leases); then every session of the batch is locked shared, in address order (so
// two batches and an append can never deadlock), then every attachment's own mutex, in
// address order. Nothing global is held while kernels run.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <shared_mutex>
#include <type_traits>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "delivery.h"
#include "engine_impl.h"
#include "profile.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {
namespace {

using kernels::bf16;
using storage::ArenaKind;

// Reconstruct outputs of one sub-batch are bounded by this many bytes (a batch of 24
// Llama-3-8B-shaped queries at budget 256 needs 384 MiB: it runs as one).
constexpr size_t kReconstructScratchBytes = size_t{1} << 30;

struct Query {
  std::shared_ptr<Attachment> attachment;
  std::shared_ptr<Session> session;
  std::vector<bf16> q;  // [hq, d]
  // The step's new token, pre-RoPE [h, d] each (empty when not given), and whether to
  // stage it as token `stage_token_id`.
  std::vector<bf16> k_new, v_new;
  bool stage = false;
  int32_t stage_token_id = 0;
  bool hold = false;
};

// A token whose last layer a call staged: appended once the call's locks are released.
struct StagedCommit {
  Session* session;
  std::string attachment;
  int32_t token = 0;
  uint64_t at_tokens = 0;  // the session's length when its staging began
  std::vector<std::vector<bf16>> k, v;
};

// Resolves and validates every (attachment, query) of a batch.
template <typename Q>
absl::StatusOr<std::vector<Query>> Resolve(SessionManager& sm, const LimitsConfig& limits,
                                           const Tenant& t, uint32_t layer,
                                           absl::Span<const Q> in) {
  if (in.size() > limits.max_batch) {
    return absl::InvalidArgumentError(absl::StrCat("queries has ", in.size(),
                                                   " entries, over the limit max_batch = ",
                                                   limits.max_batch));
  }
  std::vector<Query> out;
  out.reserve(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    const Q& qi = in[i];
    for (size_t j = 0; j < i; ++j) {
      if (in[j].attachment_id == qi.attachment_id) {
        return absl::InvalidArgumentError(absl::StrCat(
            "queries[", i, "]: attachment '", std::string(qi.attachment_id),
            "' appears more than once in the batch (one query per attachment per call)"));
      }
    }
    auto a = sm.Use(t.name, std::string(qi.attachment_id));
    if (!a.ok()) {
      return absl::Status(a.status().code(),
                          absl::StrCat("queries[", i, "]: ", a.status().message()));
    }
    Query q;
    q.attachment = *a;
    q.session = (*a)->session;
    const ModelInfo& m = q.session->model;
    if (layer >= static_cast<uint32_t>(m.layers)) {
      return absl::InvalidArgumentError(absl::StrCat("layer must be < num_layers = ", m.layers,
                                                     " of session '", q.session->id,
                                                     "', got ", layer));
    }
    q.q.resize(size_t(m.shape.query_heads()) * m.shape.d);
    bool native = false;
    if constexpr (std::is_same_v<Q, SelectQueryView>) {
      native = qi.q.empty() && !qi.chunks.empty();  // model-native: q unused
    }
    const std::string what = absl::StrCat("queries[", i, "]");
    if (native) {
      std::fill(q.q.begin(), q.q.end(), bf16{});
    } else {
      const int64_t shape[2] = {m.shape.query_heads(), m.shape.d};
      KVSHADE_RETURN_IF_ERROR(DecodeTensorInto(qi.q, shape, m.dtype, what + ".q", absl::MakeSpan(q.q)));
    }
    if (qi.stage && (qi.k_new.empty() || qi.v_new.empty() || qi.stage_token_id < 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ".stage_token_id: staging needs k_new and v_new and a token id >= 0, got id ",
          qi.stage_token_id, qi.k_new.empty() || qi.v_new.empty() ? " without k_new/v_new" : ""));
    }
    if (!qi.k_new.empty() || !qi.v_new.empty()) {
      if (std::is_same_v<Q, SelectQueryView> && !qi.stage) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ".k_new: a select query carries the new token only to stage it (set stage_token_id)"));
      }
      const int64_t hd[2] = {m.shape.h, m.shape.d};
      q.k_new.resize(size_t(m.shape.h) * m.shape.d);
      q.v_new.resize(q.k_new.size());
      KVSHADE_RETURN_IF_ERROR(DecodeTensorInto(qi.k_new, hd, m.dtype, what + ".k_new", absl::MakeSpan(q.k_new)));
      KVSHADE_RETURN_IF_ERROR(DecodeTensorInto(qi.v_new, hd, m.dtype, what + ".v_new", absl::MakeSpan(q.v_new)));
    }
    q.stage = qi.stage;
    q.stage_token_id = qi.stage_token_id;
    q.hold = qi.hold;
    out.push_back(std::move(q));
  }
  return out;
}

// Shared locks on every distinct session of a batch, in address order; checks each is
// ready.
class BatchLocks {
 public:
  absl::Status Lock(const std::vector<Query>& qs) {
    std::vector<Session*> ss;
    for (const Query& q : qs) ss.push_back(q.session.get());
    std::sort(ss.begin(), ss.end());
    ss.erase(std::unique(ss.begin(), ss.end()), ss.end());
    for (Session* s : ss) {
      locks_.emplace_back(s->mu);
      if (s->state == SessionState::kClosed) {
        return absl::NotFoundError(absl::StrCat("session '", s->id, "' not found (closed)"));
      }
      KVSHADE_RETURN_IF_ERROR(EngineImpl::CheckNotDamaged(*s, "select/attend"));
      if (s->state != SessionState::kReady) {
        return absl::FailedPreconditionError(absl::StrCat(
            "session '", s->id, "' is ", SessionStateName(s->state), "; commit its ingest first"));
      }
    }
    return absl::OkStatus();
  }

 private:
  std::vector<std::shared_lock<std::shared_mutex>> locks_;
};

// One decode step's selection for a group of sessions that share the geometry, k and
// options (the decode core's SelectionGroup), and the batch items it covers.
struct SelectGroup : decode::SelectionGroup {
  std::vector<size_t> items;  // indices into the batch
};

// The decode core's group of session `s` at a budget of k chunks over `view` (the
// session's layer view: two-stage selection scores key signatures when every segment of it
// keeps them). Its slot width g.k is k, or k*C/u units with selection units.
SelectGroup GroupOf(const Session& s, int k, bool native, const kernels::SessionLayerView& view) {
  SelectGroup g;
  g.shape = s.model.shape;
  g.C = s.profile.chunk_size;
  g.k = native ? k : s.profile.slots(k);
  g.rope = s.model.rope;
  g.codec = s.profile.codec;
  g.native = native;
  if (!native) g.options = s.profile.Policy().OptionsAt(k, g.C, g.rope, decode::HasSignatures(view));
  return g;
}

std::string GroupKey(const Session& s, const SelectGroup& g) {
  return absl::StrCat(s.model.Fingerprint(), "|", g.Key());
}

// Model-native chunk ids of one query: an int32 tensor [h, m] with m <= k, each entry -1
// or a chunk id in [0, total), distinct per head; returned as [h, k] rows, -1 padded.
absl::StatusOr<std::vector<int32_t>> NativeChunks(const TensorView& t, int h, int k, int total,
                                                  const std::string& what) {
  if (t.dtype != v1::DTYPE_INT32 || t.rank != 2 || t.shape[0] != h || t.shape[1] < 0 ||
      t.shape[1] > k) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " must be an INT32 tensor [h = ", h, ", m] with m <= slots per head (", k, ")"));
  }
  const int64_t m = t.shape[1];
  if (t.data.size() != size_t(h * m) * 4) {
    return absl::InvalidArgumentError(absl::StrCat(what, " holds ", t.data.size(),
                                                   " bytes, expected ", h * m * 4));
  }
  std::vector<int32_t> out(size_t(h) * k, -1);
  for (int hh = 0; hh < h; ++hh) {
    absl::flat_hash_set<int32_t> seen;
    for (int64_t x = 0; x < m; ++x) {
      int32_t c;
      std::memcpy(&c, t.data.data() + (hh * m + x) * 4, 4);
      if (c == -1) continue;
      if (c < -1 || c >= total) {
        return absl::InvalidArgumentError(absl::StrCat(what, "[", hh, ", ", x, "] = ", c,
                                                       " is not a chunk id in [0, ", total, ")"));
      }
      if (!seen.insert(c).second) {
        return absl::InvalidArgumentError(absl::StrCat(what, "[", hh, ", ", x, "]: chunk ", c,
                                                       " appears twice for head ", hh));
      }
      out[size_t(hh) * k + x] = c;
    }
  }
  return out;
}

// Keeps this layer's K/V of query q's new token in its attachment's staged token (a.mu
// held); queues the token in `commits` once every layer of the model is staged, unless a
// staging call of the token asked to hold it (then CommitStaged appends or discards it).
// A new token id, or an append since staging began, starts over.
absl::Status StageLayer(SessionManager& sm, const Tenant& t, Session& s, Attachment& a, int layer,
                        const Query& q, std::vector<StagedCommit>* commits) {
  KVSHADE_RETURN_IF_ERROR(sm.CheckWriter(t.name, s, a.id));
  Attachment::StagedToken& sg = a.staged;
  const int L = s.model.layers;
  if (sg.layers == 0 || sg.token_id != q.stage_token_id || sg.at_tokens != s.tokens) {
    sg = Attachment::StagedToken{};
    sg.token_id = q.stage_token_id;
    sg.at_tokens = s.tokens;
    sg.k.assign(L, {});
    sg.v.assign(L, {});
  }
  if (sg.k[layer].empty()) ++sg.layers;
  sg.k[layer] = q.k_new;
  sg.v[layer] = q.v_new;
  sg.hold = sg.hold || q.hold;
  if (sg.layers == L && !sg.hold) {
    commits->push_back({&s, a.id, sg.token_id, sg.at_tokens, std::move(sg.k), std::move(sg.v)});
    sg = Attachment::StagedToken{};
  }
  return absl::OkStatus();
}

// Appends the tokens a call's staging completed (its locks released) and returns each
// appended session's new length.
absl::StatusOr<std::vector<std::pair<const Session*, uint64_t>>> AppendStaged(
    EngineImpl& e, const Tenant& t, std::vector<StagedCommit>& commits) {
  std::vector<std::pair<const Session*, uint64_t>> out;
  for (StagedCommit& c : commits) {
    const int32_t id[1] = {c.token};
    KVSHADE_ASSIGN_OR_RETURN(uint64_t tokens,
                             e.CommitAppend(t, *c.session, c.attachment, id, c.k, c.v, c.at_tokens));
    out.emplace_back(c.session, tokens);
  }
  return out;
}

}  // namespace

// Result of selecting (and reconstructing) one sub-batch: host copies of what the callers
// need. Rows are [item][h][k].
struct SelectRun {
  std::vector<int32_t> selected, miss_slot, miss_chunk, miss_count;
  DeviceBlock keys, values;  // [items, h, k, U, d] bf16 (U = the group's unit_tokens())
};

// Runs the decode core's selection over `items` (views, queries, slot tables in backend
// memory) on `st`, brings the selection to the host (one wait), then reconstructs the
// misses into rows [0, miss_count) of each head (a second wait, for its workspace); the
// rows stay on the device for the delivery. `given`: model-native ids [h, k] per item.
static absl::StatusOr<SelectRun> RunSelect(EngineImpl& e, kernels::Stream st, const SelectGroup& g,
                                           std::vector<kernels::SelectItem>& sel,
                                           const std::vector<std::vector<bf16>*>& queries,
                                           const std::vector<const std::vector<int32_t>*>* given =
                                               nullptr) {
  const int h = g.shape.h, k = g.k, n = static_cast<int>(sel.size());
  const size_t hk = size_t(h) * k;
  const size_t words = decode::SelectOutputWords(h, k);
  SelectRun run;
  thread_local std::vector<bf16> qhost;  // kept between calls
  qhost.clear();
  for (auto* q : queries) qhost.insert(qhost.end(), q->begin(), q->end());
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock qd, e.UploadOn(st, qhost.data(), Bf16Bytes(qhost.size()), ArenaKind::kOther));
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock outs, e.Alloc(size_t(n) * words * 4, ArenaKind::kOther));
  int32_t* base = Ptr<int32_t>(outs);
  const size_t qstride = size_t(g.shape.query_heads()) * g.shape.d;
  for (int i = 0; i < n; ++i) {
    sel[i].q = Ptr<bf16>(qd) + i * qstride;
    decode::BindOutputs(base + i * words, h, k, &sel[i]);
  }
  std::vector<int32_t> all(size_t(n) * words);
  {
    StageTimer timer(e.metrics(), "select");
    if (given != nullptr) {
      // Model-native: the callers' ids [h, k] go into `selected`, then the slot diff.
      for (int i = 0; i < n; ++i) {
        KVSHADE_RETURN_IF_ERROR(e.backend().CopyFromHost(sel[i].selected, (*given)[i]->data(), hk * 4, st));
      }
    }
    const size_t wsb = decode::SelectionWorkspaceBytes(e.backend(), g, sel);
    KVSHADE_ASSIGN_OR_RETURN(DeviceBlock ws, e.Alloc(wsb, ArenaKind::kOther));
    KVSHADE_RETURN_IF_ERROR(decode::RunSelection(e.backend(), g, sel, kernels::Workspace{ws.data(), wsb}, st));
    // The one wait of the selection: its outputs come to the host.
    KVSHADE_RETURN_IF_ERROR(e.DownloadOn(st, all.data(), base, all.size() * 4));
  }
  run.selected.resize(size_t(n) * hk);
  run.miss_slot.resize(size_t(n) * hk);
  run.miss_chunk.resize(size_t(n) * hk);
  run.miss_count.resize(size_t(n) * h);
  for (int i = 0; i < n; ++i) {
    const int32_t* o = all.data() + i * words;
    std::copy_n(o, hk, run.selected.begin() + i * hk);
    std::copy_n(o + hk, hk, run.miss_slot.begin() + i * hk);
    std::copy_n(o + 2 * hk, hk, run.miss_chunk.begin() + i * hk);
    std::copy_n(o + 3 * hk, h, run.miss_count.begin() + i * h);
  }
  int64_t misses = 0;
  for (int32_t m : run.miss_count) misses += m;
  if (misses == 0) return run;

  StageTimer timer(e.metrics(), "reconstruct");
  const size_t per_item = hk * g.unit_tokens() * g.shape.d;
  KVSHADE_ASSIGN_OR_RETURN(run.keys, e.Alloc(Bf16Bytes(n * per_item), ArenaKind::kSlots));
  KVSHADE_ASSIGN_OR_RETURN(run.values, e.Alloc(Bf16Bytes(n * per_item), ArenaKind::kSlots));
  std::vector<kernels::ReconstructItem> rec(n);
  for (int i = 0; i < n; ++i) {
    rec[i] = decode::ReconstructOf(g, sel[i], Ptr<bf16>(run.keys) + i * per_item,
                                   Ptr<bf16>(run.values) + i * per_item, /*into_slots=*/false);
  }
  const size_t wsb = decode::ReconstructWorkspaceBytes(e.backend(), g, rec);
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock ws, e.Alloc(wsb, ArenaKind::kOther));
  KVSHADE_RETURN_IF_ERROR(decode::RunReconstruct(e.backend(), g, rec, kernels::Workspace{ws.data(), wsb}, st));
  // The workspace is released when this returns: wait for the kernel that uses it. (The
  // stage timer measures the kernel, as before; delivery then costs no further wait.)
  KVSHADE_RETURN_IF_ERROR(e.backend().Synchronize(st));
  return run;
}

// Makes sure an attachment's slot table for `layer` has k slots per head (chunks, or units
// with selection units), keeping the slots it had (the session only ever gains chunks, so
// k only grows).
static absl::Status EnsureSlots(EngineImpl& e, kernels::Stream st, Attachment& a, int layer,
                                int h, int k) {
  SlotTable& t = a.slots[layer];
  if (t.slots && t.k == k) return absl::OkStatus();
  std::vector<int32_t> table(size_t(h) * k, -1);
  if (t.slots) {
    std::vector<int32_t> old(size_t(h) * t.k);
    KVSHADE_RETURN_IF_ERROR(e.DownloadOn(st, old.data(), t.slots.data(), old.size() * 4));
    const int keep = std::min(t.k, k);
    for (int hh = 0; hh < h; ++hh) {
      std::copy_n(old.begin() + size_t(hh) * t.k, keep, table.begin() + size_t(hh) * k);
    }
  }
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock b,
                           e.AllocNoEvict(std::max<size_t>(table.size() * 4, 1), ArenaKind::kSlots));
  KVSHADE_RETURN_IF_ERROR(e.backend().CopyFromHost(b.data(), table.data(), table.size() * 4, st));
  t.slots = std::move(b);
  t.k = k;
  return absl::OkStatus();
}

// The recall guard's part of one decode step of one session's layer (the decode core's
// GuardStep, docs/ALGORITHM.md "Recall guard"), on a step the guard samples: recall@k of
// `selected` ([h, k_sel] host, the selection the step attends at the budget it used)
// against the oracle, exported, recorded and acted on.
static absl::Status GuardStep(EngineImpl& e, kernels::Stream st, Session& s, const SelectGroup& g,
                              int layer, const kernels::SessionLayerView& view,
                              const std::vector<bf16>& q, const int32_t* selected, int k_sel) {
  const decode::SelectionPolicy policy = s.profile.Policy();
  if (!decode::GuardSamples(s.selection, policy, layer)) return absl::OkStatus();
  const int k0 = decode::OracleBudget(policy, view.total_chunks());
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock qd, e.UploadOn(st, q.data(), Bf16Bytes(q.size()), ArenaKind::kOther));
  const size_t wsb = decode::OracleWorkspaceBytes(e.backend(), g, view, k0);
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock ws, e.Alloc(wsb, ArenaKind::kOther));
  KVSHADE_ASSIGN_OR_RETURN(decode::GuardOutcome o,
                           decode::GuardStep(e.backend(), s.selection, policy, g, layer, view,
                                             Ptr<const bf16>(qd), selected, k_sel,
                                             kernels::Workspace{ws.data(), wsb}, st));
  if (!o.sampled) return absl::OkStatus();
  SelectionMetrics* m = SelectionMetrics::For(e.metrics()->registry());
  const std::string label = policy.Label(g.native);
  m->Sampled(label, o.recall);
  if (o.action != decode::RecallAction::kNone) m->Acted(label, o.action);
  return absl::OkStatus();
}

absl::Status EngineImpl::Select(const Tenant& t, const SelectRequestView& r, SelectResult* out) {
  std::optional<StageTimer> prepare(std::in_place, metrics_, "decode_prepare");
  KVSHADE_ASSIGN_OR_RETURN(std::vector<Query> qs,
                           Resolve(sessions_, config_->limits, t, r.layer, r.queries));
  const int layer = static_cast<int>(r.layer);
  std::vector<StagedCommit> commits;  // appended once the locks below are released
  {
  BatchLocks locks;
  KVSHADE_RETURN_IF_ERROR(locks.Lock(qs));
  std::vector<Attachment*> as;
  for (const Query& q : qs) as.push_back(q.attachment.get());
  std::sort(as.begin(), as.end());
  std::vector<std::unique_lock<std::mutex>> alocks;
  for (Attachment* a : as) alocks.emplace_back(a->mu);

  StreamLease stream(*this);
  const kernels::Stream st = stream.get();
  out->Reset(qs.size());
  // Views (pins held until the result is built) and groups.
  std::vector<LayerViewHold> holds(qs.size());
  std::vector<int> ks(qs.size(), 0);
  std::vector<std::vector<int32_t>> native(qs.size());  // model-native ids [h, k]
  std::map<std::string, SelectGroup> groups;
  for (size_t i = 0; i < qs.size(); ++i) {
    const Session& s = *qs[i].session;
    // The writer rule before anything moves: a refused stage must not leave the slot
    // tables ahead of a worker that never got the deltas.
    if (qs[i].stage) KVSHADE_RETURN_IF_ERROR(sessions_.CheckWriter(t.name, s, qs[i].attachment->id));
    if (!v1::SelectPurpose_IsValid(r.queries[i].purpose)) {
      return absl::InvalidArgumentError(absl::StrCat("queries[", i, "].purpose is unknown: ",
                                                     static_cast<int>(r.queries[i].purpose)));
    }
    SlotDeltaResult& delta = out->deltas[i];
    delta.chunk_size = static_cast<uint32_t>(s.profile.slot_tokens());  // rows per miss
    delta.head_dim = static_cast<uint32_t>(s.model.shape.d);
    if (!ProfileOf(s.profile.kind).selects()) continue;  // no per-query selection
    KVSHADE_ASSIGN_OR_RETURN(holds[i], BuildView(s, layer));
    if (holds[i].total_chunks == 0) continue;
    ks[i] = std::min(s.profile.sparse_budget, holds[i].total_chunks);
    const SelectQueryView& sq = r.queries[i];
    const bool is_native = !sq.chunks.empty();
    if (is_native) {
      if (s.profile.selection_unit > 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "queries[", i, "].chunks: model-native chunk ids select whole chunks, but session '",
            s.id, "' selects units of ", s.profile.selection_unit,
            " tokens (profile.selection_unit); send q instead, or use a profile without selection units"));
      }
      KVSHADE_ASSIGN_OR_RETURN(native[i], NativeChunks(sq.chunks, s.model.shape.h, ks[i],
                                                       holds[i].total_chunks,
                                                       absl::StrCat("queries[", i, "].chunks")));
    }
    // A layer the recall guard widened past the slots is attended through Attend: nothing
    // is selected, reconstructed or delivered for it here, and the slot table stays.
    if (!is_native && s.selection.Budget(layer, ks[i], holds[i].total_chunks) > ks[i]) {
      delta.fallback = true;
      continue;
    }
    KVSHADE_RETURN_IF_ERROR(EnsureSlots(*this, st, *qs[i].attachment, layer, s.model.shape.h,
                                        s.profile.slots(ks[i])));
    SelectGroup g = GroupOf(s, ks[i], is_native, holds[i].view);
    SelectGroup& group = groups.try_emplace(GroupKey(s, g), std::move(g)).first->second;
    group.items.push_back(i);
  }
  prepare.reset();
  uint64_t total_selected = 0, total_hits = 0;
  for (auto& [key, g] : groups) {
    // U: tokens per slot (C, or the selection unit); k: slots per head.
    const int h = g.shape.h, d = g.shape.d, U = g.unit_tokens(), k = g.k;
    const size_t per_item_bytes = Bf16Bytes(size_t(h) * k * U * d) * 2;
    const size_t step = std::max<size_t>(1, kReconstructScratchBytes / std::max<size_t>(per_item_bytes, 1));
    for (size_t b0 = 0; b0 < g.items.size(); b0 += step) {
      const size_t b1 = std::min(g.items.size(), b0 + step);
      std::vector<kernels::SelectItem> sel(b1 - b0);
      std::vector<std::vector<bf16>*> queries;
      std::vector<const std::vector<int32_t>*> given;
      for (size_t j = b0; j < b1; ++j) {
        const size_t i = g.items[j];
        sel[j - b0].view = holds[i].view;
        sel[j - b0].slots = Ptr<int32_t>(qs[i].attachment->slots[layer].slots);
        queries.push_back(&qs[i].q);
        given.push_back(&native[i]);
      }
      KVSHADE_ASSIGN_OR_RETURN(SelectRun run, RunSelect(*this, st, g, sel, queries,
                                                        g.native ? &given : nullptr));
      const size_t hk = size_t(h) * k;
      Delivery delivery(*this, st);
      std::vector<int64_t> src_rows, dst_rows;
      for (size_t j = b0; j < b1; ++j) {
        const size_t i = g.items[j], jj = j - b0;
        SlotDeltaResult& delta = out->deltas[i];
        uint32_t selected = 0;
        const PeerSlots* peer = qs[i].attachment->peer_slots.get();
        const SlotLayout layout = SlotLayout::Of(qs[i].session->model, qs[i].session->profile);
        src_rows.clear();
        dst_rows.clear();
        for (int hh = 0; hh < h; ++hh) {
          for (int x = 0; x < k; ++x) selected += run.selected[jj * hk + hh * k + x] >= 0;
          const int mc = run.miss_count[jj * h + hh];
          for (int x = 0; x < mc; ++x) {
            const int32_t slot = run.miss_slot[jj * hk + hh * k + x];
            delta.head.push_back(static_cast<uint32_t>(hh));
            delta.slot.push_back(static_cast<uint32_t>(slot));
            delta.chunk.push_back(run.miss_chunk[jj * hk + hh * k + x]);
            delta.position.push_back(g.position(holds[i].view, delta.chunk.back()));
            // A head's misses are rows [0, mc) of its [k, U, d] block.
            src_rows.push_back(int64_t(jj * hk) + hh * k + x);
            if (peer != nullptr) {
              dst_rows.push_back(static_cast<int64_t>(layout.Row(layer, hh, slot)));
            }
          }
        }
        if (peer != nullptr) {
          delivery.ToPeer(*peer, src_rows, dst_rows, &delta);
        } else {
          delivery.ToReply(src_rows, &delta);
        }
        delta.selected = selected;
        delta.hits = selected - delta.misses();
      }
      // (Without misses there are no rows: Run copies nothing and marks peers delivered.)
      KVSHADE_RETURN_IF_ERROR(delivery.Run(Ptr<const bf16>(run.keys), Ptr<const bf16>(run.values),
                                           Bf16Bytes(size_t(U) * d)));
      for (size_t j = b0; j < b1; ++j) {
        const size_t i = g.items[j], jj = j - b0;
        SlotDeltaResult& delta = out->deltas[i];
        if (!g.native) {
          KVSHADE_RETURN_IF_ERROR(GuardStep(*this, st, *qs[i].session, g, layer, holds[i].view, qs[i].q,
                                            run.selected.data() + jj * hk, k));
        }
        // (When the guard widened the layer on this step, this step's selection is still
        // delivered and attended; the layer's later steps are fallbacks.)
        qs[i].attachment->selected += delta.selected;
        qs[i].attachment->hits += delta.hits;
        total_selected += delta.selected;
        total_hits += delta.hits;
      }
    }
  }
  chunks_selected_ += total_selected;
  chunk_hits_ += total_hits;
  metrics_->ChunkSelection(total_selected, total_hits);
  for (const SelectQueryView& q : r.queries) metrics_->DecodeSelect(static_cast<int>(q.purpose));
  // The new tokens queries stage (every attachment's mutex is held), after the selection:
  // a failed select stages nothing (and the writer rule was checked before it).
  for (size_t i = 0; i < qs.size(); ++i) {
    Session& s = *qs[i].session;
    if (qs[i].stage) KVSHADE_RETURN_IF_ERROR(StageLayer(sessions_, t, s, *qs[i].attachment, layer, qs[i], &commits));
    out->deltas[i].tokens = s.tokens;
  }
  }
  KVSHADE_ASSIGN_OR_RETURN(auto appended, AppendStaged(*this, t, commits));
  for (const auto& [session, tokens] : appended) {
    for (size_t i = 0; i < qs.size(); ++i) {
      if (qs[i].session.get() == session) out->deltas[i].tokens = tokens;
    }
  }
  return absl::OkStatus();
}

absl::Status EngineImpl::Attend(const Tenant& t, const AttendRequestView& r, AttendResult* out) {
  KVSHADE_ASSIGN_OR_RETURN(std::vector<Query> qs,
                           Resolve(sessions_, config_->limits, t, r.layer, r.queries));
  const int layer = static_cast<int>(r.layer);
  // Staged tokens this call completes: appended once the reads' locks are released.
  std::vector<StagedCommit> commits;
  out->Reset(qs.size());
  {
  BatchLocks locks;
  KVSHADE_RETURN_IF_ERROR(locks.Lock(qs));
  StageTimer timer(metrics_, "attend");
  StreamLease stream(*this);
  const kernels::Stream st = stream.get();
  for (size_t i = 0; i < qs.size(); ++i) {
    Session& s = *qs[i].session;
    const kernels::LayerShape& shape = s.model.shape;
    const int h = shape.h, d = shape.d;
    // The rows attended, in the decode core's order (as same-node decode attends them):
    // static set, selected chunks, exact tail, the step's new token.
    decode::AttendRows rows;
    std::vector<DeviceBlock> keep;  // scratch alive until Attend ran
    SelectRun run;
    if (ProfileOf(s.profile.kind).all_exact()) {
      // Every token: the segments' exact blocks (gathered into one when there are more
      // than the kernel takes).
      std::vector<const LayerData*> parts;
      for (const auto& seg : s.chain) {
        if (seg->data(layer).n_tail > 0) parts.push_back(&seg->data(layer));
      }
      if (s.open && s.open->layers[layer].n_tail > 0) parts.push_back(&s.open->layers[layer]);
      const int64_t tok = int64_t(h) * d;
      const size_t room = size_t(kernels::kMaxKvBlocks) - (qs[i].k_new.empty() ? 0 : 1);
      if (parts.size() <= room) {
        for (const LayerData* p : parts) {
          KVSHADE_RETURN_IF_ERROR(rows.Add(kernels::KvBlock{Ptr<const bf16>(p->tk), Ptr<const bf16>(p->tv),
                                                             p->n_tail, nullptr, d, tok}));
        }
      } else {
        std::vector<bf16> hk, hv;
        for (const LayerData* p : parts) {
          const size_t n = size_t(p->n_tail) * tok;
          const size_t at = hk.size();
          hk.resize(at + n);
          hv.resize(at + n);
          KVSHADE_RETURN_IF_ERROR(DownloadOn(st, hk.data() + at, p->tk.data(), Bf16Bytes(n)));
          KVSHADE_RETURN_IF_ERROR(DownloadOn(st, hv.data() + at, p->tv.data(), Bf16Bytes(n)));
        }
        KVSHADE_ASSIGN_OR_RETURN(DeviceBlock kb, UploadOn(st, hk.data(), Bf16Bytes(hk.size()), ArenaKind::kOther));
        KVSHADE_ASSIGN_OR_RETURN(DeviceBlock vb, UploadOn(st, hv.data(), Bf16Bytes(hv.size()), ArenaKind::kOther));
        KVSHADE_RETURN_IF_ERROR(rows.Add(kernels::KvBlock{Ptr<const bf16>(kb), Ptr<const bf16>(vb),
                                                           int64_t(hk.size() / tok), nullptr, d, tok}));
        keep.push_back(std::move(kb));
        keep.push_back(std::move(vb));
      }
    } else {
      KVSHADE_ASSIGN_OR_RETURN(const StaticCache* c, GetCache(s, layer));
      KVSHADE_RETURN_IF_ERROR(rows.AddStatic(Ptr<const bf16>(c->k), Ptr<const bf16>(c->v), c->s,
                                             Ptr<const int32_t>(c->lengths), d));
      if (ProfileOf(s.profile.kind).selects()) {
        KVSHADE_ASSIGN_OR_RETURN(LayerViewHold hold, BuildView(s, layer));
        if (hold.total_chunks > 0) {
          // The recall guard may have widened this layer's budget (or opened every chunk).
          const int k = s.selection.Budget(layer, std::min(s.profile.sparse_budget, hold.total_chunks),
                                           hold.total_chunks);
          const SelectGroup g = GroupOf(s, k, /*native=*/false, hold.view);
          // A fresh, empty slot table: every selected chunk (unit) is a miss and lands in
          // rows [0, miss_count) of its head in ascending id order.
          std::vector<int32_t> empty(size_t(h) * g.k, -1);
          KVSHADE_ASSIGN_OR_RETURN(DeviceBlock slots, UploadOn(st, empty.data(), empty.size() * 4, ArenaKind::kOther));
          std::vector<kernels::SelectItem> sel(1);
          sel[0].view = hold.view;
          sel[0].slots = Ptr<int32_t>(slots);
          std::vector<std::vector<bf16>*> queries = {&qs[i].q};
          KVSHADE_ASSIGN_OR_RETURN(run, RunSelect(*this, st, g, sel, queries));
          // Sampled at the budget this step attends (a widened layer doubles from there).
          KVSHADE_RETURN_IF_ERROR(GuardStep(*this, st, s, g, layer, hold.view, qs[i].q, run.selected.data(), g.k));
          const int U = g.unit_tokens();  // rows per selected chunk (unit)
          std::vector<int32_t> lens(h);
          int64_t any = 0;
          for (int hh = 0; hh < h; ++hh) {
            lens[hh] = run.miss_count[hh] * U;
            any += lens[hh];
          }
          if (any > 0) {
            KVSHADE_ASSIGN_OR_RETURN(DeviceBlock ld, UploadOn(st, lens.data(), lens.size() * 4, ArenaKind::kOther));
            KVSHADE_RETURN_IF_ERROR(rows.AddSelected(Ptr<const bf16>(run.keys), Ptr<const bf16>(run.values),
                                                     int64_t(g.k) * U, Ptr<const int32_t>(ld), d));
            keep.push_back(std::move(ld));
          }
          keep.push_back(std::move(slots));
        }
      }
      KVSHADE_RETURN_IF_ERROR(rows.AddTokens(Ptr<const bf16>(c->tk), Ptr<const bf16>(c->tv), c->t, nullptr,
                                             int64_t(h) * d, d));
    }
    // The step's new token, if given: rotated at the position after the session's last
    // token and attended as one more block (not stored).
    if (qs[i].stage) {
      // Kept per layer (pre-RoPE, as AppendTokens takes it); the last layer commits.
      Attachment& a = *qs[i].attachment;
      std::lock_guard<std::mutex> alock(a.mu);
      KVSHADE_RETURN_IF_ERROR(StageLayer(sessions_, t, s, a, layer, qs[i], &commits));
    }
    if (!qs[i].k_new.empty()) {
      const std::vector<bf16>& kn = qs[i].k_new;
      const std::vector<bf16>& vn = qs[i].v_new;
      KVSHADE_ASSIGN_OR_RETURN(DeviceBlock kd, UploadOn(st, kn.data(), Bf16Bytes(kn.size()), ArenaKind::kOther));
      KVSHADE_ASSIGN_OR_RETURN(DeviceBlock vd, UploadOn(st, vn.data(), Bf16Bytes(vn.size()), ArenaKind::kOther));
      const std::vector<int64_t> pos = {static_cast<int64_t>(s.tokens)};
      KVSHADE_RETURN_IF_ERROR(backend_->ApplyRope(s.model.rope, pos, h, d,
                                                  absl::Span<bf16>(Ptr<bf16>(kd), kn.size()), st));
      KVSHADE_RETURN_IF_ERROR(rows.Add(kernels::KvBlock{Ptr<const bf16>(kd), Ptr<const bf16>(vd), 1,
                                                         nullptr, d, int64_t(h) * d}));
      keep.push_back(std::move(kd));
      keep.push_back(std::move(vd));
    }
    if (rows.size() == 0) {
      return absl::FailedPreconditionError(absl::StrCat("session '", s.id, "' has no tokens to attend"));
    }
    KVSHADE_ASSIGN_OR_RETURN(DeviceBlock qd, UploadOn(st, qs[i].q.data(), Bf16Bytes(qs[i].q.size()), ArenaKind::kOther));
    const size_t out_n = size_t(shape.query_heads()) * d;
    KVSHADE_ASSIGN_OR_RETURN(DeviceBlock od, Alloc((out_n + shape.query_heads()) * 4, ArenaKind::kOther));
    std::vector<kernels::AttendItem> items = {rows.Item(Ptr<const bf16>(qd), Ptr<float>(od), Ptr<float>(od) + out_n)};
    const size_t wsb = backend_->AttendWorkspaceBytes(shape, items);
    KVSHADE_ASSIGN_OR_RETURN(DeviceBlock ws, Alloc(wsb, ArenaKind::kOther));
    KVSHADE_RETURN_IF_ERROR(backend_->Attend(shape, 1.0f / std::sqrt(float(d)), items,
                                             kernels::Workspace{ws.data(), wsb}, st));
    std::vector<float>& o = out->outputs[i];
    std::vector<float>& lse = out->lse[i];
    o.resize(out_n);
    lse.resize(shape.query_heads());
    KVSHADE_RETURN_IF_ERROR(backend_->CopyToHost(o.data(), od.data(), out_n * 4, st));
    KVSHADE_RETURN_IF_ERROR(DownloadOn(st, lse.data(), Ptr<float>(od) + out_n, lse.size() * 4));
    out->tokens[i] = s.tokens;
  }
  }
  KVSHADE_ASSIGN_OR_RETURN(auto appended, AppendStaged(*this, t, commits));
  for (const auto& [session, tokens] : appended) {
    for (size_t i = 0; i < qs.size(); ++i) {
      if (qs[i].session.get() == session) out->tokens[i] = tokens;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::GetStaticSetResponse> EngineImpl::GetStaticSet(const Tenant& t,
                                                                  const v1::GetStaticSetRequest& r) {
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Attachment> a, sessions_.Use(t.name, r.attachment_id()));
  Session& s = *a->session;
  if (r.layer() >= static_cast<uint32_t>(s.model.layers)) {
    return absl::InvalidArgumentError(absl::StrCat("layer must be < num_layers = ", s.model.layers,
                                                   ", got ", r.layer()));
  }
  const int layer = static_cast<int>(r.layer());
  std::shared_lock lock(s.mu);
  KVSHADE_RETURN_IF_ERROR(CheckNotDamaged(s, "GetStaticSet"));
  if (s.state != SessionState::kReady) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", s.id, "' is ", SessionStateName(s.state), "; commit its ingest first"));
  }
  const int h = s.model.shape.h, d = s.model.shape.d;
  const int64_t tok = int64_t(h) * d;
  v1::GetStaticSetResponse resp;
  if (ProfileOf(s.profile.kind).all_exact()) {
    // No selection for exact sessions: every token is "tail".
    std::vector<bf16> hk, hv;
    size_t total = 0;
    for (const auto& seg : s.chain) total += seg->data(layer).n_tail;
    if (s.open) total += s.open->layers[layer].n_tail;
    if (Bf16Bytes(total * tok) * 2 > config_->limits.max_message_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the exact session's ", total, " tokens do not fit one response (max_message_bytes = ",
          config_->limits.max_message_bytes, "); use Attend"));
    }
    auto add = [&](const Segment& seg, const LayerData& p) -> absl::Status {
      for (int i = 0; i < p.n_tail; ++i) resp.add_tail_positions(seg.first_position + i);
      const size_t n = size_t(p.n_tail) * tok;
      const size_t at = hk.size();
      hk.resize(at + n);
      hv.resize(at + n);
      KVSHADE_RETURN_IF_ERROR(Download(hk.data() + at, p.tk.data(), Bf16Bytes(n)));
      return Download(hv.data() + at, p.tv.data(), Bf16Bytes(n));
    };
    for (const auto& seg : s.chain) KVSHADE_RETURN_IF_ERROR(add(*seg, seg->data(layer)));
    if (s.open) KVSHADE_RETURN_IF_ERROR(add(*s.open, s.open->layers[layer]));
    EncodeBf16({}, {h, 0, d}, resp.mutable_k());
    EncodeBf16({}, {h, 0, d}, resp.mutable_v());
    for (int hh = 0; hh < h; ++hh) resp.add_lengths(0);
    EncodeBf16(hk, {int64_t(hk.size() / tok), h, d}, resp.mutable_tail_k());
    EncodeBf16(hv, {int64_t(hv.size() / tok), h, d}, resp.mutable_tail_v());
    return resp;
  }
  KVSHADE_ASSIGN_OR_RETURN(const StaticCache* c, GetCache(s, layer, /*host_rows=*/true));
  if (Bf16Bytes(c->host_k.size() + c->host_tk.size()) * 2 > config_->limits.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the static set does not fit one response (max_message_bytes = ",
        config_->limits.max_message_bytes, ")"));
  }
  EncodeBf16(c->host_k, {h, c->s, d}, resp.mutable_k());
  EncodeBf16(c->host_v, {h, c->s, d}, resp.mutable_v());
  for (int32_t len : c->host_lengths) resp.add_lengths(static_cast<uint32_t>(len));
  EncodeBf16(c->host_tk, {c->t, h, d}, resp.mutable_tail_k());
  EncodeBf16(c->host_tv, {c->t, h, d}, resp.mutable_tail_v());
  resp.mutable_positions()->Add(c->host_pos.begin(), c->host_pos.end());
  resp.mutable_tail_positions()->Add(c->host_tail_pos.begin(), c->host_tail_pos.end());
  return resp;
}

absl::StatusOr<uint64_t> EngineImpl::CommitStaged(const Tenant& t, std::string_view attachment_id,
                                                  int32_t token_id, bool discard) {
  if (!discard) KVSHADE_RETURN_IF_ERROR(CheckNotDraining("CommitStaged"));
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Attachment> a, sessions_.Use(t.name, std::string(attachment_id)));
  Session& s = *a->session;
  KVSHADE_RETURN_IF_ERROR(sessions_.CheckWriter(t.name, s, a->id));
  StagedCommit c{&s, a->id, token_id, 0, {}, {}};
  {
    // a->mu alone: the session's lock is taken after it is released (decode calls take the
    // session's lock first, then the attachment's).
    std::lock_guard<std::mutex> lock(a->mu);
    Attachment::StagedToken& sg = a->staged;
    if (sg.layers == 0 || sg.token_id != token_id) {
      return absl::FailedPreconditionError(absl::StrCat(
          "attachment '", a->id, "' has no staged token ", token_id,
          sg.layers == 0 ? std::string(" (nothing is staged)")
                         : absl::StrCat(" (token ", sg.token_id, " is)")));
    }
    const int L = s.model.layers;
    if (!discard && sg.layers < L) {
      std::vector<int> missing;
      for (int l = 0; l < L; ++l) {
        if (sg.k[l].empty()) missing.push_back(l);
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "staged token ", token_id, " lacks layers [",
          absl::StrJoin(missing.begin(), missing.begin() + std::min<size_t>(missing.size(), 16), ", "),
          missing.size() > 16 ? ", ..." : "", "] of ", L, "; stage them first"));
    }
    if (!discard) {
      c.at_tokens = sg.at_tokens;
      c.k = std::move(sg.k);
      c.v = std::move(sg.v);
    }
    sg = Attachment::StagedToken{};
  }
  if (discard) {
    std::shared_lock slock(s.mu);
    return s.tokens;
  }
  std::vector<StagedCommit> commits;
  commits.push_back(std::move(c));
  KVSHADE_ASSIGN_OR_RETURN(auto appended, AppendStaged(*this, t, commits));
  return appended[0].second;
}

}  // namespace kvshade::service
