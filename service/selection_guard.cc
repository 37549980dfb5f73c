#include "kvshade/service/selection_guard.h"

#include <map>
#include <mutex>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/strings/str_cat.h"
#include "kvshade/service/model.h"

namespace kvshade::service {

void FillSelectionHealth(const SelectionGuard& guard, v1::SelectionHealth* out) {
  uint64_t samples = 0;
  double sum = 0;
  for (const decode::LayerHealth& l : guard.Snapshot()) {
    samples += l.samples;
    sum += l.recall * double(l.samples);
    v1::LayerSelection* o = out->add_layers();
    o->set_layer(static_cast<uint32_t>(l.layer));
    o->set_samples(l.samples);
    o->set_recall(l.recall);
    o->set_recent_recall(l.recent_recall);
    o->set_budget(static_cast<uint32_t>(l.budget));
    o->set_fallback(static_cast<v1::RecallAction>(static_cast<int>(l.fallback)));
    o->set_actions(l.actions);
  }
  out->set_samples(samples);
  out->set_recall(samples == 0 ? 0.0 : sum / double(samples));
}

SelectionMetrics::SelectionMetrics(prometheus::Registry& r)
    : recall_(&prometheus::BuildHistogram()
                   .Name("kvshade_selection_recall")
                   .Help("Recall@k of sampled decode steps' selection against the oracle top-k "
                         "(exact logits of reconstructed keys), per selection profile")
                   .Register(r)),
      actions_(&prometheus::BuildCounter()
                    .Name("kvshade_selection_guard_actions_total")
                    .Help("Times the recall guard found a layer's recent recall below its "
                          "floor, by the action taken (report, widen, exact)")
                    .Register(r)) {}

SelectionMetrics* SelectionMetrics::For(const std::shared_ptr<prometheus::Registry>& registry) {
  static std::mutex mu;
  static std::map<prometheus::Registry*, std::pair<std::weak_ptr<prometheus::Registry>,
                                                   std::unique_ptr<SelectionMetrics>>>
      by_registry;
  std::lock_guard lock(mu);
  auto& slot = by_registry[registry.get()];
  if (!slot.second || slot.first.expired()) {
    // A new registry (or a new one at a freed address): register the families on it.
    slot.first = registry;
    slot.second.reset(new SelectionMetrics(*registry));
  }
  return slot.second.get();
}

void SelectionMetrics::Sampled(const std::string& profile, double recall) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {0.1, 0.2, 0.3, 0.4, 0.5,
                                                                   0.6, 0.7, 0.8, 0.9, 0.95, 1.0};
  recall_->Add({{"profile", profile}}, kBuckets).Observe(recall);
}

void SelectionMetrics::Acted(const std::string& profile, decode::RecallAction action) {
  actions_->Add({{"profile", profile}, {"action", decode::RecallActionName(action)}}).Increment();
}

}  // namespace kvshade::service
