// The durable records' encoding (service/durable_codec.h) is little-endian whatever the
// host: a known byte image, and a round trip.
#include "durable_codec.h"

#include <string>

#include "gtest/gtest.h"

namespace kvshade::service::durable {
namespace durable_codec_test {
namespace {

TEST(DurableCodec, WritesAKnownLittleEndianByteImage) {
  Writer w;
  w.out().append("MAGC");
  w.Put<uint8_t>(0xA5);
  w.Put<int32_t>(-2);
  w.Put<uint64_t>(0x0102030405060708ull);
  w.Put<double>(1.5);
  w.Str("ab");
  w.Vec(std::vector<int32_t>{1, 0x01020304});
  w.Id(storage::Id128{0x1112131415161718ull, 0x2122232425262728ull});
  const unsigned char expected[] = {
      'M', 'A', 'G', 'C',                              // magic
      0xA5,                                            // uint8
      0xFE, 0xFF, 0xFF, 0xFF,                          // int32 -2
      0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // uint64
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xF8, 0x3F,  // double 1.5
      0x02, 0x00, 0x00, 0x00, 'a', 'b',                // string
      0x02, 0x00, 0x00, 0x00,                          // vector count
      0x01, 0x00, 0x00, 0x00, 0x04, 0x03, 0x02, 0x01,  // its elements
      0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11,  // id hi
      0x28, 0x27, 0x26, 0x25, 0x24, 0x23, 0x22, 0x21,  // id lo
  };
  ASSERT_EQ(w.out(), std::string(reinterpret_cast<const char*>(expected), sizeof(expected)));

  Reader r(w.out());
  uint8_t u8 = 0;
  int32_t i32 = 0;
  uint64_t u64 = 0;
  double f = 0;
  std::string str;
  std::vector<int32_t> vec;
  storage::Id128 id;
  ASSERT_TRUE(r.Magic("MAGC"));
  ASSERT_TRUE(r.Get(&u8) && r.Get(&i32) && r.Get(&u64) && r.Get(&f) && r.Str(&str) &&
              r.Vec(&vec) && r.Id(&id));
  EXPECT_TRUE(r.empty());
  EXPECT_EQ(u8, 0xA5);
  EXPECT_EQ(i32, -2);
  EXPECT_EQ(u64, 0x0102030405060708ull);
  EXPECT_EQ(f, 1.5);
  EXPECT_EQ(str, "ab");
  EXPECT_EQ(vec, (std::vector<int32_t>{1, 0x01020304}));
  EXPECT_EQ(id, (storage::Id128{0x1112131415161718ull, 0x2122232425262728ull}));
  uint32_t more = 0;
  EXPECT_FALSE(r.Get(&more));  // past the end: refused, not read
  EXPECT_FALSE(r.ok());
}

TEST(DurableCodec, LoadsWhatItStores) {
  char b[8];
  StoreLE<int64_t>(-123456789012345, b);
  EXPECT_EQ(LoadLE<int64_t>(b), -123456789012345);
  EXPECT_EQ(static_cast<uint8_t>(b[0]), 0x87);  // the low byte first
  StoreLE<uint16_t>(0xBEEF, b);
  EXPECT_EQ(static_cast<uint8_t>(b[0]), 0xEF);
  EXPECT_EQ(static_cast<uint8_t>(b[1]), 0xBE);
}

}  // namespace
}  // namespace durable_codec_test
}  // namespace kvshade::service::durable
