// Session lifecycle: CreateSession (prefix reuse), LookupPrefix, ForkSession, GetSession,
// ListSessions, CloseSession.
#include "kvshade/service/engine.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <numeric>
#include <tuple>

#include <spdlog/spdlog.h>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine_impl.h"
#include "profile.h"
#include "status_util.h"
#include "kvshade/service/log.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {

// ---------------------------------------------------------------------------------------
// Sessions

// A shard's tensor-parallel side (SessionInfo, CreateSessionResponse, ForkSessionResponse).
static void FillShardInfo(const Session& s, v1::TensorParallelInfo* out) {
  out->set_session_id(s.tp->logical_id);
  out->set_ranks(static_cast<uint32_t>(s.tp->ranks));
  out->set_rank(static_cast<uint32_t>(s.tp->rank));
  out->set_kv_head_begin(static_cast<uint32_t>(s.model.tp_kv_begin));
  out->set_kv_head_end(static_cast<uint32_t>(s.model.tp_kv_end));
  out->set_num_kv_heads(static_cast<uint32_t>(s.model.tp_kv_heads));
  out->set_num_query_heads(static_cast<uint32_t>(s.model.tp_kv_heads * s.model.shape.g));
}

// The refusal of a call that a shard takes only through its logical session.
static absl::Status ShardRefused(const Session& s, std::string_view call) {
  return absl::FailedPreconditionError(absl::StrCat(
      "session '", s.id, "' is rank ", s.tp->rank, "'s shard of tensor-parallel session '",
      s.tp->logical_id, "': ", std::string(call), " the logical session (every rank together)"));
}

void ReleaseClosedSession(Session& s) {
  std::vector<std::shared_ptr<const Segment>> chain;
  std::shared_ptr<Segment> open;
  std::vector<storage::SegmentRef> refs;
  std::vector<std::shared_ptr<const Segment>> quarantined;
  {
    std::unique_lock lock(s.mu);
    s.state = SessionState::kClosed;
    quarantined.swap(s.quarantined);
    chain.swap(s.chain);
    open.swap(s.open);
    refs.swap(s.prefix_refs);
    s.tail.clear();
    s.cache.clear();
    s.refactor_keys.clear();
  }
  // Freed here, outside the session's lock (prefix references first, as before).
  refs.clear();
  chain.clear();
  quarantined.clear();
  open.reset();
}

// Segment ends (docs/DESIGN.md "Segment ends"): a multiple of both the prefix index's
// block (a segment registers only from a block boundary, and its key is its last whole
// block's) and the chunk size.
static int64_t SegmentEndAlignment(const ProfileInfo& p) {
  return std::lcm<int64_t>(storage::kDefaultPrefixBlockTokens, std::max<int64_t>(p.chunk_size, 1));
}

// The fewest tokens of a segment that a segment end closes (the profile's: a shadow
// segment before another one has chunks of its own).
static int64_t MinClosedSegment(const ProfileInfo& p) {
  return ProfileOf(p.kind).MinClosedSegment(p);
}

