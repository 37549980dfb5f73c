// The recall guard of one session (docs/ALGORITHM.md "Recall guard"): which decode steps
// are sampled, the recall@k each sampled step measured against the oracle (top-k by the
// exact logits of reconstructed keys), and what the guard did to a layer whose recall fell
// below the profile's floor (a wider budget, or every chunk). Thread-safe: decode batches
// of one session run under its shared lock, so the guard has its own mutex.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "kvshade/v1/kvshade.pb.h"

namespace kvshade::service {

class SelectionGuard {
 public:
  // Samples per layer over which the recent recall is averaged; the guard acts only on a
  // full window, and starts a new one after acting.
  static constexpr int kWindow = 4;

  // Advances the layer's decode-step counter; true when this step is sampled: the steps
  // where floor(n * rate) increases (rate 1: every step; 0.25: every 4th; 0: none), so
  // sampling is deterministic.
  bool Sample(int layer, double rate);

  // The budget (chunks per KV head) for `layer` now: `k` (the profile's, already clamped
  // to the layer's chunk count `total`) unless the guard widened it.
  int Budget(int layer, int k, int total) const;
  // Whether the guard acted on the layer (it is under a fallback).
  bool Fallback(int layer) const;

  // Records one sampled step's recall@k. When the window is full and its mean is below
  // `floor`, applies `action` (WIDEN: double the budget now in use, `budget_now`, up to
  // `total` and `cap`; EXACT: every chunk, up to `cap`; REPORT: nothing) and returns it;
  // else returns RECALL_ACTION_UNSPECIFIED.
  v1::RecallAction Record(int layer, double recall, double floor, v1::RecallAction action,
                          int budget_now, int total, int cap);

  // The figures for GetSession.
  void Fill(v1::SelectionHealth* out) const;

 private:
  struct Layer {
    uint64_t steps = 0, samples = 0, actions = 0;
    double recall_sum = 0;
    std::deque<double> window;
    int budget = 0;  // 0: the profile's
    v1::RecallAction fallback = v1::RECALL_ACTION_UNSPECIFIED;
  };
  mutable std::mutex mu_;
  std::map<int, Layer> layers_;
};

}  // namespace kvshade::service

namespace prometheus {
class Registry;
template <typename T>
class Family;
class Histogram;
class Counter;
}  // namespace prometheus

namespace kvshade::service {

struct ProfileInfo;

// The label of a profile's selection in metrics: "shadow", then "+rerankN" (two stages),
// "+top_pX" (mass budget); "shadow+native" for model-native steps.
std::string SelectionLabel(const ProfileInfo& p, bool native);

// The recall guard's metrics, registered once per registry (For):
//   kvshade_selection_recall{profile}                      histogram of sampled recall@k
//   kvshade_selection_guard_actions_total{profile,action}  report | widen | exact
class SelectionMetrics {
 public:
  static SelectionMetrics* For(const std::shared_ptr<prometheus::Registry>& registry);
  void Sampled(const std::string& profile, double recall);
  void Acted(const std::string& profile, v1::RecallAction action);

 private:
  explicit SelectionMetrics(prometheus::Registry& registry);
  prometheus::Family<prometheus::Histogram>* recall_;
  prometheus::Family<prometheus::Counter>* actions_;
};

}  // namespace kvshade::service
