// The byte encoding of durable records' metadata (durable.cc: segment and session records;
// append.cc: logged appends): fixed-width little-endian integers and IEEE doubles, strings
// and vectors as a uint32 count then the elements, ids as hi then lo. The byte order is
// explicit, so a record reads back the same on any host (tested on a known byte image in
// tests/service/durable_codec_test.cc).
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kvshade/storage/types.h"

namespace kvshade::service::durable {

// The magic that opens each durable record's metadata: a segment and a session record
// (durable.cc), a logged append (append_log.cc) and a damage record (damage.cc, which
// also reads the other two); and the one that opens a session record's tensor-parallel
// shard trailer (durable.cc).
inline constexpr char kSegmentMagic[] = "KVSHSEG1";
inline constexpr char kSessionMagic[] = "KVSHSES1";
inline constexpr char kTensorParallelMagic[] = "KVSHTP01";
inline constexpr char kAppendMagic[] = "KVSHAPP1";
inline constexpr char kDamageMagic[] = "KVSHDMG1";

template <size_t N>
struct UintOf;
template <> struct UintOf<1> { using type = uint8_t; };
template <> struct UintOf<2> { using type = uint16_t; };
template <> struct UintOf<4> { using type = uint32_t; };
template <> struct UintOf<8> { using type = uint64_t; };

// Little-endian bytes of an arithmetic value (or a trivially copyable 2-byte value such as
// bf16) into `out`.
template <typename T>
void StoreLE(T v, char* out) {
  static_assert(std::is_trivially_copyable_v<T>);
  using U = typename UintOf<sizeof(T)>::type;
  U u;
  std::memcpy(&u, &v, sizeof(T));
  for (size_t i = 0; i < sizeof(T); ++i) out[i] = static_cast<char>((u >> (8 * i)) & 0xff);
}

template <typename T>
T LoadLE(const char* in) {
  using U = typename UintOf<sizeof(T)>::type;
  U u = 0;
  for (size_t i = 0; i < sizeof(T); ++i) u |= U(static_cast<uint8_t>(in[i])) << (8 * i);
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

class Writer {
 public:
  template <typename T>
  void Put(const T& v) {
    char b[sizeof(T)];
    StoreLE(v, b);
    out_.append(b, sizeof(T));
  }
  void Str(std::string_view s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    out_.append(s.data(), s.size());
  }
  template <typename T>
  void Vec(const std::vector<T>& v) {
    Put<uint32_t>(static_cast<uint32_t>(v.size()));
    if constexpr (std::endian::native == std::endian::little) {
      if (!v.empty()) out_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
    } else {
      for (const T& x : v) Put(x);
    }
  }
  void Id(const storage::Id128& id) {
    Put(id.hi);
    Put(id.lo);
  }
  std::string& out() { return out_; }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(std::string_view s) : s_(s) {}
  template <typename T>
  bool Get(T* v) {
    if (s_.size() < sizeof(T)) return ok_ = false;
    *v = LoadLE<T>(s_.data());
    s_.remove_prefix(sizeof(T));
    return true;
  }
  bool Str(std::string* out) {
    uint32_t n = 0;
    if (!Get(&n) || s_.size() < n) return ok_ = false;
    out->assign(s_.data(), n);
    s_.remove_prefix(n);
    return true;
  }
  template <typename T>
  bool Vec(std::vector<T>* v) {
    uint32_t n = 0;
    if (!Get(&n) || s_.size() < size_t(n) * sizeof(T)) return ok_ = false;
    v->resize(n);
    if constexpr (std::endian::native == std::endian::little) {
      if (n > 0) std::memcpy(v->data(), s_.data(), size_t(n) * sizeof(T));
    } else {
      for (uint32_t i = 0; i < n; ++i) (*v)[i] = LoadLE<T>(s_.data() + size_t(i) * sizeof(T));
    }
    s_.remove_prefix(size_t(n) * sizeof(T));
    return true;
  }
  bool Id(storage::Id128* id) { return Get(&id->hi) && Get(&id->lo); }
  // Whether the unread bytes start with `m` (nothing is read).
  bool StartsWith(std::string_view m) const { return s_.substr(0, m.size()) == m; }
  bool Magic(std::string_view m) {
    if (s_.substr(0, m.size()) != m) return ok_ = false;
    s_.remove_prefix(m.size());
    return true;
  }
  bool ok() const { return ok_; }
  size_t left() const { return s_.size(); }
  bool empty() const { return s_.empty(); }

 private:
  std::string_view s_;
  bool ok_ = true;
};

}  // namespace kvshade::service::durable
