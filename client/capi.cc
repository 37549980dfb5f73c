// The kvshade C ABI (kvshade/kvshade.h) over the C++ client: opaque handles wrapping
// kvshade::client objects, absl::Status mapped to kvshade_code plus a thread-local message,
// inputs validated before any pointer is read, outputs decoded to fp32 and owned by handles.
// Nothing here throws or aborts: every entry point catches and reports.
#include "kvshade/kvshade.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvshade/client/local_decoder.h"
#include "kvshade/client/client.h"
#include "kvshade/client/router.h"
#include "kvshade/client/tensor.h"

struct kvshade_client {
  std::unique_ptr<kvshade::client::Client> impl;
};

struct kvshade_local_decoder {
  std::unique_ptr<kvshade::client::LocalDecoder> impl;
};

struct kvshade_prepared_sequence {
  std::unique_ptr<kvshade::client::PreparedSequence> impl;
};

struct kvshade_ingest {
  std::unique_ptr<kvshade::client::IngestWriter> writer;
  bool committed = false;
};

namespace {

// Rows of K or V as the server sent them (the wire tensor's bytes and dtype, checked against
// its shape when the reply is decoded), widened to fp32 only when a caller asks for fp32.
struct WireRows {
  int32_t dtype = 0;  // KVSHADE_DTYPE_* once taken
  std::string bytes;  // n elements of dtype, zero-padded to n when the server sent fewer rows
  size_t n = 0;
  mutable std::vector<float> f32;  // filled by Floats(), under the owner's mutex
  mutable bool widened = false;

  // Keeps t's rows padded to n elements (n >= the tensor's elements); t must have passed
  // ValidRows (kvshade::client::CheckFloatTensor). A tensor without a dtype (no rows) takes `none` (a KVSHADE_DTYPE_*).
  void Take(kvshade::v1::Tensor* t, size_t elements, int32_t none = KVSHADE_DTYPE_FP32) {
    n = elements;
    dtype = t->dtype() == kvshade::v1::DTYPE_UNSPECIFIED ? none : static_cast<int32_t>(t->dtype());
    bytes = std::move(*t->mutable_data());
    bytes.resize(n * (dtype == KVSHADE_DTYPE_FP32 ? 4 : 2), '\0');
  }
  const float* Floats() const {
    if (!widened) {
      auto f = kvshade::client::BytesToFloats(static_cast<kvshade::v1::DType>(dtype), bytes,
                                              static_cast<int64_t>(n));
      f32 = f.ok() ? *std::move(f) : std::vector<float>(n, 0.0f);  // checked when taken
      widened = true;
    }
    return f32.data();
  }
};

// A row tensor of a reply: what CheckFloatTensor accepts, a malformed reply otherwise.
absl::Status ValidRows(const kvshade::v1::Tensor& t) {
  absl::Status st = kvshade::client::CheckFloatTensor(t);
  if (st.ok()) return st;
  return absl::InternalError(absl::StrCat("malformed reply from the server: ", st.message()));
}

}  // namespace

struct kvshade_static_set {
  int64_t h = 0, s_max = 0, d = 0, t = 0;
  mutable std::mutex mu;  // guards the lazy fp32 widening of the rows
  WireRows k, v, tail_k, tail_v;
  std::vector<uint32_t> lengths;
  std::vector<int64_t> positions, tail_positions;
};

struct kvshade_select_result {
  struct Delta {
    std::string attachment_id;
    std::vector<uint32_t> head, slot;
    std::vector<int32_t> chunk;
    std::vector<int64_t> position;
    WireRows keys, values;
    int64_t chunk_size = 0, head_dim = 0;
    uint32_t hits = 0, selected = 0;
    bool delivered = false, fallback = false;
    uint64_t tokens = 0;
  };
  mutable std::mutex mu;  // guards the lazy fp32 widening of the deltas' rows
  std::vector<Delta> deltas;
};

struct kvshade_session_selection {
  uint64_t samples = 0;
  double recall = 0;
  std::vector<kvshade_layer_selection> layers;
};

struct kvshade_select_future {
  std::future<absl::StatusOr<kvshade::v1::SelectAndReconstructResponse>> f;
  bool waited = false;
};

struct kvshade_attend_future {
  std::future<absl::StatusOr<kvshade::v1::AttendResponse>> f;
  size_t n = 0, per = 0;  // queries, hq * d
  bool waited = false;
};

namespace {

namespace v1 = kvshade::v1;
using kvshade::client::Client;

thread_local std::string g_last_error;

int Report(const absl::Status& s) {
  if (s.ok()) {
    g_last_error.clear();
    return int(KVSHADE_OK);
  }
  g_last_error = std::string(s.message());
  return static_cast<int>(s.code());
}

int Bad(const std::string& msg) { return Report(absl::InvalidArgumentError(msg)); }

// Runs `fn` (returning int) and turns any escaping exception into KVSHADE_INTERNAL.
template <typename Fn>
int Guard(Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return Report(absl::InternalError(absl::StrCat("kvshade C ABI: ", e.what())));
  } catch (...) {
    return Report(absl::InternalError("kvshade C ABI: unknown exception"));
  }
}

void CopyId(const std::string& src, char* dst, size_t cap) {
  const size_t n = std::min(src.size(), cap - 1);
  std::memcpy(dst, src.data(), n);
  dst[n] = '\0';
}

bool IdOk(const char* id) { return id != nullptr && std::strlen(id) < KVSHADE_ID_CAP; }

int64_t DTypeBytes(int32_t dtype) {
  switch (dtype) {
    case KVSHADE_DTYPE_BF16:
    case KVSHADE_DTYPE_FP16:
      return 2;
    case KVSHADE_DTYPE_FP32:
      return 4;
    default:
      return 0;
  }
}

// A wire tensor of `shape` with `count` elements of `dtype` copied from `data`.
v1::Tensor MakeTensor(std::vector<int64_t> shape, int32_t dtype, const void* data) {
  v1::Tensor t;
  int64_t count = 1;
  for (int64_t s : shape) {
    t.add_shape(s);
    count *= s;
  }
  t.set_dtype(static_cast<v1::DType>(dtype));
  t.set_data(static_cast<const char*>(data), static_cast<size_t>(count * DTypeBytes(dtype)));
  return t;
}

v1::ModelSpec ToModel(const kvshade_model& m) {
  v1::ModelSpec s;
  if (m.model_id != nullptr) s.set_model_id(m.model_id);
  s.set_num_layers(m.num_layers);
  s.set_num_query_heads(m.num_query_heads);
  s.set_num_kv_heads(m.num_kv_heads);
  s.set_head_dim(m.head_dim);
  v1::RopeSpec* r = s.mutable_rope();
  r->set_theta(m.rope_theta);
  r->set_rotary_dim(m.rotary_dim);
  r->set_scaling(static_cast<v1::RopeScaling>(m.rope_scaling));
  r->set_pairing(static_cast<v1::RopePairing>(m.rope_pairing));
  r->set_factor(m.rope_factor);
  r->set_low_freq_factor(m.rope_low_freq_factor);
  r->set_high_freq_factor(m.rope_high_freq_factor);
  r->set_original_max_position(m.rope_original_max_position);
  r->set_beta_fast(m.rope_beta_fast);
  r->set_beta_slow(m.rope_beta_slow);
  s.set_dtype(static_cast<v1::DType>(m.dtype == 0 ? KVSHADE_DTYPE_BF16 : m.dtype));
  return s;
}

v1::Profile ToProfile(const kvshade_profile& p) {
  v1::Profile s;
  s.set_kind(static_cast<v1::ProfileKind>(p.kind));
  s.set_rank(p.rank);
  s.set_chunk_size(p.chunk_size);
  s.set_sparse_budget(p.sparse_budget);
  // Fields that take 0 as a value are sent only when set (proto presence).
  if (p.outliers != KVSHADE_UNSET_U32) s.set_outliers(p.outliers);
  if (p.keep_sink >= 0) s.set_keep_sink(p.keep_sink != 0);
  s.set_local_window(p.local_window);
  if (p.heavy_chunks != KVSHADE_UNSET_U32) s.set_heavy_chunks(p.heavy_chunks);
  s.set_value_codec(static_cast<v1::ValueCodec>(p.value_codec));
  if (p.min_tokens != KVSHADE_UNSET_U32) s.set_min_tokens(p.min_tokens);
  if (!std::isnan(p.refactor_threshold)) s.set_refactor_threshold(p.refactor_threshold);
  if (!std::isnan(p.energy_target)) s.set_energy_target(p.energy_target);
  if (!std::isnan(p.mini_recent_ratio)) s.set_mini_recent_ratio(p.mini_recent_ratio);
  if (!std::isnan(p.mini_heavy_ratio)) s.set_mini_heavy_ratio(p.mini_heavy_ratio);
  s.set_kivi_group(p.kivi_group);
  s.set_rerank_factor(p.rerank_factor);
  s.set_mass_top_p(p.mass_top_p);
  if (p.mass_min_chunks != KVSHADE_UNSET_U32) s.set_mass_min_chunks(p.mass_min_chunks);
  if (!std::isnan(p.recall_sample_rate)) s.set_recall_sample_rate(p.recall_sample_rate);
  if (!std::isnan(p.recall_floor)) s.set_recall_floor(p.recall_floor);
  s.set_recall_action(static_cast<v1::RecallAction>(p.recall_action));
  if (p.key_signature_bits != KVSHADE_UNSET_U32) s.set_key_signature_bits(p.key_signature_bits);
  if (p.selection_unit != KVSHADE_UNSET_U32) s.set_selection_unit(p.selection_unit);
  return s;
}

