#include "kvshade/kernels/decode_step.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::decode {

using kernels::Backend;
using kernels::ReconstructItem;
using kernels::SelectItem;
using kernels::SelectOptions;

const char* RecallActionName(RecallAction a) {
  switch (a) {
    case RecallAction::kReport: return "report";
    case RecallAction::kWiden: return "widen";
    case RecallAction::kExact: return "exact";
    case RecallAction::kNone: break;
  }
  return "none";
}

SelectOptions SelectionPolicy::OptionsAt(int k, int C, const kernels::RopeSpec& rope,
                                         bool signatures) const {
  SelectOptions o;
  if (rerank_factor > 1) {
    o.candidates = rerank_factor * k;
    o.C = C;
    o.rope = rope;
    o.signatures = signatures;
    if (units(C)) o.unit = selection_unit;
  }
  if (mass_top_p > 0) {
    o.top_p = mass_top_p;
    o.min_k = std::min(mass_min_chunks, Slots(k, C));
  }
  return o;
}

std::string SelectionPolicy::Label(bool native) const {
  if (native) return "shadow+native";
  std::string s = "shadow";
  if (rerank_factor > 1) absl::StrAppend(&s, "+rerank", rerank_factor);
  if (mass_top_p > 0) absl::StrAppend(&s, "+top_p", mass_top_p);
  if (selection_unit > 0) absl::StrAppend(&s, "+unit", selection_unit);
  return s;
}

bool HasSignatures(const kernels::SessionLayerView& view) {
  if (!kernels::ValidSignatureBits(view.sig_bits)) return false;
  for (int i = 0; i < view.n_segments; ++i) {
    if (view.segments[i].n_chunks > 0 && view.segments[i].sig == nullptr) return false;
  }
  return true;
}

absl::Status CheckUnitsSupported(Backend& be, const kernels::LayerShape& shape,
                                 const SelectionPolicy& policy, int C,
                                 const kernels::RopeSpec& rope) {
  if (!policy.units(C)) return absl::OkStatus();
  const SelectOptions o = policy.OptionsAt(1, C, rope);
  if (!o.units()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "selection units (selection_unit = ", policy.selection_unit,
        ") need two-stage selection (rerank_factor > 1), got rerank_factor = ",
        policy.rerank_factor));
  }
  return be.SelectEx(shape, o.unit_tokens(), o, {}, kernels::Workspace{}, kernels::Stream{});
}

std::string SelectionGroup::Key() const {
  return absl::StrCat(shape.h, "x", shape.g, "x", shape.d, "|", C, "|",
                      static_cast<int>(codec.codec), "/", codec.group, "|", k, "|",
                      native ? -1 : options.candidates, "|", options.top_p, "|", options.min_k,
                      "|", options.signatures ? 1 : 0, "|", native ? 0 : options.unit);
}

void BindOutputs(int32_t* block, int h, int k, SelectItem* item) {
  const size_t hk = size_t(h) * k;
  item->selected = block;
  item->miss_slot = block + hk;
  item->miss_chunk = block + 2 * hk;
  item->miss_count = block + 3 * hk;
}

size_t SelectionWorkspaceBytes(const Backend& be, const SelectionGroup& g,
                               absl::Span<const SelectItem> items) {
  if (g.native) return be.AssignSlotsWorkspaceBytes(g.shape, g.k, items);
  if (g.plain()) return be.SelectWorkspaceBytes(g.shape, g.k, items);
  return be.SelectExWorkspaceBytes(g.shape, g.k, g.options, items);
}

absl::Status RunSelection(Backend& be, const SelectionGroup& g, absl::Span<const SelectItem> items,
                          kernels::Workspace ws, kernels::Stream stream) {
  if (items.empty()) return absl::OkStatus();
  if (g.native) return be.AssignSlots(g.shape, g.k, items, ws, stream);
  if (g.plain()) return be.Select(g.shape, g.k, items, ws, stream);
  return be.SelectEx(g.shape, g.k, g.options, items, ws, stream);
}

size_t ReconstructWorkspaceBytes(const Backend& be, const SelectionGroup& g,
                                 absl::Span<const ReconstructItem> items) {
  return be.ReconstructWorkspaceBytes(g.shape, g.k, items);
}

absl::Status RunReconstruct(Backend& be, const SelectionGroup& g,
                            absl::Span<const ReconstructItem> items, kernels::Workspace ws,
                            kernels::Stream stream) {
  if (items.empty()) return absl::OkStatus();
  return be.Reconstruct(g.shape, g.C, g.k, g.rope, g.codec, items, ws, stream);
}

ReconstructItem ReconstructOf(const SelectionGroup& g, const SelectItem& s, bf16* keys,
                              bf16* values, bool into_slots) {
  ReconstructItem r;
  r.unit = g.native ? 0 : g.options.unit;
  r.view = s.view;
  r.miss_chunk = s.miss_chunk;
  r.miss_count = s.miss_count;
  r.miss_slot = into_slots ? s.miss_slot : nullptr;
  r.keys = keys;
  r.values = values;
  return r;
}

// --- Recall guard ------------------------------------------------------------------------

