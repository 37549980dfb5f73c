// Storage over the CUDA backend (label gpu; skipped without a device): the device arena's
// pool is device memory, and the host value store's blocks are host-visible (pinned,
// mapped) memory that the device copies from and that the CUDA value decoder reads
// (gathered chunks decode bit-identically to the CPU backend).
#include <cstring>

#include "gtest/gtest.h"
#include "kernels/test_util.h"
#include "kvshade/storage/device_arena.h"
#include "kvshade/storage/host_value_store.h"
#include "storage_test_util.h"

namespace kvshade::storage {
namespace storage_gpu_test {
namespace {

using kernels::ValueCodec;

TEST(StorageGpu, DeviceArenaPoolIsDeviceMemory) {
  KVSHADE_CUDA_OR_SKIP(cuda);
  auto arena = DeviceArena::Create(*cuda, 64 << 20);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ((*arena)->space(), kernels::MemorySpace::kDevice);
  auto a = (*arena)->Allocate(3 << 20, ArenaKind::kA);
  auto b = (*arena)->Allocate(1 << 20, ArenaKind::kSlots);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 256, 0u);
  const std::vector<std::byte> host = testing::Bytes(1, 3 << 20);
  ASSERT_TRUE(cuda->CopyFromHost(a->data(), host.data(), host.size()).ok());
  ASSERT_TRUE(cuda->Fill(b->data(), 0x5A, b->bytes()).ok());
  std::vector<std::byte> back(host.size());
  ASSERT_TRUE(cuda->CopyToHost(back.data(), a->data(), back.size()).ok());
  ASSERT_TRUE(cuda->Synchronize().ok());
  EXPECT_EQ(back, host);  // the neighbouring block's fill did not touch it
  EXPECT_EQ((*arena)->Stats().used_by_kind[int(ArenaKind::kSlots)], size_t{1} << 20);
  EXPECT_EQ((*arena)->Allocate(61 << 20, ArenaKind::kB).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(StorageGpu, HostStoreBlocksFeedTheDeviceDecoder) {
  KVSHADE_CUDA_OR_SKIP(cuda);
  auto cpu = kernels::testing::Cpu();
  HostValueStoreOptions o;
  o.budget_bytes = 64 << 20;
  o.slab_bytes = 16 << 20;
  o.preallocate_bytes = 16 << 20;  // pinned slabs made at start-up
  auto store = HostValueStore::Create(*cuda, o, nullptr);
  ASSERT_TRUE(store.ok()) << store.status();
  const int n = 8 * 64, h = 4, d = 128, C = 8, n_chunks = 64;
  auto rng = testing::Rng(3);
  const auto v = kernels::testing::RandomBf16(size_t(n) * h * d, rng);
  uint64_t next = 1;
  for (ValueCodec codec : {ValueCodec::kBF16, ValueCodec::kFP8, ValueCodec::kINT4, ValueCodec::kINT2}) {
    SCOPED_TRACE(std::string(kernels::ValueCodecName(codec)));
    const kernels::ValueCodecSpec spec{codec, 16};
    auto layout = SegmentValueLayout::Make(1, h, n_chunks, C, d, spec);
    ASSERT_TRUE(layout.ok());
    std::vector<std::byte> dense(layout->dense_layer_bytes());
    ASSERT_TRUE(cpu->EncodeValueChunks(v, n, h, d, C, n_chunks, spec, absl::MakeSpan(dense)).ok());
    const SegmentId id{next, next};
    ++next;
    ASSERT_TRUE((*store)->Create(id, *layout).ok());
    ASSERT_TRUE((*store)->WriteLayer(id, 0, dense).ok());
    ASSERT_TRUE((*store)->Seal(id, {}).ok());
    // Gather a random chunk list from the pinned blocks, copy it to the device, decode there.
    std::vector<ChunkRef> refs;
    for (int i = 0; i < 100; ++i) refs.push_back({id, 0, int32_t(rng() % h), int32_t(rng() % n_chunks)});
    std::vector<std::byte> gathered(refs.size() * layout->chunk_bytes);
    ASSERT_TRUE((*store)->Gather(refs, absl::MakeSpan(gathered)).ok());
    kernels::Buffer enc = kernels::testing::Upload(*cuda, gathered);
    kernels::Buffer out = kernels::testing::Scratch<kernels::bf16>(*cuda, refs.size() * C * d);
    absl::Status st = cuda->DecodeValueChunks(enc.span<const std::byte>(), int(refs.size()), C, d, spec,
                                              out.span<kernels::bf16>());
    ASSERT_TRUE(st.ok()) << st;
    const auto got = kernels::testing::Download<kernels::bf16>(*cuda, out.data(), refs.size() * C * d);
    std::vector<kernels::bf16> want(refs.size() * C * d);
    ASSERT_TRUE(cpu->DecodeValueChunks(gathered, int(refs.size()), C, d, spec, absl::MakeSpan(want)).ok());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(kernels::bf16)), 0);
    // The device copies straight from the pinned block (chunk addressing of SegmentView).
    auto pin = (*store)->Pin(id);
    ASSERT_TRUE(pin.ok());
    const LayerValues lv = pin->layer(0);
    kernels::Buffer dev = kernels::testing::Scratch<std::byte>(*cuda, layout->layer_bytes());
    ASSERT_TRUE(cuda->CopyFromHost(dev.data(), lv.base, layout->layer_bytes()).ok());
    const auto round = kernels::testing::Download<std::byte>(*cuda, dev.data(), layout->layer_bytes());
    for (int hh = 0; hh < h; ++hh) {
      for (int j = 0; j < n_chunks; ++j) {
        ASSERT_EQ(std::memcmp(round.data() + hh * lv.head_stride + j * lv.chunk_stride,
                              dense.data() + (size_t(hh) * n_chunks + j) * layout->chunk_bytes,
                              layout->chunk_bytes), 0);
      }
    }
  }
}

}  // namespace
}  // namespace storage_gpu_test
}  // namespace kvshade::storage
