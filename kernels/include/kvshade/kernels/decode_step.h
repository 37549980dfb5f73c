// The decode step, one implementation for every path that runs it: the daemon's
// SelectAndReconstruct and Attend (service/select.cc) and the worker library's same-node
// decoder (client/local_decoder.cc). docs/ALGORITHM.md, "Decode" and "Selection options".
//
// A step of one layer for a batch of sequences:
//   1. selection: each sequence's chunks for this step, by the profile's policy (one or
//      two stages, a mass budget, or the caller's own ids), with the slot diff against its
//      slot table: SelectionGroup, RunSelection;
//   2. reconstruction of the misses into a sink (persistent slot buffers, or rows [0, m)
//      of a scratch block): RunReconstruct;
//   3. the recall guard on sampled steps (SelectionGuard, GuardStep);
//   4. the attended rows (static set, selected chunks, exact tail, tokens held elsewhere)
//      as one Backend::Attend item: AttendRows.
// Everything here runs on a Backend in its memory space and never allocates: callers size
// one workspace with the *WorkspaceBytes functions.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvshade/kernels/backend.h"

namespace kvshade::decode {

using kernels::bf16;

// What the recall guard does to a layer whose recent recall@k falls below the floor. The
// values are the wire enum's (v1.RecallAction).
enum class RecallAction { kNone = 0, kReport = 1, kWiden = 2, kExact = 3 };
const char* RecallActionName(RecallAction a);  // "none", "report", "widen", "exact"

// Budgets the recall guard may widen a layer to: the CUDA backend's widest selection.
inline constexpr int kMaxGuardBudget = 4096;

// A profile's selection settings (docs/ALGORITHM.md "Selection options", "Recall guard").
struct SelectionPolicy {
  // k: chunks' worth of tokens per KV head per step (k*C tokens). Whole-chunk selection
  // selects k chunks (the slot-table width); selection units select k*C/u units of u
  // tokens, the same token budget.
  int sparse_budget = 256;
  int rerank_factor = 1;     // > 1: two stages, stage 1 keeps rerank_factor * k candidates
  float mass_top_p = 0;      // > 0: budget by estimated attention mass
  int mass_min_chunks = 32;  // floor of the mass budget (in units with selection units)
  // Selection units (docs/ALGORITHM.md "Selection units"): tokens per unit u, a divisor
  // of C below it (needs rerank_factor > 1); 0 (or C) selects whole chunks.
  int selection_unit = 0;
  float recall_sample_rate = 0;  // > 0: the recall guard samples this fraction of steps
  float recall_floor = 0.5f;
  RecallAction recall_action = RecallAction::kWiden;

  // The SelectEx options at a budget of k chunks (C, rope: the session's chunk size and
  // RoPE); every option off gives the default SelectOptions (plain Select). `signatures`:
  // the view keeps key signatures (HasSignatures), so that stage 2 scores them instead of
  // reconstructing keys. Stage 1 keeps rerank_factor * k candidate chunks; with selection
  // units, SelectEx's k is Slots(k, C) units and the mass budget's floor
  // min(mass_min_chunks, Slots(k, C)) units.
  kernels::SelectOptions OptionsAt(int k, int C, const kernels::RopeSpec& rope,
                                   bool signatures = false) const;
  // Whether selection runs on units below the chunk size C.
  bool units(int C) const { return selection_unit > 0 && selection_unit < C; }
  // Units per chunk: C/u with units, else 1.
  int UnitsPerChunk(int C) const { return units(C) ? C / selection_unit : 1; }
  // Slots per KV head (SelectEx's k) for a budget of k chunks: k*C/u units, or k chunks.
  int Slots(int k, int C) const { return k * UnitsPerChunk(C); }
  // The label of the selection in metrics: "shadow", then "+rerankN", "+top_pX",
  // "+unitU"; "shadow+native" for model-native steps.
  std::string Label(bool native) const;
  bool guard() const { return recall_sample_rate > 0; }
  bool operator==(const SelectionPolicy&) const = default;
};

// Whether every segment of the view with chunks keeps key signatures (SegmentView::sig).
bool HasSignatures(const kernels::SessionLayerView& view);

// Whether `be` runs selection units at chunk size C: OK, or the backend's refusal. Probes
// SelectEx with no items; OK when the policy selects whole chunks.
absl::Status CheckUnitsSupported(kernels::Backend& be, const kernels::LayerShape& shape,
                                 const SelectionPolicy& policy, int C,
                                 const kernels::RopeSpec& rope);

// Sequences of one step whose selection runs in one launch: same geometry, slot width and
// options.
struct SelectionGroup {
  kernels::LayerShape shape;
  int k = 0;  // slots per head
  int C = 0;
  kernels::RopeSpec rope;
  kernels::ValueCodecSpec codec;
  kernels::SelectOptions options;
  // Model-native: each item's `selected` rows already hold the caller's chunk ids; only
  // the slot diff runs (Backend::AssignSlots).
  bool native = false;

