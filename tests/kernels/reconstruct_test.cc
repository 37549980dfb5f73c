// Reconstruct (docs/ALGORITHM.md decode step 4): keys equal a naive A.B + RoPE at the true
// absolute positions, values equal DecodeValueChunks of the same stored chunks, for every
// codec, with padded value strides and several segments; rows past miss_count stay
// untouched; bad miss ids and strides are rejected. Slot-addressed output (miss_slot): the
// compact output permuted into the named slots, other rows untouched; slots outside [0, k)
// or repeated are rejected before anything is written.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/rope.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace reconstruct_test {
namespace {

using testing::Cpu;
using testing::MakeRng;
using testing::RandomBf16;

struct Segment {
  int n_chunks = 0;
  int64_t first_position = 0;
  std::vector<bf16> a;                // [n_chunks*C, r]
  std::vector<std::byte> values;      // padded store
  int64_t head_stride = 0, chunk_stride = 0;
};

struct Fixture {
  LayerShape shape{3, 2, 64};
  int C = 8, r = 24, k = 6;
  RopeSpec rope;
  ValueCodecSpec codec;
  std::vector<bf16> b;  // [h, r, d]
  std::vector<Segment> segs;

  // Builds segments with random factors and values encoded by the backend, stored with
  // explicit padding between chunks and between heads.
  void Build(Backend& be, std::mt19937_64& rng, const std::vector<int>& chunk_counts) {
    const int h = shape.h, d = shape.d;
    b = RandomBf16(size_t(h) * r * d, rng, 0.3f);
    const size_t chunk_bytes = ValueChunkBytes(codec, C, d).value();
    int64_t pos = 17;
    for (int n_chunks : chunk_counts) {
      Segment s;
      s.n_chunks = n_chunks;
      s.first_position = pos;
      pos += int64_t(n_chunks) * C + 5;
      s.a = RandomBf16(size_t(n_chunks) * C * r, rng, 1.0f);
      const int n = n_chunks * C + 3;  // a ragged tail that is not chunked
      const std::vector<bf16> v = RandomBf16(size_t(n) * h * d, rng, 1.0f);
      std::vector<std::byte> dense(size_t(h) * n_chunks * chunk_bytes);
      EXPECT_TRUE(be.EncodeValueChunks(v, n, h, d, C, n_chunks, codec, absl::MakeSpan(dense), {})
                      .ok());
      s.chunk_stride = int64_t(chunk_bytes) + 24;               // padding between chunks
      s.head_stride = s.chunk_stride * n_chunks + 40;           // and between heads
      s.values.assign(size_t(s.head_stride) * h, std::byte{0xCD});
      for (int hh = 0; hh < h; ++hh)
        for (int j = 0; j < n_chunks; ++j)
          std::memcpy(s.values.data() + hh * s.head_stride + j * s.chunk_stride,
                      dense.data() + (size_t(hh) * n_chunks + j) * chunk_bytes, chunk_bytes);
      segs.push_back(std::move(s));
    }
  }

  SessionLayerView View() const {
    SessionLayerView v;
    v.n_segments = int(segs.size());
    v.b = b.data();
    v.r = r;
    for (size_t i = 0; i < segs.size(); ++i) {
      v.segments[i].n_chunks = segs[i].n_chunks;
      v.segments[i].first_position = segs[i].first_position;
      v.segments[i].a = segs[i].a.data();
      v.segments[i].values = segs[i].values.data();
      v.segments[i].value_head_stride = segs[i].head_stride;
      v.segments[i].value_chunk_stride = segs[i].chunk_stride;
    }
    return v;
  }

