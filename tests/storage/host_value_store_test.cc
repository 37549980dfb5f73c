// HostValueStore: the [h, n_chunks, chunk_stride] block layout the decode kernels address,
// gathers of random chunk lists against a direct copy, codec round trips through the store
// (and through a spill), the budget (LRU spill and nothing else; identical bytes after
// page-in), durable seal and restore, prefetch, pins, and concurrent use.
#include "kvshade/storage/host_value_store.h"

#include <algorithm>
#include <cstring>
#include <future>
#include <map>
#include <thread>

#include "gtest/gtest.h"
#include "kernels/test_util.h"
#include "kvshade/storage/spill_tier.h"
#include "storage_test_util.h"

namespace kvshade::storage {
namespace host_value_store_test {
namespace {

using kernels::ValueCodec;
using kernels::ValueCodecSpec;
using testing::Bytes;
using testing::TempDir;

SegmentValueLayout Layout(int n_layers, int h, int n_chunks, ValueCodec codec, int d = 64) {
  auto l = SegmentValueLayout::Make(n_layers, h, n_chunks, 8, d, ValueCodecSpec{codec, 16});
  EXPECT_TRUE(l.ok()) << l.status();
  return *l;
}

// A segment's dense encoded values per layer ([h, n_chunks, chunk_bytes]), seeded.
struct Source {
  SegmentId id;
  SegmentValueLayout layout;
  std::vector<std::vector<std::byte>> dense;
  const std::byte* chunk(int layer, int head, int j) const {
    return dense[layer].data() + (size_t(head) * layout.n_chunks + j) * layout.chunk_bytes;
  }
};

Source MakeSource(uint64_t seed, const SegmentValueLayout& layout) {
  Source s;
  s.id = SegmentId{seed, ~seed};
  s.layout = layout;
  for (int l = 0; l < layout.n_layers; ++l) {
    s.dense.push_back(Bytes(seed * 131 + l, layout.dense_layer_bytes()));
  }
  return s;
}

absl::Status Put(HostValueStore& store, const Source& s, const SealOptions& seal = {}) {
  if (auto st = store.Create(s.id, s.layout); !st.ok()) return st;
  for (int l = 0; l < s.layout.n_layers; ++l) {
    if (auto st = store.WriteLayer(s.id, l, s.dense[l]); !st.ok()) return st;
  }
  return store.Seal(s.id, seal);
}

void ExpectSameValues(HostValueStore& store, const Source& s) {
  auto pin = store.Pin(s.id);
  ASSERT_TRUE(pin.ok()) << pin.status();
  for (int l = 0; l < s.layout.n_layers; ++l) {
    LayerValues v = pin->layer(l);
    for (int hh = 0; hh < s.layout.h; ++hh) {
      for (int j = 0; j < s.layout.n_chunks; ++j) {
        ASSERT_EQ(std::memcmp(v.chunk(hh, j), s.chunk(l, hh, j), s.layout.chunk_bytes), 0)
            << "layer " << l << " head " << hh << " chunk " << j;
      }
    }
  }
}

HostValueStoreOptions SmallOptions(size_t budget) {
  HostValueStoreOptions o;
  o.budget_bytes = budget;
  o.slab_bytes = 64 * 1024;
  return o;
}

TEST(HostValueStore, LayoutIsChunkMajorPerHeadInOneBlock) {
  auto cpu = kernels::testing::Cpu();
  auto store = HostValueStore::Create(*cpu, SmallOptions(8 << 20), nullptr);
  ASSERT_TRUE(store.ok()) << store.status();
  uint64_t seed = 1;
  for (ValueCodec codec : {ValueCodec::kBF16, ValueCodec::kFP8, ValueCodec::kINT4, ValueCodec::kINT2}) {
    const SegmentValueLayout layout = Layout(3, 4, 37, codec);
    EXPECT_EQ(layout.chunk_stride % kValueChunkAlign, 0u);
    EXPECT_GE(layout.chunk_stride, layout.chunk_bytes);
    const Source s = MakeSource(seed++, layout);
    ASSERT_TRUE(Put(**store, s).ok());
    auto pin = (*store)->Pin(s.id);
    ASSERT_TRUE(pin.ok());
    for (int l = 0; l < layout.n_layers; ++l) {
      LayerValues v = pin->layer(l);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(v.base) % 256, 0u);
      EXPECT_EQ(v.head_stride, int64_t(layout.n_chunks * layout.chunk_stride));
      EXPECT_EQ(v.chunk_stride, int64_t(layout.chunk_stride));
      kernels::SegmentView view;
      v.FillView(&view);
      for (int hh = 0; hh < layout.h; ++hh) {
        for (int j = 0; j < layout.n_chunks; ++j) {
          // The addressing kernels::SegmentView documents.
          const std::byte* p = view.values + hh * view.value_head_stride + j * view.value_chunk_stride;
          ASSERT_EQ(p, v.chunk(hh, j));
          ASSERT_EQ(std::memcmp(p, s.chunk(l, hh, j), layout.chunk_bytes), 0);
          for (size_t pad = layout.chunk_bytes; pad < layout.chunk_stride; ++pad) {
            ASSERT_EQ(p[pad], std::byte{0});
          }
        }
      }
    }
  }
  HostStoreStats st = (*store)->Stats();
  EXPECT_EQ(st.segments, 4u);
  EXPECT_LE(st.resident_bytes, st.physical_bytes);
}

TEST(HostValueStore, MutableLayerWritesInPlace) {
  auto cpu = kernels::testing::Cpu();
  auto store = HostValueStore::Create(*cpu, SmallOptions(1 << 20), nullptr);
  ASSERT_TRUE(store.ok());
  const SegmentValueLayout layout = Layout(2, 2, 5, ValueCodec::kINT2);
  const SegmentId id{7, 7};
  ASSERT_TRUE((*store)->Create(id, layout).ok());
  auto block = (*store)->MutableLayer(id, 1);
  ASSERT_TRUE(block.ok());
  ASSERT_EQ(block->size(), layout.layer_bytes());
  testing::FillBytes(99, *block);
  const std::vector<std::byte> copy(block->begin(), block->end());
  ASSERT_TRUE((*store)->Seal(id, {}).ok());
  auto pin = (*store)->Pin(id);
  ASSERT_TRUE(pin.ok());
  EXPECT_EQ(std::memcmp(pin->layer(1).base, copy.data(), copy.size()), 0);
  EXPECT_EQ((*store)->MutableLayer(id, 1).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(HostValueStore, RejectsBadInput) {
  auto cpu = kernels::testing::Cpu();
  auto store = HostValueStore::Create(*cpu, SmallOptions(1 << 20), nullptr);
  ASSERT_TRUE(store.ok());
  HostValueStore& s = **store;
  const SegmentValueLayout layout = Layout(2, 2, 5, ValueCodec::kBF16);
  const SegmentId id{1, 2};
  ASSERT_TRUE(s.Create(id, layout).ok());
  EXPECT_EQ(s.Create(id, layout).code(), absl::StatusCode::kAlreadyExists);
  std::vector<std::byte> wrong(layout.dense_layer_bytes() - 1);
  EXPECT_EQ(s.WriteLayer(id, 0, wrong).code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::byte> right(layout.dense_layer_bytes());
  EXPECT_EQ(s.WriteLayer(id, 2, right).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.Pin(id).status().code(), absl::StatusCode::kFailedPrecondition);  // building
  EXPECT_EQ(s.Seal(id, SealOptions{.durable = true}).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(s.Seal(id, {}).ok());
  EXPECT_EQ(s.WriteLayer(id, 0, right).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.Seal(id, {}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.Pin(SegmentId{9, 9}).status().code(), absl::StatusCode::kNotFound);
  SegmentValueLayout forged = layout;
  forged.chunk_stride = 8;
  EXPECT_EQ(s.Create(SegmentId{3, 3}, forged).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SegmentValueLayout::Make(0, 1, 1, 8, 64, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SegmentValueLayout::Make(1, 1, 1, 8, 24, ValueCodecSpec{ValueCodec::kINT2, 16}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Gather: out-of-range references and a short destination.
  std::vector<std::byte> dst(4 * layout.chunk_bytes);
  std::vector<ChunkRef> refs = {{id, 0, 0, 0}, {id, 1, 1, 5}};
  EXPECT_EQ(s.Gather(refs, absl::MakeSpan(dst)).code(), absl::StatusCode::kInvalidArgument);
  refs[1] = {id, 1, 2, 0};
  EXPECT_EQ(s.Gather(refs, absl::MakeSpan(dst)).code(), absl::StatusCode::kInvalidArgument);
  refs[1] = {id, 1, 1, 4};
  EXPECT_EQ(s.Gather(refs, absl::MakeSpan(dst).subspan(0, layout.chunk_bytes)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.Gather(refs, absl::MakeSpan(dst), layout.chunk_bytes - 2).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(s.Gather(refs, absl::MakeSpan(dst)).ok());
}

TEST(HostValueStore, GatherOfRandomChunkListsEqualsDirectCopy) {
  auto cpu = kernels::testing::Cpu();
  TempDir dir;
  auto tier = RocksSpillTier::Open(RocksSpillOptions{.path = dir.Sub("db")});
  ASSERT_TRUE(tier.ok()) << tier.status();
  // Budget for about three of the five segments: gathers page segments in and out.
  std::vector<Source> sources;
  for (int i = 0; i < 5; ++i) {
    sources.push_back(MakeSource(1000 + i, Layout(2, 4, 50 + 10 * i, i % 2 ? ValueCodec::kINT4 : ValueCodec::kINT2)));
  }
  size_t budget = 0;
  for (int i = 0; i < 3; ++i) budget += sources[i].layout.n_layers * ((sources[i].layout.layer_bytes() + 255) / 256 * 256);
  auto store = HostValueStore::Create(*cpu, SmallOptions(budget + 4096), tier->get());
  ASSERT_TRUE(store.ok());
  for (const Source& s : sources) ASSERT_TRUE(Put(**store, s).ok());

  auto rng = testing::Rng(1);
  size_t max_chunk = 0;
  for (const Source& s : sources) max_chunk = std::max(max_chunk, s.layout.chunk_bytes);
  for (int round = 0; round < 40; ++round) {
    const int n = 1 + int(rng() % 300);
    // Mostly one or two segments per call (as one session's chunk ids are), sometimes all.
    const int spread = round % 4 == 0 ? 5 : 1 + int(rng() % 2);
    const int first = int(rng() % 5);
    std::vector<ChunkRef> refs;
    for (int i = 0; i < n; ++i) {
      const Source& s = sources[(first + rng() % spread) % 5];
      refs.push_back({s.id, int32_t(rng() % s.layout.n_layers), int32_t(rng() % s.layout.h),
                      int32_t(rng() % s.layout.n_chunks)});
    }
    if (spread == 5) {
      // More distinct segments than fit pinned at once may not gather in one call (any
      // two fit the budget).
      std::map<SegmentId, int> distinct;
      for (auto& r : refs) distinct[r.segment]++;
      if (distinct.size() > 2) refs.resize(1);
    }
    const size_t stride = round % 3 == 0 ? max_chunk + 16 : 0;
    const size_t eff = stride ? stride : [&] {
      for (const Source& s : sources) if (s.id == refs[0].segment) return s.layout.chunk_bytes;
      return size_t{0};
    }();
    // A single stride only fits if every chunk fits it.
    bool fits = true;
    for (auto& r : refs) for (const Source& s : sources) if (s.id == r.segment && s.layout.chunk_bytes > eff) fits = false;
    if (!fits) continue;
    std::vector<std::byte> dst(refs.size() * eff, std::byte{0xEE});
    ASSERT_TRUE((*store)->Gather(refs, absl::MakeSpan(dst), stride).ok()) << round;
    for (size_t i = 0; i < refs.size(); ++i) {
      const Source* s = nullptr;
      for (const Source& c : sources) if (c.id == refs[i].segment) s = &c;
      ASSERT_EQ(std::memcmp(dst.data() + i * eff, s->chunk(refs[i].layer, refs[i].head, refs[i].chunk),
                            s->layout.chunk_bytes), 0)
          << "round " << round << " ref " << i;
    }
  }
  HostStoreStats st = (*store)->Stats();
  EXPECT_GT(st.page_ins, 0u);
  EXPECT_GT(st.gathered_chunks, 0u);
  EXPECT_LE(st.resident_bytes, budget + 4096);
}

// Encode -> store -> (spill, page-in) -> gather -> decode equals decoding the encoder's
// output directly, for every codec; bf16 is exact and the lossy codecs stay within
// their quantization error.
TEST(HostValueStore, CodecRoundTripThroughTheStore) {
  auto cpu = kernels::testing::Cpu();
  TempDir dir;
  auto tier = RocksSpillTier::Open(RocksSpillOptions{.path = dir.Sub("db")});
  ASSERT_TRUE(tier.ok());
  auto store = HostValueStore::Create(*cpu, SmallOptions(4 << 20), tier->get());
  ASSERT_TRUE(store.ok());
  const int n = 8 * 24 + 5, h = 3, d = 64, C = 8, n_chunks = 24;
  auto rng = testing::Rng(7);
  const std::vector<kernels::bf16> v = kernels::testing::RandomBf16(size_t(n) * h * d, rng);
  uint64_t id_seed = 50;
  for (ValueCodec codec : {ValueCodec::kBF16, ValueCodec::kFP8, ValueCodec::kINT4, ValueCodec::kINT2}) {
    SCOPED_TRACE(std::string(kernels::ValueCodecName(codec)));
    const ValueCodecSpec spec{codec, 16};
    const SegmentValueLayout layout = Layout(1, h, n_chunks, codec, d);
    std::vector<std::byte> dense(layout.dense_layer_bytes());
    absl::Status enc = cpu->EncodeValueChunks(v, n, h, d, C, n_chunks, spec, absl::MakeSpan(dense));
    ASSERT_TRUE(enc.ok()) << enc;
    const SegmentId id{id_seed, id_seed};
    ++id_seed;
    ASSERT_TRUE((*store)->Create(id, layout).ok());
    ASSERT_TRUE((*store)->WriteLayer(id, 0, dense).ok());
    ASSERT_TRUE((*store)->Seal(id, {}).ok());
    ASSERT_TRUE((*store)->Spill(id).ok());  // the gather below pages it back in

    std::vector<ChunkRef> refs;
    for (int hh = 0; hh < h; ++hh) for (int j = 0; j < n_chunks; ++j) refs.push_back({id, 0, hh, j});
    std::shuffle(refs.begin(), refs.end(), rng);
    std::vector<std::byte> gathered(refs.size() * layout.chunk_bytes);
    ASSERT_TRUE((*store)->Gather(refs, absl::MakeSpan(gathered)).ok());
    std::vector<kernels::bf16> out(refs.size() * C * d), direct(size_t(h) * n_chunks * C * d);
    ASSERT_TRUE(cpu->DecodeValueChunks(gathered, int(refs.size()), C, d, spec, absl::MakeSpan(out)).ok());
    ASSERT_TRUE(cpu->DecodeValueChunks(dense, h * n_chunks, C, d, spec, absl::MakeSpan(direct)).ok());
    double max_err = 0, max_abs = 0;
    for (size_t i = 0; i < refs.size(); ++i) {
      const size_t src = (size_t(refs[i].head) * n_chunks + refs[i].chunk) * C * d;
      ASSERT_EQ(std::memcmp(&out[i * C * d], &direct[src], C * d * sizeof(kernels::bf16)), 0);
      for (int t = 0; t < C; ++t) {
        for (int c = 0; c < d; ++c) {
          const float x = kernels::Bf16ToFloat(v[(size_t(refs[i].chunk * C + t) * h + refs[i].head) * d + c]);
          const float y = kernels::Bf16ToFloat(out[i * C * d + size_t(t) * d + c]);
          max_err = std::max(max_err, double(std::abs(x - y)));
          max_abs = std::max(max_abs, double(std::abs(x)));
        }
      }
    }
    // Bounds: bf16 exact; fp8 e4m3 relative step 2^-3 of the chunk max; KIVI: half a
    // quantization step of a group's range (range <= 2*max) plus fp16/bf16 rounding.
    const double bound = codec == ValueCodec::kBF16  ? 0.0
                         : codec == ValueCodec::kFP8 ? max_abs / 16 + 1e-3
                         : codec == ValueCodec::kINT4 ? 2 * max_abs / 15 * 0.5 * 1.05 + 1e-2
                                                      : 2 * max_abs / 3 * 0.5 * 1.05 + 1e-2;
    EXPECT_LE(max_err, bound) << "max |x| " << max_abs;
  }
}

TEST(HostValueStore, OverBudgetSpillsTheLeastRecentlyUsedAndNothingElse) {
  auto cpu = kernels::testing::Cpu();
  TempDir dir;
  auto tier = RocksSpillTier::Open(RocksSpillOptions{.path = dir.Sub("db")});
  ASSERT_TRUE(tier.ok());
  const SegmentValueLayout layout = Layout(2, 2, 64, ValueCodec::kBF16);  // 2 x 128 KiB
  const size_t seg_bytes = layout.total_bytes();
  HostValueStoreOptions o = SmallOptions(4 * seg_bytes);
  o.slab_bytes = 4 * seg_bytes;  // one slab: freed blocks are reused exactly
  auto store = HostValueStore::Create(*cpu, o, tier->get());
  ASSERT_TRUE(store.ok());
  HostValueStore& s = **store;
  std::vector<Source> src;
  for (int i = 0; i < 7; ++i) src.push_back(MakeSource(300 + i, layout));
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(Put(s, src[i]).ok());
  EXPECT_EQ(s.Stats().spills, 0u);
  // Touch 0 and 2: recency (old -> new) is 1, 3, 0, 2.
  { auto p = s.Pin(src[0].id); ASSERT_TRUE(p.ok()); }
  { auto p = s.Pin(src[2].id); ASSERT_TRUE(p.ok()); }
  auto state = [&](int i) { return s.Usage(src[i].id)->state; };

  ASSERT_TRUE(Put(s, src[4]).ok());
  EXPECT_EQ(state(1), SegmentState::kSpilled);
  for (int i : {0, 2, 3, 4}) EXPECT_EQ(state(i), SegmentState::kResident) << i;
  ASSERT_TRUE(Put(s, src[5]).ok());
  EXPECT_EQ(state(3), SegmentState::kSpilled);
  for (int i : {0, 2, 4, 5}) EXPECT_EQ(state(i), SegmentState::kResident) << i;
  HostStoreStats st = s.Stats();
  EXPECT_EQ(st.spills, 2u);
  EXPECT_EQ(st.spill_writes, 2u);
  EXPECT_EQ(st.resident_bytes, 4 * seg_bytes);
  EXPECT_EQ(st.spilled_segments, 2u);
  EXPECT_EQ(s.Usage(src[1].id)->resident_bytes, 0u);
  EXPECT_TRUE(s.Usage(src[1].id)->on_spill_tier);

  // A pinned segment is never the victim: pin 0 (now the LRU is 0, 2, 4, 5 -> 0 pinned).
  { auto p = s.Pin(src[0].id); ASSERT_TRUE(p.ok()); }
  { auto p = s.Pin(src[2].id); ASSERT_TRUE(p.ok()); }
  auto pinned = s.Pin(src[4].id);  // recency 5, 0, 2, 4; 4 pinned
  ASSERT_TRUE(pinned.ok());
  // Reading spilled segment 1 pages it in (identical bytes) and spills exactly the LRU (5).
  ExpectSameValues(s, src[1]);
  EXPECT_EQ(state(5), SegmentState::kSpilled);
  for (int i : {0, 1, 2, 4}) EXPECT_EQ(state(i), SegmentState::kResident) << i;
  EXPECT_EQ(s.Stats().page_ins, 1u);
  // Segment 1 was already on the tier: spilling it again writes nothing.
  ASSERT_TRUE(s.Spill(src[1].id).ok());
  EXPECT_EQ(s.Stats().spill_writes, 3u);
  ExpectSameValues(s, src[3]);
  ExpectSameValues(s, src[5]);
  ExpectSameValues(s, src[1]);
  for (int i = 0; i < 6; ++i) ExpectSameValues(s, src[i]);
  EXPECT_LE(s.Stats().resident_bytes, 4 * seg_bytes);
}

TEST(HostValueStore, FullWithNothingSpillableIsResourceExhausted) {
  auto cpu = kernels::testing::Cpu();
  const SegmentValueLayout layout = Layout(1, 2, 64, ValueCodec::kBF16);
  {
    auto store = HostValueStore::Create(*cpu, SmallOptions(2 * layout.total_bytes()), nullptr);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE(Put(**store, MakeSource(1, layout)).ok());
    ASSERT_TRUE(Put(**store, MakeSource(2, layout)).ok());
    const Source third = MakeSource(3, layout);
    EXPECT_EQ((*store)->Create(third.id, layout).code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ((*store)->Usage(third.id).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ((*store)->Stats().failed_reservations, 1u);
    // Erase frees room.
    ASSERT_TRUE((*store)->Erase(MakeSource(1, layout).id).ok());
    EXPECT_TRUE(Put(**store, third).ok());
  }
  TempDir dir;
  auto tier = RocksSpillTier::Open(RocksSpillOptions{.path = dir.Sub("db")});
  ASSERT_TRUE(tier.ok());
  auto store = HostValueStore::Create(*cpu, SmallOptions(2 * layout.total_bytes()), tier->get());
  ASSERT_TRUE(store.ok());
  const Source a = MakeSource(1, layout), b = MakeSource(2, layout);
  ASSERT_TRUE(Put(**store, a).ok());
  ASSERT_TRUE(Put(**store, b).ok());
  auto pa = (*store)->Pin(a.id);
  auto pb = (*store)->Pin(b.id);
  ASSERT_TRUE(pa.ok() && pb.ok());
  EXPECT_EQ((*store)->Create(SegmentId{5, 5}, layout).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*store)->Erase(a.id).code(), absl::StatusCode::kFailedPrecondition);
  // Bigger than the whole budget.
  EXPECT_EQ((*store)->Create(SegmentId{6, 6}, Layout(3, 2, 64, ValueCodec::kBF16)).code(),
            absl::StatusCode::kResourceExhausted);
  pa->Reset();
  EXPECT_TRUE((*store)->Create(SegmentId{5, 5}, layout).ok());  // spills a
  EXPECT_EQ((*store)->Usage(a.id)->state, SegmentState::kSpilled);
}

TEST(HostValueStore, OversizedBlocksGetDedicatedAllocations) {
  auto cpu = kernels::testing::Cpu();
  HostValueStoreOptions o = SmallOptions(4 << 20);
  o.slab_bytes = 16 * 1024;
  auto store = HostValueStore::Create(*cpu, o, nullptr);
  ASSERT_TRUE(store.ok());
  const Source big = MakeSource(11, Layout(2, 4, 100, ValueCodec::kBF16));  // 800 KiB per layer
  ASSERT_TRUE(Put(**store, big).ok());
  ExpectSameValues(**store, big);
  EXPECT_GE((*store)->Stats().physical_bytes, big.layout.total_bytes());
  const size_t physical = (*store)->Stats().physical_bytes;
  ASSERT_TRUE((*store)->Erase(big.id).ok());
  EXPECT_EQ((*store)->Stats().resident_bytes, 0u);
  // The freed buffers are kept and reused by a segment of the same shape.
  Source again = MakeSource(12, big.layout);
  ASSERT_TRUE(Put(**store, again).ok());
  EXPECT_EQ((*store)->Stats().physical_bytes, physical);
  ExpectSameValues(**store, again);
}

// Segments of mixed sizes (small blocks in shared slabs, large ones in dedicated
// buffers) churning through a small budget: host-visible memory never exceeds the budget
// plus one slab, resident bytes never exceed the budget, and every segment reads back.
TEST(HostValueStore, PhysicalMemoryStaysUnderBudgetPlusOneSlab) {
  auto cpu = kernels::testing::Cpu();
  TempDir dir;
  auto tier = RocksSpillTier::Open(RocksSpillOptions{.path = dir.Sub("db")});
  ASSERT_TRUE(tier.ok());
  HostValueStoreOptions o = SmallOptions(1 << 20);
  o.slab_bytes = 256 * 1024;  // blocks above 32 KiB are dedicated
  auto store = HostValueStore::Create(*cpu, o, tier->get());
  ASSERT_TRUE(store.ok());
  auto rng = testing::Rng(21);
  std::vector<Source> src;
  for (int i = 0; i < 40; ++i) {
    const ValueCodec codec = ValueCodec(rng() % 4);
    src.push_back(MakeSource(7000 + i, Layout(1 + int(rng() % 3), 1 + int(rng() % 4), 1 + int(rng() % 40), codec)));  // <= 960 KiB each
    ASSERT_TRUE(Put(**store, src.back()).ok()) << i;
    HostStoreStats st = (*store)->Stats();
    ASSERT_LE(st.physical_bytes, o.budget_bytes + o.slab_bytes) << i;
    ASSERT_LE(st.resident_bytes, o.budget_bytes) << i;
  }
  EXPECT_GT((*store)->Stats().spills, 0u);
  for (int round = 0; round < 2; ++round) {
    for (const Source& s : src) {
      ExpectSameValues(**store, s);
      ASSERT_LE((*store)->Stats().physical_bytes, o.budget_bytes + o.slab_bytes);
    }
  }
}

TEST(HostValueStore, DurableSegmentsRestoreAfterReopen) {
  auto cpu = kernels::testing::Cpu();
  TempDir dir;
  const SegmentValueLayout layout = Layout(3, 2, 20, ValueCodec::kFP8);
  const Source durable = MakeSource(77, layout), cached = MakeSource(78, layout);
  const std::vector<std::byte> factor_a = Bytes(5, 12345), factor_b = Bytes(6, 999);
  {
    auto tier = RocksSpillTier::Open(RocksSpillOptions{.path = dir.Sub("db")});
    ASSERT_TRUE(tier.ok());
    auto store = HostValueStore::Create(*cpu, SmallOptions(1 << 20), tier->get());
    ASSERT_TRUE(store.ok());
    SealOptions seal;
    seal.durable = true;
    seal.user_metadata = "session s1 turn 0";
    seal.factors = {{0, FactorKind::kA, factor_a}, {2, FactorKind::kB, factor_b}};
    ASSERT_TRUE(Put(**store, durable, seal).ok());
    ASSERT_TRUE(Put(**store, cached).ok());
    ASSERT_TRUE((*store)->Spill(cached.id).ok());  // a cache copy on disk, dropped at reopen
    EXPECT_TRUE((*store)->Usage(durable.id)->durable);
  }
  auto tier = RocksSpillTier::Open(RocksSpillOptions{.path = dir.Sub("db")});
  ASSERT_TRUE(tier.ok());
  EXPECT_EQ((*tier)->dropped_on_open(), 1u);
  auto store = HostValueStore::Create(*cpu, SmallOptions(1 << 20), tier->get());
  ASSERT_TRUE(store.ok());
  auto restored = (*store)->RestoreDurable();
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_EQ(restored->size(), 1u);
  EXPECT_EQ((*restored)[0].id, durable.id);
  EXPECT_EQ((*restored)[0].user_metadata, "session s1 turn 0");
  EXPECT_TRUE((*restored)[0].layout == layout);
  EXPECT_EQ((*store)->Usage(durable.id)->state, SegmentState::kSpilled);
  ExpectSameValues(**store, durable);
  std::vector<std::byte> fa(factor_a.size());
  ASSERT_TRUE((*tier)->ReadFactor(durable.id, 0, FactorKind::kA, absl::MakeSpan(fa)).ok());
  EXPECT_EQ(fa, factor_a);
  // Erase removes the durable copy too.
  ASSERT_TRUE((*store)->Erase(durable.id).ok());
  EXPECT_EQ((*tier)->ReadMeta(durable.id).status().code(), absl::StatusCode::kNotFound);
}

TEST(HostValueStore, PrefetchPagesInAsynchronously) {
  auto cpu = kernels::testing::Cpu();
  TempDir dir;
  auto tier = RocksSpillTier::Open(RocksSpillOptions{.path = dir.Sub("db")});
  ASSERT_TRUE(tier.ok());
  auto store = HostValueStore::Create(*cpu, SmallOptions(8 << 20), tier->get());
  ASSERT_TRUE(store.ok());
  std::vector<Source> src;
  std::vector<SegmentId> ids;
  for (int i = 0; i < 3; ++i) {
    src.push_back(MakeSource(900 + i, Layout(2, 2, 30, ValueCodec::kINT4)));
    ASSERT_TRUE(Put(**store, src.back()).ok());
    ASSERT_TRUE((*store)->Spill(src.back().id).ok());
    ids.push_back(src.back().id);
  }
  // std::promise rather than absl::Notification: TSan sees through the standard library.
  std::promise<absl::Status> done;
  (*store)->Prefetch(ids, [&](absl::Status s) { done.set_value(s); });
  absl::Status result = done.get_future().get();
  EXPECT_TRUE(result.ok()) << result;
  for (const Source& s : src) EXPECT_EQ((*store)->Usage(s.id)->state, SegmentState::kResident);
  EXPECT_EQ((*store)->Stats().page_ins, 3u);
  for (const Source& s : src) ExpectSameValues(**store, s);

  std::promise<absl::Status> done2;
  (*store)->Prefetch({SegmentId{123, 456}}, [&](absl::Status s) { done2.set_value(s); });
  result = done2.get_future().get();
  EXPECT_EQ(result.code(), absl::StatusCode::kNotFound);
}

// Two threads pin, gather and spill over segments that do not all fit: every byte read
// must be the segment's own.
TEST(HostValueStore, ConcurrentReadersUnderSpillPressure) {
  auto cpu = kernels::testing::Cpu();
  TempDir dir;
  auto tier = RocksSpillTier::Open(RocksSpillOptions{.path = dir.Sub("db")});
  ASSERT_TRUE(tier.ok());
  const SegmentValueLayout layout = Layout(2, 2, 32, ValueCodec::kINT2);
  std::vector<Source> src;
  for (int i = 0; i < 8; ++i) src.push_back(MakeSource(5000 + i, layout));
  HostValueStoreOptions o = SmallOptions(3 * layout.n_layers * ((layout.layer_bytes() + 255) / 256 * 256));
  auto store = HostValueStore::Create(*cpu, o, tier->get());
  ASSERT_TRUE(store.ok());
  for (const Source& s : src) ASSERT_TRUE(Put(**store, s).ok());
  std::atomic<int> failures{0};
  auto worker = [&](int tid) {
    auto rng = testing::Rng(40 + tid);
    std::vector<std::byte> dst(64 * layout.chunk_bytes);
    for (int op = 0; op < 150; ++op) {
      const Source& s = src[rng() % src.size()];
      if (op % 10 == 9) {
        absl::Status st = (*store)->Spill(s.id);
        if (!st.ok() && st.code() != absl::StatusCode::kFailedPrecondition) failures++;
        continue;
      }
      std::vector<ChunkRef> refs;
      for (int i = 0; i < 64; ++i) {
        refs.push_back({s.id, int32_t(rng() % 2), int32_t(rng() % 2), int32_t(rng() % 32)});
      }
      absl::Status st = (*store)->Gather(refs, absl::MakeSpan(dst));
      if (!st.ok()) {
        // Both threads may hold a pin while the third slot is being paged: only
        // ResourceExhausted is acceptable.
        if (st.code() != absl::StatusCode::kResourceExhausted) failures++;
        continue;
      }
      for (size_t i = 0; i < refs.size(); ++i) {
        if (std::memcmp(dst.data() + i * layout.chunk_bytes,
                        s.chunk(refs[i].layer, refs[i].head, refs[i].chunk), layout.chunk_bytes) != 0) {
          failures++;
        }
      }
    }
  };
  std::thread t0(worker, 0), t1(worker, 1);
  t0.join();
  t1.join();
  EXPECT_EQ(failures.load(), 0);
  for (const Source& s : src) ExpectSameValues(**store, s);
}

}  // namespace
}  // namespace host_value_store_test
}  // namespace kvshade::storage
