// Tensor-parallel sessions (docs/DESIGN.md "Tensor-parallel sessions"): DeviceRouter's
// logical sessions, each of R ranks' shards, one engine session per rank on the rank's
// device holding a contiguous range of the model's KV heads (device_router.h).
//
// The engines know a shard by its membership (Session::tp: the logical id, ranks, rank;
// its ModelInfo is the slice) and keep it in its durable record; the router keeps, per
// logical session, which shard each rank has and checks that the ranks' ranges tile the
// heads and that every rank sends the same prompt. A logical session is rebuilt at Open
// from the shards the engines restored.
#include <algorithm>
#include <limits>

#include <spdlog/spdlog.h>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/service/device_router.h"
#include "kvshade/service/log.h"
#include "kvshade/service/model.h"
#include "kvshade/service/session_manager.h"
#include "status_util.h"

namespace kvshade::service {
namespace {

DeviceRouter::TpCommon CommonOf(const v1::CreateSessionRequest& r) {
  DeviceRouter::TpCommon c;
  c.model = r.model().SerializeAsString();
  c.profile = r.profile().SerializeAsString();
  c.label = r.label();
  c.tokens = static_cast<size_t>(r.token_ids().size());
  c.tokens_hash = absl::HashOf(absl::MakeConstSpan(r.token_ids().data(), r.token_ids().size()));
  c.durable = r.durable();
  c.append_fsync = static_cast<int>(r.append_fsync());
  c.segment_ends.assign(r.segment_ends().begin(), r.segment_ends().end());
  return c;
}

// The first field in which a joining rank's request differs from the logical session's
// (empty: none).
std::string CommonDiff(const DeviceRouter::TpCommon& a, const DeviceRouter::TpCommon& b) {
  if (a.model != b.model) return "model";
  if (a.profile != b.profile) return "profile";
  if (a.tokens != b.tokens || a.tokens_hash != b.tokens_hash) return "token_ids";
  if (a.durable != b.durable) return "durable";
  if (a.append_fsync != b.append_fsync) return "append_fsync";
  if (a.label != b.label) return "label";
  if (a.segment_ends != b.segment_ends) return "segment_ends";
  return "";
}

std::string Range(uint32_t b, uint32_t e) { return absl::StrCat("[", b, ", ", e, ")"); }

}  // namespace

std::optional<DeviceRouter::TpGroup> DeviceRouter::FindGroup(const Tenant& t,
                                                             const std::string& id) const {
  base::MutexLock lock(&tp_mu_);
  auto it = tp_groups_.find(id);
  if (it == tp_groups_.end() || it->second->tenant != t.name) return std::nullopt;
  return *it->second;
}

absl::Status DeviceRouter::CheckNotLogical(const Tenant& t, std::string_view id,
                                           std::string_view call) const {
  base::MutexLock lock(&tp_mu_);
  if (tp_groups_.empty()) return absl::OkStatus();
  auto it = tp_groups_.find(std::string(id));
  if (it == tp_groups_.end() || it->second->tenant != t.name) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "session '", BoundedId(absl::string_view(id.data(), id.size())), "' is a tensor-parallel session of ", it->second->ranks,
      " ranks: each rank calls ", std::string(call),
      " with its own shard's session id (CreateSessionResponse.session_id, or "
      "SessionInfo.tensor_parallel.shards)"));
}

