// `kvshade demo`: see demo.h. Every figure printed is measured by this process against
// the server it talks to; nothing is estimated. The client keeps a mirror of each
// attachment's slot tables (applying the SlotDelta of every step), which is how a worker
// knows what it holds and how the demo tells whether each planted needle was selected.
#include "demo.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <set>

#include "absl/strings/str_format.h"
#include "kvshade/base/stats.h"
#include "kvshade/client/tensor.h"
#include "synthetic.h"
#include "ucx_probe.h"

namespace kvshade::cli {
namespace {

using Clock = std::chrono::steady_clock;
using base::Percentile;
using synthetic::FormatBytes;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Whether the command line asked for UCX explicitly (the last of --ucx / --no-ucx given
// was --ucx; set while parsing, see AddDemoOptions). Then a fallback to gRPC fails the
// demo (exit 4); without either flag the demo uses UCX when the daemon offers it and
// reports the transport it used.
bool ucx_required = false;

// A one-line progress bar on stderr when it is a terminal; silent otherwise (the phase
// summaries on stdout are the record).
class Progress {
 public:
  Progress(std::string label, int64_t total, bool enabled)
      : label_(std::move(label)), total_(std::max<int64_t>(total, 1)),
        enabled_(enabled && isatty(STDERR_FILENO)) {
    Draw(0);
  }
  ~Progress() { Done(); }
  void Draw(int64_t done) {
    if (!enabled_) return;
    const int width = 30;
    const int fill = static_cast<int>(width * std::min<int64_t>(done, total_) / total_);
    std::fprintf(stderr, "\r  %-22s [%s%s] %3d%%", label_.c_str(), std::string(fill, '#').c_str(),
                 std::string(width - fill, '.').c_str(), static_cast<int>(100 * done / total_));
    std::fflush(stderr);
  }
  void Done() {
    if (!enabled_ || finished_) return;
    finished_ = true;
    std::fprintf(stderr, "\r%*s\r", 70, "");
    std::fflush(stderr);
  }

 private:
  std::string label_;
  int64_t total_;
  bool enabled_;
  bool finished_ = false;
};

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "kvshade demo: %s failed: %s\n", what.c_str(), s.ToString().c_str());
  return 1;
}

struct QuestionSession {
  std::string session_id;
  std::string attachment_id;
  bool forked = false;
  uint64_t reused = 0;     // tokens reused from the cache (create) or shared (fork)
  uint64_t ingested = 0;   // tokens this session sent
  double setup_seconds = 0;
  int64_t position = 0;    // position of the decode query
  // slots[layer][head] = chunk id per slot (mirror of the server's slot table)
  std::vector<std::vector<std::vector<int32_t>>> slots;
  // static_needle[layer][head]: the target needle's first key is in the static set
  std::vector<std::vector<bool>> static_needle;
};

// Exact attention of one query [hq, d] over keys/values [n, h, d] (fp32, post-RoPE).
std::vector<float> ExactAttention(const std::vector<float>& q, const std::vector<float>& k,
                                  const std::vector<float>& v, int64_t n, int h, int hq, int d) {
  const int g = hq / h;
  std::vector<float> out(static_cast<size_t>(hq) * d, 0.0f);
  std::vector<double> logit(n);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int qh = 0; qh < hq; ++qh) {
    const int hh = qh / g;
    double mx = -1e300;
    for (int64_t t = 0; t < n; ++t) {
      const float* kt = &k[(t * h + hh) * d];
      double s = 0;
      for (int c = 0; c < d; ++c) s += static_cast<double>(q[qh * d + c]) * kt[c];
      logit[t] = s * scale;
      mx = std::max(mx, logit[t]);
    }
    double z = 0;
    std::vector<double> acc(d, 0.0);
    for (int64_t t = 0; t < n; ++t) {
      const double e = std::exp(logit[t] - mx);
      z += e;
      const float* vt = &v[(t * h + hh) * d];
      for (int c = 0; c < d; ++c) acc[c] += e * vt[c];
    }
    for (int c = 0; c < d; ++c) out[qh * d + c] = static_cast<float>(acc[c] / z);
  }
  return out;
}