  bool plain() const { return !native && options.candidates == 0 && options.top_p == 0; }
  // Tokens per slot: the selection unit, or C for whole chunks (and model-native ids).
  int unit_tokens() const { return options.units() ? options.unit : C; }
  // Slots per chunk: C / unit_tokens().
  int units_per_chunk() const { return options.units() ? C / options.unit : 1; }
  // Absolute position of the first token of slot id `id` (a chunk id, or a unit id).
  int64_t position(const kernels::SessionLayerView& view, int id) const {
    const int u = unit_tokens();
    return view.chunk_position(int(int64_t(id) * u / C), C) + int64_t(id) * u % C;
  }
  // Equal keys may share a launch (with equal shapes, checked by the caller's grouping).
  std::string Key() const;
};

// One item's select outputs in one int32 block of SelectOutputWords(h, k) words: selected,
// miss_slot, miss_chunk [h, k] each, then miss_count [h].
inline size_t SelectOutputWords(int h, int k) { return 3 * size_t(h) * k + h; }
void BindOutputs(int32_t* block, int h, int k, kernels::SelectItem* item);

// Selection (Select, SelectEx or AssignSlots by the group) for `items`, each with view, q
// (unless native), slots and outputs bound.
size_t SelectionWorkspaceBytes(const kernels::Backend& be, const SelectionGroup& g,
                               absl::Span<const kernels::SelectItem> items);
absl::Status RunSelection(kernels::Backend& be, const SelectionGroup& g,
                          absl::Span<const kernels::SelectItem> items, kernels::Workspace ws,
                          kernels::Stream stream);
// Reconstruction of the misses the selection left in `items` (miss_chunk, miss_count,
// and miss_slot when the sink is a slot buffer).
size_t ReconstructWorkspaceBytes(const kernels::Backend& be, const SelectionGroup& g,
                                 absl::Span<const kernels::ReconstructItem> items);
absl::Status RunReconstruct(kernels::Backend& be, const SelectionGroup& g,
                            absl::Span<const kernels::ReconstructItem> items,
                            kernels::Workspace ws, kernels::Stream stream);
// The reconstruct item of a select item of group `g`, into `keys`/`values` ([h, k, U, d]
// bf16, U = g.unit_tokens()): at each miss's slot when `into_slots` (a persistent slot
// buffer: hits stay), else at rows [0, miss_count) of each head.
kernels::ReconstructItem ReconstructOf(const SelectionGroup& g, const kernels::SelectItem& s,
                                       bf16* keys, bf16* values, bool into_slots);

// The recall guard of one sequence (docs/ALGORITHM.md "Recall guard"): which decode steps
// are sampled, the recall@k each sampled step measured against the oracle, and what the
// guard did to a layer whose recall fell below the floor. Thread-safe.
struct LayerHealth {
  int layer = 0;
  uint64_t samples = 0;
  double recall = 0;         // mean over the samples
  double recent_recall = 0;  // mean over the current window
  int budget = 0;            // chunks per KV head the guard widened to (0: the profile's)
  RecallAction fallback = RecallAction::kNone;  // kWiden or kExact once it acted
  uint64_t actions = 0;
};

class SelectionGuard {
 public:
  // Samples per layer over which the recent recall is averaged; the guard acts only on a
  // full window, and starts a new one after acting.
  static constexpr int kWindow = 4;

  // Advances the layer's decode-step counter; true when this step is sampled: the steps
  // where floor(n * rate) increases (rate 1: every step; 0.25: every 4th; 0: none).
  bool Sample(int layer, double rate);
  // The budget (chunks per KV head) for `layer` now: `k` (the profile's, already clamped
  // to the layer's chunk count `total`) unless the guard widened it.
  int Budget(int layer, int k, int total) const;
  // Whether the guard widened the layer (it is under a fallback).
  bool Fallback(int layer) const;
  // Records one sampled step's recall@k, measured at the budget the step used
  // (`budget_now`). When the window is full and its mean is below `floor`, applies
  // `action` (kWiden: double budget_now, up to `total` and `cap`; kExact: every chunk, up
  // to `cap`; kReport: nothing) and returns it; else kNone.
  RecallAction Record(int layer, double recall, double floor, RecallAction action,
                      int budget_now, int total, int cap);
  // A widened budget learned elsewhere (the daemon's, carried by a session export).
  void Adopt(int layer, int budget, RecallAction fallback);
  // Every layer with samples or a fallback, the lowest mean recall first (then the lowest
  // recent recall; layers with no samples last).
  std::vector<LayerHealth> Snapshot() const;