absl::StatusOr<v1::CreateSessionResponse> DeviceRouter::CreateTensorParallel(
    const Tenant& t, const v1::CreateSessionRequest& r) {
  const v1::TensorParallel& tp = r.tensor_parallel();
  KVSHADE_ASSIGN_OR_RETURN(const int device, Resolve(r.device()));
  if (!r.has_model()) return absl::InvalidArgumentError("model is required");
  // What one request can check (the engine checks again, and the rest of the request).
  KVSHADE_ASSIGN_OR_RETURN(ModelInfo whole,
                           ResolveModel(r.model(), devices_[device].config->limits));
  KVSHADE_RETURN_IF_ERROR(SliceModel(whole, tp).status());
  KVSHADE_RETURN_IF_ERROR(CheckIdLength(tp.session_id(), "tensor_parallel.session_id"));
  const uint32_t rank = tp.rank(), b = tp.kv_head_begin(), e = tp.kv_head_end();
  TpCommon common = CommonOf(r);

  // Reserve the rank (checked against the ranks that joined or are joining).
  std::string id;
  bool created_group = false;
  {
    base::MutexLock lock(&tp_mu_);
    std::shared_ptr<TpGroup> g;
    if (tp.session_id().empty()) {
      g = std::make_shared<TpGroup>();
      g->id = SessionManager::NewId();
      g->tenant = t.name;
      g->ranks = tp.ranks();
      g->kv_heads = r.model().num_kv_heads();
      g->query_heads = r.model().num_query_heads();
      g->common = common;
      g->rank.resize(tp.ranks());
      created_group = true;
    } else {
      auto it = tp_groups_.find(tp.session_id());
      if (it == tp_groups_.end() || it->second->tenant != t.name) {
        return absl::NotFoundError(absl::StrCat("tensor-parallel session '",
                                                BoundedId(tp.session_id()), "' not found"));
      }
      g = it->second;
      if (!g->damage.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tensor-parallel session '", g->id, "' is damaged (", g->damage,
            "): no rank joins it; close it"));
      }
      if (g->closing) {
        return absl::FailedPreconditionError(
            absl::StrCat("tensor-parallel session '", g->id, "' is being closed"));
      }
      if (tp.ranks() != g->ranks) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor_parallel.ranks = ", tp.ranks(), ", and tensor-parallel session '", g->id,
            "' has ", g->ranks, " ranks"));
      }
      if (!g->common) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tensor-parallel session '", g->id, "' has all its ranks (it was forked or restored)"));
      }
      if (const std::string diff = CommonDiff(*g->common, common); !diff.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            diff, " differs from the one rank(s) of tensor-parallel session '", g->id,
            "' sent: every rank sends the same model, profile, token_ids, durable, "
            "append_fsync, label and segment_ends"));
      }
      const TpRank& mine = g->rank[rank];
      if (!mine.session_id.empty() || mine.joining) {
        return absl::FailedPreconditionError(absl::StrCat(
            "rank ", rank, " of tensor-parallel session '", g->id, "' has already joined",
            mine.session_id.empty() ? " (its create is under way)"
                                    : absl::StrCat(" (shard '", mine.session_id, "')")));
      }
      // The ranges tile the heads in rank order: a joined rank j < rank ends at or before
      // b, with a head for each rank between them; j > rank begins at or after e, alike;
      // adjacent ranks meet.
      for (uint32_t j = 0; j < g->ranks; ++j) {
        const TpRank& o = g->rank[j];
        if (j == rank || (o.session_id.empty() && !o.joining)) continue;
        const std::string theirs = absl::StrCat("rank ", j, "'s KV heads ", Range(o.kv_begin, o.kv_end));
        if (j < rank) {
          if (o.kv_end > b) {
            return absl::InvalidArgumentError(absl::StrCat(
                "tensor_parallel: rank ", rank, "'s KV heads ", Range(b, e), " overlap ", theirs,
                " (or come before them): ranks hold consecutive ranges in rank order"));
          }
          if (j + 1 == rank && o.kv_end != b) {
            return absl::InvalidArgumentError(absl::StrCat(
                "tensor_parallel: rank ", rank, "'s KV heads ", Range(b, e), " leave KV heads ",
                Range(o.kv_end, b), " uncovered after ", theirs));
          }
          if (b - o.kv_end < rank - j - 1) {
            return absl::InvalidArgumentError(absl::StrCat(
                "tensor_parallel: rank ", rank, "'s KV heads ", Range(b, e), " leave the ",
                rank - j - 1, " ranks between it and ", theirs, " fewer than one KV head each"));
          }
        } else {
          if (o.kv_begin < e) {
            return absl::InvalidArgumentError(absl::StrCat(
                "tensor_parallel: rank ", rank, "'s KV heads ", Range(b, e), " overlap ", theirs,
                " (or come after them): ranks hold consecutive ranges in rank order"));
          }
          if (j == rank + 1 && o.kv_begin != e) {
            return absl::InvalidArgumentError(absl::StrCat(
                "tensor_parallel: rank ", rank, "'s KV heads ", Range(b, e), " leave KV heads ",
                Range(e, o.kv_begin), " uncovered before ", theirs));
          }
          if (o.kv_begin - e < j - rank - 1) {
            return absl::InvalidArgumentError(absl::StrCat(
                "tensor_parallel: rank ", rank, "'s KV heads ", Range(b, e), " leave the ",
                j - rank - 1, " ranks between it and ", theirs, " fewer than one KV head each"));
          }
        }
      }
    }
    TpRank& mine = g->rank[rank];
    mine.joining = true;
    mine.device = device;
    mine.kv_begin = b;
    mine.kv_end = e;
    id = g->id;
    if (created_group) tp_groups_[id] = g;
  }

  v1::CreateSessionRequest shard = r;
  shard.mutable_tensor_parallel()->set_session_id(id);
  absl::StatusOr<v1::CreateSessionResponse> resp = devices_[device].engine->CreateSession(t, shard);

  // Record the shard, or give the rank back (and a group no rank joined).
  bool closed_meanwhile = false;
  uint32_t joined = 0;
  {
    base::MutexLock lock(&tp_mu_);
    auto it = tp_groups_.find(id);
    TpGroup* g = it == tp_groups_.end() ? nullptr : it->second.get();
    if (g != nullptr) {
      TpRank& mine = g->rank[rank];
      mine.joining = false;
      if (resp.ok() && !g->closing) {
        mine.session_id = resp->session_id();
      } else {
        closed_meanwhile = resp.ok();
        mine = TpRank{};  // not joined: its range binds no other rank
      }
      bool any = false;
      for (const TpRank& x : g->rank) {
        any = any || x.joining || !x.session_id.empty();
        joined += !x.session_id.empty();
      }
      if (!any) tp_groups_.erase(it);
    } else if (resp.ok()) {
      closed_meanwhile = true;
    }
  }
  if (!resp.ok()) return resp.status();
  if (closed_meanwhile) {
    v1::CloseSessionRequest c;
    c.set_session_id(resp->session_id());
    devices_[device].engine->CloseShard(t, c).IgnoreError();
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor-parallel session '", id, "' was closed while rank ", rank, " joined it"));
  }
  resp->mutable_tensor_parallel()->set_ranks_joined(joined);
  log::Event(spdlog::level::info, "tensor_parallel_rank_joined")
      .Str("session", id)
      .Str("shard", resp->session_id())
      .Str("tenant", t.name)
      .Uint("rank", rank)
      .Uint("ranks", tp.ranks())
      .Str("kv_heads", Range(b, e))
      .Str("device", devices_[device].name);
  return resp;
}

