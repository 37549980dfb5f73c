// The synthetic document-QA workload (see synthetic.h for the model of the keys). Random
// numbers come from a counter-based generator (splitmix64 of a key built from the seed and
// the element's coordinates), so any slice of any tensor is generated independently and
// identically in every process, in any order.
#include "synthetic.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/strings/str_format.h"
#include "kvshade/client/tensor.h"

namespace kvshade::synthetic {
namespace {

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A small sequential generator for set-up tensors.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(SplitMix(seed)) {}
  uint64_t Next() { return state_ = SplitMix(state_); }
  double Uniform() { return (Next() >> 11) * (1.0 / 9007199254740992.0); }
  float Normal() {
    double u1 = Uniform(), u2 = Uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }

 private:
  uint64_t state_;
};

// Normal(0,1) keyed by coordinates (counter-based).
float KeyedNormal(uint64_t a, uint64_t b, uint64_t c) {
  Rng r(SplitMix(a ^ SplitMix(b ^ SplitMix(c))));
  return r.Normal();
}

enum Stream : uint64_t {
  kTokens = 1, kLatent, kMixK, kMixV, kMean, kNeedleDir, kNeedleVal, kSink, kKeyNoise,
  kValNoise, kQuestion, kQueryTopic, kQueryNoise, kOutlier
};

constexpr float kLatentRho = 0.98f;      // AR(1) over tokens: ~50-token topic drift
constexpr float kOutlierMagnitude = 6.0f;
constexpr int kOutlierChannelsPerHead = 2;
constexpr float kNeedleStrength = 1.0f;  // x sqrt(d): needle part ~ the content part's norm
constexpr float kSinkStrength = 4.0f;    // x sqrt(d)
constexpr float kQueryNeedleScale = 12.0f;    // needle logit ~ 12 (others < ~5)
constexpr float kQuerySinkScale = 1.5f;
constexpr float kQueryTopicScale = 4.0f;

}  // namespace

void ApplyRope(float theta, int d, int64_t pos, float* x) {
  const int half = d / 2;
  for (int i = 0; i < half; ++i) {
    const double inv_freq = std::pow(static_cast<double>(theta), -2.0 * i / d);
    const double angle = static_cast<double>(pos) * inv_freq;
    const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
    const float a = x[i], b = x[i + half];
    x[i] = a * c - b * s;
    x[i + half] = a * s + b * c;
  }
}