 private:
  struct Layer {
    uint64_t steps = 0, samples = 0, actions = 0;
    double recall_sum = 0;
    std::deque<double> window;
    int budget = 0;  // 0: the profile's
    RecallAction fallback = RecallAction::kNone;
  };
  mutable std::mutex mu_;
  std::map<int, Layer> layers_;
};

// Recall@k of one sequence's selection against the oracle: the top-`k_oracle` chunks of
// SelectEx scoring every selectable chunk (stage 2's scores of reconstructed keys). With
// selection units (g.options.units()), the oracle ranks units of the same size over every
// selectable chunk and keeps the top k_oracle * C/u units (the same token budget): recall
// is counted in units, and `selected` holds unit ids.
//   q        : [hq, d] bf16 (backend memory), the step's query
//   selected : [h, k_sel] int32 (host), the selection to measure (-1 = none)
//   k_oracle : the oracle's budget in chunks (OracleBudget)
// Averaged over the heads with an oracle chunk (unit); nullopt when the backend cannot
// score every chunk in one call (CUDA past 16384 chunks) or no head has one: the step is
// not sampled.
size_t OracleWorkspaceBytes(const kernels::Backend& be, const SelectionGroup& g,
                            const kernels::SessionLayerView& view, int k_oracle);
absl::StatusOr<std::optional<double>> OracleRecall(kernels::Backend& be, const SelectionGroup& g,
                                                   const kernels::SessionLayerView& view,
                                                   const bf16* q, const int32_t* selected,
                                                   int k_sel, int k_oracle, kernels::Workspace ws,
                                                   kernels::Stream stream);

// The guard's part of one step of one sequence's layer, after its selection: on a sampled
// step, recall@k of `selected` (host [h, k_sel], the selection the step attends, at the
// budget it used: k_sel slots, g.k) against the oracle at the profile's budget, recorded
// and acted on. The guard's budgets count chunks (k_sel / g.units_per_chunk()).
struct GuardOutcome {
  bool sampled = false;
  double recall = 0;
  RecallAction action = RecallAction::kNone;
};
absl::StatusOr<GuardOutcome> GuardStep(kernels::Backend& be, SelectionGuard& guard,
                                       const SelectionPolicy& policy, const SelectionGroup& g,
                                       int layer, const kernels::SessionLayerView& view,
                                       const bf16* q, const int32_t* selected, int k_sel,
                                       kernels::Workspace ws, kernels::Stream stream);
// Whether `layer`'s step is sampled (advances the counter): call once per step, before
// GuardStep, so that a caller can bring the selection to the host only when it is.
bool GuardSamples(SelectionGuard& guard, const SelectionPolicy& policy, int layer);
// The oracle's budget for a layer of `total` selectable chunks.
inline int OracleBudget(const SelectionPolicy& p, int total) {
  return p.sparse_budget < total ? p.sparse_budget : total;
}

// The rows one sequence attends in one layer, as one Backend::Attend item (at most
// kernels::kMaxKvBlocks blocks).
class AttendRows {
 public:
  // The static set: [h, s, d] per head, `lengths` [h] valid rows (backend memory).
  absl::Status AddStatic(const bf16* k, const bf16* v, int s, const int32_t* lengths, int d);
  // Selected chunks (units): [h, k*U, d], U tokens per slot (C, or the selection unit);
  // `lengths` [h] rows attended per head (backend memory).
  absl::Status AddSelected(const bf16* k, const bf16* v, int64_t rows, const int32_t* lengths,
                           int d);
  // Exact tokens in [t, h, d] layout (a tail, the tokens of a step); `lengths` may be null.
  absl::Status AddTokens(const bf16* k, const bf16* v, int64_t t, const int32_t* lengths,
                         int64_t token_stride, int d);
  absl::Status Add(const kernels::KvBlock& b);
  int size() const { return item_.n_blocks; }
  int room() const { return kernels::kMaxKvBlocks - item_.n_blocks; }
  kernels::AttendItem Item(const bf16* q, float* out, float* lse) const;

 private:
  kernels::AttendItem item_;
};

}  // namespace kvshade::decode