absl::StatusOr<v1::SessionInfo> DeviceRouter::LogicalInfo(const Tenant& t, const TpGroup& g) {
  v1::SessionInfo info;
  info.set_session_id(g.id);
  v1::TensorParallelInfo* tpi = info.mutable_tensor_parallel();
  tpi->set_session_id(g.id);
  tpi->set_ranks(g.ranks);
  tpi->set_kv_head_begin(0);
  tpi->set_kv_head_end(g.kv_heads);
  tpi->set_num_kv_heads(g.kv_heads);
  tpi->set_num_query_heads(g.query_heads);
  std::vector<std::string> damage;
  if (!g.damage.empty()) damage.push_back(g.damage);
  uint64_t tokens = std::numeric_limits<uint64_t>::max(), reused = tokens;
  uint32_t layers = std::numeric_limits<uint32_t>::max();
  uint32_t joined = 0, attachments = 0;
  uint64_t gpu = 0, host = 0, parts = 0, lost = 0;
  bool any_found = false, joining = false, ingesting = false, missing = false;
  for (uint32_t r = 0; r < g.ranks; ++r) {
    const TpRank& x = g.rank[r];
    v1::TensorParallelShard* sh = tpi->add_shards();
    sh->set_rank(r);
    sh->set_session_id(x.session_id);
    sh->set_kv_head_begin(x.kv_begin);
    sh->set_kv_head_end(x.kv_end);
    if (x.device >= 0) sh->set_device(devices_[x.device].name);
    if (x.session_id.empty()) {
      sh->set_state("joining");
      joining = true;
      tokens = reused = 0;
      layers = 0;
      continue;
    }
    ++joined;
    v1::GetSessionRequest q;
    q.set_session_id(x.session_id);
    absl::StatusOr<v1::SessionInfo> s = devices_[x.device].engine->GetSession(t, q);
    if (absl::IsNotFound(s.status())) {
      sh->set_state("missing");
      missing = true;
      damage.push_back(absl::StrCat("rank ", r, "'s shard '", x.session_id, "' is gone"));
      tokens = reused = 0;
      layers = 0;
      continue;
    }
    if (!s.ok()) return s.status();
    any_found = true;
    sh->set_tokens(s->tokens());
    sh->set_reused_tokens(s->reused_tokens());
    sh->set_state(s->state());
    tokens = std::min<uint64_t>(tokens, s->tokens());
    reused = std::min<uint64_t>(reused, s->reused_tokens());
    layers = std::min<uint32_t>(layers, s->layers_ingested());
    attachments += s->attachments();
    gpu += s->gpu_bytes();
    host += s->host_bytes();
    parts += s->ingest_parts_taken();
    ingesting = ingesting || s->state() == "ingesting";
    if (s->damaged()) {
      lost = std::max<uint64_t>(lost, s->tokens_lost());
      // A shard marked for its logical session's own damage says nothing more.
      if (g.damage.empty() || s->damage().find(g.damage) == std::string::npos) {
        damage.push_back(absl::StrCat("rank ", r, ": ", s->damage()));
      }
    }
    if (r == 0 || info.model_id().empty()) {
      info.set_model_id(s->model_id());
      info.set_profile(s->profile());
      info.set_durable(s->durable());
      info.set_append_fsync(s->append_fsync());
      info.set_label(s->label());
      info.set_value_codec(s->value_codec());
      info.set_selection_unit(s->selection_unit());
    }
  }
  if (!any_found && missing && !joining) {
    return absl::NotFoundError(absl::StrCat("session '", g.id, "' not found"));
  }
  tpi->set_ranks_joined(joined);
  info.set_tokens(tokens == std::numeric_limits<uint64_t>::max() ? 0 : tokens);
  info.set_reused_tokens(reused == std::numeric_limits<uint64_t>::max() ? 0 : reused);
  info.set_layers_ingested(layers == std::numeric_limits<uint32_t>::max() ? 0 : layers);
  info.set_attachments(attachments);
  info.set_gpu_bytes(gpu);
  info.set_host_bytes(host);
  info.set_ingest_parts_taken(parts);
  if (!damage.empty()) {
    info.set_state("damaged");
    info.set_damaged(true);
    info.set_damage(absl::StrJoin(damage, "; "));
    info.set_tokens_lost(lost);
  } else {
    info.set_state(joining ? "joining" : ingesting ? "ingesting" : "ready");
  }
  return info;
}

