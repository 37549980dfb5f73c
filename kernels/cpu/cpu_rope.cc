// CPU ApplyRope: x [n, heads, d] bf16 rotated in place at absolute positions [n] int64.
// Convention: each element is read as fp32, rotated with the table's cos/sin exactly as
// ApplyRopeReference does (angles in double, rounded to float; common/rope_math.h), and
// rounded once to bf16 (nearest even). Dimensions >= rotary_dim are untouched. The result
// is bit-identical to ApplyRopeReference on the bf16->fp32 inputs followed by one rounding.
//
// Cos/sin: a double sin and cos per (position, pair) cost more than the rotation itself
// (an ingest rotates every layer at the same positions), so they come from a cache of
// float tables owned by the backend object, in blocks of kBlockPositions positions, for
// the last frequency table seen. A cached value is the very float rope_math::CosSin
// returns (the same function fills the cache), so results do not depend on whether the
// cache was used. Blocks are built only by calls of at least kMinTokensToBuild tokens (a
// one-token decode append must not pay for 1024 positions); smaller calls use blocks
// already there and compute the rest per token as before. At most kMaxCacheBytes.
#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "common/rope_math.h"
#include "common/validate.h"
#include "cpu/cpu_backend.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels {
namespace {

constexpr int kPairTile = 64;
constexpr int64_t kBlockPositions = 1024;
constexpr int64_t kMinTokensToBuild = 256;
constexpr size_t kMaxCacheBytes = size_t{64} << 20;

// cos and sin of pairs [0, half) at positions [first, first + kBlockPositions).
struct CosSinBlock {
  std::vector<float> cs, sn;  // [kBlockPositions, half]
};

}  // namespace

class CosSinCache {
 public:
  // Blocks for block indices [b0, b1] of `table` (null where absent and not built);
  // `build` builds the missing ones when they fit under the cap.
  std::vector<std::shared_ptr<const CosSinBlock>> Get(const RopeTable& table, int64_t b0,
                                                      int64_t b1, bool build) {
    const int half = table.rotary_dim / 2;
    const size_t block_bytes = size_t(kBlockPositions) * half * 2 * sizeof(float);
    const int64_t max_blocks = static_cast<int64_t>(kMaxCacheBytes / std::max<size_t>(block_bytes, 1));
    std::vector<std::shared_ptr<const CosSinBlock>> out(size_t(b1 - b0 + 1));
    std::vector<int64_t> missing;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!SameTable(table)) {
        if (!build) return out;  // a small call does not evict another model's table
        key_ = table;
        blocks_.clear();
      }
      for (int64_t b = b0; b <= b1; ++b) {
        if (b < static_cast<int64_t>(blocks_.size()) && blocks_[size_t(b)]) {
          out[size_t(b - b0)] = blocks_[size_t(b)];
        } else if (build && b < max_blocks) {
          missing.push_back(b);
        }
      }
    }
    if (missing.empty()) return out;
    // Built outside the lock (another caller may build the same block: same values; the
    // first to insert wins).
    std::vector<std::shared_ptr<CosSinBlock>> built(missing.size());
    for (auto& blk : built) {
      blk = std::make_shared<CosSinBlock>();
      blk->cs.resize(size_t(kBlockPositions) * half);
      blk->sn.resize(size_t(kBlockPositions) * half);
    }
    const int64_t total = static_cast<int64_t>(missing.size()) * kBlockPositions;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < total; ++j) {
      const size_t m = size_t(j / kBlockPositions);
      const int64_t p = j % kBlockPositions;
      const long long pos = missing[m] * kBlockPositions + p;
      CosSinBlock& blk = *built[m];
      for (int i = 0; i < half; ++i) {
        rope_math::CosSin(table, pos, i, &blk.cs[size_t(p) * half + i], &blk.sn[size_t(p) * half + i]);
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    const bool still = SameTable(table);
    for (size_t m = 0; m < missing.size(); ++m) {
      const int64_t b = missing[m];
      if (still) {
        if (static_cast<int64_t>(blocks_.size()) <= b) blocks_.resize(size_t(b) + 1);
        if (!blocks_[size_t(b)]) blocks_[size_t(b)] = built[m];
        out[size_t(b - b0)] = blocks_[size_t(b)];
      } else {
        out[size_t(b - b0)] = built[m];  // another table took over meanwhile: use, don't keep
      }
    }
    return out;
  }

 private:
  bool SameTable(const RopeTable& t) const {
    return t.rotary_dim == key_.rotary_dim && t.inv_freq.size() == key_.inv_freq.size() &&
           std::memcmp(&t.position_scale, &key_.position_scale, sizeof(float)) == 0 &&
           std::memcmp(&t.magnitude, &key_.magnitude, sizeof(float)) == 0 &&
           (t.inv_freq.empty() ||
            std::memcmp(t.inv_freq.data(), key_.inv_freq.data(), t.inv_freq.size() * sizeof(float)) == 0);
  }

  std::mutex mu_;
  RopeTable key_{-1, {}, 0.0f, 0.0f};
  std::vector<std::shared_ptr<const CosSinBlock>> blocks_;  // by position / kBlockPositions
};