// The request's segment_ends against the prompt alone (before the prefix lookup): refused
// with INVALID_ARGUMENT naming the rule.
static absl::Status CheckSegmentEnds(const google::protobuf::RepeatedField<uint64_t>& ends,
                                     size_t n_tokens, const ProfileInfo& p) {
  if (ends.size() > kMaxSegmentEnds) {
    return absl::InvalidArgumentError(absl::StrCat(
        "segment_ends holds at most ", kMaxSegmentEnds, " positions (a session holds at most ",
        kMaxSegmentEnds + 1, " segments of its prompt), got ", ends.size()));
  }
  const int64_t align = SegmentEndAlignment(p);
  const int64_t min_len = MinClosedSegment(p);
  uint64_t prev = 0;
  for (int i = 0; i < ends.size(); ++i) {
    const uint64_t e = ends[i];
    if (e == 0 || e >= n_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "segment_ends[", i, "] = ", e, " must be inside (0, ", n_tokens,
          "): a segment end cuts the prompt of ", n_tokens, " tokens"));
    }
    if (i > 0 && e <= prev) {
      return absl::InvalidArgumentError(absl::StrCat(
          "segment_ends must be strictly increasing: segment_ends[", i, "] = ", e,
          " follows ", prev));
    }
    if (int64_t(e) % align != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "segment_ends[", i, "] = ", e, " must be a multiple of ", align,
          " (of the prefix index's block of ", storage::kDefaultPrefixBlockTokens,
          " tokens and of chunk_size ", p.chunk_size, ")"));
    }
    if (int64_t(e - prev) < min_len) {
      return absl::InvalidArgumentError(absl::StrCat(
          "segment_ends[", i, "] = ", e, " closes a segment of ", e - prev,
          " tokens; a shadow segment before a segment end needs at least local_window + "
          "chunk_size = ", min_len));
    }
    prev = e;
  }
  return absl::OkStatus();
}

// The segment ends a session's ingest uses, past the reused prefix: the requested ones that
// still cut the new tokens (those at or before reused_tokens are already segment ends; one
// that would close a too-short first segment after the prefix is dropped), plus the
// automatic end where the prefix match stopped inside a cached segment, within the cap of
// kMaxSegmentEnds + 1 segments of the prompt (the first ends are kept).
struct SegmentEndPlan {
  std::vector<uint64_t> ends;
  uint64_t automatic = 0;  // 0: none
  uint64_t hinted = 0;     // requested ends kept
};
static SegmentEndPlan PlanSegmentEnds(const google::protobuf::RepeatedField<uint64_t>& requested,
                                      const ProfileInfo& p, size_t n_tokens,
                                      uint64_t reused_tokens, size_t reused_segments,
                                      int64_t partial_tokens) {
  SegmentEndPlan plan;
  const int64_t min_len = MinClosedSegment(p);
  std::vector<uint64_t> hinted;
  uint64_t prev = reused_tokens;
  for (uint64_t e : requested) {
    if (e <= reused_tokens || int64_t(e - prev) < min_len) continue;
    hinted.push_back(e);
    prev = e;
  }
  std::vector<uint64_t> ends = hinted;
  // The automatic end: at least a prefix block (and a shadow segment's minimum) past the
  // reused prefix, short of the prompt's end, and no closer to a neighbouring end than a
  // segment's minimum.
  const int64_t align = SegmentEndAlignment(p);
  const int64_t a = partial_tokens / align * align;
  const int64_t auto_min = std::max<int64_t>(storage::kDefaultPrefixBlockTokens, min_len);
  if (a - int64_t(reused_tokens) >= auto_min && a < int64_t(n_tokens) &&
      std::find(ends.begin(), ends.end(), uint64_t(a)) == ends.end()) {
    auto at = std::lower_bound(ends.begin(), ends.end(), uint64_t(a));
    const uint64_t before = at == ends.begin() ? reused_tokens : *(at - 1);
    const bool fits = a - int64_t(before) >= min_len && (at == ends.end() || int64_t(*at) - a >= min_len);
    if (fits) {
      ends.insert(at, uint64_t(a));
      plan.automatic = uint64_t(a);
    }
  }
  // Room under the cap: the reused segments and the ingested ones together.
  const size_t room = size_t(kMaxSegmentEnds) + 1 - std::min<size_t>(reused_segments, kMaxSegmentEnds);
  if (ends.size() + 1 > room) ends.resize(room - 1);
  if (plan.automatic && std::find(ends.begin(), ends.end(), plan.automatic) == ends.end()) {
    plan.automatic = 0;
  }
  for (uint64_t e : ends) plan.hinted += std::find(hinted.begin(), hinted.end(), e) != hinted.end();
  plan.ends = std::move(ends);
  return plan;
}