void DeviceRouter::ForgetGoneGroup(const std::string& id) {
  base::MutexLock lock(&tp_mu_);
  auto it = tp_groups_.find(id);
  if (it == tp_groups_.end()) return;
  for (const TpRank& x : it->second->rank) {
    if (x.joining) return;  // a rank joins: not gone
  }
  tp_groups_.erase(it);
}

absl::StatusOr<v1::ForkSessionResponse> DeviceRouter::ForkLogical(const Tenant& t,
                                                                  const TpGroup& g,
                                                                  const v1::ForkSessionRequest& r) {
  if (!g.damage.empty()) {
    return absl::DataLossError(absl::StrCat("ForkSession: tensor-parallel session '", g.id,
                                            "' is damaged and not served: ", g.damage));
  }
  if (g.closing) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor-parallel session '", g.id, "' is being closed"));
  }
  // Every rank must have joined and committed at_token.
  for (uint32_t k = 0; k < g.ranks; ++k) {
    const TpRank& x = g.rank[k];
    if (x.session_id.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor-parallel session '", g.id, "': rank ", k, " has not joined; only a session "
          "every rank has joined can be forked"));
    }
    v1::GetSessionRequest q;
    q.set_session_id(x.session_id);
    KVSHADE_ASSIGN_OR_RETURN(v1::SessionInfo s, devices_[x.device].engine->GetSession(t, q));
    if (s.damaged()) {
      return absl::DataLossError(absl::StrCat("ForkSession: tensor-parallel session '", g.id,
                                              "': rank ", k, "'s shard is damaged: ", s.damage()));
    }
    if (s.state() != "ready" || s.tokens() < r.at_token()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor-parallel session '", g.id, "': rank ", k, " has committed ", s.tokens(),
          " tokens (", s.state(), "), and the fork is at token ", r.at_token(),
          ": every rank must have committed it"));
    }
  }
  auto child = std::make_shared<TpGroup>();
  child->id = SessionManager::NewId();
  child->tenant = t.name;
  child->ranks = g.ranks;
  child->kv_heads = g.kv_heads;
  child->query_heads = g.query_heads;
  child->rank = g.rank;
  uint64_t shared = 0;
  for (uint32_t k = 0; k < g.ranks; ++k) {
    v1::ForkSessionRequest f;
    f.set_parent_session_id(g.rank[k].session_id);
    f.set_at_token(r.at_token());
    absl::StatusOr<v1::ForkSessionResponse> got =
        devices_[g.rank[k].device].engine->ForkShard(t, f, child->id);
    if (!got.ok()) {
      // Nothing of the fork stays: the ranks already forked are closed.
      for (uint32_t j = 0; j < k; ++j) {
        v1::CloseSessionRequest c;
        c.set_session_id(child->rank[j].session_id);
        devices_[child->rank[j].device].engine->CloseShard(t, c).IgnoreError();
      }
      return absl::Status(got.status().code(), absl::StrCat("ForkSession: rank ", k, "'s shard: ",
                                                            got.status().message()));
    }
    child->rank[k].session_id = got->session_id();
    child->rank[k].joining = false;
    shared = got->shared_tokens();
  }
  {
    base::MutexLock lock(&tp_mu_);
    tp_groups_[child->id] = child;
  }
  v1::ForkSessionResponse resp;
  resp.set_session_id(child->id);
  resp.set_shared_tokens(shared);
  absl::StatusOr<v1::SessionInfo> info = LogicalInfo(t, *child);
  if (info.ok()) *resp.mutable_tensor_parallel() = info->tensor_parallel();
  log::Event(spdlog::level::info, "tensor_parallel_forked")
      .Str("session", child->id)
      .Str("parent", g.id)
      .Str("tenant", t.name)
      .Uint("shared_tokens", shared);
  return resp;
}