  // Global chunk id -> (segment, local).
  std::pair<int, int> Locate(int c) const {
    int s = 0;
    while (c >= segs[s].n_chunks) c -= segs[s++].n_chunks;
    return {s, c};
  }
};

// Naive key of token t of local chunk j of segment s for head hh: double A.B, then the
// reference RoPE on the float vector.
std::vector<float> NaiveKey(const Fixture& f, int s, int j, int t, int hh) {
  const int d = f.shape.d, r = f.r;
  std::vector<float> k(d);
  for (int c = 0; c < d; ++c) {
    double acc = 0;
    for (int i = 0; i < r; ++i) {
      acc += double(Bf16ToFloat(f.segs[s].a[(size_t(j) * f.C + t) * r + i])) *
             Bf16ToFloat(f.b[(size_t(hh) * r + i) * d + c]);
    }
    k[c] = float(acc);
  }
  const RopeTable table = MakeRopeTable(f.rope, d).value();
  ApplyRopeReference(table, f.rope.pairing, f.segs[s].first_position + int64_t(j) * f.C + t,
                     k.data(), d);
  return k;
}

class ReconstructCodecs : public ::testing::TestWithParam<ValueCodecSpec> {};

TEST_P(ReconstructCodecs, KeysAndValuesMatchNaive) {
  auto be = Cpu();
  auto rng = MakeRng(30 + int(GetParam().codec));
  Fixture f;
  f.codec = GetParam();
  f.rope.theta = 500000.0f;
  f.Build(*be, rng, {7, 4, 9});
  const int h = f.shape.h, d = f.shape.d, C = f.C, k = f.k;
  const int total = 20;
  // Misses per head: head 0 all k, head 1 three (spanning segments), head 2 none.
  std::vector<int32_t> miss_chunk(size_t(h) * k, -1), miss_count = {k, 3, 0};
  const int32_t head0[] = {0, 6, 7, 10, 11, 19};
  const int32_t head1[] = {3, 8, 15};
  for (int j = 0; j < k; ++j) miss_chunk[j] = head0[j];
  for (int j = 0; j < 3; ++j) miss_chunk[k + j] = head1[j];
  const size_t out_elems = size_t(h) * k * C * d;
  std::vector<bf16> keys(out_elems, bf16{0xFFFF}), values(out_elems, bf16{0xFFFF});
  ReconstructItem item;
  item.view = f.View();
  item.miss_chunk = miss_chunk.data();
  item.miss_count = miss_count.data();
  item.keys = keys.data();
  item.values = values.data();
  std::vector<ReconstructItem> items = {item};
  auto ws = be->Allocate(be->ReconstructWorkspaceBytes(f.shape, k, items)).value();
  ASSERT_TRUE(be->Reconstruct(f.shape, C, k, f.rope, f.codec, items, ws.workspace()).ok());
  ASSERT_EQ(item.view.total_chunks(), total);

  const size_t chunk_bytes = ValueChunkBytes(f.codec, C, d).value();
  for (int hh = 0; hh < h; ++hh) {
    for (int j = 0; j < k; ++j) {
      const size_t row = (size_t(hh) * k + j) * C * d;
      if (j >= miss_count[hh]) {  // untouched
        for (size_t e = 0; e < size_t(C) * d; ++e) {
          ASSERT_EQ(keys[row + e].bits, 0xFFFF);
          ASSERT_EQ(values[row + e].bits, 0xFFFF);
        }
        continue;
      }
      const auto [s, local] = f.Locate(miss_chunk[size_t(hh) * k + j]);
      for (int t = 0; t < C; ++t) {
        const std::vector<float> want = NaiveKey(f, s, local, t, hh);
        double norm = 0;
        for (float x : want) norm += double(x) * x;
        norm = std::sqrt(norm / d);
        for (int c = 0; c < d; ++c) {
          const float got = Bf16ToFloat(keys[row + size_t(t) * d + c]);
          // bf16 rounding (2^-9 relative) plus fp32 accumulation and RoPE angles.
          ASSERT_NEAR(got, want[c], 0x1p-8 * std::fabs(want[c]) + 1e-4 * norm)
              << "head " << hh << " miss " << j << " token " << t << " channel " << c;
        }
      }
      // Values: bit-identical to decoding the stored chunk on its own.
      const std::byte* src = f.segs[s].values.data() + hh * f.segs[s].head_stride +
                             local * f.segs[s].chunk_stride;
      std::vector<bf16> want(size_t(C) * d);
      ASSERT_TRUE(be->DecodeValueChunks(absl::MakeConstSpan(src, chunk_bytes), 1, C, d, f.codec,
                                        absl::MakeSpan(want), {}).ok());
      ASSERT_EQ(std::memcmp(values.data() + row, want.data(), want.size() * sizeof(bf16)), 0)
          << "head " << hh << " miss " << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, ReconstructCodecs,
                         ::testing::Values(ValueCodecSpec{ValueCodec::kBF16},
                                           ValueCodecSpec{ValueCodec::kFP8},
                                           ValueCodecSpec{ValueCodec::kINT4, 16},
                                           ValueCodecSpec{ValueCodec::kINT2, 32}));

TEST(Reconstruct, InterleavedRopeAndDeterminism) {
  auto be = Cpu();
  auto rng = MakeRng(31);
  Fixture f;
  f.shape = {2, 4, 128};
  f.r = 64;
  f.k = 4;
  f.rope.pairing = RopePairing::kInterleaved;
  f.rope.rotary_dim = 64;  // partial rotary: channels >= 64 pass through
  f.Build(*be, rng, {12});
  const int h = 2, d = 128, C = 8, k = 4;
  std::vector<int32_t> miss_chunk = {11, 2, 5, 0, 1, 3, 4, 9}, miss_count = {4, 4};
  std::vector<bf16> keys1(size_t(h) * k * C * d), vals1(keys1.size());
  std::vector<bf16> keys2(keys1.size()), vals2(keys1.size());
  for (auto* out : {&keys1, &keys2}) {
    ReconstructItem item;
    item.view = f.View();
    item.miss_chunk = miss_chunk.data();
    item.miss_count = miss_count.data();
    item.keys = out->data();
    item.values = (out == &keys1 ? vals1 : vals2).data();
    std::vector<ReconstructItem> items = {item};
    auto ws = be->Allocate(be->ReconstructWorkspaceBytes(f.shape, k, items)).value();
    ASSERT_TRUE(be->Reconstruct(f.shape, C, k, f.rope, f.codec, items, ws.workspace()).ok());
  }
  EXPECT_EQ(std::memcmp(keys1.data(), keys2.data(), keys1.size() * 2), 0);
  EXPECT_EQ(std::memcmp(vals1.data(), vals2.data(), vals1.size() * 2), 0);
  for (int hh = 0; hh < h; ++hh) {
    for (int j = 0; j < k; ++j) {
      const int local = miss_chunk[size_t(hh) * k + j];
      for (int t = 0; t < C; t += 3) {
        const auto want = NaiveKey(f, 0, local, t, hh);
        for (int c = 0; c < d; ++c) {
          const float got = Bf16ToFloat(keys1[((size_t(hh) * k + j) * C + t) * d + c]);
          ASSERT_NEAR(got, want[c], 0x1p-8 * std::fabs(want[c]) + 1e-3);
        }
      }
    }
  }
}

TEST(Reconstruct, BadArgumentsRejected) {
  auto be = Cpu();
  auto rng = MakeRng(32);
  Fixture f;
  f.Build(*be, rng, {5});
  const int h = f.shape.h, k = 2;
  std::vector<int32_t> miss_chunk(size_t(h) * k, 0), miss_count(h, 1);
  std::vector<bf16> keys(size_t(h) * k * f.C * f.shape.d), values(keys.size());
  ReconstructItem item;
  item.view = f.View();
  item.miss_chunk = miss_chunk.data();
  item.miss_count = miss_count.data();
  item.keys = keys.data();
  item.values = values.data();
  auto ws = be->Allocate(1 << 16).value();
  auto run = [&](const ReconstructItem& it, int kk = 2) {
    std::vector<ReconstructItem> items = {it};
    return be->Reconstruct(f.shape, f.C, kk, f.rope, f.codec, items, ws.workspace()).code();
  };
  EXPECT_EQ(run(item), absl::StatusCode::kOk);
  EXPECT_EQ(run(item, 6), absl::StatusCode::kInvalidArgument);  // k > total chunks
  miss_chunk[1 * k] = 5;  // id out of range
  EXPECT_EQ(run(item), absl::StatusCode::kInvalidArgument);
  miss_chunk[1 * k] = 0;
  miss_count[2] = 3;  // count > k
  EXPECT_EQ(run(item), absl::StatusCode::kInvalidArgument);
  miss_count[2] = 1;
  ReconstructItem bad = item;
  bad.view.segments[0].value_chunk_stride = 16;  // < ValueChunkBytes
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad = item;
  bad.view.b = nullptr;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad = item;
  bad.view.segments[0].a = nullptr;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad = item;
  bad.keys = nullptr;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad = item;
  bad.view.segments[0].first_position = -1;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  RopeSpec bad_rope;
  bad_rope.rotary_dim = 3;
  std::vector<ReconstructItem> items = {item};
  EXPECT_EQ(be->Reconstruct(f.shape, f.C, k, bad_rope, f.codec, items, ws.workspace()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(be->Reconstruct(f.shape, f.C, k, f.rope, {ValueCodec::kINT2, 48}, items,
                            ws.workspace()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(be->Reconstruct(f.shape, f.C, k, f.rope, f.codec, items, Workspace{}).code(),
            absl::StatusCode::kInvalidArgument);
}

// Misses of the slot tests: head 0 all k (slots a permutation), head 1 three spanning the
// segments (slots not ascending), head 2 none. Entries past miss_count hold garbage that
// must be ignored.
struct SlotCase {
  std::vector<int32_t> miss_chunk, miss_count, miss_slot;
};

SlotCase MakeSlotCase(int h, int k) {
  SlotCase sc;
  sc.miss_chunk.assign(size_t(h) * k, -1);
  sc.miss_slot.assign(size_t(h) * k, 99);
  sc.miss_count = {k, 3, 0};
  const int32_t chunks0[] = {0, 6, 7, 10, 11, 19}, slots0[] = {3, 0, 5, 1, 4, 2};
  const int32_t chunks1[] = {3, 8, 15}, slots1[] = {5, 1, 2};
  for (int j = 0; j < k; ++j) {
    sc.miss_chunk[j] = chunks0[j];
    sc.miss_slot[j] = slots0[j];
  }
  for (int j = 0; j < 3; ++j) {
    sc.miss_chunk[k + j] = chunks1[j];
    sc.miss_slot[k + j] = slots1[j];
  }
  return sc;
}

class ReconstructSlots : public ::testing::TestWithParam<ValueCodecSpec> {};

TEST_P(ReconstructSlots, SlotOutputIsCompactOutputPermuted) {
  auto be = Cpu();
  auto rng = MakeRng(33 + int(GetParam().codec));
  Fixture f;
  f.codec = GetParam();
  f.Build(*be, rng, {7, 4, 9});
  const int h = f.shape.h, d = f.shape.d, C = f.C, k = f.k;
  const SlotCase sc = MakeSlotCase(h, k);
  const size_t out_elems = size_t(h) * k * C * d, row_elems = size_t(C) * d;
  std::vector<bf16> keys(out_elems, bf16{0xFFFF}), values(out_elems, bf16{0xFFFF});
  // The slot buffer starts with a sentinel that no reconstruction produces (a NaN).
  const bf16 kSentinel{0x7FC1};
  std::vector<bf16> slot_keys(out_elems, kSentinel), slot_values(out_elems, kSentinel);
  ReconstructItem compact;
  compact.view = f.View();
  compact.miss_chunk = sc.miss_chunk.data();
  compact.miss_count = sc.miss_count.data();
  compact.keys = keys.data();
  compact.values = values.data();
  ReconstructItem slotted = compact;
  slotted.miss_slot = sc.miss_slot.data();
  slotted.keys = slot_keys.data();
  slotted.values = slot_values.data();
  // Both in one call: items are independent.
  std::vector<ReconstructItem> items = {compact, slotted};
  auto ws = be->Allocate(be->ReconstructWorkspaceBytes(f.shape, k, items)).value();
  ASSERT_TRUE(be->Reconstruct(f.shape, C, k, f.rope, f.codec, items, ws.workspace()).ok());

  for (int hh = 0; hh < h; ++hh) {
    std::vector<bool> named(k, false);
    for (int j = 0; j < sc.miss_count[hh]; ++j) {
      const int slot = sc.miss_slot[size_t(hh) * k + j];
      named[slot] = true;
      const size_t from = (size_t(hh) * k + j) * row_elems;
      const size_t to = (size_t(hh) * k + slot) * row_elems;
      EXPECT_EQ(std::memcmp(slot_keys.data() + to, keys.data() + from, row_elems * 2), 0)
          << "head " << hh << " miss " << j << " slot " << slot;
      EXPECT_EQ(std::memcmp(slot_values.data() + to, values.data() + from, row_elems * 2), 0)
          << "head " << hh << " miss " << j << " slot " << slot;
    }
    for (int slot = 0; slot < k; ++slot) {
      if (named[slot]) continue;
      const size_t row = (size_t(hh) * k + slot) * row_elems;
      for (size_t e = 0; e < row_elems; ++e) {
        ASSERT_EQ(slot_keys[row + e].bits, kSentinel.bits) << "head " << hh << " slot " << slot;
        ASSERT_EQ(slot_values[row + e].bits, kSentinel.bits) << "head " << hh << " slot " << slot;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, ReconstructSlots,
                         ::testing::Values(ValueCodecSpec{ValueCodec::kBF16},
                                           ValueCodecSpec{ValueCodec::kINT4, 16}));

TEST(Reconstruct, BadSlotRejectedBeforeAnyWrite) {
  auto be = Cpu();
  auto rng = MakeRng(34);
  Fixture f;
  f.Build(*be, rng, {7, 4, 9});
  const int h = f.shape.h, C = f.C, k = f.k;
  SlotCase sc = MakeSlotCase(h, k);
  const size_t out_elems = size_t(h) * k * C * f.shape.d;
  const bf16 kSentinel{0x7FC1};
  std::vector<bf16> keys(out_elems, kSentinel), values(out_elems, kSentinel);
  ReconstructItem good;  // item 0: valid, so a lazy check would already have written it
  std::vector<bf16> good_keys(out_elems, kSentinel), good_values(out_elems, kSentinel);
  good.view = f.View();
  good.miss_chunk = sc.miss_chunk.data();
  good.miss_count = sc.miss_count.data();
  good.keys = good_keys.data();
  good.values = good_values.data();
  std::vector<int32_t> good_slots = sc.miss_slot;
  good.miss_slot = good_slots.data();
  ReconstructItem item = good;
  item.miss_slot = sc.miss_slot.data();
  item.keys = keys.data();
  item.values = values.data();
  auto ws = be->Allocate(be->ReconstructWorkspaceBytes(f.shape, k, {good, item})).value();
  auto run = [&]() {
    std::vector<ReconstructItem> items = {good, item};
    return be->Reconstruct(f.shape, C, k, f.rope, f.codec, items, ws.workspace());
  };
  auto untouched = [&]() {
    for (const auto* out : {&keys, &values, &good_keys, &good_values}) {
      for (const bf16 x : *out) {
        if (x.bits != kSentinel.bits) return false;
      }
    }
    return true;
  };
  struct Bad {
    int index;  // into miss_slot, [h, k]
    int32_t slot;
    std::string message;
  };
  const Bad bads[] = {
      {k + 2, k, "items[1].miss_slot[1, 2] must be in [0, k = 6), got 6"},
      {k + 2, -1, "items[1].miss_slot[1, 2] must be in [0, k = 6), got -1"},
      {4, 0, "items[1].miss_slot[0, 4] repeats slot 0 of miss_slot[0, 1]"},
      {k + 1, 5, "items[1].miss_slot[1, 1] repeats slot 5 of miss_slot[1, 0]"},
  };
  for (const Bad& bad : bads) {
    const int32_t saved = sc.miss_slot[bad.index];
    sc.miss_slot[bad.index] = bad.slot;
    const absl::Status st = run();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad.message;
    EXPECT_NE(st.message().find(bad.message), std::string_view::npos) << st.message();
    EXPECT_TRUE(untouched()) << bad.message;
    sc.miss_slot[bad.index] = saved;
  }
  // Entries past miss_count are not slots (99 here) and head 2 has none: accepted.
  EXPECT_TRUE(run().ok());
  EXPECT_FALSE(untouched());
}

}  // namespace
}  // namespace reconstruct_test
}  // namespace kvshade::kernels