absl::StatusOr<v1::CreateSessionResponse> EngineImpl::CreateSession(
    const Tenant& t, const v1::CreateSessionRequest& r) {
  KVSHADE_RETURN_IF_ERROR(CheckNotDraining("CreateSession"));
  if (!r.has_model()) return absl::InvalidArgumentError("model is required");
  KVSHADE_ASSIGN_OR_RETURN(ModelInfo model, ResolveModel(r.model(), config_->limits));
  std::optional<TensorParallelMembership> tp;
  if (r.has_tensor_parallel()) {
    if (r.tensor_parallel().session_id().empty()) {
      return absl::InvalidArgumentError(
          "tensor_parallel.session_id must name the logical session the shard belongs to");
    }
    KVSHADE_ASSIGN_OR_RETURN(model, SliceModel(model, r.tensor_parallel()));
    tp = TensorParallelMembership{r.tensor_parallel().session_id(),
                                  static_cast<int>(r.tensor_parallel().ranks()),
                                  static_cast<int>(r.tensor_parallel().rank())};
  }
  if (r.token_ids().empty()) {
    return absl::InvalidArgumentError("token_ids must not be empty (the prompt to cache)");
  }
  const absl::Span<const int32_t> tokens(r.token_ids().data(), r.token_ids().size());
  KVSHADE_RETURN_IF_ERROR(ValidateTokens(tokens, 0, config_->limits, "token_ids"));
  if (r.label().size() > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("label must be <= 256 bytes, got ", r.label().size()));
  }
  KVSHADE_ASSIGN_OR_RETURN(ProfileInfo profile,
                           ResolveProfile(r.profile(), config_->profile, model, tokens.size()));
  // Selection units need the backend's kernels for them (the CUDA backend refuses them
  // until it has them): refused here rather than at the first select.
  if (absl::Status st = decode::CheckUnitsSupported(*backend_, model.shape, profile.Policy(),
                                                     profile.chunk_size, model.rope);
      !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("profile.selection_unit = ", profile.selection_unit,
                                                " is not available on the ", std::string(backend_->name()),
                                                " backend: ", st.message()));
  }
  KVSHADE_RETURN_IF_ERROR(CheckSegmentEnds(r.segment_ends(), tokens.size(), profile));
  if (!v1::AppendFsync_IsValid(r.append_fsync())) {
    return absl::InvalidArgumentError(
        absl::StrCat("append_fsync must be one of UNSPECIFIED, NO, EVERYSEC, ALWAYS, got ",
                     static_cast<int>(r.append_fsync())));
  }
  if (r.durable() && !spill_) {
    return absl::FailedPreconditionError(
        "durable sessions need a spill tier, and this server has none (spill_path is empty)");
  }

  auto s = std::make_shared<Session>();
  s->id = SessionManager::NewId(options_.device_index);
  s->tenant = t.name;
  s->model = model;
  s->tp = tp;
  s->profile = profile;
  s->durable = r.durable();
  s->append_fsync = ResolveAppendFsync(s->durable, r.append_fsync());
  s->label = r.label();
  s->prompt.assign(tokens.begin(), tokens.end());
  s->created_unix_ms = sessions_.Now();
  s->tail.resize(model.layers);
  s->cache.resize(model.layers);
  s->captured_energy.assign(model.layers, 0.0);
  s->residual_energy.assign(model.layers, 0.0);
  s->drift.assign(model.layers, 0.0);

  // Prefix reuse: shadow and exact segments are content-addressed; mini keeps per-prompt
  // budgets (fractions of the prompt length), so its segments are not reusable by others.
  const ProfileStrategy& strategy = ProfileOf(profile.kind);
  std::optional<PrefixStop> reuse_stop;  // no lookup for mini
  SegmentEndPlan ends;                   // none for mini: its segments are not cached
  if (strategy.reusable()) {
    KVSHADE_ASSIGN_OR_RETURN(storage::PrefixHasher hasher, Hasher(t, model, profile));
    ReuseMatch m = FindReusable(hasher, tokens, s->durable, /*page_in=*/true);
    ++prefix_lookups_;
    if (m.tokens > 0) ++prefix_hits_;
    sessions_.CountPrefixLookup(t.name, m.tokens > 0);
    metrics_->PrefixLookup(m.stop, tokens.size(), m.tokens, m.chain.size() - m.paged_in,
                           m.paged_in);
    reuse_stop = m.stop;
    ends = PlanSegmentEnds(r.segment_ends(), profile, tokens.size(), m.tokens, m.chain.size(),
                           m.partial_tokens);
    s->segment_ends = ends.ends;
    s->chain = std::move(m.chain);
    s->prefix_refs = std::move(m.refs);
    s->reused_tokens = m.tokens;
  }
  // The profile's own checks (shadow: a prompt long enough to chunk; mini: its pyramid).
  KVSHADE_RETURN_IF_ERROR(strategy.CheckSession(model, profile, s->reused_tokens, tokens.size()));
  s->tokens = s->reused_tokens;
  if (s->reused_tokens == tokens.size()) s->state = SessionState::kReady;
  KVSHADE_RETURN_IF_ERROR(sessions_.AddSession(s));
  if (!ends.ends.empty()) metrics_->PrefixSplits(ends.hinted, ends.automatic != 0);
  if (s->state == SessionState::kReady && s->durable) {
    std::unique_lock lock(s->mu);
    if (absl::Status st = PersistSession(*s); !st.ok()) {
      lock.unlock();
      sessions_.RemoveSession(t.name, s->id).IgnoreError();
      return st;
    }
  }
  UpdateGauges();

  v1::CreateSessionResponse resp;
  resp.set_session_id(s->id);
  resp.set_device(device_name());
  resp.set_reused_tokens(s->reused_tokens);
  resp.set_effective_profile(profile.kind);
  resp.set_tokens_to_ingest(tokens.size() - s->reused_tokens);
  for (uint64_t e : s->segment_ends) resp.add_segment_ends(e);
  resp.set_automatic_segment_end(ends.automatic);
  if (s->tp) FillShardInfo(*s, resp.mutable_tensor_parallel());
  log::Event(spdlog::level::info, "session_created")
      .Str("session", s->id)
      .Str("tenant", t.name)
      .Str("model", model.model_id)
      .Str("profile", v1::ProfileKind_Name(profile.kind))
      .Uint("tokens", tokens.size())
      .Uint("reused_tokens", s->reused_tokens)
      .Str("reuse_stop", reuse_stop ? PrefixStopName(*reuse_stop) : "none")
      .Str("segment_ends", absl::StrJoin(s->segment_ends, ","))
      .Bool("durable", s->durable);
  return resp;
}