bool SelectionGuard::Sample(int layer, double rate) {
  if (!(rate > 0)) return false;
  std::lock_guard lock(mu_);
  Layer& l = layers_[layer];
  const uint64_t n = l.steps++;
  return std::floor(double(n + 1) * rate) > std::floor(double(n) * rate);
}

int SelectionGuard::Budget(int layer, int k, int total) const {
  std::lock_guard lock(mu_);
  auto it = layers_.find(layer);
  if (it == layers_.end() || it->second.budget <= 0) return k;
  return std::min(std::max(it->second.budget, k), total);
}

bool SelectionGuard::Fallback(int layer) const {
  std::lock_guard lock(mu_);
  auto it = layers_.find(layer);
  return it != layers_.end() && it->second.fallback != RecallAction::kNone;
}

RecallAction SelectionGuard::Record(int layer, double recall, double floor, RecallAction action,
                                    int budget_now, int total, int cap) {
  std::lock_guard lock(mu_);
  Layer& l = layers_[layer];
  ++l.samples;
  l.recall_sum += recall;
  l.window.push_back(recall);
  while (l.window.size() > size_t(kWindow)) l.window.pop_front();
  if (l.window.size() < size_t(kWindow)) return RecallAction::kNone;
  double mean = 0;
  for (double r : l.window) mean += r;
  mean /= double(l.window.size());
  if (mean >= floor) return RecallAction::kNone;
  l.window.clear();
  const int limit = std::min(total, cap);
  switch (action) {
    case RecallAction::kWiden:
      if (budget_now >= limit) return RecallAction::kNone;  // nothing left to add
      l.budget = std::min(limit, std::max(1, budget_now) * 2);
      break;
    case RecallAction::kExact:
      if (budget_now >= limit) return RecallAction::kNone;
      l.budget = limit;
      break;
    default:
      ++l.actions;
      return RecallAction::kReport;
  }
  l.fallback = action;
  ++l.actions;
  return action;
}

void SelectionGuard::Adopt(int layer, int budget, RecallAction fallback) {
  std::lock_guard lock(mu_);
  Layer& l = layers_[layer];
  if (budget > l.budget) {
    l.budget = budget;
    l.fallback = fallback;
  }
}

std::vector<LayerHealth> SelectionGuard::Snapshot() const {
  std::vector<LayerHealth> out;
  {
    std::lock_guard lock(mu_);
    for (const auto& [layer, l] : layers_) {
      if (l.samples == 0 && l.fallback == RecallAction::kNone) continue;
      LayerHealth o;
      o.layer = layer;
      o.samples = l.samples;
      o.recall = l.samples == 0 ? 0.0 : l.recall_sum / double(l.samples);
      double recent = 0;
      for (double r : l.window) recent += r;
      o.recent_recall = l.window.empty() ? o.recall : recent / double(l.window.size());
      o.budget = std::max(l.budget, 0);
      o.fallback = l.fallback;
      o.actions = l.actions;
      out.push_back(o);
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const LayerHealth& a, const LayerHealth& b) {
    if (a.samples == 0 || b.samples == 0) return a.samples > b.samples;  // unsampled last
    if (a.recall != b.recall) return a.recall < b.recall;
    return a.recent_recall < b.recent_recall;
  });
  return out;
}

namespace {

// Word offsets of the oracle's scratch: outputs, then the empty slot table, then SelectEx's
// workspace (16-byte aligned).
struct OracleLayout {
  size_t outs = 0, slots = 0, ws = 0, ws_bytes = 0, total = 0;
};

SelectOptions OracleOptions(const SelectionGroup& g, const kernels::SessionLayerView& view) {
  SelectOptions o;
  o.candidates = std::max(view.total_chunks(), 1);
  o.C = g.C;
  o.rope = g.rope;
  o.unit = g.native ? 0 : g.options.unit;  // the oracle ranks the group's units
  return o;
}

OracleLayout LayoutOf(const Backend& be, const SelectionGroup& g,
                      const kernels::SessionLayerView& view, int k_oracle) {
  OracleLayout l;
  const int h = g.shape.h;
  auto up = [](size_t b) { return (b + 15) / 16 * 16; };
  l.outs = 0;
  l.slots = up(SelectOutputWords(h, k_oracle) * 4);
  l.ws = l.slots + up(size_t(h) * k_oracle * 4);
  SelectItem it;
  it.view = view;
  const SelectItem items[1] = {it};
  l.ws_bytes = be.SelectExWorkspaceBytes(g.shape, k_oracle, OracleOptions(g, view), items);
  l.total = l.ws + up(std::max<size_t>(l.ws_bytes, 1));
  return l;
}

}  // namespace

size_t OracleWorkspaceBytes(const Backend& be, const SelectionGroup& g,
                            const kernels::SessionLayerView& view, int k_oracle) {
  if (k_oracle <= 0) return 0;
  return LayoutOf(be, g, view, k_oracle * g.units_per_chunk()).total;
}