absl::StatusOr<v1::CloseSessionResponse> DeviceRouter::CloseLogical(const Tenant& t,
                                                                    const std::string& id) {
  std::vector<std::pair<uint32_t, TpRank>> shards;
  {
    base::MutexLock lock(&tp_mu_);
    auto it = tp_groups_.find(id);
    if (it == tp_groups_.end() || it->second->tenant != t.name) {
      return absl::NotFoundError(absl::StrCat("session '", BoundedId(id), "' not found"));
    }
    it->second->closing = true;
    for (uint32_t r = 0; r < it->second->rank.size(); ++r) {  // misfits restored past ranks too
      if (!it->second->rank[r].session_id.empty()) shards.emplace_back(r, it->second->rank[r]);
    }
  }
  // Each shard in rank order; one that fails stops the close (it answers the error, the
  // shards not closed stay, and a retry closes them).
  absl::Status failed;
  for (const auto& [r, x] : shards) {
    v1::CloseSessionRequest c;
    c.set_session_id(x.session_id);
    absl::Status st = devices_[x.device].engine->CloseShard(t, c).status();
    if (!st.ok() && !absl::IsNotFound(st)) {
      failed = absl::Status(st.code(), absl::StrCat("CloseSession: tensor-parallel session '", id,
                                                    "', rank ", r, "'s shard: ", st.message()));
      break;
    }
    base::MutexLock lock(&tp_mu_);
    if (auto it = tp_groups_.find(id); it != tp_groups_.end()) it->second->rank[r].session_id.clear();
  }
  {
    base::MutexLock lock(&tp_mu_);
    if (auto it = tp_groups_.find(id); it != tp_groups_.end()) {
      bool any = false;
      for (const TpRank& x : it->second->rank) any = any || x.joining || !x.session_id.empty();
      if (!any) tp_groups_.erase(it);
    }
  }
  if (!failed.ok()) return failed;
  log::Event(spdlog::level::info, "tensor_parallel_closed").Str("session", id).Str("tenant", t.name);
  return v1::CloseSessionResponse();
}

