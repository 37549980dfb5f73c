// The recall guard of a session (docs/ALGORITHM.md "Recall guard"): the guard itself is the
// decode core's (kvshade/kernels/decode_step.h, shared with same-node decode); here are its
// wire form (GetSession's SelectionHealth) and its Prometheus metrics.
#pragma once

#include <memory>
#include <string>

#include "kvshade/kernels/decode_step.h"
#include "kvshade/v1/kvshade.pb.h"

namespace prometheus {
class Registry;
template <typename T>
class Family;
class Histogram;
class Counter;
}  // namespace prometheus

namespace kvshade::service {

using decode::SelectionGuard;

// The guard's figures for GetSession, per layer (the worst recent recall first) and in
// total.
void FillSelectionHealth(const SelectionGuard& guard, v1::SelectionHealth* out);

// The recall guard's metrics, registered once per registry (For):
//   kvshade_selection_recall{profile}                      histogram of sampled recall@k
//   kvshade_selection_guard_actions_total{profile,action}  report | widen | exact
// `profile` is decode::SelectionPolicy::Label.
class SelectionMetrics {
 public:
  static SelectionMetrics* For(const std::shared_ptr<prometheus::Registry>& registry);
  void Sampled(const std::string& profile, double recall);
  void Acted(const std::string& profile, decode::RecallAction action);

 private:
  explicit SelectionMetrics(prometheus::Registry& registry);
  prometheus::Family<prometheus::Histogram>* recall_;
  prometheus::Family<prometheus::Counter>* actions_;
};

}  // namespace kvshade::service
