// A synthetic prefix-cached document-QA workload with the key structure real long-context
// models show, so that compression and selection behave as they would on real caches:
//   - low-rank keys: pre-RoPE keys of all heads of a layer are a rank-`latent_rank` mix of
//     a slowly drifting latent (AR(1) over tokens), plus small noise;
//   - outlier channels: a few channels per head carry a large constant offset;
//   - an attention sink: token 0 has a large key that every query partly aligns with;
//   - planted needles: spans of `needle_span` tokens whose keys (and values) share a strong
//     direction in RoPE's low-frequency channels; question j's decode queries look for
//     needle j % needles.
// Everything is a deterministic function of (spec, seed), so any process (demo, benchmark,
// integration test, reference computation) regenerates the same tensors.
//
// Thread-safe: every method is const and allocates its own outputs.
//
// Layouts: keys/values [n, h, d] (token, KV head, channel), queries [hq, d]; bf16 carried as
// raw uint16_t bits (client/tensor.h). RoPE: half-split pairing, rotary_dim = d.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvshade/client/client.h"
#include "kvshade/v1/kvshade.pb.h"

namespace kvshade::synthetic {

struct DocSpec {
  int layers = 4;
  int kv_heads = 2;
  int q_heads = 8;
  int head_dim = 64;
  int64_t doc_tokens = 16384;
  int question_tokens = 64;  // per question, appended after the document
  int needles = 4;
  int needle_span = 16;      // tokens per needle (chunk-aligned when a multiple of C)
  int latent_rank = 12;
  float noise = 0.05f;
  float rope_theta = 10000.0f;
  uint64_t seed = 1;
  std::string model_id = "synthetic/doc-qa";
};

struct Needle {
  int64_t position = 0;  // first token
  int span = 0;
};

// Half-split ("neox") RoPE of one head vector x [d] at `pos`, in place, fp32.
void ApplyRope(float theta, int d, int64_t pos, float* x);

class Document {
 public:
  explicit Document(const DocSpec& spec);

  const DocSpec& spec() const { return spec_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  const std::vector<Needle>& needles() const { return needles_; }
  // Document tokens followed by question j's tokens.
  std::vector<int32_t> SessionTokens(int question) const;
  kvshade::v1::ModelSpec Model() const;

  // Pre-RoPE keys and values of `layer` for absolute positions [t0, t1) of the timeline
  // of `question` (positions < doc_tokens are the document whatever `question` is;
  // positions >= doc_tokens are that question's tokens). bf16 bits, [t1-t0, h, d].
  void KeysValues(int layer, int question, int64_t t0, int64_t t1, std::vector<uint16_t>* k,
                  std::vector<uint16_t>* v) const;

  // Post-RoPE decode query [hq, d] (fp32, bf16-representable) of question `question` at
  // decode step `step` for `layer`, at absolute position `position`.
  std::vector<float> Query(int layer, int question, int step, int64_t position) const;

  // The needle question j looks for.
  // The needle question `question` asks about (the document alone, question -1, asks
  // about the first).
  int TargetNeedle(int question) const {
    return question < 0 ? 0 : question % static_cast<int>(needles_.size());
  }

  // Bytes of the full bf16 K+V cache of `tokens` tokens over all layers.
  uint64_t DenseBytes(int64_t tokens) const {
    return static_cast<uint64_t>(tokens) * spec_.layers * spec_.kv_heads * spec_.head_dim * 2 * 2;
  }

 private:
  // Latents [count, latent_rank] of the `count` tokens after the document on question j's
  // timeline (default count: its question tokens; more: the tokens decoded after it): the
  // document's AR(1) process continued with a per-question random stream (recomputed per
  // call: tiny).
  std::vector<float> QuestionLatents(int question, int64_t count = -1) const;

  DocSpec spec_;
  std::vector<int32_t> tokens_;
  std::vector<Needle> needles_;
  std::vector<float> doc_latent_;                        // [doc_tokens, R]
  std::vector<std::vector<float>> mix_k_, mix_v_;        // per layer: [D, R]
  std::vector<std::vector<float>> mean_k_;               // per layer: [D]
  std::vector<std::vector<float>> needle_dir_;           // per needle: [h*d] unit per head
  std::vector<std::vector<float>> needle_val_;           // per needle: [h*d]
  std::vector<float> sink_dir_;                          // [h*d]
};

struct IngestResult {
  kvshade::v1::IngestResponse response;
  double seconds = 0;     // first write to commit answered
  uint64_t bytes = 0;     // serialized request bytes sent
  int64_t tokens = 0;     // tokens ingested (t1 - t0)
};

// Streams layers [0, L) of positions [t0, t1) of `question`'s timeline into `session_id`
// (which must expect exactly those tokens: CreateSession's reused_tokens = t0) and commits.
// `on_layer(l)` is called after layer l is sent (progress display).
absl::StatusOr<IngestResult> IngestRange(kvshade::client::Client& client, const Document& doc,
                                         const std::string& session_id, int question, int64_t t0,
                                         int64_t t1,
                                         const std::function<void(int)>& on_layer = nullptr);

// An AppendTokens request carrying positions [t0, t1) of `question`'s timeline.
kvshade::v1::AppendTokensRequest MakeAppend(const Document& doc, const std::string& session_id,
                                            int question, int64_t t0, int64_t t1);

// A CreateSession request for question `question` (document + its question tokens), or
// for the document alone when question < 0.
// "1.5 MiB": a byte count in binary units with one decimal (reports).
std::string FormatBytes(double bytes);

kvshade::v1::CreateSessionRequest MakeCreate(const Document& doc, const kvshade::v1::Profile& profile,
                                             int question, bool durable = false);

}  // namespace kvshade::synthetic
