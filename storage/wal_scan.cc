// ScanWalFiles: RocksDB's WAL format, read without RocksDB (wal_scan.h).
//
// A WAL file is a sequence of 32 KiB blocks; a block holds physical records
//   u32 masked crc32c(type ++ payload) | u16 payload length | u8 type | payload
// (recyclable types 5..8 add a u32 log number after the type, inside the checksum), and a
// block tail shorter than a header is zero padding. Types: 0 zero (preallocated space),
// 1 full, 2 first, 3 middle, 4 last; a logical record (one WriteBatch: u64 sequence,
// u32 count, entries) is a full record or first, middles and last. On a checksum mismatch
// RocksDB drops the rest of the block (the length itself may be the damaged field) and,
// with point-in-time recovery, everything after it; the scan does the same to find where
// the damage is, then keeps reading (next block) to learn what was dropped.
#include "wal_scan.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "record_format.h"
#include "rocksdb/write_batch.h"

namespace kvshade::storage::internal {
namespace {

constexpr size_t kBlockSize = 32768;
constexpr size_t kHeaderSize = 7;
constexpr size_t kRecyclableHeaderSize = 11;
constexpr uint32_t kMaskDelta = 0xa282ead8u;

std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    t[i] = c;
  }
  return t;
}

uint32_t Unmask(uint32_t masked) {
  const uint32_t rot = masked - kMaskDelta;
  return (rot >> 17) | (rot << 15);
}

// Collects the metadata records of a batch (puts whose value is a checksummed kvshade
// metadata record under its key); a put with a metadata-sized key (16 bytes) whose record
// does not check out is a damaged metadata record: what it named is unknown.
class MetaCollector : public rocksdb::WriteBatch::Handler {
 public:
  rocksdb::Status PutCF(uint32_t, const rocksdb::Slice& key, const rocksdb::Slice& value) override {
    const std::string_view k(key.data(), key.size());
    absl::StatusOr<std::string_view> payload =
        DecodeRecord(RecordType::kSegmentMeta, k, std::string_view(value.data(), value.size()));
    if (payload.ok()) {
      absl::StatusOr<SegmentMeta> meta = DecodeMetaPayload(*payload);
      if (meta.ok()) {
        metas.push_back(*std::move(meta));
        return rocksdb::Status::OK();
      }
      damaged_meta = true;
      return rocksdb::Status::OK();
    }
    SegmentId id;
    if (k.size() == 16 && SegmentIdOfKey(k, &id)) {
      // Not a metadata record of this key: a piece has a longer key, so this is damaged
      // metadata (or a record of another column family that happens to be 16 bytes long:
      // counted the same way, the safe side).
      if (DecodeRecord(RecordType::kFactorPiece, k, std::string_view(value.data(), value.size())).ok() ||
          DecodeRecord(RecordType::kValuePiece, k, std::string_view(value.data(), value.size())).ok()) {
        return rocksdb::Status::OK();
      }
      damaged_meta = true;
    }
    return rocksdb::Status::OK();
  }
  rocksdb::Status DeleteCF(uint32_t, const rocksdb::Slice&) override { return rocksdb::Status::OK(); }
  rocksdb::Status SingleDeleteCF(uint32_t, const rocksdb::Slice&) override {
    return rocksdb::Status::OK();
  }
  rocksdb::Status DeleteRangeCF(uint32_t, const rocksdb::Slice&, const rocksdb::Slice&) override {
    return rocksdb::Status::OK();
  }
  rocksdb::Status MergeCF(uint32_t, const rocksdb::Slice&, const rocksdb::Slice&) override {
    return rocksdb::Status::OK();
  }
  rocksdb::Status PutBlobIndexCF(uint32_t, const rocksdb::Slice&, const rocksdb::Slice&) override {
    return rocksdb::Status::OK();
  }
  void LogData(const rocksdb::Slice&) override {}

  std::vector<SegmentMeta> metas;
  bool damaged_meta = false;
};

