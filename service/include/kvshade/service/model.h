// Validated, resolved descriptors of a session: the model geometry (from v1::ModelSpec)
// and the compression profile (from v1::Profile with the server's defaults filled in),
// plus the tensor conversions every data RPC shares. Every check returns
// InvalidArgument with a message naming the field, the expected and the actual value.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/decode_step.h"
#include "kvshade/service/config.h"
#include "kvshade/service/decode.h"
#include "kvshade/v1/kvshade.pb.h"

namespace kvshade::service {

// The geometry of a model's attention, as the kernels need it.
struct ModelInfo {
  std::string model_id;
  int layers = 0;
  kernels::LayerShape shape;  // h, g, d
  kernels::RopeSpec rope;
  v1::DType dtype = v1::DTYPE_BF16;  // wire dtype of K/V/Q tensors
  v1::ModelSpec spec;                // as given (normalized: dtype filled in)
  // A tensor-parallel shard's slice of the whole model (docs/DESIGN.md "Tensor-parallel
  // sessions"): KV heads [tp_kv_begin, tp_kv_end) of the model's tp_kv_heads, whose GQA
  // groups' query heads it holds; `shape` and `spec` are the slice's (h = tp_kv_end -
  // tp_kv_begin). tp_kv_heads 0: the whole model.
  int tp_kv_begin = 0;
  int tp_kv_end = 0;
  int tp_kv_heads = 0;
  bool sliced() const { return tp_kv_heads > 0; }

  // Identity of everything that makes two caches interchangeable (part of prefix keys; a
  // slice's includes its head range, so that only the same heads share a prefix).
  std::string Fingerprint() const;
};

// A profile with every default resolved. `kind` is never AUTO here.
struct ProfileInfo {
  v1::ProfileKind kind = v1::PROFILE_KIND_SHADOW;
  v1::ProfileKind requested = v1::PROFILE_KIND_AUTO;
  int rank = 160;
  int chunk_size = 8;
  int sparse_budget = 256;
  int outliers = 48;
  bool keep_sink = true;
  int local_window = 32;
  int heavy_chunks = 0;
  kernels::ValueCodecSpec codec;
  int min_tokens = 8192;
  float refactor_threshold = 0.05f;
  float energy_target = 0;
  float mini_recent_ratio = 0.1f;
  float mini_heavy_ratio = 0.1f;
  int kivi_group = 32;
  // Key signatures of the chunked tokens (shadow; 2, 4 or 8 bits, 0 = none): stored with the
  // segments (part of the fingerprint when on), read by two-stage selection.
  int key_signature_bits = 0;
  // Selection options (not part of the fingerprint: they change what a decode step
  // selects, not what is stored). docs/ALGORITHM.md "Selection options".
  int rerank_factor = 1;          // 1 = one stage
  float mass_top_p = 0;           // 0 = fixed budget
  int mass_min_chunks = 32;
  float recall_sample_rate = 0;   // 0 = guard off
  float recall_floor = 0.5f;
  v1::RecallAction recall_action = v1::RECALL_ACTION_WIDEN;
  // Selection units (shadow): tokens per unit, a divisor of chunk_size below it; 0 = whole
  // chunks (a request's chunk_size resolves to 0). docs/ALGORITHM.md "Selection units".
  int selection_unit = 0;

  // Tokens per slot: selection_unit, or chunk_size for whole chunks.
  int slot_tokens() const { return selection_unit > 0 ? selection_unit : chunk_size; }
  // Slots per KV head of a budget of k chunks (k * chunk_size / slot_tokens()).
  int slots(int k) const { return k * (chunk_size / slot_tokens()); }

