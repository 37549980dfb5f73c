// Model and profile resolution and the inline-tensor conversions (see model.h).
#include "kvshade/service/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvshade/base/bf16.h"
#include "kvshade/base/status_macros.h"
#include "profile.h"

namespace kvshade::service {
namespace {

using kernels::bf16;

absl::Status Bad(std::string_view field, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(std::string(field), " ", std::string(what)));
}

size_t DTypeBytes(v1::DType d) {
  switch (d) {
    case v1::DTYPE_BF16:
    case v1::DTYPE_FP16: return 2;
    case v1::DTYPE_FP32:
    case v1::DTYPE_INT32: return 4;
    default: return 0;
  }
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

std::string ModelInfo::Fingerprint() const {
  const auto& r = rope;
  return absl::StrCat("model=", model_id, ";L=", layers, ";h=", shape.h, ";g=", shape.g,
                      ";d=", shape.d, ";rope=", r.theta, ",", r.rotary_dim, ",",
                      static_cast<int>(r.scaling), ",", static_cast<int>(r.pairing), ",",
                      r.factor, ",", r.low_freq_factor, ",", r.high_freq_factor, ",",
                      r.original_max_position, ",", r.beta_fast, ",", r.beta_slow,
                      // Only for a slice: whole models' fingerprints are unchanged.
                      sliced() ? absl::StrCat(";tp=", tp_kv_begin, "-", tp_kv_end, "/", tp_kv_heads)
                               : std::string());
}

std::string ProfileInfo::Fingerprint() const {
  return absl::StrCat("kind=", static_cast<int>(kind), ";r=", rank, ";C=", chunk_size,
                      ";O=", outliers, ";sink=", keep_sink ? 1 : 0, ";w=", local_window,
                      ";H=", heavy_chunks, ";codec=", static_cast<int>(codec.codec), "/",
                      codec.group, ";e=", energy_target, ";rw=", mini_recent_ratio,
                      ";hh=", mini_heavy_ratio, ";G=", kivi_group,
                      // Only when on: fingerprints (prefix keys) of profiles without
                      // signatures are those written before signatures existed.
                      key_signature_bits > 0 ? absl::StrCat(";sig=", key_signature_bits)
                                             : std::string());
}

decode::SelectionPolicy ProfileInfo::Policy() const {
  decode::SelectionPolicy p;
  p.sparse_budget = sparse_budget;
  p.rerank_factor = rerank_factor;
  p.mass_top_p = mass_top_p;
  p.mass_min_chunks = mass_min_chunks;
  p.recall_sample_rate = recall_sample_rate;
  p.recall_floor = recall_floor;
  p.recall_action = static_cast<decode::RecallAction>(static_cast<int>(recall_action));
  p.selection_unit = selection_unit;
  return p;
}

v1::Profile ProfileInfo::ToProto() const {
  v1::Profile p;
  p.set_kind(kind);
  p.set_rank(rank);
  p.set_chunk_size(chunk_size);
  p.set_sparse_budget(sparse_budget);
  p.set_outliers(outliers);
  p.set_keep_sink(keep_sink);
  p.set_local_window(local_window);
  p.set_heavy_chunks(heavy_chunks);
  p.set_value_codec(CodecToProto(codec.codec));
  p.set_min_tokens(min_tokens);
  p.set_refactor_threshold(refactor_threshold);
  p.set_energy_target(energy_target);
  p.set_mini_recent_ratio(mini_recent_ratio);
  p.set_mini_heavy_ratio(mini_heavy_ratio);
  p.set_kivi_group(kivi_group);
  p.set_key_signature_bits(key_signature_bits);
  p.set_rerank_factor(rerank_factor);
  p.set_mass_top_p(mass_top_p);
  p.set_mass_min_chunks(mass_min_chunks);
  p.set_recall_sample_rate(recall_sample_rate);
  p.set_recall_floor(recall_floor);
  p.set_recall_action(recall_action);
  p.set_selection_unit(selection_unit);
  return p;
}

absl::StatusOr<ModelInfo> SliceModel(const ModelInfo& whole, const v1::TensorParallel& tp) {
  const uint32_t h = static_cast<uint32_t>(whole.shape.h);
  const uint32_t g = static_cast<uint32_t>(whole.shape.g);
  if (whole.sliced()) return Bad("tensor_parallel", "the model is already a slice");
  if (tp.ranks() < 1 || tp.ranks() > h) {
    return Bad("tensor_parallel.ranks",
               absl::StrCat("must be in [1, num_kv_heads = ", h, "] (each rank holds at least one "
                            "KV head), got ", tp.ranks()));
  }
  if (tp.rank() >= tp.ranks()) {
    return Bad("tensor_parallel.rank", absl::StrCat("must be < ranks = ", tp.ranks(), ", got ", tp.rank()));
  }
  const uint32_t b = tp.kv_head_begin(), e = tp.kv_head_end();
  if (b >= e || e > h) {
    return Bad("tensor_parallel.kv_head_begin/kv_head_end",
               absl::StrCat("must be a non-empty range of the model's num_kv_heads = ", h,
                            " KV heads (begin < end <= ", h, "), got [", b, ", ", e, ")"));
  }
  if (tp.rank() == 0 && b != 0) {
    return Bad("tensor_parallel.kv_head_begin",
               absl::StrCat("rank 0 must start at KV head 0 (else KV heads [0, ", b,
                            ") are left uncovered), got ", b));
  }
  if (tp.rank() + 1 == tp.ranks() && e != h) {
    return Bad("tensor_parallel.kv_head_end",
               absl::StrCat("the last rank (", tp.rank(), ") must end at num_kv_heads = ", h,
                            " (else KV heads [", e, ", ", h, ") are left uncovered), got ", e));
  }
  if (b < tp.rank() || h - e < tp.ranks() - 1 - tp.rank()) {
    return Bad("tensor_parallel.kv_head_begin/kv_head_end",
               absl::StrCat("rank ", tp.rank(), " of ", tp.ranks(), " holding KV heads [", b, ", ", e,
                            ") leaves the ", tp.rank(), " ranks before it and the ",
                            tp.ranks() - 1 - tp.rank(), " after it fewer than one KV head each"));
  }
  if (tp.query_head_begin() != 0 || tp.query_head_end() != 0) {
    if (tp.query_head_begin() != b * g || tp.query_head_end() != e * g) {
      return Bad("tensor_parallel.query_head_begin/query_head_end",
                 absl::StrCat("must be the query heads of KV heads [", b, ", ", e, ")'s GQA groups of ", g,
                              ", [", b * g, ", ", e * g, "), got [", tp.query_head_begin(), ", ",
                              tp.query_head_end(), "): a rank holds whole GQA groups"));
    }
  }
  ModelInfo m = whole;
  m.shape.h = static_cast<int>(e - b);
  m.spec.set_num_kv_heads(e - b);
  m.spec.set_num_query_heads((e - b) * g);
  MarkSlice(&m, static_cast<int>(b), static_cast<int>(e), static_cast<int>(h));
  return m;
}

void MarkSlice(ModelInfo* m, int begin, int end, int kv_heads) {
  m->tp_kv_begin = begin;
  m->tp_kv_end = end;
  m->tp_kv_heads = kv_heads;
}

absl::StatusOr<ModelInfo> ResolveModel(const v1::ModelSpec& spec, const LimitsConfig& limits) {
  ModelInfo m;
  if (spec.model_id().empty()) return Bad("model.model_id", "must not be empty");
  if (spec.model_id().size() > 256) {
    return Bad("model.model_id", absl::StrCat("must be <= 256 bytes, got ", spec.model_id().size()));
  }
  if (spec.num_layers() < 1 || spec.num_layers() > limits.max_layers) {
    return Bad("model.num_layers", absl::StrCat("must be in [1, ", limits.max_layers, "], got ",
                                                spec.num_layers()));
  }
  if (spec.num_kv_heads() < 1 || spec.num_kv_heads() > 1024) {
    return Bad("model.num_kv_heads", absl::StrCat("must be in [1, 1024], got ", spec.num_kv_heads()));
  }
  if (spec.num_query_heads() < spec.num_kv_heads() ||
      spec.num_query_heads() % spec.num_kv_heads() != 0 || spec.num_query_heads() > 8192) {
    return Bad("model.num_query_heads",
               absl::StrCat("must be a multiple of num_kv_heads = ", spec.num_kv_heads(),
                            " (and <= 8192), got ", spec.num_query_heads()));
  }
  if (spec.head_dim() < 2 || spec.head_dim() > limits.max_head_dim || spec.head_dim() % 2 != 0) {
    return Bad("model.head_dim", absl::StrCat("must be even and in [2, ", limits.max_head_dim,
                                              "], got ", spec.head_dim()));
  }
  v1::DType dtype = spec.dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_BF16 : spec.dtype();
  if (dtype != v1::DTYPE_BF16 && dtype != v1::DTYPE_FP16 && dtype != v1::DTYPE_FP32) {
    return Bad("model.dtype", absl::StrCat("must be BF16, FP16 or FP32, got ",
                                           v1::DType_Name(spec.dtype())));
  }
  m.model_id = spec.model_id();
  m.layers = static_cast<int>(spec.num_layers());
  m.shape.h = static_cast<int>(spec.num_kv_heads());
  m.shape.g = static_cast<int>(spec.num_query_heads() / spec.num_kv_heads());
  m.shape.d = static_cast<int>(spec.head_dim());
  m.dtype = dtype;

  const v1::RopeSpec& r = spec.rope();
  kernels::RopeSpec& k = m.rope;
  if (!std::isfinite(r.theta()) || r.theta() < 0) {
    return Bad("model.rope.theta", absl::StrCat("must be finite and >= 0, got ", r.theta()));
  }
  if (r.theta() > 0) k.theta = r.theta();
  k.rotary_dim = static_cast<int>(r.rotary_dim());
  switch (r.scaling()) {
    case v1::ROPE_SCALING_NONE: k.scaling = kernels::RopeScaling::kNone; break;
    case v1::ROPE_SCALING_LINEAR: k.scaling = kernels::RopeScaling::kLinear; break;
    case v1::ROPE_SCALING_LLAMA3: k.scaling = kernels::RopeScaling::kLlama3; break;
    case v1::ROPE_SCALING_YARN: k.scaling = kernels::RopeScaling::kYarn; break;
    default: return Bad("model.rope.scaling", absl::StrCat("is unknown: ", r.scaling()));
  }
  switch (r.pairing()) {
    case v1::ROPE_PAIRING_HALF_SPLIT: k.pairing = kernels::RopePairing::kHalfSplit; break;
    case v1::ROPE_PAIRING_INTERLEAVED: k.pairing = kernels::RopePairing::kInterleaved; break;
    default: return Bad("model.rope.pairing", absl::StrCat("is unknown: ", r.pairing()));
  }
  for (auto [name, v] : {std::pair{"factor", r.factor()}, {"low_freq_factor", r.low_freq_factor()},
                         {"high_freq_factor", r.high_freq_factor()},
                         {"beta_fast", r.beta_fast()}, {"beta_slow", r.beta_slow()}}) {
    if (!std::isfinite(v) || v < 0) {
      return Bad(absl::StrCat("model.rope.", name), absl::StrCat("must be finite and >= 0, got ", v));
    }
  }
  if (r.factor() > 0) k.factor = r.factor();
  if (r.low_freq_factor() > 0) k.low_freq_factor = r.low_freq_factor();
  if (r.high_freq_factor() > 0) k.high_freq_factor = r.high_freq_factor();
  if (r.original_max_position() > 0) k.original_max_position = static_cast<int>(r.original_max_position());
  if (r.beta_fast() > 0) k.beta_fast = r.beta_fast();
  if (r.beta_slow() > 0) k.beta_slow = r.beta_slow();
  if (auto t = kernels::MakeRopeTable(k, m.shape.d); !t.ok()) {
    return Bad("model.rope", absl::StrCat("is invalid: ", std::string(t.status().message())));
  }
  m.spec = spec;
  m.spec.set_dtype(dtype);
  return m;
}

absl::StatusOr<kernels::ValueCodec> CodecFromProto(v1::ValueCodec c, const std::string& fallback) {
  switch (c) {
    case v1::VALUE_CODEC_UNSPECIFIED: {
      auto parsed = kernels::ParseValueCodec(fallback);
      if (!parsed.ok()) return Bad("profile.value_codec", "server default is invalid");
      return *parsed;
    }
    case v1::VALUE_CODEC_BF16: return kernels::ValueCodec::kBF16;
    case v1::VALUE_CODEC_FP8: return kernels::ValueCodec::kFP8;
    case v1::VALUE_CODEC_INT4: return kernels::ValueCodec::kINT4;
    case v1::VALUE_CODEC_INT2: return kernels::ValueCodec::kINT2;
    default: return Bad("profile.value_codec", absl::StrCat("is unknown: ", static_cast<int>(c)));
  }
}

v1::ValueCodec CodecToProto(kernels::ValueCodec c) {
  switch (c) {
    case kernels::ValueCodec::kBF16: return v1::VALUE_CODEC_BF16;
    case kernels::ValueCodec::kFP8: return v1::VALUE_CODEC_FP8;
    case kernels::ValueCodec::kINT4: return v1::VALUE_CODEC_INT4;
    case kernels::ValueCodec::kINT2: return v1::VALUE_CODEC_INT2;
  }
  return v1::VALUE_CODEC_UNSPECIFIED;
}

absl::StatusOr<ProfileInfo> ResolveProfile(const v1::Profile& p, const ProfileDefaults& def,
                                           const ModelInfo& model, uint64_t n_tokens) {
  ProfileInfo o;
  auto pick = [](uint32_t v, uint32_t d) { return static_cast<int>(v != 0 ? v : d); };
  auto pickf = [](float v, float d) { return v != 0 ? v : d; };
  // The optional fields (the proto's presence) take 0 as a value; the others' 0 is the
  // default (0 is not valid for them).
  o.requested = p.kind() == v1::PROFILE_KIND_UNSPECIFIED ? v1::PROFILE_KIND_AUTO : p.kind();
  if (!v1::ProfileKind_IsValid(p.kind())) {
    return Bad("profile.kind", absl::StrCat("is unknown: ", static_cast<int>(p.kind())));
  }
  for (auto [name, v] : {std::pair{"rank", p.rank()}, {"chunk_size", p.chunk_size()},
                         {"sparse_budget", p.sparse_budget()}, {"outliers", p.outliers()},
                         {"local_window", p.local_window()}, {"heavy_chunks", p.heavy_chunks()},
                         {"min_tokens", p.min_tokens()}, {"kivi_group", p.kivi_group()}}) {
    if (v > (1u << 24)) {
      return Bad(absl::StrCat("profile.", name), absl::StrCat("is out of range: ", v));
    }
  }
  o.rank = pick(p.rank(), def.rank);
  o.chunk_size = pick(p.chunk_size(), def.chunk_size);
  o.sparse_budget = pick(p.sparse_budget(), def.sparse_budget);
  o.outliers = static_cast<int>(p.has_outliers() ? p.outliers() : def.outliers);
  o.keep_sink = p.has_keep_sink() ? p.keep_sink() : def.keep_sink;
  o.local_window = pick(p.local_window(), def.local_window);
  o.heavy_chunks = static_cast<int>(p.has_heavy_chunks() ? p.heavy_chunks() : def.heavy_chunks);
  o.min_tokens = static_cast<int>(p.has_min_tokens() ? p.min_tokens() : def.min_tokens);
  o.kivi_group = pick(p.kivi_group(), def.kivi_group);
  if (p.kivi_group() == 0) {
    // The server's group, halved down to 16 until it divides the head dim (80 -> 16); a
    // group asked for is taken as it is and checked by the profile.
    while (o.kivi_group > 16 && model.shape.d > 0 && model.shape.d % o.kivi_group != 0) o.kivi_group /= 2;
  }
  for (auto [name, v] : {std::pair{"refactor_threshold", p.refactor_threshold()},
                         {"energy_target", p.energy_target()},
                         {"mini_recent_ratio", p.mini_recent_ratio()},
                         {"mini_heavy_ratio", p.mini_heavy_ratio()}}) {
    if (!std::isfinite(v) || v < 0 || v > 1) {
      return Bad(absl::StrCat("profile.", name), absl::StrCat("must be in [0, 1], got ", v));
    }
  }
  o.refactor_threshold = p.has_refactor_threshold() ? p.refactor_threshold() : def.refactor_threshold;
  o.energy_target = p.energy_target();
  o.mini_recent_ratio = p.has_mini_recent_ratio() ? p.mini_recent_ratio() : def.mini_recent_ratio;
  o.mini_heavy_ratio = p.has_mini_heavy_ratio() ? p.mini_heavy_ratio() : def.mini_heavy_ratio;
  // Selection options.
  if (p.rerank_factor() > 64) {
    return Bad("profile.rerank_factor", absl::StrCat("must be in [1, 64] (1 = one stage), got ",
                                                     p.rerank_factor()));
  }
  for (auto [name, v] : {std::pair{"mass_top_p", p.mass_top_p()},
                         {"recall_sample_rate", p.recall_sample_rate()},
                         {"recall_floor", p.recall_floor()}}) {
    if (!std::isfinite(v) || v < 0 || v > 1) {
      return Bad(absl::StrCat("profile.", name), absl::StrCat("must be in [0, 1], got ", v));
    }
  }
  if (p.mass_min_chunks() > (1u << 24)) {
    return Bad("profile.mass_min_chunks", absl::StrCat("is out of range: ", p.mass_min_chunks()));
  }
  if (!v1::RecallAction_IsValid(p.recall_action())) {
    return Bad("profile.recall_action", absl::StrCat("is unknown: ", static_cast<int>(p.recall_action())));
  }
  o.rerank_factor = pick(p.rerank_factor(), def.rerank_factor);
  o.mass_top_p = pickf(p.mass_top_p(), def.mass_top_p);
  o.mass_min_chunks = static_cast<int>(p.has_mass_min_chunks() ? p.mass_min_chunks() : def.mass_min_chunks);
  o.recall_sample_rate = p.has_recall_sample_rate() ? p.recall_sample_rate() : def.recall_sample_rate;
  o.recall_floor = p.has_recall_floor() ? p.recall_floor() : def.recall_floor;
  if (p.recall_action() != v1::RECALL_ACTION_UNSPECIFIED) {
    o.recall_action = p.recall_action();
  } else {
    o.recall_action = def.recall_action == "report"  ? v1::RECALL_ACTION_REPORT
                      : def.recall_action == "exact" ? v1::RECALL_ACTION_EXACT
                                                     : v1::RECALL_ACTION_WIDEN;
  }
  o.kind = o.requested == v1::PROFILE_KIND_AUTO ? AutoProfileKind(n_tokens, o) : o.requested;
  // The rest depends on the profile: its strategy resolves and checks it (profile.h).
  const ProfileRequest request{p, def, model, n_tokens, o.requested == v1::PROFILE_KIND_AUTO};
  KVSHADE_RETURN_IF_ERROR(ProfileOf(o.kind).Resolve(request, o));
  return o;
}

absl::Status ValidateTokens(absl::Span<const int32_t> tokens, uint64_t already,
                            const LimitsConfig& limits, std::string_view what) {
  if (already + tokens.size() > limits.max_tokens_per_session) {
    return absl::ResourceExhaustedError(absl::StrCat(
        std::string(what), ": session would hold ", already + tokens.size(),
        " tokens, over the limit max_tokens_per_session = ", limits.max_tokens_per_session));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0) {
      return Bad(absl::StrCat(std::string(what), "[", i, "]"),
                 absl::StrCat("must be >= 0, got ", tokens[i]));
    }
  }
  return absl::OkStatus();
}

bool TensorEmpty(const v1::Tensor& t) { return t.shape_size() == 0 && t.data().empty(); }

namespace {

// Index of the first bf16 in x [n] whose exponent is all ones (inf or NaN), or n.
size_t FirstNonFiniteBf16(const bf16* x, size_t n) {
  static_assert(sizeof(bf16) == sizeof(uint16_t));
  return base::FirstNonFiniteBf16Bits(reinterpret_cast<const uint16_t*>(x), n);
}

}  // namespace

absl::StatusOr<std::vector<bf16>> DecodeTensor(const v1::Tensor& t, absl::Span<const int64_t> shape,
                                               v1::DType dtype, std::string_view what) {
  size_t count = 1;
  for (int64_t s : shape) count *= static_cast<size_t>(std::max<int64_t>(s, 0));
  std::vector<bf16> out(count);
  KVSHADE_RETURN_IF_ERROR(DecodeTensorInto(t, shape, dtype, what, absl::MakeSpan(out)));
  return out;
}

TensorView ViewOf(const v1::Tensor& t) {
  TensorView v;
  v.dtype = t.dtype();
  if (t.shape_size() > TensorView::kMaxRank) {  // no shape check can pass
    v.rank = TensorView::kMaxRank;
    for (int64_t& s : v.shape) s = -1;
  } else {
    v.rank = t.shape_size();
    for (int i = 0; i < v.rank; ++i) v.shape[i] = t.shape(i);
  }
  v.data = t.data();
  return v;
}

absl::Status DecodeTensorInto(const v1::Tensor& t, absl::Span<const int64_t> shape,
                              v1::DType dtype, std::string_view what, absl::Span<bf16> out) {
  if (t.shape_size() > TensorView::kMaxRank) {
    return Bad(absl::StrCat(std::string(what), ".shape"),
               absl::StrCat("must be ", ShapeString(shape), ", got ",
                            ShapeString(absl::MakeConstSpan(t.shape().data(), t.shape_size()))));
  }
  return DecodeTensorInto(ViewOf(t), shape, dtype, what, out);
}

namespace {

// DecodeTensorInto's checks of dtype, shape and byte size; the element count in `count`.
absl::Status CheckTensorHeader(const TensorView& t, absl::Span<const int64_t> shape,
                               v1::DType dtype, const std::string& name, size_t* count) {
  if (t.dtype != dtype) {
    return Bad(absl::StrCat(name, ".dtype"),
               absl::StrCat("must be ", v1::DType_Name(dtype), " (the model's dtype), got ",
                            v1::DType_IsValid(t.dtype) ? v1::DType_Name(t.dtype)
                                                       : absl::StrCat(static_cast<int>(t.dtype))));
  }
  bool same = t.rank == static_cast<int>(shape.size());
  for (int i = 0; same && i < t.rank; ++i) same = t.shape[i] == shape[i];
  if (!same) {
    return Bad(absl::StrCat(name, ".shape"),
               absl::StrCat("must be ", ShapeString(shape), ", got ", ShapeString(t.dims())));
  }
  *count = 1;
  for (int64_t s : shape) *count *= static_cast<size_t>(s);
  const size_t eb = DTypeBytes(dtype);
  if (t.data.size() != *count * eb) {
    return Bad(absl::StrCat(name, ".data"),
               absl::StrCat("must hold ", *count * eb, " bytes for shape ", ShapeString(shape), " of ",
                            v1::DType_Name(dtype), ", got ", t.data.size()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTensor(const TensorView& t, absl::Span<const int64_t> shape, v1::DType dtype,
                         std::string_view what) {
  const std::string name(what);
  if (dtype != v1::DTYPE_BF16) {
    return absl::InternalError(absl::StrCat("CheckTensor(", name, "): bf16 only, got ",
                                            v1::DType_Name(dtype)));
  }
  size_t count = 0;
  KVSHADE_RETURN_IF_ERROR(CheckTensorHeader(t, shape, dtype, name, &count));
  const size_t bad = FirstNonFiniteBf16(reinterpret_cast<const bf16*>(t.data.data()), count);
  if (bad < count) return NonFiniteError(name, bad);
  return absl::OkStatus();
}

absl::Status CheckTensorLayout(const TensorView& t, absl::Span<const int64_t> shape,
                               v1::DType dtype, std::string_view what) {
  size_t count = 0;
  return CheckTensorHeader(t, shape, dtype, std::string(what), &count);
}

absl::Status NonFiniteError(std::string_view what, size_t index) {
  return Bad(what, absl::StrCat("holds a non-finite value at flat index ", index));
}

absl::Status DecodeTensorInto(const TensorView& t, absl::Span<const int64_t> shape,
                              v1::DType dtype, std::string_view what, absl::Span<bf16> out) {
  const std::string name(what);
  size_t count = 0;
  KVSHADE_RETURN_IF_ERROR(CheckTensorHeader(t, shape, dtype, name, &count));
  if (out.size() != count) {  // a caller's bug, not the peer's
    return absl::InternalError(absl::StrCat("DecodeTensorInto(", name, "): destination holds ",
                                            out.size(), " values, the tensor ", count));
  }
  const char* src = t.data.data();
  auto non_finite = [&](size_t i) { return NonFiniteError(name, i); };
  if (dtype == v1::DTYPE_BF16) {
    // Copy and check block by block (8 KiB: the check reads what the copy just wrote from
    // L1), one pass over memory instead of two.
    constexpr size_t kBlock = 4096;
    for (size_t b0 = 0; b0 < count; b0 += kBlock) {
      const size_t nb = std::min(kBlock, count - b0);
      std::memcpy(out.data() + b0, src + 2 * b0, nb * 2);
      const size_t bad = FirstNonFiniteBf16(out.data() + b0, nb);
      if (bad < nb) return non_finite(b0 + bad);
    }
  } else if (dtype == v1::DTYPE_FP16) {
    for (size_t i = 0; i < count; ++i) {
      kernels::fp16 h;
      std::memcpy(&h.bits, src + 2 * i, 2);
      if ((h.bits & 0x7c00u) == 0x7c00u) return non_finite(i);
      out[i] = kernels::FloatToBf16(kernels::Fp16ToFloat(h));
    }
  } else {
    for (size_t i = 0; i < count; ++i) {
      float f;
      std::memcpy(&f, src + 4 * i, 4);
      if (!std::isfinite(f)) return non_finite(i);
      kernels::bf16 b = kernels::FloatToBf16(f);
      if ((b.bits & 0x7f80u) == 0x7f80u) return non_finite(i);  // overflowed bf16
      out[i] = b;
    }
  }
  return absl::OkStatus();
}

void EncodeBf16(absl::Span<const bf16> data, absl::Span<const int64_t> shape, v1::Tensor* out) {
  out->Clear();
  for (int64_t s : shape) out->add_shape(s);
  out->set_dtype(v1::DTYPE_BF16);
  out->set_data(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(bf16));
}

void EncodeF32(absl::Span<const float> data, absl::Span<const int64_t> shape, v1::Tensor* out) {
  out->Clear();
  for (int64_t s : shape) out->add_shape(s);
  out->set_dtype(v1::DTYPE_FP32);
  out->set_data(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float));
}

}  // namespace kvshade::service