absl::StatusOr<v1::LookupPrefixResponse> EngineImpl::LookupPrefix(
    const Tenant& t, const v1::LookupPrefixRequest& r) {
  if (!r.has_model()) return absl::InvalidArgumentError("model is required");
  KVSHADE_ASSIGN_OR_RETURN(ModelInfo model, ResolveModel(r.model(), config_->limits));
  if (r.has_tensor_parallel()) {
    KVSHADE_ASSIGN_OR_RETURN(model, SliceModel(model, r.tensor_parallel()));
  }
  const absl::Span<const int32_t> tokens(r.token_ids().data(), r.token_ids().size());
  KVSHADE_RETURN_IF_ERROR(ValidateTokens(tokens, 0, config_->limits, "token_ids"));
  KVSHADE_ASSIGN_OR_RETURN(ProfileInfo profile,
                           ResolveProfile(r.profile(), config_->profile, model, tokens.size()));
  v1::LookupPrefixResponse resp;
  if (!ProfileOf(profile.kind).reusable() || tokens.empty()) return resp;
  KVSHADE_ASSIGN_OR_RETURN(storage::PrefixHasher hasher, Hasher(t, model, profile));
  ReuseMatch m = FindReusable(hasher, tokens, /*need_durable=*/false, /*page_in=*/false);
  ++prefix_lookups_;
  if (m.tokens > 0) ++prefix_hits_;
  sessions_.CountPrefixLookup(t.name, m.tokens > 0);
  metrics_->PrefixProbe(m.tokens > 0);
  resp.set_reusable_tokens(m.tokens);
  resp.set_cached_segments(m.chain.size());
  return resp;
}