// Relative L2 error ||out - ref|| / ||ref|| of one query's attention output [hq, d].
double RelativeError(const std::vector<float>& out, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size() && i < out.size(); ++i) {
    const double e = static_cast<double>(out[i]) - ref[i];
    num += e * e;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Post-RoPE fp32 keys and fp32 values of positions [t0, t1) of a question's timeline.
void PostRopeKv(const synthetic::Document& doc, int layer, int question, int64_t t0, int64_t t1,
                std::vector<float>* kr, std::vector<float>* v) {
  const auto& s = doc.spec();
  const int h = s.kv_heads, d = s.head_dim;
  std::vector<uint16_t> kb, vb;
  doc.KeysValues(layer, question, t0, t1, &kb, &vb);
  const size_t base_k = kr->size();
  kr->resize(base_k + kb.size());
  v->resize(base_k + vb.size());
  for (size_t i = 0; i < kb.size(); ++i) {
    (*kr)[base_k + i] = client::Bf16BitsToFloat(kb[i]);
    (*v)[base_k + i] = client::Bf16BitsToFloat(vb[i]);
  }
  for (int64_t t = t0; t < t1; ++t) {
    for (int hh = 0; hh < h; ++hh) {
      synthetic::ApplyRope(s.rope_theta, d, t, &(*kr)[base_k + ((t - t0) * h + hh) * d]);
    }
  }
}

// Attend with question 0's queries of decode step `step` against an exact-profile session
// of the same tokens (every token kept in bf16, nothing selected or compressed); returns the
// relative error per layer against ExactAttention. What remains there is bf16 rounding, so
// next to the compressed session's error it shows what the sparse budget costs. The session
// is closed afterwards (its prefix stays cached, like the document's). doc_kr/doc_v: the
// document's post-RoPE keys and values per layer.
absl::StatusOr<std::vector<double>> ExactProfileErrors(client::Client& client, const synthetic::Document& doc,
                                                       const std::vector<std::vector<float>>& doc_kr,
                                                       const std::vector<std::vector<float>>& doc_v, int step,
                                                       int64_t position) {
  const auto& sp = doc.spec();
  v1::Profile exact;
  exact.set_kind(v1::PROFILE_KIND_EXACT);
  auto created = client.CreateSession(synthetic::MakeCreate(doc, exact, 0));
  if (!created.ok()) return created.status();
  const std::string id = created->session_id();
  auto errors = [&]() -> absl::StatusOr<std::vector<double>> {
    if (created->tokens_to_ingest() > 0) {
      auto ing = synthetic::IngestRange(client, doc, id, 0, static_cast<int64_t>(created->reused_tokens()), position);
      if (!ing.ok()) return ing.status();
    }
    v1::AttachRequest ar;
    ar.set_session_id(id);
    ar.set_worker_id("demo-exact-reference");
    auto att = client.Attach(ar);
    if (!att.ok()) return att.status();
    std::vector<double> err;
    for (int l = 0; l < sp.layers; ++l) {
      const std::vector<float> q = doc.Query(l, 0, step, position);
      v1::AttendRequest req;
      req.set_layer(l);
      auto* aq = req.add_queries();
      aq->set_attachment_id(att->attachment_id());
      *aq->mutable_q() = client::MakeBf16Tensor({sp.q_heads, sp.head_dim}, absl::MakeConstSpan(q));
      auto r = client.Attend(req);
      if (!r.ok()) return r.status();
      if (r->outputs_size() != 1) return absl::InternalError("Attend answered no output");
      auto out = client::TensorToFloats(r->outputs(0));
      if (!out.ok()) return out.status();
      std::vector<float> kr = doc_kr[l], vv = doc_v[l];
      PostRopeKv(doc, l, 0, sp.doc_tokens, position, &kr, &vv);
      err.push_back(RelativeError(*out, ExactAttention(q, kr, vv, position, sp.kv_heads, sp.q_heads, sp.head_dim)));
    }
    return err;
  };
  auto err = errors();
  const absl::Status closed = client.CloseSession(id);  // also ends its attachment
  if (err.ok() && !closed.ok()) return closed;
  return err;
}

}  // namespace