absl::StatusOr<std::optional<double>> OracleRecall(Backend& be, const SelectionGroup& g,
                                                   const kernels::SessionLayerView& view,
                                                   const bf16* q, const int32_t* selected,
                                                   int k_sel, int k_oracle, kernels::Workspace ws,
                                                   kernels::Stream stream) {
  if (k_oracle <= 0) return std::optional<double>();
  k_oracle *= g.units_per_chunk();  // in slots: units with selection units
  const int h = g.shape.h;
  const OracleLayout l = LayoutOf(be, g, view, k_oracle);
  if (ws.bytes < l.total) {
    return absl::InternalError(absl::StrCat("OracleRecall: workspace of ", ws.bytes,
                                            " bytes, needs ", l.total));
  }
  char* base = static_cast<char*>(ws.data);
  const size_t hk = size_t(h) * k_oracle;
  SelectItem it;
  it.view = view;
  it.q = q;
  it.slots = reinterpret_cast<int32_t*>(base + l.slots);
  BindOutputs(reinterpret_cast<int32_t*>(base + l.outs), h, k_oracle, &it);
  KVSHADE_RETURN_IF_ERROR(be.Fill(it.slots, 0xff, hk * 4, stream));  // every slot empty
  const SelectItem items[1] = {it};
  absl::Status st = be.SelectEx(g.shape, k_oracle, OracleOptions(g, view), items,
                                kernels::Workspace{base + l.ws, l.ws_bytes}, stream);
  if (absl::IsInvalidArgument(st)) return std::optional<double>();  // too wide for the backend
  KVSHADE_RETURN_IF_ERROR(st);
  std::vector<int32_t> oracle(hk);
  KVSHADE_RETURN_IF_ERROR(be.CopyToHost(oracle.data(), it.selected, hk * 4, stream));
  KVSHADE_RETURN_IF_ERROR(be.Synchronize(stream));
  double sum = 0;
  int heads = 0;
  for (int hh = 0; hh < h; ++hh) {
    int n = 0, hit = 0;
    const int32_t* row = selected + size_t(hh) * k_sel;
    for (int x = 0; x < k_oracle; ++x) {
      const int32_t c = oracle[size_t(hh) * k_oracle + x];
      if (c < 0) continue;
      ++n;
      hit += std::find(row, row + k_sel, c) != row + k_sel;
    }
    if (n == 0) continue;
    sum += double(hit) / n;
    ++heads;
  }
  if (heads == 0) return std::optional<double>();
  return std::optional<double>(sum / heads);
}

bool GuardSamples(SelectionGuard& guard, const SelectionPolicy& policy, int layer) {
  return policy.guard() && guard.Sample(layer, policy.recall_sample_rate);
}

absl::StatusOr<GuardOutcome> GuardStep(Backend& be, SelectionGuard& guard,
                                       const SelectionPolicy& policy, const SelectionGroup& g,
                                       int layer, const kernels::SessionLayerView& view,
                                       const bf16* q, const int32_t* selected, int k_sel,
                                       kernels::Workspace ws, kernels::Stream stream) {
  GuardOutcome out;
  const int total = view.total_chunks();
  KVSHADE_ASSIGN_OR_RETURN(std::optional<double> recall,
                           OracleRecall(be, g, view, q, selected, k_sel, OracleBudget(policy, total),
                                        ws, stream));
  if (!recall) return out;
  out.sampled = true;
  out.recall = *recall;
  // The guard's budgets count chunks: k_sel slots of units are k_sel / (C/u) chunks.
  out.action = guard.Record(layer, *recall, policy.recall_floor, policy.recall_action,
                            k_sel / g.units_per_chunk(), total, kMaxGuardBudget);
  return out;
}

// --- Attended rows -----------------------------------------------------------------------

absl::Status AttendRows::Add(const kernels::KvBlock& b) {
  if (item_.n_blocks == kernels::kMaxKvBlocks) {
    return absl::InternalError(absl::StrCat("a decode step attends at most ",
                                            kernels::kMaxKvBlocks, " blocks"));
  }
  item_.blocks[item_.n_blocks++] = b;
  return absl::OkStatus();
}

absl::Status AttendRows::AddStatic(const bf16* k, const bf16* v, int s, const int32_t* lengths,
                                   int d) {
  if (s <= 0) return absl::OkStatus();
  return Add(kernels::KvBlock{k, v, s, lengths, int64_t(s) * d, d});
}

absl::Status AttendRows::AddSelected(const bf16* k, const bf16* v, int64_t rows,
                                     const int32_t* lengths, int d) {
  if (rows <= 0) return absl::OkStatus();
  return Add(kernels::KvBlock{k, v, rows, lengths, rows * d, d});
}

absl::Status AttendRows::AddTokens(const bf16* k, const bf16* v, int64_t t,
                                   const int32_t* lengths, int64_t token_stride, int d) {
  if (t <= 0) return absl::OkStatus();
  return Add(kernels::KvBlock{k, v, t, lengths, d, token_stride});
}

kernels::AttendItem AttendRows::Item(const bf16* q, float* out, float* lse) const {
  kernels::AttendItem it = item_;
  it.q = q;
  it.out = out;
  it.lse = lse;
  return it;
}

}  // namespace kvshade::decode
