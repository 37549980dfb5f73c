// Prints the C++ Router's placement for a fixed set of prompts and endpoint lists, one JSON
// object per line, for test_routing.py to compare with kvshade.routing (Python over the C
// ABI). The Router is connected to the names as targets (Connect makes no call), so the
// figures are those of Router::PrefixKey and Router::Rank themselves.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "kvshade/client/router.h"

namespace {

uint64_t g_state = 0x9E3779B97F4A7C15ull;  // fixed: the same vectors on every run
uint64_t Next() {
  g_state ^= g_state << 13;
  g_state ^= g_state >> 7;
  g_state ^= g_state << 17;
  return g_state;
}

}  // namespace

int main() {
  const std::vector<std::string> models = {"m", "llama-3-8b", "org/model:v2", ""};
  const std::vector<uint32_t> prefixes = {1, 4, 256, 1000};
  const std::vector<std::vector<std::string>> lists = {
      {"kv-0"},
      {"kv-0", "kv-1", "kv-2"},
      {"10.0.0.1:50551", "10.0.0.2:50551", "10.0.0.3:50551", "10.0.0.4:50551", "10.0.0.5:50551"},
      {"node-a", "node-b", "node-c", "node-d", "node-e", "node-f", "node-g", "node-h"}};
  for (int c = 0; c < 64; ++c) {
    const std::string& model = models[c % models.size()];
    const uint32_t prefix = prefixes[(c / 4) % prefixes.size()];
    const std::vector<std::string>& names = lists[(c / 16) % lists.size()];
    std::vector<int32_t> tokens(Next() % 600);
    for (int32_t& t : tokens) t = static_cast<int32_t>(Next());  // negative ids too
    kvshade::client::ClientOptions shared;
    shared.timeout = absl::Seconds(1);
    auto router = kvshade::client::Router::Connect(names, shared, prefix);
    if (!router.ok()) {
      std::fprintf(stderr, "Router::Connect: %s\n", router.status().ToString().c_str());
      return 1;
    }
    const uint64_t key = (*router)->PrefixKey(model, tokens);
    std::printf("{\"model\": \"%s\", \"prefix\": %u, \"key\": %llu, \"tokens\": [", model.c_str(), prefix,
                static_cast<unsigned long long>(key));
    for (size_t i = 0; i < tokens.size(); ++i) std::printf("%s%d", i ? ", " : "", tokens[i]);
    std::printf("], \"names\": [");
    for (size_t i = 0; i < names.size(); ++i) std::printf("%s\"%s\"", i ? ", " : "", names[i].c_str());
    std::printf("], \"weights\": [");
    for (size_t i = 0; i < names.size(); ++i) {
      std::printf("%s%llu", i ? ", " : "",
                  static_cast<unsigned long long>(kvshade::client::RendezvousWeight(names[i], key)));
    }
    std::printf("], \"rank\": [");
    const std::vector<size_t> rank = (*router)->Rank(key);
    for (size_t i = 0; i < rank.size(); ++i) std::printf("%s%zu", i ? ", " : "", rank[i]);
    std::printf("]}\n");
  }
  return 0;
}