Document::Document(const DocSpec& spec) : spec_(spec) {
  const int R = spec_.latent_rank, h = spec_.kv_heads, d = spec_.head_dim, D = h * d;
  const int64_t n = spec_.doc_tokens;
  Rng rng(spec_.seed * 1000003 + kTokens);
  tokens_.resize(n);
  for (auto& t : tokens_) t = 1000 + static_cast<int32_t>(rng.Next() % 29000);

  // Needles: evenly spread, 16-aligned (chunk-aligned for C in {1,2,4,8,16}).
  const int N = std::max(0, spec_.needles);
  for (int i = 0; i < N; ++i) {
    int64_t p = static_cast<int64_t>((i + 0.5) / N * n);
    p = std::clamp<int64_t>(p, 64, std::max<int64_t>(64, n - 64 - spec_.needle_span));
    p -= p % 16;
    needles_.push_back({p, spec_.needle_span});
    for (int t = 0; t < spec_.needle_span && p + t < n; ++t) tokens_[p + t] = 50000 + i * 64 + t;
  }

  // Document latent: AR(1).
  doc_latent_.resize(static_cast<size_t>(n) * R);
  Rng lat(spec_.seed * 1000003 + kLatent);
  const float innov = std::sqrt(1 - kLatentRho * kLatentRho);
  for (int r = 0; r < R; ++r) doc_latent_[r] = lat.Normal();
  for (int64_t t = 1; t < n; ++t) {
    for (int r = 0; r < R; ++r) {
      doc_latent_[t * R + r] = kLatentRho * doc_latent_[(t - 1) * R + r] + innov * lat.Normal();
    }
  }

  // Per-layer mixing (one basis across heads: the cross-head low rank ShadowKV exploits)
  // and key means with outlier channels.
  Rng mix(spec_.seed * 1000003 + kMixK);
  const float scale = 1.0f / std::sqrt(static_cast<float>(R));
  mix_k_.assign(spec_.layers, std::vector<float>(static_cast<size_t>(D) * R));
  mix_v_.assign(spec_.layers, std::vector<float>(static_cast<size_t>(D) * R));
  mean_k_.assign(spec_.layers, std::vector<float>(D));
  for (int l = 0; l < spec_.layers; ++l) {
    for (auto& x : mix_k_[l]) x = mix.Normal() * scale;
    for (auto& x : mix_v_[l]) x = mix.Normal() * scale;
    for (int hh = 0; hh < h; ++hh) {
      for (int c = 0; c < d; ++c) mean_k_[l][hh * d + c] = 0.5f * mix.Normal();
      // Outlier channels outside the needles' low-frequency band.
      for (int o = 0; o < kOutlierChannelsPerHead; ++o) {
        const int c = static_cast<int>(mix.Next() % static_cast<uint64_t>(std::max(1, 3 * d / 8)));
        mean_k_[l][hh * d + c] = (o % 2 ? -1.0f : 1.0f) * kOutlierMagnitude;
      }
    }
  }

  // Needle directions: unit per head in the low-frequency RoPE band (pairs i, i + d/2 with
  // i in [3d/8, d/2)), where a span of tokens keeps its direction after RoPE.
  Rng nd(spec_.seed * 1000003 + kNeedleDir);
  const int half = d / 2, lo = 3 * d / 8;
  for (int i = 0; i < N; ++i) {
    std::vector<float> dir(D, 0.0f), val(D, 0.0f);
    for (int hh = 0; hh < h; ++hh) {
      double norm = 0;
      for (int c = lo; c < half; ++c) {
        dir[hh * d + c] = nd.Normal();
        dir[hh * d + c + half] = nd.Normal();
        norm += dir[hh * d + c] * dir[hh * d + c] + dir[hh * d + c + half] * dir[hh * d + c + half];
      }
      const float inv = static_cast<float>(1.0 / std::sqrt(std::max(norm, 1e-12)));
      for (int c = 0; c < d; ++c) dir[hh * d + c] *= inv;
      for (int c = 0; c < d; ++c) val[hh * d + c] = 3.0f * nd.Normal();
    }
    needle_dir_.push_back(std::move(dir));
    needle_val_.push_back(std::move(val));
  }
  Rng sk(spec_.seed * 1000003 + kSink);
  sink_dir_.assign(D, 0.0f);
  for (int hh = 0; hh < h; ++hh) {
    double norm = 0;
    for (int c = 0; c < d; ++c) {
      sink_dir_[hh * d + c] = sk.Normal();
      norm += sink_dir_[hh * d + c] * sink_dir_[hh * d + c];
    }
    for (int c = 0; c < d; ++c) sink_dir_[hh * d + c] /= static_cast<float>(std::sqrt(norm));
  }
}

std::vector<float> Document::QuestionLatents(int question, int64_t count) const {
  const int R = spec_.latent_rank;
  if (count < 0) count = spec_.question_tokens;
  std::vector<float> z(static_cast<size_t>(count) * R);
  Rng lat(spec_.seed * 1000003 + kQuestion * 7919 + static_cast<uint64_t>(question));
  const float innov = std::sqrt(1 - kLatentRho * kLatentRho);
  const float* prev = &doc_latent_[(spec_.doc_tokens - 1) * R];
  for (int64_t t = 0; t < count; ++t) {
    for (int r = 0; r < R; ++r) z[t * R + r] = kLatentRho * prev[r] + innov * lat.Normal();
    prev = &z[t * R];
  }
  return z;
}

std::vector<int32_t> Document::SessionTokens(int question) const {
  std::vector<int32_t> out = tokens_;
  Rng rng(spec_.seed * 1000003 + kQuestion + static_cast<uint64_t>(question) * 104729);
  for (int t = 0; t < spec_.question_tokens; ++t) out.push_back(1000 + static_cast<int32_t>(rng.Next() % 29000));
  return out;
}

kvshade::v1::ModelSpec Document::Model() const {
  kvshade::v1::ModelSpec m;
  m.set_model_id(spec_.model_id);
  m.set_num_layers(spec_.layers);
  m.set_num_query_heads(spec_.q_heads);
  m.set_num_kv_heads(spec_.kv_heads);
  m.set_head_dim(spec_.head_dim);
  m.mutable_rope()->set_theta(spec_.rope_theta);
  m.mutable_rope()->set_rotary_dim(spec_.head_dim);
  m.mutable_rope()->set_pairing(kvshade::v1::ROPE_PAIRING_HALF_SPLIT);
  m.set_dtype(kvshade::v1::DTYPE_BF16);
  return m;
}