void DeviceRouter::RestoreTensorParallel() {
  struct Found {
    Engine::ShardRecord rec;
    int device;
  };
  absl::flat_hash_map<std::string, std::vector<Found>> by_group;  // tenant + '\n' + logical id
  for (size_t d = 0; d < devices_.size(); ++d) {
    for (Engine::ShardRecord& rec : devices_[d].engine->TensorParallelShards()) {
      std::string key = absl::StrCat(rec.tenant, "\n", rec.logical_id);
      by_group[key].push_back(Found{std::move(rec), static_cast<int>(d)});
    }
  }
  base::MutexLock lock(&tp_mu_);
  for (auto& [key, found] : by_group) {
    auto g = std::make_shared<TpGroup>();
    const Engine::ShardRecord& first = found[0].rec;
    g->id = first.logical_id;
    g->tenant = first.tenant;
    g->ranks = static_cast<uint32_t>(first.ranks);
    g->kv_heads = static_cast<uint32_t>(first.kv_heads);
    g->query_heads = static_cast<uint32_t>(first.query_heads);
    g->rank.resize(g->ranks);
    std::vector<std::string> problems;
    for (const Found& f : found) {
      const Engine::ShardRecord& s = f.rec;
      if (s.ranks != first.ranks || s.kv_heads != first.kv_heads || s.rank < 0 ||
          s.rank >= first.ranks || !g->rank[s.rank].session_id.empty()) {
        problems.push_back(absl::StrCat("shard '", s.session_id, "' (rank ", s.rank, " of ", s.ranks,
                                        ") does not fit the other ranks' layout"));
        continue;
      }
      if (!s.damage.empty()) {
        problems.push_back(absl::StrCat("rank ", s.rank, "'s shard '", s.session_id, "' is damaged (",
                                        s.damage, ")"));
      }
      TpRank& x = g->rank[s.rank];
      x.session_id = s.session_id;
      x.device = f.device;
      x.kv_begin = static_cast<uint32_t>(s.kv_head_begin);
      x.kv_end = static_cast<uint32_t>(s.kv_head_end);
    }
    uint32_t expect = 0;
    for (uint32_t r = 0; r < g->ranks; ++r) {
      const TpRank& x = g->rank[r];
      if (x.session_id.empty()) {
        problems.push_back(absl::StrCat("rank ", r, "'s shard was not restored (its ingest was not "
                                        "committed before the stop, or its record was lost)"));
        continue;
      }
      if (x.kv_begin != expect) {
        problems.push_back(absl::StrCat("rank ", r, "'s KV heads ", Range(x.kv_begin, x.kv_end),
                                        " do not follow the rank before it"));
      }
      expect = x.kv_end;
    }
    if (problems.empty() && expect != g->kv_heads) {
      problems.push_back(absl::StrCat("the ranks' KV heads end at ", expect, " of ", g->kv_heads));
    }
    if (!problems.empty()) {
      g->damage = absl::StrCat("tensor-parallel session '", g->id, "' is not whole: ",
                               absl::StrJoin(problems, "; "));
      Tenant t{g->tenant, ""};
      for (const Found& f : found) {
        devices_[f.device].engine->MarkShardDamaged(t, f.rec.session_id, g->damage).IgnoreError();
      }
      spdlog::error("restore: {}; its shards are not served until it is closed", g->damage);
    }
    // The restored shards that do not fit the layout are still closed with the session.
    if (!problems.empty()) {
      for (const Found& f : found) {
        bool placed = false;
        for (const TpRank& x : g->rank) placed = placed || x.session_id == f.rec.session_id;
        if (!placed) {
          g->rank.push_back(TpRank{f.rec.session_id, false, f.device,
                                   static_cast<uint32_t>(f.rec.kv_head_begin),
                                   static_cast<uint32_t>(f.rec.kv_head_end)});
        }
      }
    }
    tp_groups_[g->id] = std::move(g);
  }
}

}  // namespace kvshade::service