// Shared argument checks of select and attend.
int CheckQueries(size_t n, const char* const* ids, int32_t dtype, int32_t hq, int32_t d, const void* q) {
  if (n == 0) return Bad("n must be > 0, got 0");
  if (ids == nullptr || q == nullptr) return Bad("attachment_ids and q must not be NULL");
  if (DTypeBytes(dtype) == 0) return Bad(absl::StrCat("dtype must be 1 (bf16), 2 (fp16) or 3 (fp32), got ", dtype));
  if (hq <= 0 || d <= 0) return Bad(absl::StrCat("hq and d must be > 0, got ", hq, " and ", d));
  for (size_t i = 0; i < n; ++i) {
    if (!IdOk(ids[i])) return Bad(absl::StrCat("attachment_ids[", i, "] is NULL or too long"));
  }
  return KVSHADE_OK;
}

// The request of kvshade_select / kvshade_select_async (arguments already checked): the
// queries are copied, so the caller's buffers are free once this returns.
v1::SelectAndReconstructRequest MakeSelect(uint32_t layer, size_t n, const char* const* ids, int32_t dtype,
                                           int32_t hq, int32_t d, const void* q) {
  const int64_t q_bytes = static_cast<int64_t>(hq) * d * DTypeBytes(dtype);
  v1::SelectAndReconstructRequest req;
  req.set_layer(layer);
  for (size_t i = 0; i < n; ++i) {
    v1::SelectQuery* sq = req.add_queries();
    sq->set_attachment_id(ids[i]);
    *sq->mutable_q() = MakeTensor({hq, d}, dtype, static_cast<const char*>(q) + i * q_bytes);
  }
  return req;
}

v1::AttendRequest MakeAttend(uint32_t layer, size_t n, const char* const* ids, int32_t dtype, int32_t hq,
                             int32_t d, const void* q) {
  const int64_t q_bytes = static_cast<int64_t>(hq) * d * DTypeBytes(dtype);
  v1::AttendRequest req;
  req.set_layer(layer);
  for (size_t i = 0; i < n; ++i) {
    v1::AttendQuery* aq = req.add_queries();
    aq->set_attachment_id(ids[i]);
    *aq->mutable_q() = MakeTensor({hq, d}, dtype, static_cast<const char*>(q) + i * q_bytes);
  }
  return req;
}

// Checks a kvshade_new_tokens argument (NULL is fine) for n queries; `stage_required`:
// select, which carries new tokens only to stage them.
int CheckNewTokens(const kvshade_new_tokens* t, bool stage_required) {
  if (t == nullptr) return KVSHADE_OK;
  if (t->h <= 0) return Bad(absl::StrCat("tokens.h must be > 0, got ", t->h));
  if (t->k_new == nullptr || t->v_new == nullptr) return Bad("tokens.k_new and tokens.v_new must not be NULL");
  if (stage_required && t->stage_token_ids == nullptr) {
    return Bad("tokens.stage_token_ids must not be NULL: a select carries new tokens only to stage them");
  }
  return KVSHADE_OK;
}

// Adds query i's new token (and its staging) from `t` to a select or attend query.
template <typename Query>
void AddNewToken(const kvshade_new_tokens* t, size_t i, int32_t dtype, int32_t d, bool only_staged, Query* q) {
  if (t == nullptr) return;
  const bool stage = t->stage_token_ids != nullptr && t->stage_token_ids[i] >= 0;
  if (only_staged && !stage) return;
  const int64_t bytes = static_cast<int64_t>(t->h) * d * DTypeBytes(dtype);
  *q->mutable_k_new() = MakeTensor({t->h, d}, dtype, static_cast<const char*>(t->k_new) + i * bytes);
  *q->mutable_v_new() = MakeTensor({t->h, d}, dtype, static_cast<const char*>(t->v_new) + i * bytes);
  if (stage) {
    q->set_stage_token_id(t->stage_token_ids[i]);
    q->set_stage_hold(t->hold != 0);
  }
}

// Decodes a select response into a result handle (*out), reporting the outcome.
// Takes the deltas out of *r (their row bytes move into the result).
int DecodeSelect(v1::SelectAndReconstructResponse* r, kvshade_select_result** out) {
  auto res = std::make_unique<kvshade_select_result>();
  res->deltas.reserve(static_cast<size_t>(r->deltas_size()));
  for (v1::SlotDelta& sd : *r->mutable_deltas()) {
    kvshade_select_result::Delta dl;
    dl.attachment_id = sd.attachment_id();
    dl.head.assign(sd.head().begin(), sd.head().end());
    dl.slot.assign(sd.slot().begin(), sd.slot().end());
    dl.chunk.assign(sd.chunk().begin(), sd.chunk().end());
    dl.position.assign(sd.position().begin(), sd.position().end());
    dl.hits = sd.hits();
    dl.selected = sd.selected();
    dl.delivered = sd.delivered();
    dl.fallback = sd.fallback();
    dl.tokens = sd.tokens();
    if (dl.slot.size() != dl.head.size() || dl.chunk.size() != dl.head.size() ||
        dl.position.size() != dl.head.size()) {
      return Report(absl::InternalError(
          "malformed SlotDelta from the server (head/slot/chunk/position lengths differ)"));
    }
    if (!dl.head.empty() && sd.delivered()) {
      // K and V are already in the registered slot buffers: only the shape comes back.
      if (sd.keys().shape_size() == 3) {
        dl.chunk_size = sd.keys().shape(1);
        dl.head_dim = sd.keys().shape(2);
      }
    } else if (!dl.head.empty()) {
      if (absl::Status st = ValidRows(sd.keys()); !st.ok()) return Report(st);
      if (absl::Status st = ValidRows(sd.values()); !st.ok()) return Report(st);
      if (sd.keys().shape_size() != 3 || sd.keys().shape(0) != static_cast<int64_t>(dl.head.size()) ||
          sd.values().dtype() != sd.keys().dtype() ||
          sd.values().data().size() != sd.keys().data().size()) {
        return Report(absl::InternalError("malformed SlotDelta from the server (shapes disagree)"));
      }
      dl.chunk_size = sd.keys().shape(1);
      dl.head_dim = sd.keys().shape(2);
      const size_t n = dl.head.size() * static_cast<size_t>(dl.chunk_size * dl.head_dim);
      dl.keys.Take(sd.mutable_keys(), n);
      dl.values.Take(sd.mutable_values(), n);
    }
    res->deltas.push_back(std::move(dl));
  }
  *out = res.release();
  return Report(absl::OkStatus());
}

// Copies an attend response's n outputs of `per` floats each into out [n, per].
int DecodeAttend(const v1::AttendResponse& r, size_t n, size_t per, float* out) {
  if (static_cast<size_t>(r.outputs_size()) != n) {
    return Report(absl::InternalError(absl::StrCat("server returned ", r.outputs_size(), " outputs for ", n, " queries")));
  }
  for (size_t i = 0; i < n; ++i) {
    auto f = kvshade::client::TensorToFloats(r.outputs(static_cast<int>(i)));
    if (!f.ok()) return Report(f.status());
    if (f->size() != per) {
      return Report(absl::InternalError(absl::StrCat("attend output ", i, " has ", f->size(), " values, expected ", per)));
    }
    std::memcpy(out + i * per, f->data(), per * sizeof(float));
  }
  return Report(absl::OkStatus());
}

}  // namespace