void Document::KeysValues(int layer, int question, int64_t t0, int64_t t1, std::vector<uint16_t>* k,
                          std::vector<uint16_t>* v) const {
  const int R = spec_.latent_rank, h = spec_.kv_heads, d = spec_.head_dim, D = h * d;
  const int64_t n = spec_.doc_tokens;
  k->resize(static_cast<size_t>(t1 - t0) * D);
  v->resize(static_cast<size_t>(t1 - t0) * D);
  std::vector<float> qlat;
  if (t1 > n) qlat = QuestionLatents(question, t1 - n);
  const float sqrt_d = std::sqrt(static_cast<float>(d));
  const auto& mk = mix_k_[layer];
  const auto& mv = mix_v_[layer];
  const auto& mean = mean_k_[layer];
  const uint64_t base = spec_.seed * 1000003 + static_cast<uint64_t>(layer) * 7777;
  for (int64_t t = t0; t < t1; ++t) {
    const float* z = t < n ? &doc_latent_[t * R] : &qlat[(t - n) * R];
    // Question tokens are noise-keyed by question so that different questions differ.
    const uint64_t tkey = t < n ? static_cast<uint64_t>(t) : (static_cast<uint64_t>(t) << 20) ^ (question + 1);
    int needle = -1;
    for (size_t i = 0; i < needles_.size(); ++i) {
      if (t >= needles_[i].position && t < needles_[i].position + needles_[i].span) needle = static_cast<int>(i);
    }
    for (int c = 0; c < D; ++c) {
      float kk = mean[c], vv = 0;
      for (int r = 0; r < R; ++r) {
        kk += mk[c * R + r] * z[r];
        vv += mv[c * R + r] * z[r];
      }
      kk += spec_.noise * KeyedNormal(base + kKeyNoise, tkey, c);
      vv += spec_.noise * KeyedNormal(base + kValNoise, tkey, c);
      if (needle >= 0) {
        kk += kNeedleStrength * sqrt_d * needle_dir_[needle][c];
        vv = needle_val_[needle][c];
      }
      if (t == 0) kk += kSinkStrength * sqrt_d * sink_dir_[c];
      (*k)[(t - t0) * D + c] = client::FloatToBf16Bits(kk);
      (*v)[(t - t0) * D + c] = client::FloatToBf16Bits(vv);
    }
  }
}

std::vector<float> Document::Query(int layer, int question, int step, int64_t position) const {
  const int R = spec_.latent_rank, h = spec_.kv_heads, d = spec_.head_dim, hq = spec_.q_heads;
  const int g = std::max(1, hq / h);
  std::vector<float> q(static_cast<size_t>(hq) * d, 0.0f);
  // Topic: the question's last latent, drifting slowly with the step (temporal locality).
  std::vector<float> qlat = QuestionLatents(question);
  std::vector<float> z(R);
  const float* last = spec_.question_tokens > 0 ? &qlat[(spec_.question_tokens - 1) * R]
                                                : &doc_latent_[(spec_.doc_tokens - 1) * R];
  const float a = std::cos(0.05f * step), b = std::sin(0.05f * step);
  for (int r = 0; r < R; ++r) {
    z[r] = a * last[r] + b * KeyedNormal(spec_.seed + kQueryTopic, static_cast<uint64_t>(question), r);
  }
  const Needle* nd = needles_.empty() ? nullptr : &needles_[TargetNeedle(question)];
  std::vector<float> tmp(d);
  for (int qh = 0; qh < hq; ++qh) {
    const int hh = qh / g;
    float* out = &q[static_cast<size_t>(qh) * d];
    // Needle: its direction as RoPE'd at the needle's centre (what a query attending to it
    // looks like after RoPE).
    if (nd != nullptr) {
      for (int c = 0; c < d; ++c) tmp[c] = needle_dir_[TargetNeedle(question)][hh * d + c];
      ApplyRope(spec_.rope_theta, d, nd->position + nd->span / 2, tmp.data());
      for (int c = 0; c < d; ++c) out[c] += kQueryNeedleScale * tmp[c];
    }
    // Topic: the layer's key map of the topic latent, RoPE'd at the query position.
    double norm = 0;
    for (int c = 0; c < d; ++c) {
      float s = 0;
      for (int r = 0; r < R; ++r) s += mix_k_[layer][(hh * d + c) * R + r] * z[r];
      tmp[c] = s;
      norm += s * s;
    }
    ApplyRope(spec_.rope_theta, d, position, tmp.data());
    // |q_topic| = kQueryTopicScale: a fully aligned content key (norm ~ sqrt(d)) gets
    // logit ~ kQueryTopicScale.
    const float tscale = kQueryTopicScale / static_cast<float>(std::sqrt(std::max(norm, 1e-12)));
    for (int c = 0; c < d; ++c) out[c] += tscale * tmp[c];
    for (int c = 0; c < d; ++c) {
      out[c] += kQuerySinkScale * sink_dir_[hh * d + c] +
                0.1f * KeyedNormal(spec_.seed + kQueryNoise,
                                   (static_cast<uint64_t>(question) << 32) ^ (static_cast<uint64_t>(step) << 8) ^ layer,
                                   static_cast<uint64_t>(qh) * d + c);
      out[c] = client::Bf16BitsToFloat(client::FloatToBf16Bits(out[c]));
    }
  }
  return q;
}