absl::StatusOr<v1::ForkSessionResponse> EngineImpl::ForkSession(const Tenant& t,
                                                                const v1::ForkSessionRequest& r,
                                                                const std::string* logical_id) {
  KVSHADE_RETURN_IF_ERROR(CheckNotDraining("ForkSession"));
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Session> parent,
                           sessions_.FindSession(t.name, r.parent_session_id()));
  KVSHADE_RETURN_IF_ERROR(CheckNotDamaged(*parent, "ForkSession"));
  if (parent->tp && logical_id == nullptr) return ShardRefused(*parent, "fork");
  if (!parent->tp && logical_id != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", parent->id, "' is not a tensor-parallel shard"));
  }
  auto child = std::make_shared<Session>();
  {
    std::unique_lock lock(parent->mu);
    if (parent->state != SessionState::kReady) {
      return absl::FailedPreconditionError(
          absl::StrCat("session '", parent->id, "' is ", SessionStateName(parent->state),
                       "; only a ready session can be forked"));
    }
    const uint64_t at = r.at_token();
    std::vector<uint64_t> bounds;
    uint64_t pos = 0;
    for (const auto& seg : parent->chain) {
      pos += seg->n_tokens;
      bounds.push_back(pos);
    }
    size_t keep = parent->chain.size();
    const bool at_end = at == parent->tokens;
    if (!at_end) {
      auto it = std::find(bounds.begin(), bounds.end(), at);
      if (at == 0 || it == bounds.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "at_token must be a committed segment boundary (one of [", absl::StrJoin(bounds, ", "),
            "]) or the end of the committed tokens (", parent->tokens, "), got ", at));
      }
      keep = size_t(it - bounds.begin()) + 1;
    } else {
      // Everything the parent has: its open segment is sealed so that both share it, merged
      // with the parent's sealed appended segments as far as it takes to leave room for a
      // later open segment in the kernels' view (append.cc "Compaction"). Only a chain of
      // more segments that cannot merge than a session gets today (a durable session of a
      // version that reused 6 cached segments) has no such room.
      if (parent->open && parent->open->layers[0].n_chunks > 0 && !PlanCompaction(*parent).fits) {
        return absl::FailedPreconditionError(absl::StrCat(
            "forking session '", parent->id, "' at its end would give it more than ",
            kernels::kMaxSegments, " segments: it holds ", PlanCompaction(*parent).fixed,
            " segments that cannot merge (cached prefixes and its own ingested segment); fork "
            "at a segment boundary or create a new session over the whole token list (its "
            "cached prefix is reused)"));
      }
      KVSHADE_RETURN_IF_ERROR(SealOpen(*parent));
      // A durable parent whose seal merged segments names them in its record: the record is
      // written again (naming the merged one) before they may go.
      if (!parent->retired.empty()) KVSHADE_RETURN_IF_ERROR(PersistSession(*parent));
      keep = parent->chain.size();
      child->tail = parent->tail;
      child->appended_tokens = parent->appended_tokens;
    }
    child->id = SessionManager::NewId(options_.device_index);
    child->tenant = t.name;
    child->model = parent->model;
    if (logical_id) {
      child->tp = TensorParallelMembership{*logical_id, parent->tp->ranks, parent->tp->rank};
    }
    child->profile = parent->profile;
    child->durable = parent->durable;
    child->append_fsync = parent->append_fsync;
    child->label = parent->label;
    child->prompt.assign(parent->prompt.begin(),
                         parent->prompt.begin() + std::min<size_t>(at, parent->prompt.size()));
    child->created_unix_ms = sessions_.Now();
    child->chain.assign(parent->chain.begin(), parent->chain.begin() + keep);
    child->tokens = at;
    child->reused_tokens = at;
    child->state = SessionState::kReady;
    if (child->tail.empty()) child->tail.resize(child->model.layers);
    child->cache.resize(child->model.layers);
    child->captured_energy = parent->captured_energy;
    child->residual_energy = parent->residual_energy;
    child->drift.assign(child->model.layers, 0.0);
  }
  for (const auto& seg : child->chain) {
    if (!seg->prefix_key) continue;
    auto ref = prefix_.Acquire(seg->id);
    if (ref.ok()) child->prefix_refs.push_back(std::move(ref).value());
  }
  KVSHADE_RETURN_IF_ERROR(sessions_.AddSession(child));
  if (child->durable) {
    std::unique_lock lock(child->mu);
    if (absl::Status st = PersistSession(*child); !st.ok()) {
      lock.unlock();
      sessions_.RemoveSession(t.name, child->id).IgnoreError();
      return st;
    }
  }
  UpdateGauges();
  v1::ForkSessionResponse resp;
  resp.set_session_id(child->id);
  resp.set_shared_tokens(child->tokens);
  if (child->tp) FillShardInfo(*child, resp.mutable_tensor_parallel());
  log::Event(spdlog::level::info, "session_forked")
      .Str("session", child->id)
      .Str("parent", r.parent_session_id())
      .Str("tenant", t.name)
      .Uint("shared_tokens", child->tokens);
  return resp;
}