void AddDemoOptions(CLI::App* app, DemoOptions* o) {
  app->add_option("--doc-tokens", o->doc_tokens, "Document length in tokens")->check(CLI::Range(256, 1 << 20));
  app->add_option("--layers", o->layers, "Model layers")->check(CLI::Range(1, 256));
  app->add_option("--kv-heads", o->kv_heads, "KV heads")->check(CLI::Range(1, 64));
  app->add_option("--q-heads", o->q_heads, "Query heads (multiple of --kv-heads)")->check(CLI::Range(1, 256));
  app->add_option("--head-dim", o->head_dim, "Head dim (even)")->check(CLI::Range(8, 256));
  app->add_option("--questions", o->questions, "Question sessions")->check(CLI::Range(1, 1024));
  app->add_option("--question-tokens", o->question_tokens, "Tokens per question")->check(CLI::Range(1, 8192));
  app->add_option("--steps", o->steps, "Decode steps per question")->check(CLI::Range(1, 100000));
  app->add_option("--needles", o->needles, "Planted needles")->check(CLI::Range(1, 64));
  app->add_option("--mode", o->mode, "How question sessions share the document")
      ->check(CLI::IsMember({"reuse", "fork", "mixed"}));
  app->add_option("--profile", o->profile, "Compression profile")
      ->check(CLI::IsMember({"shadow", "mini", "exact", "auto"}));
  app->add_option("--rank", o->rank, "Shadow rank r (multiple of 8)");
  app->add_option("--chunk-size", o->chunk_size, "Chunk size C");
  app->add_option("--sparse-budget", o->sparse_budget, "Chunks selected per KV head per step");
  app->add_option("--outliers", o->outliers, "Outlier chunks per head");
  app->add_option("--local-window", o->local_window, "Exact tail tokens");
  app->add_flag("--attend,!--no-attend", o->attend, "Also call Attend and check it against exact attention");
  CLI::Option* ucx = app->add_flag(
      "--ucx,!--no-ucx", o->ucx,
      "--ucx: data calls over the UCX data plane, failing (exit 4) if the client falls back to gRPC; --no-ucx: "
      "gRPC inline. Default: UCX when the daemon offers it, else gRPC inline");
  app->final_callback([o, ucx] { ucx_required = o->ucx && ucx->count() > 0; });
  app->add_flag("--keep", o->keep, "Leave the sessions open");
  app->add_flag("--progress,!--no-progress", o->progress, "Progress bar on a terminal");
  app->add_option("--seed", o->seed, "Workload seed");
  // A later value overrides an earlier one, so that wrappers (scripts/demo.sh) can pass
  // their defaults first and the user's flags after them.
  for (CLI::Option* opt : app->get_options()) opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
}