std::shared_ptr<CosSinCache> NewCosSinCache() { return std::make_shared<CosSinCache>(); }

namespace {


// Rotates one token's heads [heads, d] with cos/sin of its pairs [half].
inline void RotateToken(RopePairing pairing, int rotary_dim, int heads, int d, const float* cs,
                        const float* sn, int i0, int i1, bf16* token) {
  const int half = rotary_dim / 2;
  for (int hh = 0; hh < heads; ++hh) {
    bf16* v = token + static_cast<int64_t>(hh) * d;
    if (pairing == RopePairing::kHalfSplit) {
      for (int i = i0; i < i1; ++i) {
        float xa = Bf16ToFloat(v[i]), xb = Bf16ToFloat(v[i + half]);
        rope_math::Rotate(cs[i - i0], sn[i - i0], &xa, &xb);
        v[i] = FloatToBf16(xa);
        v[i + half] = FloatToBf16(xb);
      }
    } else {
      for (int i = i0; i < i1; ++i) {
        float xa = Bf16ToFloat(v[2 * i]), xb = Bf16ToFloat(v[2 * i + 1]);
        rope_math::Rotate(cs[i - i0], sn[i - i0], &xa, &xb);
        v[2 * i] = FloatToBf16(xa);
        v[2 * i + 1] = FloatToBf16(xb);
      }
    }
  }
}

}  // namespace

absl::Status CpuBackend::ApplyRope(const RopeSpec& rope, absl::Span<const int64_t> positions,
                                   int heads, int d, absl::Span<bf16> x, Stream) {
  KVSHADE_RETURN_IF_ERROR(validate::ApplyRope(rope, positions.size(), heads, d, x.size()));
  KVSHADE_ASSIGN_OR_RETURN(RopeTable table, MakeRopeTable(rope, d));
  const int64_t n = static_cast<int64_t>(positions.size());
  const int half = table.rotary_dim / 2;
  const RopePairing pairing = rope.pairing;
  const int64_t* pos = positions.data();
  bf16* data = x.data();
  if (n == 0 || half == 0) return absl::OkStatus();

  // Cached blocks covering [min, max] of the positions, when that range is non-negative
  // and not much wider than the call (scattered positions compute per token).
  const auto [lo, hi] = std::minmax_element(pos, pos + n);
  std::vector<std::shared_ptr<const CosSinBlock>> blocks;
  int64_t b0 = 0;
  if (*lo >= 0 && (*hi - *lo) / kBlockPositions <= n / kBlockPositions + 1) {
    b0 = *lo / kBlockPositions;
    blocks = rope_cache_->Get(table, b0, *hi / kBlockPositions, n >= kMinTokensToBuild);
  }
  const int64_t nb = static_cast<int64_t>(blocks.size());

#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    bf16* token = data + t * static_cast<int64_t>(heads) * d;
    const int64_t b = pos[t] >= 0 ? pos[t] / kBlockPositions - b0 : -1;
    if (b >= 0 && b < nb && blocks[size_t(b)] != nullptr) {
      const size_t row = size_t(pos[t] % kBlockPositions) * half;
      RotateToken(pairing, table.rotary_dim, heads, d, blocks[size_t(b)]->cs.data() + row,
                  blocks[size_t(b)]->sn.data() + row, 0, half, token);
      continue;
    }
    float cs[kPairTile], sn[kPairTile];
    for (int i0 = 0; i0 < half; i0 += kPairTile) {
      const int i1 = std::min(half, i0 + kPairTile);
      for (int i = i0; i < i1; ++i) rope_math::CosSin(table, pos[t], i, &cs[i - i0], &sn[i - i0]);
      RotateToken(pairing, table.rotary_dim, heads, d, cs, sn, i0, i1, token);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvshade::kernels