absl::StatusOr<IngestResult> IngestRange(kvshade::client::Client& client, const Document& doc,
                                         const std::string& session_id, int question, int64_t t0,
                                         int64_t t1, const std::function<void(int)>& on_layer) {
  IngestResult result;
  result.tokens = t1 - t0;
  const auto& s = doc.spec();
  const auto start = std::chrono::steady_clock::now();
  auto writer = client.StartIngest(session_id);
  if (!writer.ok()) return writer.status();
  std::vector<uint16_t> k, v;
  for (int l = 0; l < s.layers; ++l) {
    if (t1 > t0) {
      doc.KeysValues(l, question, t0, t1, &k, &v);
      absl::Status st = (*writer)->WriteLayer(static_cast<uint32_t>(l), t1 - t0, s.kv_heads, s.head_dim,
                                              k, v);
      if (!st.ok()) return st;
    }
    if (on_layer) on_layer(l);
  }
  auto resp = (*writer)->Commit();
  if (!resp.ok()) return resp.status();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.bytes = (*writer)->bytes_sent();
  result.response = *std::move(resp);
  return result;
}

kvshade::v1::AppendTokensRequest MakeAppend(const Document& doc, const std::string& session_id,
                                            int question, int64_t t0, int64_t t1) {
  const auto& s = doc.spec();
  kvshade::v1::AppendTokensRequest req;
  req.set_session_id(session_id);
  const std::vector<int32_t> tokens = doc.SessionTokens(question);
  for (int64_t t = t0; t < t1; ++t) {
    req.add_token_ids(t < static_cast<int64_t>(tokens.size()) ? tokens[t] : 1000 + static_cast<int32_t>(t % 29000));
  }
  std::vector<uint16_t> k, v;
  for (int l = 0; l < s.layers; ++l) {
    doc.KeysValues(l, question, t0, t1, &k, &v);
    auto* layer = req.add_layers();
    layer->set_layer(static_cast<uint32_t>(l));
    *layer->mutable_k() = client::MakeBf16Tensor({t1 - t0, s.kv_heads, s.head_dim}, absl::MakeConstSpan(k));
    *layer->mutable_v() = client::MakeBf16Tensor({t1 - t0, s.kv_heads, s.head_dim}, absl::MakeConstSpan(v));
  }
  return req;
}

kvshade::v1::CreateSessionRequest MakeCreate(const Document& doc, const kvshade::v1::Profile& profile,
                                             int question, bool durable) {
  kvshade::v1::CreateSessionRequest req;
  *req.mutable_model() = doc.Model();
  *req.mutable_profile() = profile;
  const std::vector<int32_t> tokens = question < 0 ? doc.tokens() : doc.SessionTokens(question);
  req.mutable_token_ids()->Assign(tokens.begin(), tokens.end());
  req.set_durable(durable);
  req.set_label(question < 0 ? "document" : "question-" + std::to_string(question));
  return req;
}

std::string FormatBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return absl::StrFormat("%.1f %s", bytes, units[u]);
}

}  // namespace kvshade::synthetic
