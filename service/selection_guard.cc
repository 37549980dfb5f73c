#include "kvshade/service/selection_guard.h"

#include <algorithm>
#include <cmath>

namespace kvshade::service {

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
  return it != layers_.end() && it->second.fallback != v1::RECALL_ACTION_UNSPECIFIED;
}

v1::RecallAction SelectionGuard::Record(int layer, double recall, double floor,
                                        v1::RecallAction action, int budget_now, int total,
                                        int cap) {
  std::lock_guard lock(mu_);
  Layer& l = layers_[layer];
  ++l.samples;
  l.recall_sum += recall;
  l.window.push_back(recall);
  while (l.window.size() > size_t(kWindow)) l.window.pop_front();
  if (l.window.size() < size_t(kWindow)) return v1::RECALL_ACTION_UNSPECIFIED;
  double mean = 0;
  for (double r : l.window) mean += r;
  mean /= double(l.window.size());
  if (mean >= floor) return v1::RECALL_ACTION_UNSPECIFIED;
  l.window.clear();
  const int limit = std::min(total, cap);
  switch (action) {
    case v1::RECALL_ACTION_WIDEN:
      if (budget_now >= limit) return v1::RECALL_ACTION_UNSPECIFIED;  // nothing left to add
      l.budget = std::min(limit, std::max(1, budget_now) * 2);
      break;
    case v1::RECALL_ACTION_EXACT:
      if (budget_now >= limit) return v1::RECALL_ACTION_UNSPECIFIED;
      l.budget = limit;
      break;
    default:
      ++l.actions;
      return v1::RECALL_ACTION_REPORT;
  }
  l.fallback = action;
  ++l.actions;
  return action;
}

void SelectionGuard::Fill(v1::SelectionHealth* out) const {
  std::lock_guard lock(mu_);
  uint64_t samples = 0;
  double sum = 0;
  for (const auto& [layer, l] : layers_) {
    if (l.samples == 0) continue;
    samples += l.samples;
    sum += l.recall_sum;
    v1::LayerSelection* o = out->add_layers();
    o->set_layer(static_cast<uint32_t>(layer));
    o->set_samples(l.samples);
    o->set_recall(l.recall_sum / double(l.samples));
    double recent = 0;
    for (double r : l.window) recent += r;
    o->set_recent_recall(l.window.empty() ? o->recall() : recent / double(l.window.size()));
    o->set_budget(static_cast<uint32_t>(std::max(l.budget, 0)));
    o->set_fallback(l.fallback);
    o->set_actions(l.actions);
  }
  out->set_samples(samples);
  out->set_recall(samples == 0 ? 0.0 : sum / double(samples));
}

}  // namespace kvshade::service

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/strings/str_cat.h"
#include "kvshade/service/model.h"

namespace kvshade::service {

std::string SelectionLabel(const ProfileInfo& p, bool native) {
  if (native) return "shadow+native";
  std::string s = "shadow";
  if (p.rerank_factor > 1) absl::StrAppend(&s, "+rerank", p.rerank_factor);
  if (p.mass_top_p > 0) absl::StrAppend(&s, "+top_p", p.mass_top_p);
  return s;
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

void SelectionMetrics::Acted(const std::string& profile, v1::RecallAction action) {
  const char* name = action == v1::RECALL_ACTION_WIDEN   ? "widen"
                     : action == v1::RECALL_ACTION_EXACT ? "exact"
                                                         : "report";
  actions_->Add({{"profile", profile}, {"action", name}}).Increment();
}

}  // namespace kvshade::service