absl::StatusOr<v1::SessionInfo> EngineImpl::GetSession(const Tenant& t,
                                                       const v1::GetSessionRequest& r) {
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, sessions_.FindSession(t.name, r.session_id()));
  v1::SessionInfo info;
  const int attachments = sessions_.AttachmentCount(*s);
  std::shared_lock lock(s->mu);
  info.set_session_id(s->id);
  info.set_model_id(s->model.model_id);
  info.set_profile(s->profile.kind);
  info.set_tokens(s->tokens);
  info.set_reused_tokens(s->reused_tokens);
  info.set_attachments(static_cast<uint32_t>(attachments));
  info.set_durable(s->durable);
  info.set_append_fsync(s->append_fsync);
  info.set_state(std::string(SessionStateName(s->state)));
  if (s->damaged.load()) {
    std::lock_guard<std::mutex> damage_lock(s->damage_mu);
    info.set_state("damaged");
    info.set_damaged(true);
    info.set_damage(s->damage);
    info.set_tokens_lost(s->tokens_lost);
  }
  // Its own segments: those past the prefix it reused from the cache (its own ingest's are
  // registered as prefixes too, and still its own).
  uint64_t gpu = 0, host = 0, pos = 0;
  for (const auto& seg : s->chain) {
    pos += seg->n_tokens;
    if (seg->prefix_key && pos <= s->reused_tokens) continue;  // reused: another's
    gpu += seg->DeviceBytes();
    host += seg->HostBytes();
  }
  if (s->open) {
    gpu += s->open->DeviceBytes();
    host += s->open->HostBytes();
  }
  info.set_gpu_bytes(gpu);
  info.set_host_bytes(host);
  info.set_label(s->label);
  info.set_layers_ingested(s->state == SessionState::kReady ? s->model.layers
                                                            : s->layers_ingested.load());
  info.set_ingest_parts_taken(s->ingest_parts_taken.load());
  info.set_value_codec(CodecToProto(s->profile.codec.codec));
  info.set_selection_unit(static_cast<uint32_t>(s->profile.selection_unit));
  info.set_device(device_name());
  if (s->tp) FillShardInfo(*s, info.mutable_tensor_parallel());
  if (r.include_selection()) FillSelectionHealth(s->selection, info.mutable_selection());
  return info;
}

