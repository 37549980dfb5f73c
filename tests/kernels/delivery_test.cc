// Copy and Copy2D (the gathers of ingest), and CopyRows (row scatter into a worker's slot
// buffers) on the CPU reference: every listed
// row lands where asked, nothing else changes; malformed calls are rejected; the cpu
// backend refuses CUDA IPC peer buffers with a clear error; and its staging memory (what
// a data plane receives into before the copy) is private.
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace delivery_test {
namespace {

using testing::Cpu;
using testing::MakeRng;

TEST(DeliveryTest, CopyRowsScattersExactlyTheListedRows) {
  auto cpu = Cpu();
  auto rng = MakeRng(3);
  const size_t row_bytes = 2048;  // C = 8, d = 128, bf16
  const int src_n = 40, dst_n = 96, n = 25;
  std::vector<uint8_t> src(src_n * row_bytes), dst(dst_n * row_bytes);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : src) b = static_cast<uint8_t>(byte(rng));
  for (auto& b : dst) b = static_cast<uint8_t>(byte(rng));
  const std::vector<uint8_t> before = dst;
  // Distinct destination rows in random order; sources may repeat.
  std::vector<int64_t> dst_rows(dst_n);
  for (int i = 0; i < dst_n; ++i) dst_rows[i] = i;
  std::shuffle(dst_rows.begin(), dst_rows.end(), rng);
  dst_rows.resize(n);
  std::vector<int64_t> src_rows(n);
  std::uniform_int_distribution<int> pick(0, src_n - 1);
  for (auto& r : src_rows) r = pick(rng);
  ASSERT_TRUE(cpu->CopyRows(src.data(), dst.data(), row_bytes, n, src_rows.data(), dst_rows.data())
                  .ok());
  std::vector<int> written(dst_n, -1);
  for (int i = 0; i < n; ++i) written[dst_rows[i]] = static_cast<int>(src_rows[i]);
  for (int r = 0; r < dst_n; ++r) {
    const uint8_t* want = written[r] >= 0 ? &src[written[r] * row_bytes] : &before[r * row_bytes];
    EXPECT_EQ(std::memcmp(&dst[r * row_bytes], want, row_bytes), 0) << "row " << r;
  }
}

TEST(DeliveryTest, Copy2DMovesExactlyTheRectangle) {
  auto cpu = Cpu();
  auto rng = MakeRng(5);
  // A chunk of one head out of [n, h, d] bf16: 8 rows of d = 64 elements, 8*64 apart.
  const size_t width = 64 * 2, src_pitch = 8 * 64 * 2, dst_pitch = width + 32, height = 8;
  std::vector<uint8_t> src(height * src_pitch), dst(height * dst_pitch);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : src) b = static_cast<uint8_t>(byte(rng));
  for (auto& b : dst) b = static_cast<uint8_t>(byte(rng));
  const std::vector<uint8_t> before = dst;
  ASSERT_TRUE(cpu->Copy2D(dst.data(), dst_pitch, src.data() + 3 * 128, src_pitch, width, height).ok());
  for (size_t r = 0; r < height; ++r) {
    EXPECT_EQ(std::memcmp(&dst[r * dst_pitch], &src[r * src_pitch + 3 * 128], width), 0) << "row " << r;
    EXPECT_EQ(std::memcmp(&dst[r * dst_pitch + width], &before[r * dst_pitch + width], dst_pitch - width), 0)
        << "padding of row " << r << " was written";
  }
  std::vector<uint8_t> flat(100);
  ASSERT_TRUE(cpu->Copy(flat.data(), src.data() + 7, flat.size()).ok());
  EXPECT_EQ(std::memcmp(flat.data(), src.data() + 7, flat.size()), 0);
  EXPECT_EQ(cpu->Copy2D(dst.data(), 8, src.data(), src_pitch, 16, 2).code(),
            absl::StatusCode::kInvalidArgument);  // pitch below width
  EXPECT_EQ(cpu->Copy(nullptr, src.data(), 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(cpu->Copy2D(nullptr, 0, nullptr, 0, 0, 0).ok());  // nothing to do
}

TEST(DeliveryTest, CopyRowsRejectsMalformedCalls) {
  auto cpu = Cpu();
  std::vector<uint8_t> a(64), b(64);
  int64_t rows[1] = {0};
  EXPECT_EQ(cpu->CopyRows(a.data(), b.data(), 24, 1, rows, rows).code(),
            absl::StatusCode::kInvalidArgument);  // not a multiple of 16
  EXPECT_EQ(cpu->CopyRows(a.data(), b.data(), 0, 1, rows, rows).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu->CopyRows(a.data(), b.data(), 16, -1, rows, rows).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu->CopyRows(nullptr, b.data(), 16, 1, rows, rows).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu->CopyRows(a.data(), b.data(), 16, 1, rows, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(cpu->CopyRows(nullptr, nullptr, 16, 0, nullptr, nullptr).ok());  // nothing to do
}

// Staging memory: writable over its whole size, resident, and private even when the
// backend shares its other host memory for same-node decode.
TEST(DeliveryTest, CpuStagingMemoryIsWritableAndNeverExported) {
  auto be = testing::Cpu();
  be->EnableSharedMemory(SharedHostMemory::kFile);
  const size_t bytes = (1u << 20) + 7;
  auto buf = be->AllocateStaging(bytes);
  ASSERT_TRUE(buf.ok()) << buf.status();
  auto* p = static_cast<unsigned char*>(buf->data());
  for (size_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(p[bytes - 1], static_cast<unsigned char>(bytes - 1));
  EXPECT_FALSE(be->ExportMemory(p).ok());
  auto shared = be->Allocate(4096);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_TRUE(be->ExportMemory(shared->data()).ok());
  auto none = be->AllocateStaging(0);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->data(), nullptr);
}

TEST(DeliveryTest, CpuBackendRefusesPeerBuffers) {
  auto cpu = Cpu();
  auto p = cpu->OpenPeerBuffer(std::string(64, '\1'));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(p.status().message().find("CUDA backend"), std::string_view::npos);
}

}  // namespace
}  // namespace delivery_test
}  // namespace kvshade::kernels