  // The selection options and the recall guard's settings, as the decode core takes them.
  decode::SelectionPolicy Policy() const;
  // The fields that change what is stored (part of prefix keys).
  std::string Fingerprint() const;
  v1::Profile ToProto() const;
};

absl::StatusOr<ModelInfo> ResolveModel(const v1::ModelSpec& spec, const LimitsConfig& limits);

// The slice of the whole model `whole` that a tensor-parallel rank holds (ModelInfo's tp_*
// fields set, shape and spec narrowed to its heads), after checking what one request can
// check of `tp`: ranks in [1, num_kv_heads], rank < ranks, a non-empty head range inside
// the model, rank 0 starting at head 0 and the last rank ending at num_kv_heads, room for
// the ranks before and after it (a head each), and the query heads (when given) exactly
// those of its KV heads' GQA groups. INVALID_ARGUMENT naming the field otherwise. (That the
// ranks' ranges tile the heads is checked against the ranks that joined: DeviceRouter.)
absl::StatusOr<ModelInfo> SliceModel(const ModelInfo& whole, const v1::TensorParallel& tp);
// Marks `m` (a slice's own geometry, as a durable record keeps it) as KV heads
// [begin, end) of `kv_heads`.
void MarkSlice(ModelInfo* m, int begin, int end, int kv_heads);

// Resolves `profile` for a session of `n_tokens` prompt tokens (AUTO: MINI below
// min_tokens, SHADOW at or above) and checks it against the model.
absl::StatusOr<ProfileInfo> ResolveProfile(const v1::Profile& profile,
                                           const ProfileDefaults& defaults,
                                           const ModelInfo& model, uint64_t n_tokens);

absl::StatusOr<kernels::ValueCodec> CodecFromProto(v1::ValueCodec c, const std::string& fallback);
v1::ValueCodec CodecToProto(kernels::ValueCodec c);

// Checks token ids (>= 0) and the per-session limit. `what` names the field.
absl::Status ValidateTokens(absl::Span<const int32_t> tokens, uint64_t already,
                            const LimitsConfig& limits, std::string_view what);

// Decodes an inline tensor of exactly `shape` in dtype `dtype` (BF16, FP16 or FP32) to bf16,
// checking dtype, shape, byte size and that every value is finite. `what` names the tensor
// in messages (e.g. "layers[3].k").
absl::StatusOr<std::vector<kernels::bf16>> DecodeTensor(const v1::Tensor& t,
                                                        absl::Span<const int64_t> shape,
                                                        v1::DType dtype, std::string_view what);
// The same checks, writing into `out` (exactly the tensor's element count; a caller's
// buffer, e.g. the slice of a layer a part fills) instead of a new vector: one pass over
// the bytes instead of a copy into a temporary and another into the destination. On error
// `out` may be partly written.
absl::Status DecodeTensorInto(const v1::Tensor& t, absl::Span<const int64_t> shape,
                              v1::DType dtype, std::string_view what,
                              absl::Span<kernels::bf16> out);
// The same over a caller-owned view (decode.h), the decode path's form.
absl::Status DecodeTensorInto(const TensorView& t, absl::Span<const int64_t> shape,
                              v1::DType dtype, std::string_view what,
                              absl::Span<kernels::bf16> out);
// DecodeTensorInto's checks without the copy, for bf16 tensors whose bytes are used where
// they are (e.g. copied straight to the device): dtype, shape, byte size, every value
// finite.
absl::Status CheckTensor(const TensorView& t, absl::Span<const int64_t> shape, v1::DType dtype,
                         std::string_view what);
// CheckTensor without reading the values (dtype, shape, byte size), for bytes whose values
// are checked where they land (e.g. on the device, Backend::FirstNonFinite); a non-finite
// value found there is reported with NonFiniteError.
absl::Status CheckTensorLayout(const TensorView& t, absl::Span<const int64_t> shape,
                               v1::DType dtype, std::string_view what);
absl::Status NonFiniteError(std::string_view what, size_t index);
// A view of a v1 tensor's bytes (valid while `t` is); a shape of rank > kMaxRank becomes
// [-1, -1, -1, -1], which no shape check accepts.
TensorView ViewOf(const v1::Tensor& t);
// True when the tensor carries no shape and no data (an omitted optional tensor).
bool TensorEmpty(const v1::Tensor& t);

// Writes `data` as a tensor of `shape` (bf16 or fp32).
void EncodeBf16(absl::Span<const kernels::bf16> data, absl::Span<const int64_t> shape,
                v1::Tensor* out);
void EncodeF32(absl::Span<const float> data, absl::Span<const int64_t> shape, v1::Tensor* out);

}  // namespace kvshade::service