absl::StatusOr<v1::ListSessionsResponse> EngineImpl::ListSessions(const Tenant& t) {
  SessionManager::UntouchedScope listing;  // listing keeps no session from idle expiry
  v1::ListSessionsResponse resp;
  for (const auto& s : sessions_.ListSessions(t.name)) {
    v1::GetSessionRequest req;
    req.set_session_id(s->id);
    auto info = GetSession(t, req);
    if (info.ok()) *resp.add_sessions() = std::move(info).value();
  }
  return resp;
}

absl::StatusOr<v1::CloseSessionResponse> EngineImpl::CloseSession(
    const Tenant& t, const v1::CloseSessionRequest& r, bool shard_ok) {
  if (!shard_ok) {
    auto found = sessions_.FindSession(t.name, r.session_id());
    if (found.ok() && (*found)->tp) return ShardRefused(**found, "close");
  }
  // A durable session's record goes first, while the session is still registered: when the
  // delete fails (a storage fault), the close answers its error and the session stays as
  // it was, so that a restart never brings back a session whose close was acknowledged.
  if (spill_) {
    auto found = sessions_.FindSession(t.name, r.session_id());
    if (found.ok() && (*found)->durable) {
      Session& d = **found;
      std::unique_lock lock(d.mu);
      if (d.state != SessionState::kClosed) {
        if (absl::Status st = DeleteDurableRecord(d); !st.ok()) {
          return absl::Status(st.code(), absl::StrCat("CloseSession: session '", d.id,
                                                      "' is durable and its record could not be "
                                                      "deleted; it stays open (retry the close): ",
                                                      st.message()));
        }
        // Nothing writes its record again (appends, commits and refactorizations check it).
        d.state = SessionState::kClosed;
      }
    }
  }
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Session> s,
                           sessions_.RemoveSession(t.name, r.session_id()));
  ReleaseClosedSession(*s);
  UpdateGauges();
  log::Event(spdlog::level::info, "session_closed").Str("session", s->id).Str("tenant", t.name);
  return v1::CloseSessionResponse();
}

// ---------------------------------------------------------------------------------------
// Tensor-parallel shards (docs/DESIGN.md "Tensor-parallel sessions"; DeviceRouter keeps the
// logical sessions)

std::vector<Engine::ShardRecord> EngineImpl::TensorParallelShards() {
  std::vector<Engine::ShardRecord> out;
  for (const auto& s : sessions_.AllSessions()) {
    if (!s->tp) continue;
    Engine::ShardRecord r;
    r.tenant = s->tenant;
    r.session_id = s->id;
    r.logical_id = s->tp->logical_id;
    r.ranks = s->tp->ranks;
    r.rank = s->tp->rank;
    r.kv_head_begin = s->model.tp_kv_begin;
    r.kv_head_end = s->model.tp_kv_end;
    r.kv_heads = s->model.tp_kv_heads;
    r.query_heads = s->model.tp_kv_heads * s->model.shape.g;
    if (s->damaged.load()) {
      std::lock_guard<std::mutex> lock(s->damage_mu);
      r.damage = s->damage;
    }
    out.push_back(std::move(r));
  }
  return out;
}

absl::Status EngineImpl::MarkShardDamaged(const Tenant& t, const std::string& session_id,
                                          const std::string& what) {
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, sessions_.FindSession(t.name, session_id));
  if (!s->tp) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", s->id, "' is not a tensor-parallel shard"));
  }
  MarkDamaged(*s, "tensor_parallel", what, 0, /*persist=*/false);
  return absl::OkStatus();
}

}  // namespace kvshade::service