extern "C" {

uint32_t kvshade_abi_version(void) { return KVSHADE_ABI_VERSION; }

const char* kvshade_last_error(void) { return g_last_error.c_str(); }

const char* kvshade_code_name(int code) {
  static const char* const kNames[] = {
      "OK",        "CANCELLED",         "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS",    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED",   "OUT_OF_RANGE",      "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
      "DATA_LOSS", "UNAUTHENTICATED"};
  return code >= 0 && code <= 16 ? kNames[code] : "UNKNOWN";
}

void kvshade_client_options_init(kvshade_client_options* o) {
  if (o != nullptr) std::memset(o, 0, sizeof(*o));
}

void kvshade_model_init(kvshade_model* m) {
  if (m == nullptr) return;
  std::memset(m, 0, sizeof(*m));
  m->dtype = KVSHADE_DTYPE_BF16;
}

void kvshade_profile_init(kvshade_profile* p) {
  if (p == nullptr) return;
  std::memset(p, 0, sizeof(*p));
  p->keep_sink = -1;
  p->outliers = p->heavy_chunks = p->min_tokens = p->mass_min_chunks = p->key_signature_bits =
      p->selection_unit = KVSHADE_UNSET_U32;
  p->refactor_threshold = p->energy_target = p->mini_recent_ratio = p->mini_heavy_ratio = p->recall_sample_rate =
      p->recall_floor = std::numeric_limits<float>::quiet_NaN();
}

int kvshade_connect(const kvshade_client_options* o, kvshade_client** out) {
  return Guard([&] {
    if (out == nullptr) return Bad("out must not be NULL");
    *out = nullptr;
    kvshade::client::ClientOptions opts;
    if (o != nullptr) {
      if (o->target != nullptr && *o->target) opts.target = o->target;
      if (o->bearer_token != nullptr) opts.bearer_token = o->bearer_token;
      opts.tls = o->tls != 0;
      if (o->ca_file != nullptr) opts.ca_file = o->ca_file;
      if (o->cert_file != nullptr) opts.cert_file = o->cert_file;
      if (o->key_file != nullptr) opts.key_file = o->key_file;
      if (o->tls_server_name != nullptr) opts.tls_server_name = o->tls_server_name;
      if (o->timeout_ms > 0) opts.timeout = absl::Milliseconds(o->timeout_ms);
      if (o->max_message_bytes > 0) opts.max_message_bytes = o->max_message_bytes;
      opts.use_ucx = o->use_ucx != 0;
      if (o->ucx_transports != nullptr) opts.ucx_transports = o->ucx_transports;
      if (o->ucx_ingest_window > 0) opts.ucx_ingest_window = o->ucx_ingest_window;
      if (o->ucx_busy_poll_us > 1000000) {
        return Bad(absl::StrCat("ucx_busy_poll_us must be <= 1000000, got ", o->ucx_busy_poll_us));
      }
      if (o->ucx_busy_poll_us != 0) opts.ucx_busy_poll_us = std::max(0, o->ucx_busy_poll_us);
    }
    auto c = Client::Connect(opts);
    if (!c.ok()) return Report(c.status());
    *out = new kvshade_client{*std::move(c)};
    return Report(absl::OkStatus());
  });
}

void kvshade_client_free(kvshade_client* client) { delete client; }

int kvshade_wait_ready(kvshade_client* c, int64_t timeout_ms) {
  return Guard([&] {
    if (c == nullptr) return Bad("client must not be NULL");
    return Report(c->impl->WaitForServing(absl::Milliseconds(timeout_ms)));
  });
}

int kvshade_health(kvshade_client* c, int32_t* serving) {
  return Guard([&] {
    if (c == nullptr || serving == nullptr) return Bad("client and serving must not be NULL");
    auto h = c->impl->CheckHealth();
    if (!h.ok()) return Report(h.status());
    *serving = *h == kvshade::client::HealthStatus::kServing ? 1 : 0;
    return Report(absl::OkStatus());
  });
}

int kvshade_ucx_status(kvshade_client* c, int32_t* connected, uint64_t* fallbacks) {
  return Guard([&] {
    if (c == nullptr) return Bad("client must not be NULL");
    if (connected != nullptr) *connected = c->impl->ucx_connected() ? 1 : 0;
    if (fallbacks != nullptr) *fallbacks = c->impl->ucx_fallbacks();
    return Report(absl::OkStatus());
  });
}

int kvshade_create_session(kvshade_client* c, const kvshade_model* model, const kvshade_profile* profile,
                           const int32_t* token_ids, size_t n_tokens, int32_t durable, const char* label,
                           kvshade_session_created* out) {
  return kvshade_create_session_ex(c, model, profile, token_ids, n_tokens, durable, label, nullptr, 0,
                                   nullptr, out);
}

int kvshade_create_session_on(kvshade_client* c, const kvshade_model* model,
                              const kvshade_profile* profile, const int32_t* token_ids,
                              size_t n_tokens, int32_t durable, const char* label,
                              const char* device, kvshade_session_created* out) {
  return kvshade_create_session_ex(c, model, profile, token_ids, n_tokens, durable, label, nullptr, 0,
                                   device, out);
}

int kvshade_create_session_ex(kvshade_client* c, const kvshade_model* model, const kvshade_profile* profile,
                              const int32_t* token_ids, size_t n_tokens, int32_t durable, const char* label,
                              const uint64_t* segment_ends, size_t n_segment_ends, const char* device,
                              kvshade_session_created* out) {
  return kvshade_create_session_tp(c, model, profile, token_ids, n_tokens, durable, label, segment_ends,
                                   n_segment_ends, device, nullptr, out);
}

int kvshade_create_session_tp(kvshade_client* c, const kvshade_model* model, const kvshade_profile* profile,
                              const int32_t* token_ids, size_t n_tokens, int32_t durable, const char* label,
                              const uint64_t* segment_ends, size_t n_segment_ends, const char* device,
                              const kvshade_tensor_parallel* tp, kvshade_session_created* out) {
  return Guard([&] {
    if (c == nullptr || model == nullptr || out == nullptr) return Bad("client, model and out must not be NULL");
    if (n_tokens > 0 && token_ids == nullptr) return Bad("token_ids is NULL but n_tokens > 0");
    if (n_segment_ends > 0 && segment_ends == nullptr) {
      return Bad("segment_ends is NULL but n_segment_ends > 0");
    }
    if (n_segment_ends > KVSHADE_MAX_SEGMENT_ENDS) {
      return Bad(absl::StrCat("segment_ends holds at most ", KVSHADE_MAX_SEGMENT_ENDS,
                              " positions, got ", n_segment_ends));
    }
    v1::CreateSessionRequest req;
    *req.mutable_model() = ToModel(*model);
    if (profile != nullptr) *req.mutable_profile() = ToProfile(*profile);
    req.mutable_token_ids()->Add(token_ids, token_ids + n_tokens);
    req.set_durable(durable != 0);
    if (label != nullptr) req.set_label(label);
    if (n_segment_ends > 0) req.mutable_segment_ends()->Add(segment_ends, segment_ends + n_segment_ends);
    if (device != nullptr) req.set_device(device);
    if (tp != nullptr) {
      if (std::memchr(tp->session_id, 0, sizeof(tp->session_id)) == nullptr) {
        return Bad("tp->session_id is not NUL-terminated");
      }
      v1::TensorParallel* t = req.mutable_tensor_parallel();
      t->set_ranks(tp->ranks);
      t->set_rank(tp->rank);
      t->set_kv_head_begin(tp->kv_head_begin);
      t->set_kv_head_end(tp->kv_head_end);
      t->set_query_head_begin(tp->query_head_begin);
      t->set_query_head_end(tp->query_head_end);
      t->set_session_id(tp->session_id);
    }
    auto r = c->impl->CreateSession(req);
    if (!r.ok()) return Report(r.status());
    std::memset(out, 0, sizeof(*out));
    CopyId(r->session_id(), out->session_id, KVSHADE_ID_CAP);
    out->reused_tokens = r->reused_tokens();
    out->tokens_to_ingest = r->tokens_to_ingest();
    out->effective_profile = r->effective_profile();
    const int n_ends = std::min<int>(r->segment_ends_size(), KVSHADE_MAX_SEGMENT_ENDS);
    out->n_segment_ends = static_cast<uint32_t>(n_ends);
    for (int i = 0; i < n_ends; ++i) out->segment_ends[i] = r->segment_ends(i);
    out->automatic_segment_end = r->automatic_segment_end();
    CopyId(r->device(), out->device, sizeof(out->device));
    if (r->has_tensor_parallel()) {
      CopyId(r->tensor_parallel().session_id(), out->tp_session_id, sizeof(out->tp_session_id));
      out->tp_ranks = r->tensor_parallel().ranks();
      out->tp_rank = r->tensor_parallel().rank();
      out->tp_ranks_joined = r->tensor_parallel().ranks_joined();
    }
    return Report(absl::OkStatus());
  });
}

int kvshade_get_tensor_parallel_shards(kvshade_client* c, const char* session_id,
                                       kvshade_tensor_parallel_shard* out, size_t cap, size_t* n) {
  return Guard([&] {
    if (c == nullptr || n == nullptr) return Bad("client and n must not be NULL");
    if (cap > 0 && out == nullptr) return Bad("out is NULL but cap > 0");
    if (!IdOk(session_id)) return Bad("session_id is NULL or too long");
    auto r = c->impl->GetSession(session_id);
    if (!r.ok()) return Report(r.status());
    if (!r->has_tensor_parallel() || r->tensor_parallel().session_id() != r->session_id()) {
      return Bad(absl::StrCat("session '", r->session_id(),
                              "' is not a tensor-parallel logical session"));
    }
    const auto& shards = r->tensor_parallel().shards();
    *n = static_cast<size_t>(shards.size());
    for (size_t i = 0; i < std::min<size_t>(cap, shards.size()); ++i) {
      const v1::TensorParallelShard& x = shards[static_cast<int>(i)];
      kvshade_tensor_parallel_shard& o = out[i];
      std::memset(&o, 0, sizeof(o));
      o.rank = x.rank();
      o.kv_head_begin = x.kv_head_begin();
      o.kv_head_end = x.kv_head_end();
      CopyId(x.session_id(), o.session_id, sizeof(o.session_id));
      CopyId(x.device(), o.device, sizeof(o.device));
      CopyId(x.state(), o.state, sizeof(o.state));
      o.tokens = x.tokens();
      o.reused_tokens = x.reused_tokens();
    }
    return Report(absl::OkStatus());
  });
}

int kvshade_lookup_prefix(kvshade_client* c, const kvshade_model* model, const kvshade_profile* profile,
                          const int32_t* token_ids, size_t n_tokens, uint64_t* reusable, uint64_t* segments) {
  return kvshade_lookup_prefix_on(c, model, profile, token_ids, n_tokens, nullptr, reusable, segments);
}

int kvshade_lookup_prefix_on(kvshade_client* c, const kvshade_model* model,
                             const kvshade_profile* profile, const int32_t* token_ids,
                             size_t n_tokens, const char* device, uint64_t* reusable,
                             uint64_t* segments) {
  return Guard([&] {
    if (c == nullptr || model == nullptr) return Bad("client and model must not be NULL");
    if (n_tokens > 0 && token_ids == nullptr) return Bad("token_ids is NULL but n_tokens > 0");
    v1::LookupPrefixRequest req;
    *req.mutable_model() = ToModel(*model);
    if (profile != nullptr) *req.mutable_profile() = ToProfile(*profile);
    req.mutable_token_ids()->Add(token_ids, token_ids + n_tokens);
    if (device != nullptr) req.set_device(device);
    auto r = c->impl->LookupPrefix(req);
    if (!r.ok()) return Report(r.status());
    if (reusable != nullptr) *reusable = r->reusable_tokens();
    if (segments != nullptr) *segments = r->cached_segments();
    return Report(absl::OkStatus());
  });
}

int kvshade_fork_session(kvshade_client* c, const char* parent, uint64_t at_token, char* out_id,
                         uint64_t* shared) {
  return Guard([&] {
    if (c == nullptr || out_id == nullptr) return Bad("client and out_session_id must not be NULL");
    if (!IdOk(parent)) return Bad("parent_session_id is NULL or too long");
    auto r = c->impl->ForkSession(parent, at_token);
    if (!r.ok()) return Report(r.status());
    CopyId(r->session_id(), out_id, KVSHADE_ID_CAP);
    if (shared != nullptr) *shared = r->shared_tokens();
    return Report(absl::OkStatus());
  });
}

int kvshade_get_session(kvshade_client* c, const char* session_id, kvshade_session_info* out) {
  return Guard([&] {
    if (c == nullptr || out == nullptr) return Bad("client and out must not be NULL");
    if (!IdOk(session_id)) return Bad("session_id is NULL or too long");
    auto r = c->impl->GetSession(session_id);
    if (!r.ok()) return Report(r.status());
    std::memset(out, 0, sizeof(*out));
    CopyId(r->session_id(), out->session_id, sizeof(out->session_id));
    CopyId(r->model_id(), out->model_id, sizeof(out->model_id));
    CopyId(r->state(), out->state, sizeof(out->state));
    CopyId(r->label(), out->label, sizeof(out->label));
    out->profile = r->profile();
    out->durable = r->durable() ? 1 : 0;
    out->attachments = r->attachments();
    out->layers_ingested = r->layers_ingested();
    out->tokens = r->tokens();
    out->reused_tokens = r->reused_tokens();
    out->gpu_bytes = r->gpu_bytes();
    out->host_bytes = r->host_bytes();
    out->damaged = r->damaged() ? 1 : 0;
    CopyId(r->damage(), out->damage, sizeof(out->damage));
    out->tokens_lost = r->tokens_lost();
    out->ingest_parts_taken = r->ingest_parts_taken();
    out->selection_unit = r->selection_unit();
    CopyId(r->device(), out->device, sizeof(out->device));
    if (r->has_tensor_parallel()) {
      const v1::TensorParallelInfo& tp = r->tensor_parallel();
      CopyId(tp.session_id(), out->tp_session_id, sizeof(out->tp_session_id));
      out->tp_ranks = tp.ranks();
      out->tp_rank = tp.rank();
      out->tp_kv_head_begin = tp.kv_head_begin();
      out->tp_kv_head_end = tp.kv_head_end();
      out->tp_num_kv_heads = tp.num_kv_heads();
      out->tp_ranks_joined = tp.ranks_joined();
    }
    return Report(absl::OkStatus());
  });
}

int kvshade_close_session(kvshade_client* c, const char* session_id) {
  return Guard([&] {
    if (c == nullptr) return Bad("client must not be NULL");
    if (!IdOk(session_id)) return Bad("session_id is NULL or too long");
    return Report(c->impl->CloseSession(session_id));
  });
}

int kvshade_get_session_selection(kvshade_client* c, const char* session_id, kvshade_session_selection** out) {
  return Guard([&] {
    if (c == nullptr || out == nullptr) return Bad("client and out must not be NULL");
    *out = nullptr;
    if (!IdOk(session_id)) return Bad("session_id is NULL or too long");
    v1::GetSessionRequest req;
    req.set_session_id(session_id);
    req.set_include_selection(true);
    auto r = c->impl->GetSession(req);
    if (!r.ok()) return Report(r.status());
    auto res = std::make_unique<kvshade_session_selection>();
    const v1::SelectionHealth& h = r->selection();
    res->samples = h.samples();
    res->recall = h.recall();
    for (const v1::LayerSelection& l : h.layers()) {
      kvshade_layer_selection o;
      std::memset(&o, 0, sizeof(o));
      o.layer = l.layer();
      o.samples = l.samples();
      o.recall = l.recall();
      o.recent_recall = l.recent_recall();
      o.budget = l.budget();
      // Only a fallback (widen, exact) is one; REPORT never puts a layer under one.
      o.fallback = l.fallback() == v1::RECALL_ACTION_WIDEN || l.fallback() == v1::RECALL_ACTION_EXACT
                       ? static_cast<int32_t>(l.fallback())
                       : 0;
      o.actions = l.actions();
      res->layers.push_back(o);
    }
    *out = res.release();
    return Report(absl::OkStatus());
  });
}

void kvshade_session_selection_summary(const kvshade_session_selection* s, uint64_t* samples, double* recall) {
  if (samples != nullptr) *samples = s == nullptr ? 0 : s->samples;
  if (recall != nullptr) *recall = s == nullptr ? 0.0 : s->recall;
}

size_t kvshade_session_selection_count(const kvshade_session_selection* s) {
  return s == nullptr ? 0 : s->layers.size();
}

int kvshade_session_selection_layer(const kvshade_session_selection* s, size_t i, kvshade_layer_selection* out) {
  if (s == nullptr || out == nullptr) return Bad("selection and out must not be NULL");
  if (i >= s->layers.size()) {
    return Report(absl::OutOfRangeError(absl::StrCat("layer index ", i, " >= count ", s->layers.size())));
  }
  *out = s->layers[i];
  return Report(absl::OkStatus());
}

void kvshade_session_selection_free(kvshade_session_selection* s) { delete s; }

int kvshade_ingest_begin(kvshade_client* c, const char* session_id, kvshade_ingest** out) {
  return Guard([&] {
    if (c == nullptr || out == nullptr) return Bad("client and out must not be NULL");
    *out = nullptr;
    if (!IdOk(session_id)) return Bad("session_id is NULL or too long");
    auto w = c->impl->StartIngest(session_id);
    if (!w.ok()) return Report(w.status());
    *out = new kvshade_ingest{*std::move(w)};
    return Report(absl::OkStatus());
  });
}

int kvshade_ingest_layer_part_cuda_ipc(kvshade_ingest* ing, uint32_t layer, uint64_t token_offset,
                                       int32_t last_part, int64_t n, int32_t h, int32_t d, const void* k_handle,
                                       uint64_t k_offset, const void* v_handle, uint64_t v_offset) {
  return Guard([&] {
    if (ing == nullptr) return Bad("ingest must not be NULL");
    if (ing->committed) return Report(absl::FailedPreconditionError("ingest stream already committed"));
    if (n <= 0 || h <= 0 || d <= 0) return Bad(absl::StrCat("n, h, d must be > 0, got ", n, ", ", h, ", ", d));
    if (k_handle == nullptr || v_handle == nullptr) return Bad("k_handle and v_handle must not be NULL");
    v1::IngestLayer part;
    part.set_layer(layer);
    part.set_token_offset(token_offset);
    part.set_last_part(last_part != 0);
    for (auto [t, handle, offset] : {std::tuple{part.mutable_k(), k_handle, k_offset},
                                     std::tuple{part.mutable_v(), v_handle, v_offset}}) {
      t->add_shape(n);
      t->add_shape(h);
      t->add_shape(d);
      t->set_dtype(v1::DTYPE_BF16);
      t->mutable_cuda_ipc()->set_handle(static_cast<const char*>(handle), 64);
      t->mutable_cuda_ipc()->set_offset(offset);
    }
    return Report(ing->writer->Write(part));
  });
}

int kvshade_ingest_layer_cuda_ipc(kvshade_ingest* ing, uint32_t layer, int64_t n, int32_t h, int32_t d,
                                  const void* k_handle, uint64_t k_offset, const void* v_handle,
                                  uint64_t v_offset) {
  return kvshade_ingest_layer_part_cuda_ipc(ing, layer, 0, 1, n, h, d, k_handle, k_offset, v_handle, v_offset);
}

int kvshade_ingest_layer_part(kvshade_ingest* ing, uint32_t layer, uint64_t token_offset, int32_t last_part,
                              int32_t dtype, int64_t n, int32_t h, int32_t d, const void* k, const void* v,
                              const void* obs, int64_t w, int32_t hq) {
  return Guard([&] {
    if (ing == nullptr) return Bad("ingest must not be NULL");
    if (ing->committed) return Report(absl::FailedPreconditionError("ingest stream already committed"));
    const int64_t eb = DTypeBytes(dtype);
    if (eb == 0) return Bad(absl::StrCat("dtype must be 1 (bf16), 2 (fp16) or 3 (fp32), got ", dtype));
    if (n <= 0 || h <= 0 || d <= 0) return Bad(absl::StrCat("n, h, d must be > 0, got ", n, ", ", h, ", ", d));
    if (k == nullptr || v == nullptr) return Bad("k and v must not be NULL");
    if (obs != nullptr && (w <= 0 || hq <= 0)) {
      return Bad(absl::StrCat("obs given: w and hq must be > 0, got ", w, " and ", hq));
    }
    if (obs != nullptr && last_part == 0) return Bad("obs may only come with the layer's last part");
    // Parts of at most ~8 MiB of K and V together on the wire, split by token range; only
    // the wire part that ends this call's range carries last_part (and the observation
    // queries).
    const int64_t row_bytes = static_cast<int64_t>(h) * d * eb;
    const int64_t per_part = std::max<int64_t>(1, (int64_t{8} << 20) / (2 * row_bytes));
    for (int64_t t0 = 0; t0 < n; t0 += per_part) {
      const int64_t m = std::min(per_part, n - t0);
      const bool last = t0 + m == n && last_part != 0;
      v1::IngestLayer part;
      part.set_layer(layer);
      part.set_token_offset(token_offset + static_cast<uint64_t>(t0));
      *part.mutable_k() = MakeTensor({m, h, d}, dtype, static_cast<const char*>(k) + t0 * row_bytes);
      *part.mutable_v() = MakeTensor({m, h, d}, dtype, static_cast<const char*>(v) + t0 * row_bytes);
      if (last && obs != nullptr) *part.mutable_observation_queries() = MakeTensor({w, hq, d}, dtype, obs);
      part.set_last_part(last);
      if (absl::Status s = ing->writer->Write(part); !s.ok()) return Report(s);
    }
    return Report(absl::OkStatus());
  });
}

int kvshade_ingest_layer(kvshade_ingest* ing, uint32_t layer, int32_t dtype, int64_t n, int32_t h, int32_t d,
                         const void* k, const void* v, const void* obs, int64_t w, int32_t hq) {
  return kvshade_ingest_layer_part(ing, layer, 0, 1, dtype, n, h, d, k, v, obs, w, hq);
}

int kvshade_ingest_commit(kvshade_ingest* ing, uint64_t* tokens) {
  return Guard([&] {
    if (ing == nullptr) return Bad("ingest must not be NULL");
    if (ing->committed) return Report(absl::FailedPreconditionError("ingest stream already committed"));
    ing->committed = true;  // the stream is finished whatever the answer
    auto r = ing->writer->Commit();
    if (!r.ok()) return Report(r.status());
    if (tokens != nullptr) *tokens = r->tokens();
    return Report(absl::OkStatus());
  });
}

void kvshade_ingest_free(kvshade_ingest* ing) {
  try {
    delete ing;
  } catch (...) {
  }
}

int kvshade_append(kvshade_client* c, const char* session_id, const char* attachment_id, const int32_t* token_ids,
                   int64_t t, uint32_t num_layers, int32_t dtype, int32_t h, int32_t d, const void* k, const void* v,
                   uint64_t* tokens) {
  return Guard([&] {
    if (c == nullptr) return Bad("client must not be NULL");
    if (!IdOk(session_id)) return Bad("session_id is NULL or too long");
    if (attachment_id != nullptr && !IdOk(attachment_id)) return Bad("attachment_id is too long");
    const int64_t eb = DTypeBytes(dtype);
    if (eb == 0) return Bad(absl::StrCat("dtype must be 1 (bf16), 2 (fp16) or 3 (fp32), got ", dtype));
    if (t <= 0 || h <= 0 || d <= 0 || num_layers == 0) {
      return Bad(absl::StrCat("t, num_layers, h, d must be > 0, got ", t, ", ", num_layers, ", ", h, ", ", d));
    }
    if (token_ids == nullptr || k == nullptr || v == nullptr) return Bad("token_ids, k and v must not be NULL");
    v1::AppendTokensRequest req;
    req.set_session_id(session_id);
    if (attachment_id != nullptr) req.set_attachment_id(attachment_id);
    req.mutable_token_ids()->Add(token_ids, token_ids + t);
    const int64_t layer_bytes = t * h * d * eb;
    for (uint32_t l = 0; l < num_layers; ++l) {
      v1::LayerKV* kv = req.add_layers();
      kv->set_layer(l);
      *kv->mutable_k() = MakeTensor({t, h, d}, dtype, static_cast<const char*>(k) + l * layer_bytes);
      *kv->mutable_v() = MakeTensor({t, h, d}, dtype, static_cast<const char*>(v) + l * layer_bytes);
    }
    auto r = c->impl->AppendTokens(req);
    if (!r.ok()) return Report(r.status());
    if (tokens != nullptr) *tokens = r->tokens();
    return Report(absl::OkStatus());
  });
}

void kvshade_attach_options_init(kvshade_attach_options* o) {
  if (o != nullptr) std::memset(o, 0, sizeof(*o));
}

int kvshade_attach_ex(kvshade_client* c, const kvshade_attach_options* o, kvshade_attachment* out) {
  return Guard([&] {
    if (c == nullptr || o == nullptr || out == nullptr) return Bad("client, options and out must not be NULL");
    if (!IdOk(o->session_id)) return Bad("session_id is NULL or too long");
    if (o->delivery < KVSHADE_DELIVERY_INLINE || o->delivery > KVSHADE_DELIVERY_CUDA_IPC) {
      return Bad(absl::StrCat("delivery must be 0 (inline), 1 (ucx_rma) or 2 (cuda_ipc), got ", o->delivery));
    }
    v1::AttachRequest req;
    req.set_session_id(o->session_id);
    if (o->worker_id != nullptr) req.set_worker_id(o->worker_id);
    req.set_lease_ms(o->lease_ms);
    req.set_writer(o->writer != 0);
    req.set_delivery(static_cast<v1::DeliveryMode>(o->delivery));
    if (o->device != nullptr) req.set_device(o->device);
    if (o->delivery == KVSHADE_DELIVERY_CUDA_IPC) {
      v1::CudaIpcSlotBuffers* ipc = req.mutable_cuda_ipc();
      ipc->set_k_handle(reinterpret_cast<const char*>(o->cuda_ipc_k_handle), sizeof(o->cuda_ipc_k_handle));
      ipc->set_k_offset(o->cuda_ipc_k_offset);
      ipc->set_v_handle(reinterpret_cast<const char*>(o->cuda_ipc_v_handle), sizeof(o->cuda_ipc_v_handle));
      ipc->set_v_offset(o->cuda_ipc_v_offset);
      ipc->set_bytes(o->cuda_ipc_bytes);
    }
    auto r = c->impl->Attach(req);
    if (!r.ok()) return Report(r.status());
    std::memset(out, 0, sizeof(*out));
    CopyId(r->attachment_id(), out->attachment_id, KVSHADE_ID_CAP);
    out->lease_expires_unix_ms = r->lease_expires_unix_ms();
    out->chunk_size = r->chunk_size();
    out->slots_per_head = r->slots_per_head();
    out->local_window = r->local_window();
    out->writer = r->writer() ? 1 : 0;
    out->data_plane = r->data_plane_address().empty() ? 0 : 1;
    out->delivery = static_cast<int32_t>(r->delivery());
    out->slot_buffer_bytes = r->slot_buffer_bytes();
    out->slot_tokens = r->slot_tokens() != 0 ? r->slot_tokens() : r->chunk_size();
    return Report(absl::OkStatus());
  });
}

int kvshade_attach(kvshade_client* c, const char* session_id, const char* worker_id, uint32_t lease_ms,
                   int32_t writer, kvshade_attachment* out) {
  kvshade_attach_options o;
  kvshade_attach_options_init(&o);
  o.session_id = session_id;
  o.worker_id = worker_id;
  o.lease_ms = lease_ms;
  o.writer = writer;
  return kvshade_attach_ex(c, &o, out);
}

int kvshade_register_slot_buffers(kvshade_client* c, const char* attachment_id, void* k, void* v,
                                  uint64_t bytes) {
  return Guard([&] {
    if (c == nullptr) return Bad("client must not be NULL");
    if (!IdOk(attachment_id)) return Bad("attachment_id is NULL or too long");
    if (k == nullptr || v == nullptr || bytes == 0) return Bad("k and v must not be NULL and bytes must be > 0");
    return Report(c->impl->RegisterSlotBuffers(attachment_id, k, v, static_cast<size_t>(bytes)));
  });
}

int kvshade_detach(kvshade_client* c, const char* attachment_id) {
  return Guard([&] {
    if (c == nullptr) return Bad("client must not be NULL");
    if (!IdOk(attachment_id)) return Bad("attachment_id is NULL or too long");
    return Report(c->impl->Detach(attachment_id));
  });
}

int kvshade_local_decoder_open(kvshade_client* c, size_t n, const char* const* attachment_ids,
                               const char* backend, int32_t local_capacity, int32_t count_hits,
                               kvshade_local_decoder** out) {
  return Guard([&] {
    if (c == nullptr || out == nullptr) return Bad("client and out must not be NULL");
    *out = nullptr;
    if (n > 0 && attachment_ids == nullptr) return Bad("attachment_ids must not be NULL when n > 0");
    std::vector<std::string> ids;
    for (size_t i = 0; i < n; ++i) {
      if (!IdOk(attachment_ids[i])) return Bad("an attachment id is NULL or too long");
      ids.emplace_back(attachment_ids[i]);
    }
    kvshade::client::LocalDecoderOptions o;
    if (backend != nullptr && backend[0] != 0) o.backend = backend;
    if (local_capacity > 0) o.local_capacity = local_capacity;
    o.count_hits = count_hits != 0;
    auto r = kvshade::client::LocalDecoder::Open(c->impl.get(), ids, o);
    if (!r.ok()) return Report(r.status());
    *out = new kvshade_local_decoder{*std::move(r)};
    return int(KVSHADE_OK);
  });
}

int kvshade_local_decoder_attend(kvshade_local_decoder* dec, uint32_t layer, const void* q,
                                 const void* k_new, const void* v_new, float* out, void* stream) {
  return Guard([&] {
    if (dec == nullptr) return Bad("decoder must not be NULL");
    return Report(dec->impl->Attend(static_cast<int>(layer), static_cast<const kvshade::kernels::bf16*>(q),
                                    static_cast<const kvshade::kernels::bf16*>(k_new),
                                    static_cast<const kvshade::kernels::bf16*>(v_new), out,
                                    kvshade::kernels::Stream{stream}));
  });
}

int kvshade_local_decoder_attend_lse(kvshade_local_decoder* dec, uint32_t layer, const void* q,
                                     const void* k_new, const void* v_new, float* out, float* lse,
                                     void* stream) {
  return Guard([&] {
    if (dec == nullptr) return Bad("decoder must not be NULL");
    return Report(dec->impl->Attend(static_cast<int>(layer), static_cast<const kvshade::kernels::bf16*>(q),
                                    static_cast<const kvshade::kernels::bf16*>(k_new),
                                    static_cast<const kvshade::kernels::bf16*>(v_new), out,
                                    kvshade::kernels::Stream{stream}, lse));
  });
}

int kvshade_local_decoder_advance(kvshade_local_decoder* dec) {
  return Guard([&] {
    if (dec == nullptr) return Bad("decoder must not be NULL");
    return Report(dec->impl->Advance());
  });
}

int kvshade_local_decoder_refresh(kvshade_local_decoder* dec) {
  return Guard([&] {
    if (dec == nullptr) return Bad("decoder must not be NULL");
    return Report(dec->impl->Refresh());
  });
}

int kvshade_local_decoder_info(kvshade_local_decoder* dec, int32_t* batch, int32_t* layers,
                               int32_t* kv_heads, int32_t* query_heads, int32_t* head_dim,
                               uint64_t* selected, uint64_t* hits, uint64_t* steps) {
  return Guard([&] {
    if (dec == nullptr) return Bad("decoder must not be NULL");
    kvshade::client::LocalDecoder& d = *dec->impl;
    if (batch) *batch = d.batch();
    if (layers) *layers = d.layers();
    if (kv_heads) *kv_heads = d.kv_heads();
    if (query_heads) *query_heads = d.query_heads();
    if (head_dim) *head_dim = d.head_dim();
    auto st = d.Stats();
    if (!st.ok()) return Report(st.status());
    if (selected) *selected = st->selected;
    if (hits) *hits = st->hits;
    if (steps) *steps = st->steps;
    return int(KVSHADE_OK);
  });
}

int kvshade_local_decoder_join(kvshade_local_decoder* dec, const char* attachment_id, int32_t* index) {
  return Guard([&] {
    if (dec == nullptr) return Bad("decoder must not be NULL");
    if (!IdOk(attachment_id)) return Bad("attachment_id is NULL or too long");
    auto b = dec->impl->Join(attachment_id);
    if (!b.ok()) return Report(b.status());
    if (index) *index = *b;
    return int(KVSHADE_OK);
  });
}

int kvshade_local_decoder_prepare(kvshade_local_decoder* dec, const char* attachment_id,
                                  kvshade_prepared_sequence** out) {
  return Guard([&] {
    if (dec == nullptr || out == nullptr) return Bad("decoder and out must not be NULL");
    if (!IdOk(attachment_id)) return Bad("attachment_id is NULL or too long");
    *out = nullptr;
    auto p = dec->impl->Prepare(attachment_id);
    if (!p.ok()) return Report(p.status());
    *out = new kvshade_prepared_sequence{std::move(*p)};
    return int(KVSHADE_OK);
  });
}

int kvshade_local_decoder_join_prepared(kvshade_local_decoder* dec, kvshade_prepared_sequence* prepared,
                                        int32_t* index) {
  std::unique_ptr<kvshade_prepared_sequence> owned(prepared);  // taken whatever happens
  return Guard([&] {
    if (dec == nullptr) return Bad("decoder must not be NULL");
    if (owned == nullptr) return Bad("prepared must not be NULL");
    auto b = dec->impl->Join(std::move(owned->impl));
    if (!b.ok()) return Report(b.status());
    if (index) *index = *b;
    return int(KVSHADE_OK);
  });
}

void kvshade_prepared_sequence_free(kvshade_prepared_sequence* prepared) { delete prepared; }

int kvshade_local_decoder_leave(kvshade_local_decoder* dec, uint32_t index) {
  return Guard([&] {
    if (dec == nullptr) return Bad("decoder must not be NULL");
    return Report(dec->impl->Leave(static_cast<int>(index)));
  });
}

int kvshade_local_decoder_extend(kvshade_local_decoder* dec, uint32_t index, uint32_t n, const void* k,
                                 const void* v, void* stream) {
  return Guard([&] {
    if (dec == nullptr) return Bad("decoder must not be NULL");
    if (n > uint32_t(INT32_MAX) || index > uint32_t(INT32_MAX)) return Bad("index or n out of range");
    return Report(dec->impl->Extend(static_cast<int>(index), static_cast<int>(n),
                                    static_cast<const kvshade::kernels::bf16*>(k),
                                    static_cast<const kvshade::kernels::bf16*>(v), kvshade::kernels::Stream{stream}));
  });
}

int kvshade_local_decoder_attend_chunks(kvshade_local_decoder* dec, uint32_t layer, const void* q,
                                        const int32_t* chunks, int32_t m, const void* k_new,
                                        const void* v_new, float* out, float* lse, void* stream) {
  return Guard([&] {
    if (dec == nullptr) return Bad("decoder must not be NULL");
    return Report(dec->impl->AttendChunks(static_cast<int>(layer), static_cast<const kvshade::kernels::bf16*>(q),
                                          chunks, m, static_cast<const kvshade::kernels::bf16*>(k_new),
                                          static_cast<const kvshade::kernels::bf16*>(v_new), out,
                                          kvshade::kernels::Stream{stream}, lse));
  });
}

int kvshade_local_decoder_selected(kvshade_local_decoder* dec, uint32_t b, uint32_t layer, int32_t* out,
                                   size_t cap, int32_t* k) {
  return Guard([&] {
    if (dec == nullptr) return Bad("decoder must not be NULL");
    auto sel = dec->impl->Selected(static_cast<int>(b), static_cast<int>(layer));
    if (!sel.ok()) return Report(sel.status());
    if (k) *k = dec->impl->slots_per_head(static_cast<int>(b), static_cast<int>(layer));
    if (out != nullptr) std::copy_n(sel->begin(), std::min(cap, sel->size()), out);
    return int(KVSHADE_OK);
  });
}

int kvshade_local_decoder_selection(kvshade_local_decoder* dec, uint32_t b, kvshade_layer_selection* out,
                                    size_t cap, size_t* n) {
  return Guard([&] {
    if (dec == nullptr) return Bad("decoder must not be NULL");
    auto layers = dec->impl->Selection(static_cast<int>(b));
    if (!layers.ok()) return Report(layers.status());
    if (n) *n = layers->size();
    for (size_t i = 0; i < layers->size() && i < cap && out != nullptr; ++i) {
      const kvshade::decode::LayerHealth& l = (*layers)[i];
      out[i] = kvshade_layer_selection{static_cast<uint32_t>(l.layer), l.samples, l.recall,
                                       l.recent_recall, static_cast<uint32_t>(l.budget),
                                       static_cast<int32_t>(l.fallback), l.actions};
    }
    return int(KVSHADE_OK);
  });
}

const char* kvshade_local_decoder_backend(const kvshade_local_decoder* dec) {
  if (dec == nullptr) return "";
  return dec->impl->backend_name().data();  // a string literal of the backend, or ""
}

void kvshade_local_decoder_free(kvshade_local_decoder* dec) { delete dec; }

int kvshade_commit_staged(kvshade_client* c, const char* attachment_id, int32_t stage_token_id, int32_t discard,
                          uint64_t* tokens) {
  return Guard([&] {
    if (c == nullptr) return Bad("client must not be NULL");
    if (!IdOk(attachment_id)) return Bad("attachment_id is NULL or too long");
    auto r = c->impl->CommitStaged(attachment_id, stage_token_id, discard != 0);
    if (!r.ok()) return Report(r.status());
    if (tokens != nullptr) *tokens = *r;
    return Report(absl::OkStatus());
  });
}

int kvshade_get_static_set(kvshade_client* c, const char* attachment_id, uint32_t layer, kvshade_static_set** out) {
  return Guard([&] {
    if (c == nullptr || out == nullptr) return Bad("client and out must not be NULL");
    *out = nullptr;
    if (!IdOk(attachment_id)) return Bad("attachment_id is NULL or too long");
    auto r = c->impl->GetStaticSet(attachment_id, layer);
    if (!r.ok()) return Report(r.status());
    auto s = std::make_unique<kvshade_static_set>();
    v1::DType rows_dtype = v1::DTYPE_UNSPECIFIED;  // one for all four (kvshade_static_set_rows)
    for (const v1::Tensor* t : {&r->k(), &r->v(), &r->tail_k(), &r->tail_v()}) {
      if (t->shape_size() == 0 && t->data().empty()) continue;  // none
      if (absl::Status st = ValidRows(*t); !st.ok()) return Report(st);
      if (rows_dtype != v1::DTYPE_UNSPECIFIED && t->dtype() != rows_dtype) {
        return Report(absl::InternalError("malformed static set from the server (rows of two dtypes)"));
      }
      rows_dtype = t->dtype();
    }
    if (r->k().shape_size() == 3) {
      s->h = r->k().shape(0);
      s->s_max = r->k().shape(1);
      s->d = r->k().shape(2);
    }
    if (r->tail_k().shape_size() == 3) {
      s->t = r->tail_k().shape(0);
      if (s->h == 0) s->h = r->tail_k().shape(1);
      if (s->d == 0) s->d = r->tail_k().shape(2);
    }
    // Consumers index k/v by [h, s_max, d]: the rows keep that size even when empty.
    const size_t n_static = static_cast<size_t>(s->h * s->s_max * s->d);
    const size_t n_tail = static_cast<size_t>(s->t * s->h * s->d);
    for (auto [t, dst, n] : {std::tuple{r->mutable_k(), &s->k, n_static}, {r->mutable_v(), &s->v, n_static},
                             {r->mutable_tail_k(), &s->tail_k, n_tail}, {r->mutable_tail_v(), &s->tail_v, n_tail}}) {
      if (static_cast<size_t>(t->data().size()) > n * (t->dtype() == v1::DTYPE_FP32 ? 4 : 2)) {
        return Report(absl::InternalError("malformed static set from the server (shapes disagree)"));
      }
      // Rows a set lacks (no static rows, or no tail) read as its other rows' dtype.
      dst->Take(t, n, rows_dtype == v1::DTYPE_UNSPECIFIED ? KVSHADE_DTYPE_FP32 : static_cast<int32_t>(rows_dtype));
    }
    s->lengths.assign(r->lengths().begin(), r->lengths().end());
    s->lengths.resize(static_cast<size_t>(s->h));
    s->positions.assign(r->positions().begin(), r->positions().end());
    s->positions.resize(static_cast<size_t>(s->h * s->s_max), -1);
    s->tail_positions.assign(r->tail_positions().begin(), r->tail_positions().end());
    s->tail_positions.resize(static_cast<size_t>(s->t), -1);
    *out = s.release();
    return Report(absl::OkStatus());
  });
}

void kvshade_static_set_shape(const kvshade_static_set* s, int64_t* h, int64_t* s_max, int64_t* d, int64_t* t) {
  if (s == nullptr) return;
  if (h != nullptr) *h = s->h;
  if (s_max != nullptr) *s_max = s->s_max;
  if (d != nullptr) *d = s->d;
  if (t != nullptr) *t = s->t;
}

void kvshade_static_set_data(const kvshade_static_set* s, const float** k, const float** v, const uint32_t** lengths,
                             const float** tail_k, const float** tail_v) {
  if (s == nullptr) return;
  std::lock_guard<std::mutex> lock(s->mu);
  if (k != nullptr) *k = s->k.Floats();
  if (v != nullptr) *v = s->v.Floats();
  if (lengths != nullptr) *lengths = s->lengths.data();
  if (tail_k != nullptr) *tail_k = s->tail_k.Floats();
  if (tail_v != nullptr) *tail_v = s->tail_v.Floats();
}

void kvshade_static_set_rows(const kvshade_static_set* s, int32_t* dtype, const void** k, const void** v,
                             const void** tail_k, const void** tail_v) {
  if (s == nullptr) return;
  // The static rows and the tail share the session's dtype (fp32 for a set without rows).
  if (dtype != nullptr) *dtype = s->k.dtype;
  if (k != nullptr) *k = s->k.bytes.data();
  if (v != nullptr) *v = s->v.bytes.data();
  if (tail_k != nullptr) *tail_k = s->tail_k.bytes.data();
  if (tail_v != nullptr) *tail_v = s->tail_v.bytes.data();
}

void kvshade_static_set_positions(const kvshade_static_set* s, const int64_t** positions,
                                  const int64_t** tail_positions) {
  if (s == nullptr) return;
  if (positions != nullptr) *positions = s->positions.data();
  if (tail_positions != nullptr) *tail_positions = s->tail_positions.data();
}

void kvshade_static_set_free(kvshade_static_set* s) { delete s; }

int kvshade_select(kvshade_client* c, uint32_t layer, size_t n, const char* const* ids, int32_t dtype, int32_t hq,
                   int32_t d, const void* q, kvshade_select_result** out) {
  return kvshade_select_ex(c, layer, n, ids, dtype, hq, d, q, nullptr, KVSHADE_SELECT_SYNCHRONOUS, out);
}

int kvshade_select_chunks(kvshade_client* c, uint32_t layer, size_t n, const char* const* ids, int32_t h,
                          int32_t m, const int32_t* chunks, kvshade_select_result** out) {
  return Guard([&] {
    if (c == nullptr || out == nullptr) return Bad("client and out must not be NULL");
    *out = nullptr;
    if (n > 0 && (ids == nullptr || chunks == nullptr)) return Bad("attachment_ids and chunks must not be NULL");
    if (h < 1 || m < 0) return Bad(absl::StrCat("h must be >= 1 and m >= 0, got h = ", h, ", m = ", m));
    v1::SelectAndReconstructRequest req;
    req.set_layer(layer);
    const size_t block = size_t(h) * size_t(m);
    for (size_t i = 0; i < n; ++i) {
      if (ids[i] == nullptr) return Bad(absl::StrCat("attachment_ids[", i, "] is NULL"));
      v1::SelectQuery* sq = req.add_queries();
      sq->set_attachment_id(ids[i]);
      v1::Tensor* t = sq->mutable_chunks();
      t->add_shape(h);
      t->add_shape(m);
      t->set_dtype(v1::DTYPE_INT32);
      t->set_data(reinterpret_cast<const char*>(chunks + i * block), block * sizeof(int32_t));
    }
    auto r = c->impl->SelectAndReconstruct(req);
    if (!r.ok()) return Report(r.status());
    return DecodeSelect(&*r, out);
  });
}

size_t kvshade_select_count(const kvshade_select_result* r) { return r == nullptr ? 0 : r->deltas.size(); }

namespace {

// *out from delta dl, its keys and values left NULL.
void FillDelta(const kvshade_select_result::Delta& dl, kvshade_slot_delta* out) {
  out->attachment_id = dl.attachment_id.c_str();
  out->m = dl.head.size();
  out->head = dl.head.data();
  out->slot = dl.slot.data();
  out->chunk = dl.chunk.data();
  out->position = dl.position.data();
  out->keys = nullptr;
  out->values = nullptr;
  out->chunk_size = dl.chunk_size;
  out->head_dim = dl.head_dim;
  out->hits = dl.hits;
  out->selected = dl.selected;
  out->delivered = dl.delivered ? 1 : 0;
  out->fallback = dl.fallback ? 1 : 0;
  out->tokens = dl.tokens;
}

int CheckDeltaIndex(const kvshade_select_result* r, size_t i) {
  if (i >= r->deltas.size()) {
    return Report(absl::OutOfRangeError(absl::StrCat("delta index ", i, " >= count ", r->deltas.size())));
  }
  return KVSHADE_OK;
}

}  // namespace

int kvshade_select_delta(const kvshade_select_result* r, size_t i, kvshade_slot_delta* out) {
  if (r == nullptr || out == nullptr) return Bad("result and out must not be NULL");
  if (int rc = CheckDeltaIndex(r, i); rc != KVSHADE_OK) return rc;
  const auto& dl = r->deltas[i];
  FillDelta(dl, out);
  if (!dl.delivered) {
    std::lock_guard<std::mutex> lock(r->mu);
    out->keys = dl.keys.Floats();
    out->values = dl.values.Floats();
  }
  return Report(absl::OkStatus());
}

int kvshade_select_delta_rows(const kvshade_select_result* r, size_t i, kvshade_slot_delta* out, int32_t* dtype,
                              const void** keys, const void** values) {
  if (r == nullptr || out == nullptr) return Bad("result and out must not be NULL");
  if (int rc = CheckDeltaIndex(r, i); rc != KVSHADE_OK) return rc;
  const auto& dl = r->deltas[i];
  FillDelta(dl, out);
  const bool rows = !dl.delivered && dl.keys.n > 0;
  if (dtype != nullptr) *dtype = rows ? dl.keys.dtype : 0;
  if (keys != nullptr) *keys = rows ? dl.keys.bytes.data() : nullptr;
  if (values != nullptr) *values = rows ? dl.values.bytes.data() : nullptr;
  return Report(absl::OkStatus());
}

void kvshade_select_free(kvshade_select_result* r) { delete r; }

// The request of kvshade_select_ex / kvshade_select_async_ex: checks the arguments
// (reporting the first bad one) and builds *req.
int MakeSelectEx(uint32_t layer, size_t n, const char* const* ids, int32_t dtype, int32_t hq, int32_t d,
                 const void* q, const kvshade_new_tokens* tokens, int32_t purpose,
                 v1::SelectAndReconstructRequest* req) {
  if (int rc = CheckQueries(n, ids, dtype, hq, d, q); rc != KVSHADE_OK) return rc;
  if (int rc = CheckNewTokens(tokens, true); rc != KVSHADE_OK) return rc;
  if (!v1::SelectPurpose_IsValid(purpose)) {
    return Bad(absl::StrCat("purpose must be a KVSHADE_SELECT_* value, got ", purpose));
  }
  *req = MakeSelect(layer, n, ids, dtype, hq, d, q);
  for (size_t i = 0; i < n; ++i) {
    v1::SelectQuery* sq = req->mutable_queries(static_cast<int>(i));
    AddNewToken(tokens, i, dtype, d, true, sq);
    sq->set_purpose(static_cast<v1::SelectPurpose>(purpose));
  }
  return KVSHADE_OK;
}

int kvshade_select_ex(kvshade_client* c, uint32_t layer, size_t n, const char* const* ids, int32_t dtype,
                      int32_t hq, int32_t d, const void* q, const kvshade_new_tokens* tokens, int32_t purpose,
                      kvshade_select_result** out) {
  return Guard([&] {
    if (c == nullptr || out == nullptr) return Bad("client and out must not be NULL");
    *out = nullptr;
    v1::SelectAndReconstructRequest req;
    if (int rc = MakeSelectEx(layer, n, ids, dtype, hq, d, q, tokens, purpose, &req); rc != KVSHADE_OK) return rc;
    auto r = c->impl->SelectAndReconstruct(req);
    if (!r.ok()) return Report(r.status());
    return DecodeSelect(&*r, out);
  });
}

int kvshade_select_async_ex(kvshade_client* c, uint32_t layer, size_t n, const char* const* ids, int32_t dtype,
                            int32_t hq, int32_t d, const void* q, const kvshade_new_tokens* tokens,
                            int32_t purpose, kvshade_select_future** out) {
  return Guard([&] {
    if (c == nullptr || out == nullptr) return Bad("client and out must not be NULL");
    *out = nullptr;
    v1::SelectAndReconstructRequest req;
    if (int rc = MakeSelectEx(layer, n, ids, dtype, hq, d, q, tokens, purpose, &req); rc != KVSHADE_OK) return rc;
    auto f = std::make_unique<kvshade_select_future>();
    f->f = c->impl->SelectAndReconstructAsync(req);
    *out = f.release();
    return Report(absl::OkStatus());
  });
}

int kvshade_attend_ex(kvshade_client* c, uint32_t layer, size_t n, const char* const* ids, int32_t dtype,
                      int32_t hq, int32_t d, const void* q, const kvshade_new_tokens* tokens, float* out,
                      float* lse, uint64_t* lengths) {
  return Guard([&] {
    if (c == nullptr || out == nullptr) return Bad("client and out must not be NULL");
    if (int rc = CheckQueries(n, ids, dtype, hq, d, q); rc != KVSHADE_OK) return rc;
    if (int rc = CheckNewTokens(tokens, false); rc != KVSHADE_OK) return rc;
    v1::AttendRequest req = MakeAttend(layer, n, ids, dtype, hq, d, q);
    for (size_t i = 0; i < n; ++i) AddNewToken(tokens, i, dtype, d, false, req.mutable_queries(static_cast<int>(i)));
    auto r = c->impl->Attend(req);
    if (!r.ok()) return Report(r.status());
    if (int rc = DecodeAttend(*r, n, static_cast<size_t>(hq) * d, out); rc != KVSHADE_OK) return rc;
    if (lse != nullptr) {
      if (r->lse_size() != static_cast<int>(n)) {
        return Report(absl::InternalError(absl::StrCat("server returned ", r->lse_size(), " lse for ", n, " queries")));
      }
      for (size_t i = 0; i < n; ++i) {
        auto f = kvshade::client::TensorToFloats(r->lse(static_cast<int>(i)));
        if (!f.ok()) return Report(f.status());
        if (f->size() != static_cast<size_t>(hq)) {
          return Report(absl::InternalError(absl::StrCat("server returned ", f->size(), " lse values for hq = ", hq)));
        }
        std::copy(f->begin(), f->end(), lse + i * static_cast<size_t>(hq));
      }
    }
    if (lengths != nullptr) {
      if (r->tokens_size() != static_cast<int>(n)) {
        return Report(absl::InternalError(absl::StrCat("server returned ", r->tokens_size(), " lengths for ", n, " queries")));
      }
      for (size_t i = 0; i < n; ++i) lengths[i] = r->tokens(static_cast<int>(i));
    }
    return Report(absl::OkStatus());
  });
}

int kvshade_attend(kvshade_client* c, uint32_t layer, size_t n, const char* const* ids, int32_t dtype, int32_t hq,
                   int32_t d, const void* q, float* out) {
  return kvshade_attend_ex(c, layer, n, ids, dtype, hq, d, q, nullptr, out, nullptr, nullptr);
}

int kvshade_select_async(kvshade_client* c, uint32_t layer, size_t n, const char* const* ids, int32_t dtype,
                         int32_t hq, int32_t d, const void* q, kvshade_select_future** out) {
  return kvshade_select_async_ex(c, layer, n, ids, dtype, hq, d, q, nullptr, KVSHADE_SELECT_SYNCHRONOUS, out);
}

int kvshade_select_future_ready(const kvshade_select_future* f, int32_t* ready) {
  return Guard([&] {
    if (f == nullptr || ready == nullptr) return Bad("future and ready must not be NULL");
    *ready = f->waited || f->f.wait_for(std::chrono::seconds(0)) == std::future_status::ready ? 1 : 0;
    return Report(absl::OkStatus());
  });
}

int kvshade_select_future_wait(kvshade_select_future* f, kvshade_select_result** out) {
  return Guard([&] {
    if (f == nullptr || out == nullptr) return Bad("future and out must not be NULL");
    *out = nullptr;
    if (f->waited) return Report(absl::FailedPreconditionError("select future already waited on"));
    f->waited = true;
    auto r = f->f.get();
    if (!r.ok()) return Report(r.status());
    return DecodeSelect(&*r, out);
  });
}

void kvshade_select_future_free(kvshade_select_future* f) { delete f; }

int kvshade_attend_async(kvshade_client* c, uint32_t layer, size_t n, const char* const* ids, int32_t dtype,
                         int32_t hq, int32_t d, const void* q, kvshade_attend_future** out) {
  return Guard([&] {
    if (c == nullptr || out == nullptr) return Bad("client and out must not be NULL");
    *out = nullptr;
    if (int rc = CheckQueries(n, ids, dtype, hq, d, q); rc != KVSHADE_OK) return rc;
    auto f = std::make_unique<kvshade_attend_future>();
    f->n = n;
    f->per = static_cast<size_t>(hq) * d;
    f->f = c->impl->AttendAsync(MakeAttend(layer, n, ids, dtype, hq, d, q));
    *out = f.release();
    return Report(absl::OkStatus());
  });
}

int kvshade_attend_future_ready(const kvshade_attend_future* f, int32_t* ready) {
  return Guard([&] {
    if (f == nullptr || ready == nullptr) return Bad("future and ready must not be NULL");
    *ready = f->waited || f->f.wait_for(std::chrono::seconds(0)) == std::future_status::ready ? 1 : 0;
    return Report(absl::OkStatus());
  });
}

int kvshade_attend_future_wait(kvshade_attend_future* f, float* out) {
  return Guard([&] {
    if (f == nullptr || out == nullptr) return Bad("future and out must not be NULL");
    if (f->waited) return Report(absl::FailedPreconditionError("attend future already waited on"));
    f->waited = true;
    auto r = f->f.get();
    if (!r.ok()) return Report(r.status());
    return DecodeAttend(*r, f->n, f->per, out);
  });
}

void kvshade_attend_future_free(kvshade_attend_future* f) { delete f; }

int kvshade_get_stats(kvshade_client* c, kvshade_stats* out) {
  return Guard([&] {
    if (c == nullptr || out == nullptr) return Bad("client and out must not be NULL");
    auto r = c->impl->Stats();
    if (!r.ok()) return Report(r.status());
    std::memset(out, 0, sizeof(*out));
    CopyId(r->backend(), out->backend, sizeof(out->backend));
    CopyId(r->version(), out->version, sizeof(out->version));
    out->sessions = r->sessions();
    out->attachments = r->attachments();
    out->segments = r->segments();
    out->device_bytes_used = r->device_bytes_used();
    out->device_bytes_budget = r->device_bytes_budget();
    out->host_bytes_used = r->host_bytes_used();
    out->host_bytes_budget = r->host_bytes_budget();
    out->spilled_bytes = r->spilled_bytes();
    out->prefix_lookups = r->prefix_lookups();
    out->prefix_hits = r->prefix_hits();
    out->chunks_selected = r->chunks_selected();
    out->chunk_hits = r->chunk_hits();
    return Report(absl::OkStatus());
  });
}

int kvshade_get_device_stats(kvshade_client* c, kvshade_device_stats* out, size_t n, size_t* count) {
  return Guard([&] {
    if (c == nullptr || count == nullptr) return Bad("client and count must not be NULL");
    if (out == nullptr && n > 0) return Bad(absl::StrCat("out is NULL with n = ", n));
    auto r = c->impl->Stats();
    if (!r.ok()) return Report(r.status());
    const size_t have = static_cast<size_t>(r->devices_size());
    for (size_t i = 0; i < std::min(n, have); ++i) {
      const v1::DeviceStats& d = r->devices(static_cast<int>(i));
      kvshade_device_stats& o = out[i];
      std::memset(&o, 0, sizeof(o));
      CopyId(d.device(), o.device, sizeof(o.device));
      CopyId(d.pci_bus_id(), o.pci_bus_id, sizeof(o.pci_bus_id));
      o.sessions = d.sessions();
      o.attachments = d.attachments();
      o.segments = d.segments();
      o.device_bytes_used = d.device_bytes_used();
      o.device_bytes_budget = d.device_bytes_budget();
      o.device_bytes_held = d.device_bytes_held();
      o.host_bytes_used = d.host_bytes_used();
      o.host_bytes_budget = d.host_bytes_budget();
      o.spilled_bytes = d.spilled_bytes();
      o.prefix_lookups = d.prefix_lookups();
      o.prefix_hits = d.prefix_hits();
      o.chunks_selected = d.chunks_selected();
      o.chunk_hits = d.chunk_hits();
    }
    *count = have;
    return Report(absl::OkStatus());
  });
}

// --- Placement ---------------------------------------------------------------------------

static_assert(KVSHADE_ROUTE_SEED == kvshade::client::kRouteSeed, "kvshade.h and router.h disagree");
static_assert(KVSHADE_DEFAULT_ROUTE_PREFIX_TOKENS == kvshade::client::kDefaultRoutePrefixTokens,
              "kvshade.h and router.h disagree");

int kvshade_route_prefix_key(const char* model_id, const int32_t* token_ids, size_t n,
                             uint32_t route_prefix_tokens, uint64_t* key) {
  return Guard([&] {
    if (model_id == nullptr || key == nullptr) return Bad("model_id and key must not be NULL");
    if (token_ids == nullptr && n > 0) return Bad("token_ids is NULL with n > 0");
    if (route_prefix_tokens == 0) route_prefix_tokens = kvshade::client::kDefaultRoutePrefixTokens;
    *key = kvshade::client::RoutePrefixKey(model_id, absl::MakeConstSpan(token_ids, n), route_prefix_tokens);
    return Report(absl::OkStatus());
  });
}

int kvshade_rendezvous_weight(const char* endpoint_name, uint64_t key, uint64_t* weight) {
  return Guard([&] {
    if (endpoint_name == nullptr || weight == nullptr) return Bad("endpoint_name and weight must not be NULL");
    *weight = kvshade::client::RendezvousWeight(endpoint_name, key);
    return Report(absl::OkStatus());
  });
}

int kvshade_rendezvous_rank(const char* const* names, size_t n, uint64_t key, size_t* order) {
  return Guard([&] {
    if (n == 0) return Report(absl::OkStatus());
    if (names == nullptr || order == nullptr) return Bad("names and order must not be NULL");
    std::vector<std::string> v;
    v.reserve(n);
    std::set<std::string> seen;
    for (size_t i = 0; i < n; ++i) {
      if (names[i] == nullptr) return Bad(absl::StrCat("names[", i, "] is NULL"));
      v.emplace_back(names[i]);
      if (!seen.insert(v.back()).second) {
        return Bad(absl::StrCat("endpoint names must be unique, '", v.back(), "' appears twice"));
      }
    }
    const std::vector<size_t> rank = kvshade::client::RendezvousRank(v, key);
    std::copy(rank.begin(), rank.end(), order);
    return Report(absl::OkStatus());
  });
}

}  // extern "C"