// Parses one logical record (a WriteBatch). `complete` is false when the batch's framing
// or one of its metadata records is damaged (what it wrote cannot be told in full).
void ParseBatch(const std::string& rep, std::vector<SegmentMeta>* out, bool* complete) {
  *complete = false;
  if (rep.size() < 12) return;
  rocksdb::WriteBatch batch(rep);
  MetaCollector c;
  rocksdb::Status s = batch.Iterate(&c);
  for (SegmentMeta& m : c.metas) out->push_back(std::move(m));
  *complete = s.ok() && !c.damaged_meta;
}

// Whether a physical record with a matching checksum starts at `q` and ends in the block.
bool ValidAt(const std::string& data, size_t q, size_t end) {
  if (q + kHeaderSize > end) return false;
  const auto* h = reinterpret_cast<const uint8_t*>(data.data() + q);
  const size_t length = size_t(h[4]) | size_t(h[5]) << 8;
  const uint8_t type = h[6];
  if (type == 0 || type > 10) return false;
  const size_t header = type >= 5 && type <= 8 ? kRecyclableHeaderSize : kHeaderSize;
  if (q + header + length > end) return false;
  uint32_t masked = 0;
  std::memcpy(&masked, h, 4);
  return Unmask(masked) == Crc32c(0, data.data() + q + 6, header - 6 + length);
}

bool FileNumber(const std::filesystem::path& p, uint64_t* n) {
  const std::string stem = p.stem().string();
  if (stem.empty() || stem.size() > 19) return false;
  uint64_t v = 0;
  for (char ch : stem) {
    if (ch < '0' || ch > '9') return false;
    v = v * 10 + uint64_t(ch - '0');
  }
  *n = v;
  return true;
}