int RunDemo(client::Client& client, const DemoOptions& o) {
  if (o.q_heads % o.kv_heads != 0) {
    std::fprintf(stderr, "kvshade demo: --q-heads (%d) must be a multiple of --kv-heads (%d)\n", o.q_heads, o.kv_heads);
    return 2;
  }
  const auto t_all = Clock::now();
  synthetic::DocSpec spec;
  spec.layers = o.layers;
  spec.kv_heads = o.kv_heads;
  spec.q_heads = o.q_heads;
  spec.head_dim = o.head_dim;
  spec.doc_tokens = o.doc_tokens;
  spec.question_tokens = o.question_tokens;
  spec.needles = o.needles;
  spec.seed = o.seed;
  spec.needle_span = 2 * o.chunk_size;
  synthetic::Document doc(spec);
  const int h = o.kv_heads, hq = o.q_heads, d = o.head_dim, L = o.layers;
  const int64_t n = o.doc_tokens;

  v1::Profile profile;
  static const std::map<std::string, v1::ProfileKind> kKinds = {
      {"shadow", v1::PROFILE_KIND_SHADOW}, {"mini", v1::PROFILE_KIND_MINI},
      {"exact", v1::PROFILE_KIND_EXACT}, {"auto", v1::PROFILE_KIND_AUTO}};
  profile.set_kind(kKinds.at(o.profile));
  profile.set_rank(o.rank);
  profile.set_chunk_size(o.chunk_size);
  profile.set_sparse_budget(o.sparse_budget);
  profile.set_outliers(o.outliers);
  profile.set_local_window(o.local_window);

  std::printf("kvshade demo: prefix-cached document QA against %s\n", client.options().target.c_str());
  std::printf("  model: %d layers, %d query heads, %d KV heads, head dim %d (bf16)\n", L, hq, h, d);
  std::printf("  document: %lld tokens, %d needles; %d questions x %d tokens, %d decode steps, mode %s\n",
              static_cast<long long>(n), o.needles, o.questions, o.question_tokens, o.steps, o.mode.c_str());
  std::printf("  profile: %s, rank %d, chunk %d, budget %d chunks/head, %d outliers, window %d\n",
              o.profile.c_str(), o.rank, o.chunk_size, o.sparse_budget, o.outliers, o.local_window);
  const std::string transports =
      client.options().ucx_transports.empty() ? "UCX's choice" : client.options().ucx_transports;
  std::string data_plane = "gRPC inline (--no-ucx)";
  if (o.ucx && ucx_required) {
    data_plane = absl::StrFormat("UCX, required by --ucx (client transports: %s); gRPC for the control plane",
                                 transports);
  } else if (o.ucx) {
    data_plane = absl::StrFormat("UCX if the daemon offers it, else gRPC inline (client transports: %s); gRPC "
                                 "for the control plane",
                                 transports);
  }
  std::printf("  data plane: %s\n\n", data_plane.c_str());

  // ---- 1. The document, ingested once. The run's footprint is what Stats grows by from
  // here (its segment is shared, so GetSession does not count it as the session's own).
  // The baseline is read once the document's session exists and before anything is
  // ingested, so that a document cached by an earlier run is in it: the growth is then
  // what this run stored, whether Stats counts the server's tiers or the caller's sessions.
  const auto t0 = Clock::now();
  auto created = client.CreateSession(synthetic::MakeCreate(doc, profile, -1));
  if (!created.ok()) return Fail("CreateSession(document)", created.status());
  const double create_doc_s = Since(t0);
  const std::string doc_id = created->session_id();
  auto base = client.Stats();
  if (!base.ok()) return Fail("Stats", base.status());
  double ingest_s = 0, ingest_mb = 0;
  std::vector<float> captured;
  if (created->tokens_to_ingest() > 0) {
    Progress bar("ingesting document", L, o.progress);
    auto ing = synthetic::IngestRange(client, doc, doc_id, -1, static_cast<int64_t>(created->reused_tokens()), n,
                                      [&](int l) { bar.Draw(l + 1); });
    bar.Done();
    if (!ing.ok()) return Fail("Ingest(document)", ing.status());
    ingest_s = ing->seconds;
    ingest_mb = ing->bytes / 1048576.0;
    captured.assign(ing->response.captured_energy().begin(), ing->response.captured_energy().end());
    std::printf("[document] session %s: ingested %lld tokens x %d layers in %.2f s: %.0f tokens/s, %.1f MB/s\n",
                doc_id.c_str(), static_cast<long long>(ing->tokens), L, ingest_s, ing->tokens / ingest_s,
                ingest_mb / ingest_s);
  } else {
    std::printf("[document] session %s: all %llu tokens already cached (reused), nothing to ingest\n",
                doc_id.c_str(), static_cast<unsigned long long>(created->reused_tokens()));
  }
  if (!captured.empty()) {
    const double mean = std::accumulate(captured.begin(), captured.end(), 0.0) / captured.size();
    const double mn = *std::min_element(captured.begin(), captured.end());
    std::printf("           rank-%d keys capture %.2f%% of key energy (worst layer %.2f%%)\n", o.rank, 100 * mean,
                100 * mn);
  }

  // ---- 2. Question sessions: reuse the cached prefix, or fork the document.
  std::vector<QuestionSession> qs(o.questions);
  std::vector<double> create_ms, fork_ms, attach_ms, static_ms;
  std::string data_plane_address;  // the daemon's UCX worker, from the first Attach
  // Most tokens one KV head's Attend reads besides the selected chunks: static set + tail.
  uint64_t static_and_tail_max = 0;
  uint64_t selected_tokens = 0;  // slots_per_head x chunk_size
  {
    Progress bar("question sessions", o.questions, o.progress);
    for (int j = 0; j < o.questions; ++j) {
      QuestionSession& q = qs[j];
      q.forked = o.mode == "fork" || (o.mode == "mixed" && j % 2 == 1);
      const int64_t total = n + o.question_tokens;
      auto ts = Clock::now();
      if (!q.forked) {
        auto c = client.CreateSession(synthetic::MakeCreate(doc, profile, j));
        if (!c.ok()) return Fail(absl::StrFormat("CreateSession(question %d)", j), c.status());
        create_ms.push_back(1e3 * Since(ts));
        q.session_id = c->session_id();
        q.reused = c->reused_tokens();
        if (c->tokens_to_ingest() > 0) {
          auto ing = synthetic::IngestRange(client, doc, q.session_id, j, static_cast<int64_t>(q.reused), total);
          if (!ing.ok()) return Fail(absl::StrFormat("Ingest(question %d)", j), ing.status());
          q.ingested = ing->tokens;
        }
      } else {
        auto f = client.ForkSession(doc_id, static_cast<uint64_t>(n));
        if (!f.ok()) return Fail(absl::StrFormat("ForkSession(question %d)", j), f.status());
        fork_ms.push_back(1e3 * Since(ts));
        q.session_id = f->session_id();
        q.reused = f->shared_tokens();
      }
      // Attach one worker per question (the writer, so a forked question can append).
      v1::AttachRequest ar;
      ar.set_session_id(q.session_id);
      ar.set_worker_id(absl::StrFormat("demo-worker-%d", j));
      ar.set_writer(true);
      auto ta = Clock::now();
      auto att = client.Attach(ar);
      if (!att.ok()) return Fail(absl::StrFormat("Attach(question %d)", j), att.status());
      attach_ms.push_back(1e3 * Since(ta));
      q.attachment_id = att->attachment_id();
      if (data_plane_address.empty()) data_plane_address = att->data_plane_address();
      if (q.forked) {
        v1::AppendTokensRequest append = synthetic::MakeAppend(doc, q.session_id, j, n, total);
        append.set_attachment_id(q.attachment_id);  // the writer attachment appends
        auto ap = client.AppendTokens(append);
        if (!ap.ok()) return Fail(absl::StrFormat("AppendTokens(question %d)", j), ap.status());
        q.ingested = o.question_tokens;
      }
      q.setup_seconds = Since(ts);
      q.position = total;
      const int k = static_cast<int>(att->slots_per_head() > 0 ? att->slots_per_head() : o.sparse_budget);
      const uint32_t per_slot = att->slot_tokens() > 0 ? att->slot_tokens() : att->chunk_size();
      selected_tokens = static_cast<uint64_t>(k) * (per_slot > 0 ? per_slot : o.chunk_size);
      q.slots.assign(L, std::vector<std::vector<int32_t>>(h, std::vector<int32_t>(k, -1)));
      // The static set, loaded once per attachment; also tells whether the target needle
      // sits in it (an outlier chunk is always attended, never selected).
      q.static_needle.assign(L, std::vector<bool>(h, false));
      const auto& needle = doc.needles()[doc.TargetNeedle(j)];
      std::vector<float> nk, nv;
      for (int l = 0; l < L; ++l) {
        auto tsl = Clock::now();
        auto st = client.GetStaticSet(q.attachment_id, l);
        if (!st.ok()) return Fail(absl::StrFormat("GetStaticSet(question %d, layer %d)", j, l), st.status());
        static_ms.push_back(1e3 * Since(tsl));
        const uint64_t tail = st->tail_k().shape_size() == 3 ? static_cast<uint64_t>(st->tail_k().shape(0)) : 0;
        for (int hh = 0; hh < st->lengths_size(); ++hh) {
          static_and_tail_max = std::max<uint64_t>(static_and_tail_max, st->lengths(hh) + tail);
        }
        auto sk = client::TensorToFloats(st->k());
        if (!sk.ok() || st->k().shape_size() != 3) continue;
        const int64_t smax = st->k().shape(1);
        nk.clear();
        nv.clear();
        PostRopeKv(doc, l, j, needle.position, needle.position + 1, &nk, &nv);
        for (int hh = 0; hh < h && hh < st->lengths_size(); ++hh) {
          for (uint32_t r = 0; r < st->lengths(hh) && r < smax; ++r) {
            const float* row = &(*sk)[(hh * smax + r) * d];
            float diff = 0, mag = 0;
            for (int c = 0; c < d; ++c) {
              diff = std::max(diff, std::fabs(row[c] - nk[hh * d + c]));
              mag = std::max(mag, std::fabs(nk[hh * d + c]));
            }
            if (diff <= 0.02f * mag + 0.02f) q.static_needle[l][hh] = true;
          }
        }
      }
      bar.Draw(j + 1);
    }
  }
  uint64_t reused_total = 0, ingested_total = 0;
  for (const auto& q : qs) {
    reused_total += q.reused;
    ingested_total += q.ingested;
  }
  std::printf("[questions] %d sessions: %llu document tokens reused or shared, %llu question tokens ingested\n",
              o.questions, static_cast<unsigned long long>(reused_total),
              static_cast<unsigned long long>(ingested_total));
  for (int j = 0; j < o.questions; ++j) {
    const auto& q = qs[j];
    std::printf("   q%-3d %s %s: %s %llu tokens, sent %llu, ready in %.0f ms\n", j, q.session_id.c_str(),
                q.forked ? "fork " : "reuse", q.forked ? "shares" : "reused",
                static_cast<unsigned long long>(q.reused), static_cast<unsigned long long>(q.ingested),
                1e3 * q.setup_seconds);
  }

  // ---- 3. Decode: per step and layer one batched SelectAndReconstruct (and Attend).
  std::vector<double> select_ms, attend_ms;
  uint64_t selected = 0, hits = 0, first_selected = 0, first_hits = 0, moved_bytes = 0, misses = 0;
  std::map<int, std::pair<uint64_t, uint64_t>> needle_found;  // needle -> (chunk-heads found, total)
  std::map<int, uint64_t> needle_static;                      // needle -> static (layer, head) pairs
  std::vector<double> attend_err, attend_err_q0;  // relative error per (question, layer), last step
  std::map<std::string, int> by_attachment;
  for (int j = 0; j < o.questions; ++j) by_attachment[qs[j].attachment_id] = j;
  // Exact-attention reference keys of the document (post-RoPE), for the last step.
  std::vector<std::vector<float>> doc_kr(L), doc_v(L);
  {
    Progress bar("decoding", static_cast<int64_t>(o.steps) * L, o.progress);
    for (int step = 0; step < o.steps; ++step) {
      const bool last = step == o.steps - 1;
      for (int l = 0; l < L; ++l) {
        v1::SelectAndReconstructRequest sr;
        v1::AttendRequest atr;
        sr.set_layer(l);
        atr.set_layer(l);
        std::vector<std::vector<float>> queries(o.questions);
        for (int j = 0; j < o.questions; ++j) {
          queries[j] = doc.Query(l, j, step, qs[j].position);
          auto* sq = sr.add_queries();
          sq->set_attachment_id(qs[j].attachment_id);
          *sq->mutable_q() = client::MakeBf16Tensor({hq, d}, absl::MakeConstSpan(queries[j]));
          auto* aq = atr.add_queries();
          aq->set_attachment_id(qs[j].attachment_id);
          *aq->mutable_q() = sq->q();
        }
        auto ts = Clock::now();
        auto resp = client.SelectAndReconstruct(sr);
        if (!resp.ok()) return Fail(absl::StrFormat("SelectAndReconstruct(step %d, layer %d)", step, l), resp.status());
        select_ms.push_back(1e3 * Since(ts));
        for (const auto& delta : resp->deltas()) {
          auto it = by_attachment.find(delta.attachment_id());
          if (it == by_attachment.end()) continue;
          auto& slots = qs[it->second].slots[l];
          for (int m = 0; m < delta.head_size() && m < delta.slot_size() && m < delta.chunk_size(); ++m) {
            const uint32_t hh = delta.head(m), slot = delta.slot(m);
            if (hh < slots.size() && slot < slots[hh].size()) slots[hh][slot] = delta.chunk(m);
          }
          selected += delta.selected();
          hits += delta.hits();
          misses += delta.chunk_size();
          moved_bytes += delta.keys().data().size() + delta.values().data().size();
          if (step == 0) {
            first_selected += delta.selected();
            first_hits += delta.hits();
          }
        }
        // Needle bookkeeping from the slot mirrors.
        for (int j = 0; j < o.questions; ++j) {
          const int ni = doc.TargetNeedle(j);
          const auto& nd = doc.needles()[ni];
          const int64_t c0 = nd.position / o.chunk_size, c1 = (nd.position + nd.span - 1) / o.chunk_size;
          for (int hh = 0; hh < h; ++hh) {
            if (qs[j].static_needle[l][hh]) {
              if (step == 0) needle_static[ni]++;
              continue;
            }
            const auto& row = qs[j].slots[l][hh];
            for (int64_t c = c0; c <= c1; ++c) {
              needle_found[ni].second++;
              if (std::find(row.begin(), row.end(), static_cast<int32_t>(c)) != row.end()) needle_found[ni].first++;
            }
          }
        }
        if (o.attend) {
          auto ta = Clock::now();
          auto ar = client.Attend(atr);
          if (!ar.ok()) return Fail(absl::StrFormat("Attend(step %d, layer %d)", step, l), ar.status());
          attend_ms.push_back(1e3 * Since(ta));
          if (last) {
            if (doc_kr[l].empty()) PostRopeKv(doc, l, -1, 0, n, &doc_kr[l], &doc_v[l]);
            for (int j = 0; j < o.questions && j < ar->outputs_size(); ++j) {
              auto out = client::TensorToFloats(ar->outputs(j));
              if (!out.ok()) continue;
              std::vector<float> kr = doc_kr[l], vv = doc_v[l];
              PostRopeKv(doc, l, j, n, qs[j].position, &kr, &vv);
              const double err = RelativeError(*out, ExactAttention(queries[j], kr, vv, qs[j].position, h, hq, d));
              attend_err.push_back(err);
              if (j == 0) attend_err_q0.push_back(err);
            }
          }
        }
        bar.Draw(static_cast<int64_t>(step) * L + l + 1);
      }
    }
  }
  // The tiers' growth is read before anything else touches the server.
  auto stats = client.Stats();
  if (!stats.ok()) return Fail("Stats", stats.status());

  std::printf("[decode] %d steps x %d layers, batch %d: %llu chunks selected, %.1f%% hits overall "
              "(%.1f%% after step 0), %s reconstructed and moved\n",
              o.steps, L, o.questions, static_cast<unsigned long long>(selected),
              selected ? 100.0 * hits / selected : 0.0,
              selected > first_selected ? 100.0 * (hits - first_hits) / (selected - first_selected) : 0.0,
              FormatBytes(static_cast<double>(moved_bytes)).c_str());
  std::printf("[needles] (selected = share of the needle's chunks in the slot tables, over steps, layers, heads)\n");
  int needles_ok = 0, needles_seen = 0;
  for (int i = 0; i < o.needles; ++i) {
    const auto& nd = doc.needles()[i];
    std::vector<int> askers;
    for (int j = 0; j < o.questions; ++j) {
      if (doc.TargetNeedle(j) == i) askers.push_back(j);
    }
    if (askers.empty()) continue;
    ++needles_seen;
    const auto f = needle_found[i];
    const double pct = f.second ? 100.0 * f.first / f.second : 100.0;
    const uint64_t st = needle_static[i];
    if (pct >= 90.0) ++needles_ok;
    std::printf("   needle %d at token %6lld (%d tokens), asked by %zu question(s): selected %5.1f%%%s\n", i,
                static_cast<long long>(nd.position), nd.span, askers.size(), pct,
                st ? absl::StrFormat(", in the static set for %llu layer-heads", static_cast<unsigned long long>(st)).c_str()
                   : "");
  }
  if (!attend_err.empty()) {
    // What the figure is: ||o - o_exact|| / ||o_exact|| per query, o_exact computed here in
    // fp64 over every token from the same bf16 K/V. What bounds it: a compressed profile
    // attends a subset of the tokens (and, for shadow, rank-r keys), so the output is an
    // approximation whose error is the attention mass it leaves out.
    const int64_t total = n + o.question_tokens;
    const auto mean = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / v.size(); };
    std::printf("[attend] Attend output vs exact attention over all %lld tokens (relative L2 error, last step, "
                "%d questions x %d layers): mean %.4f, max %.4f\n",
                static_cast<long long>(total), o.questions, L, mean(attend_err),
                *std::max_element(attend_err.begin(), attend_err.end()));
    const v1::ProfileKind kind = created->effective_profile();
    if (kind == v1::PROFILE_KIND_SHADOW) {
      const uint64_t read = std::min<uint64_t>(static_and_tail_max + selected_tokens, static_cast<uint64_t>(total));
      std::printf("         an approximation by design: each KV head attends at most %llu of the %lld tokens (%.1f%%: "
                  "static set and tail, plus %llu tokens of selected chunks) with rank-%d keys;\n"
                  "         the error is the attention mass on the skipped tokens plus the low-rank key error, and "
                  "falls as --sparse-budget and --rank grow\n",
                  static_cast<unsigned long long>(read), static_cast<long long>(total), 100.0 * read / total,
                  static_cast<unsigned long long>(selected_tokens), o.rank);
    } else if (kind == v1::PROFILE_KIND_MINI) {
      std::printf("         an approximation by design: the mini profile keeps INT2 heavy hitters and a recent window, "
                  "not every token\n");
    } else {
      std::printf("         the exact profile attends every token: what remains is bf16 rounding\n");
    }
    if (kind != v1::PROFILE_KIND_EXACT && !attend_err_q0.empty()) {
      auto exact = ExactProfileErrors(client, doc, doc_kr, doc_v, o.steps - 1, qs[0].position);
      if (exact.ok() && !exact->empty()) {
        std::printf("         reference: question 0's queries on an exact-profile session of its tokens (every token "
                    "attended): mean %.4f, max %.4f, against mean %.4f for question 0 above\n",
                    mean(*exact), *std::max_element(exact->begin(), exact->end()), mean(attend_err_q0));
      } else {
        std::printf("         (exact-profile comparison skipped: %s)\n",
                    exact.ok() ? "no output" : exact.status().ToString().c_str());
      }
    }
  }

  // ---- 4. Memory, and latencies. The footprint is what Stats grew by during this run
  // (shared segments are stored once; static sets, tails and slot tables included); the
  // comparison is a dense bf16 K+V cache of the same new tokens.
  const uint64_t doc_new = created->tokens_to_ingest();
  const uint64_t new_tokens = doc_new + ingested_total;
  const double dense = static_cast<double>(doc.DenseBytes(static_cast<int64_t>(new_tokens)));
  const double dev = std::max(0.0, static_cast<double>(stats->device_bytes_used()) -
                                       static_cast<double>(base->device_bytes_used()));
  const double host = std::max(0.0, static_cast<double>(stats->host_bytes_used()) -
                                        static_cast<double>(base->host_bytes_used()));
  std::string doc_part = absl::StrFormat("the document's %lld tokens (stored once)", static_cast<long long>(n));
  if (doc_new == 0) {
    doc_part = absl::StrFormat("none of the document's (its %lld tokens were cached before this run)",
                               static_cast<long long>(n));
  } else if (doc_new < static_cast<uint64_t>(n)) {
    doc_part = absl::StrFormat("%llu of the document's (the other %llu were cached before this run)",
                               static_cast<unsigned long long>(doc_new),
                               static_cast<unsigned long long>(n - doc_new));
  }
  std::printf("[memory] this run added %s on the device tier + %s on the host tier = %s (Stats before and after: "
              "segments,\n         static sets, tails, slot tables) for %llu new tokens: %s and %llu question tokens\n",
              FormatBytes(dev).c_str(), FormatBytes(host).c_str(), FormatBytes(dev + host).c_str(),
              static_cast<unsigned long long>(new_tokens), doc_part.c_str(),
              static_cast<unsigned long long>(ingested_total));
  if (dev + host > 0) {
    std::printf("         a dense bf16 K+V cache of the same %llu tokens takes %s: %.1fx what this run added, %.1fx "
                "its device tier part\n",
                static_cast<unsigned long long>(new_tokens), FormatBytes(dense).c_str(), dense / (dev + host),
                dev > 0 ? dense / dev : 0.0);
  }
  std::printf("[latency] ms              p50        tail      n   (tail: p99 from 100 samples on, else the max)\n");
  auto row = [](const char* name, const std::vector<double>& v) {
    if (v.empty()) return;
    const bool p99 = v.size() >= 100;
    std::printf("   %-16s %8.3f %8.3f %-4s %5zu\n", name, Percentile(v, 0.5),
                p99 ? Percentile(v, 0.99) : *std::max_element(v.begin(), v.end()), p99 ? "p99" : "max", v.size());
  };
  std::vector<double> create_doc = {1e3 * create_doc_s};
  row("CreateSession", create_ms.empty() ? create_doc : create_ms);
  row("ForkSession", fork_ms);
  row("Attach", attach_ms);
  row("GetStaticSet", static_ms);
  row(absl::StrFormat("Select (b=%d)", o.questions).c_str(), select_ms);
  row(absl::StrFormat("Attend (b=%d)", o.questions).c_str(), attend_ms);
  std::printf("[server] backend %s, version %s: prefix lookups %llu (hits %llu), chunk hits %llu of %llu\n",
              stats->backend().c_str(), stats->version().c_str(),
              static_cast<unsigned long long>(stats->prefix_lookups()),
              static_cast<unsigned long long>(stats->prefix_hits()),
              static_cast<unsigned long long>(stats->chunk_hits()),
              static_cast<unsigned long long>(stats->chunks_selected()));

  // The transport the data calls really used. With --ucx, running over gRPC is a failure
  // (the fallback is loud in the client too: a log line per fallback); without it the demo
  // reports what it used.
  const uint64_t fallbacks = client.ucx_fallbacks();
  const bool over_ucx = o.ucx && fallbacks == 0 && client.ucx_connected();
  const bool fell_back = o.ucx && ucx_required && !over_ucx;
  const std::string why = data_plane_address.empty()
                              ? "the daemon offers no UCX data plane (its config has ucx.enable: false)"
                              : "the client could not use the daemon's UCX data plane (see the client's log line "
                                "above and `kvshade doctor`)";
  if (!o.ucx) {
    std::printf("[transport] data calls over gRPC inline (--no-ucx)\n");
  } else if (over_ucx) {
    // The lanes UCP picks to the daemon's worker from this host (a throwaway endpoint).
    auto lanes = UcxLanesTo(data_plane_address, client.options().ucx_transports);
    std::printf("[transport] data calls (ingest, append, select, attend) over UCX via %s (client transports: %s); "
                "%llu fallbacks to gRPC\n",
                lanes.ok() ? lanes->c_str() : "(lanes unknown)", transports.c_str(),
                static_cast<unsigned long long>(fallbacks));
  } else if (fell_back) {
    std::printf("[transport] FAILED: --ucx asks for the UCX data plane, but the client fell back to gRPC inline: %s "
                "(%llu fallbacks, connected: %s)\n",
                why.c_str(), static_cast<unsigned long long>(fallbacks), client.ucx_connected() ? "yes" : "no");
  } else {
    std::printf("[transport] data calls over gRPC inline: %s; the client tried UCX first (%llu fallback%s to gRPC; "
                "--ucx makes this a failure, --no-ucx skips the attempt)\n",
                why.c_str(), static_cast<unsigned long long>(fallbacks), fallbacks == 1 ? "" : "s");
  }

  // ---- 5. Clean up.
  if (!o.keep) {
    for (const auto& q : qs) {
      absl::Status s = client.Detach(q.attachment_id);
      if (!s.ok()) return Fail("Detach", s);
      s = client.CloseSession(q.session_id);
      if (!s.ok()) return Fail("CloseSession", s);
    }
    absl::Status s = client.CloseSession(doc_id);
    if (!s.ok()) return Fail("CloseSession(document)", s);
  }
  std::printf("done in %.1f s: %d of %d asked needles selected in >= 90%% of (step, layer, head)\n", Since(t_all),
              needles_ok, needles_seen);
  if (fell_back) {
    std::fprintf(stderr, "kvshade demo: --ucx was given and the run fell back to gRPC inline (exit 4)\n");
    return 4;
  }
  return 0;
}

}  // namespace kvshade::cli