absl::Status ScanOne(WalFileScan* f) {
  std::ifstream in(f->path, std::ios::binary);
  if (!in) return absl::UnavailableError(absl::StrCat("cannot read WAL file ", f->path));
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::UnavailableError(absl::StrCat("reading WAL file ", f->path, " failed"));
  f->bytes = data.size();
  std::string scratch;        // fragments of the logical record being assembled
  bool in_fragments = false;
  bool scratch_damaged = false;  // the record being assembled lost a fragment
  auto emit = [&](bool damaged) {
    std::vector<SegmentMeta> metas;
    bool complete = false;
    // A damaged batch is still read for what it names: its framing (entry lengths and the
    // entry count) must parse whole and every metadata record in it must pass its own
    // checksum, or what it wrote is unknown.
    ParseBatch(scratch, &metas, &complete);
    (void)damaged;
    if (!complete) ++f->unreadable_batches;
    if (f->damaged) {
      if (!complete) ++f->unidentified_batches;
      f->after_damage.insert(f->after_damage.end(), metas.begin(), metas.end());
    }
    f->all.insert(f->all.end(), metas.begin(), metas.end());
    scratch.clear();
    in_fragments = false;
    scratch_damaged = false;
  };
  auto damage = [&](uint64_t offset, std::string reason) {
    if (f->damaged) return;
    f->damaged = true;
    f->damage_offset = offset;
    f->damage_reason = std::move(reason);
  };

  for (size_t block = 0; block < data.size(); block += kBlockSize) {
    const size_t end = std::min(data.size(), block + kBlockSize);
    size_t pos = block;
    while (pos + kHeaderSize <= end) {
      const auto* h = reinterpret_cast<const uint8_t*>(data.data() + pos);
      uint32_t masked = 0;
      std::memcpy(&masked, h, 4);
      const size_t length = size_t(h[4]) | size_t(h[5]) << 8;
      const uint8_t type = h[6];
      if (type == 0 && length == 0) break;  // zeroed (preallocated) space: rest of the block
      const bool recyclable = type >= 5 && type <= 8;
      const size_t header = recyclable ? kRecyclableHeaderSize : kHeaderSize;
      const bool fits = pos + header + length <= end;
      if (!fits && end == data.size()) {
        // Cut short by the end of the file: a write torn by a crash (never acknowledged).
        pos = end;
        break;
      }
      const uint32_t crc = fits ? Crc32c(0, data.data() + pos + 6, header - 6 + length) : 0;
      if (!fits || Unmask(masked) != crc || type > 10) {
        damage(pos, !fits ? "a record's length runs past its block"
                    : type > 10 ? "unknown record type" : "checksum mismatch");
        // The length may be the damaged field: the next record is where its length says if
        // a valid record (or the block's end, or zero padding) is there, else the first
        // offset in the block where one is (a checksum match at a wrong offset is a 2^-32
        // chance). The damaged record's own bytes (up to there) are still read for what
        // they name.
        size_t next = end;
        const size_t guess = pos + header + length;
        auto zero_at = [&](size_t q) {
          return q + kHeaderSize > end || (data[q + 4] == 0 && data[q + 5] == 0 && data[q + 6] == 0);
        };
        if (fits && (zero_at(guess) || ValidAt(data, guess, end))) {
          next = guess;
        } else {
          for (size_t q = pos + 1; q + kHeaderSize <= end; ++q) {
            if (ValidAt(data, q, end)) {
              next = q;
              break;
            }
          }
        }
        const size_t avail = next > pos + header ? next - pos - header : 0;
        const char* payload = data.data() + pos + header;
        const size_t n = std::min(avail, fits ? length : avail);
        const uint8_t base = recyclable ? uint8_t(type - 4) : type;
        if (base == 1 || base == 2) {
          if (in_fragments) emit(true);
          scratch.assign(payload, n);
          in_fragments = true;
          scratch_damaged = true;
          if (base == 1) emit(true);
        } else if ((base == 3 || base == 4) && in_fragments) {
          scratch.append(payload, n);
          scratch_damaged = true;
          if (base == 4) emit(true);
        } else {
          // The type is the damaged field: what the record was is unknown.
          if (in_fragments) emit(true);
          ++f->unidentified_batches;
          ++f->unreadable_batches;
        }
        pos = next;
        continue;
      }
      const char* payload = data.data() + pos + header;
      pos += header + length;
      const uint8_t base = recyclable ? uint8_t(type - 4) : type;
      switch (base) {
        case 1:  // full
          if (in_fragments) emit(true);
          scratch.assign(payload, length);
          emit(false);
          break;
        case 2:  // first
          if (in_fragments) emit(true);
          scratch.assign(payload, length);
          in_fragments = true;
          break;
        case 3:  // middle
          if (!in_fragments) break;  // the rest of a record whose start was dropped
          scratch.append(payload, length);
          break;
        case 4:  // last
          if (!in_fragments) break;
          scratch.append(payload, length);
          emit(scratch_damaged);
          break;
        default:  // compression type and other control records: nothing written
          break;
      }
    }
  }
  if (in_fragments && scratch_damaged) emit(true);  // an unfinished damaged record
  return absl::OkStatus();
}

}  // namespace

uint32_t Crc32c(uint32_t init, const char* data, size_t n) {
  static const std::array<uint32_t, 256> table = MakeTable();
  uint32_t c = ~init;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ uint8_t(data[i])) & 0xff] ^ (c >> 8);
  return ~c;
}

absl::StatusOr<std::vector<WalFileScan>> ScanWalFiles(const std::string& dir) {
  std::vector<WalFileScan> out;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return out;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    uint64_t n = 0;
    if (e.path().extension() != ".log" || !FileNumber(e.path(), &n)) continue;
    WalFileScan f;
    f.path = e.path().string();
    f.number = n;
    out.push_back(std::move(f));
  }
  if (ec) return absl::UnavailableError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  std::sort(out.begin(), out.end(),
            [](const WalFileScan& a, const WalFileScan& b) { return a.number < b.number; });
  for (WalFileScan& f : out) {
    if (absl::Status st = ScanOne(&f); !st.ok()) return st;
  }
  return out;
}

}  // namespace kvshade::storage::internal
