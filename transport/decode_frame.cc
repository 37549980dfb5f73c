// Binary decode frames (decode_frame.h). Little-endian on the wire; every field is read
// with memcpy (entries are not aligned).
#include "kvshade/transport/decode_frame.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvshade::transport::frame {
namespace {

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <typename T>
T Get(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// A cursor over a payload that refuses to read past its end.
class Reader {
 public:
  explicit Reader(std::string_view b) : b_(b) {}
  bool Take(size_t n, std::string_view* out) {
    if (n > b_.size() - at_) return false;
    *out = b_.substr(at_, n);
    at_ += n;
    return true;
  }
  size_t left() const { return b_.size() - at_; }

 private:
  std::string_view b_;
  size_t at_ = 0;
};

absl::Status Short(std::string_view what, uint32_t i, std::string_view field, size_t need,
                   size_t left) {
  return absl::InvalidArgumentError(absl::StrCat("ucx ", std::string(what), " frame: entry ", i,
                                                 ": ", std::string(field), " needs ", need,
                                                 " bytes, ", left, " left in the payload"));
}

constexpr size_t kQueryEntryBytes = 44;
constexpr size_t kDeltaEntryBytes = 32;
constexpr size_t kOutputEntryBytes = 16;

uint64_t TensorBytes(const TensorRef& t) {
  return uint64_t{t.rows} * t.cols * ElementBytes(t.dtype);
}

}  // namespace

size_t ElementBytes(uint8_t dtype) {
  switch (dtype) {
    case 1:  // BF16
    case 2:  // FP16
      return 2;
    case 3:  // FP32
    case 4:  // INT32
      return 4;
    default:
      return 0;
  }
}

std::string EncodeHeader(const FrameHeader& h) {
  std::string out;
  out.reserve(kHeaderBytes);
  Put<uint32_t>(&out, kMagic);
  Put<uint16_t>(&out, h.kind);
  Put<uint16_t>(&out, 0);
  Put<uint64_t>(&out, h.request_id);
  std::string key = h.key.substr(0, kKeyBytes);
  key.resize(kKeyBytes, '\0');
  out += key;
  Put<int32_t>(&out, h.code);
  Put<uint32_t>(&out, h.layer);
  Put<uint32_t>(&out, h.count);
  Put<uint32_t>(&out, 0);
  return out;
}

absl::StatusOr<FrameHeader> DecodeHeader(std::string_view b) {
  if (b.size() != kHeaderBytes || Get<uint32_t>(b.data()) != kMagic) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ucx frame: the header must be ", kHeaderBytes, " bytes starting with the frame magic, got ",
        b.size(), " bytes"));
  }
  FrameHeader h;
  h.kind = Get<uint16_t>(b.data() + 4);
  if (h.kind != kSelect && h.kind != kAttend && h.kind != kReply) {
    return absl::InvalidArgumentError(absl::StrCat("ucx frame: unknown kind ", h.kind));
  }
  h.request_id = Get<uint64_t>(b.data() + 8);
  h.key.assign(b.data() + 16, kKeyBytes);
  h.code = Get<int32_t>(b.data() + 32);
  h.layer = Get<uint32_t>(b.data() + 36);
  h.count = Get<uint32_t>(b.data() + 40);
  return h;
}

void AppendQuery(const QueryRef& q, std::string* body) {
  const TensorRef* ts[4] = {&q.q, &q.chunks, &q.k_new, &q.v_new};
  Put<uint16_t>(body, static_cast<uint16_t>(q.attachment_id.size()));
  for (const TensorRef* t : ts) Put<uint8_t>(body, t->dtype);
  Put<uint8_t>(body, static_cast<uint8_t>((q.stage ? 1 : 0) | ((q.purpose & 3) << 1) | (q.hold ? 8 : 0)));
  body->append(1, '\0');
  for (const TensorRef* t : ts) {
    Put<uint32_t>(body, t->rows);
    Put<uint32_t>(body, t->cols);
  }
  Put<int32_t>(body, q.stage_token_id);
  body->append(q.attachment_id.substr(0, 0xffff));
  for (const TensorRef* t : ts) body->append(t->data);
}

absl::StatusOr<std::vector<QueryRef>> ParseQueries(std::string_view body, uint32_t count,
                                                   Kind kind) {
  const std::string_view what = kind == kSelect ? "SELECT" : "ATTEND";
  // Every entry takes at least its fixed part: a count the payload cannot hold is refused
  // before anything is allocated for it.
  if (uint64_t{count} * kQueryEntryBytes > body.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ucx ", std::string(what), " frame: ", count,
                                                   " queries cannot fit a ", body.size(),
                                                   "-byte payload"));
  }
  static constexpr std::string_view kNames[4] = {"q", "chunks", "k_new", "v_new"};
  std::vector<QueryRef> out(count);
  Reader r(body);
  for (uint32_t i = 0; i < count; ++i) {
    std::string_view fixed;
    if (!r.Take(kQueryEntryBytes, &fixed)) return Short(what, i, "the entry", kQueryEntryBytes, r.left());
    QueryRef& q = out[i];
    const uint16_t id_len = Get<uint16_t>(fixed.data());
    TensorRef* ts[4] = {&q.q, &q.chunks, &q.k_new, &q.v_new};
    for (int t = 0; t < 4; ++t) {
      ts[t]->dtype = static_cast<uint8_t>(fixed[2 + t]);
      ts[t]->rows = Get<uint32_t>(fixed.data() + 8 + 8 * t);
      ts[t]->cols = Get<uint32_t>(fixed.data() + 12 + 8 * t);
      if (ts[t]->dtype != 0 && ElementBytes(ts[t]->dtype) == 0) {
        return absl::InvalidArgumentError(absl::StrCat("ucx ", std::string(what), " frame: entry ", i,
                                                       ": ", std::string(kNames[t]), " has unknown dtype ",
                                                       int{ts[t]->dtype}));
      }
      if (ts[t]->dtype == 0 && (ts[t]->rows != 0 || ts[t]->cols != 0)) {
        return absl::InvalidArgumentError(absl::StrCat("ucx ", std::string(what), " frame: entry ", i,
                                                       ": ", std::string(kNames[t]),
                                                       " is absent (dtype 0) but has a shape"));
      }
    }
    const uint8_t flags = static_cast<uint8_t>(fixed[6]);
    // Bit 0: stage; bits 1-2: the select's purpose (3 is none); bit 3: hold the staged
    // token for CommitStaged (only with bit 0).
    if ((flags & ~15u) != 0 || ((flags >> 1) & 3) == 3 || ((flags & 8) && !(flags & 1)) || fixed[7] != 0) {
      return absl::InvalidArgumentError(absl::StrCat("ucx ", std::string(what), " frame: entry ", i,
                                                     ": unknown flags ", int{flags}, "/",
                                                     int{static_cast<uint8_t>(fixed[7])}));
    }
    q.stage = flags & 1;
    q.hold = flags & 8;
    q.purpose = static_cast<uint8_t>((flags >> 1) & 3);
    q.stage_token_id = Get<int32_t>(fixed.data() + 40);
    if (kind == kAttend && q.chunks.present()) {
      return absl::InvalidArgumentError(absl::StrCat("ucx ATTEND frame: entry ", i,
                                                     ": an attend query carries no chunks"));
    }
    if (kind == kAttend && q.purpose != 0) {
      return absl::InvalidArgumentError(absl::StrCat("ucx ATTEND frame: entry ", i,
                                                     ": an attend query has no select purpose"));
    }
    if (!r.Take(id_len, &q.attachment_id)) return Short(what, i, "attachment_id", id_len, r.left());
    for (int t = 0; t < 4; ++t) {
      const uint64_t n = TensorBytes(*ts[t]);
      if (n > r.left() || !r.Take(static_cast<size_t>(n), &ts[t]->data)) {
        return Short(what, i, kNames[t], static_cast<size_t>(std::min<uint64_t>(n, SIZE_MAX)), r.left());
      }
    }
  }
  if (r.left() != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ucx ", std::string(what), " frame: ", r.left(),
                                                   " bytes after the last of ", count, " queries"));
  }
  return out;
}

void AppendDelta(const DeltaRef& d, std::string* body) {
  const bool rows = !d.keys.empty() || !d.values.empty();
  Put<uint32_t>(body, d.misses);
  Put<uint32_t>(body, d.chunk_size);
  Put<uint32_t>(body, d.head_dim);
  Put<uint32_t>(body, d.selected);
  Put<uint32_t>(body, d.hits);
  Put<uint8_t>(body, (d.delivered ? 1 : 0) | (d.fallback ? 2 : 0) | (rows ? 4 : 0));
  body->append(3, '\0');
  Put<uint64_t>(body, d.tokens);
  if (d.misses > 0) {
    body->append(reinterpret_cast<const char*>(d.head), size_t{d.misses} * 4);
    body->append(reinterpret_cast<const char*>(d.slot), size_t{d.misses} * 4);
    body->append(reinterpret_cast<const char*>(d.chunk), size_t{d.misses} * 4);
    body->append(reinterpret_cast<const char*>(d.position), size_t{d.misses} * 8);
  }
  if (rows) {
    body->append(d.keys);
    body->append(d.values);
  }
}

absl::StatusOr<std::vector<Delta>> ParseDeltas(std::string_view body, uint32_t count) {
  if (uint64_t{count} * kDeltaEntryBytes > body.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ucx SELECT reply: ", count,
                                                   " deltas cannot fit a ", body.size(),
                                                   "-byte payload"));
  }
  std::vector<Delta> out(count);
  Reader r(body);
  for (uint32_t i = 0; i < count; ++i) {
    std::string_view fixed;
    if (!r.Take(kDeltaEntryBytes, &fixed)) return Short("SELECT reply", i, "the entry", kDeltaEntryBytes, r.left());
    Delta& d = out[i];
    const uint32_t m = Get<uint32_t>(fixed.data());
    d.chunk_size = Get<uint32_t>(fixed.data() + 4);
    d.head_dim = Get<uint32_t>(fixed.data() + 8);
    d.selected = Get<uint32_t>(fixed.data() + 12);
    d.hits = Get<uint32_t>(fixed.data() + 16);
    const uint8_t flags = static_cast<uint8_t>(fixed[20]);
    d.delivered = flags & 1;
    d.fallback = flags & 2;
    d.tokens = Get<uint64_t>(fixed.data() + 24);
    std::string_view ids;
    if (uint64_t{m} * 20 > r.left() || !r.Take(size_t{m} * 20, &ids)) {
      return Short("SELECT reply", i, "head, slot, chunk and position", size_t{m} * 20, r.left());
    }
    d.head.resize(m);
    d.slot.resize(m);
    d.chunk.resize(m);
    d.position.resize(m);
    if (m > 0) {
      std::memcpy(d.head.data(), ids.data(), size_t{m} * 4);
      std::memcpy(d.slot.data(), ids.data() + size_t{m} * 4, size_t{m} * 4);
      std::memcpy(d.chunk.data(), ids.data() + size_t{m} * 8, size_t{m} * 4);
      std::memcpy(d.position.data(), ids.data() + size_t{m} * 12, size_t{m} * 8);
    }
    if (flags & 4) {
      const uint64_t n = uint64_t{m} * d.chunk_size * d.head_dim * 2;
      if (n > r.left() || !r.Take(static_cast<size_t>(n), &d.keys)) return Short("SELECT reply", i, "keys", n, r.left());
      if (n > r.left() || !r.Take(static_cast<size_t>(n), &d.values)) return Short("SELECT reply", i, "values", n, r.left());
    }
  }
  if (r.left() != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ucx SELECT reply: ", r.left(),
                                                   " bytes after the last of ", count, " deltas"));
  }
  return out;
}

void AppendOutput(const OutputRef& o, std::string* body) {
  Put<uint32_t>(body, o.query_heads);
  Put<uint32_t>(body, o.head_dim);
  Put<uint64_t>(body, o.tokens);
  body->append(o.output);
  body->append(o.lse);
}

absl::StatusOr<std::vector<OutputRef>> ParseOutputs(std::string_view body, uint32_t count) {
  if (uint64_t{count} * kOutputEntryBytes > body.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ucx ATTEND reply: ", count,
                                                   " outputs cannot fit a ", body.size(),
                                                   "-byte payload"));
  }
  std::vector<OutputRef> out(count);
  Reader r(body);
  for (uint32_t i = 0; i < count; ++i) {
    std::string_view fixed;
    if (!r.Take(kOutputEntryBytes, &fixed)) return Short("ATTEND reply", i, "the entry", kOutputEntryBytes, r.left());
    OutputRef& o = out[i];
    o.query_heads = Get<uint32_t>(fixed.data());
    o.head_dim = Get<uint32_t>(fixed.data() + 4);
    o.tokens = Get<uint64_t>(fixed.data() + 8);
    const uint64_t n = uint64_t{o.query_heads} * o.head_dim * 4, nl = uint64_t{o.query_heads} * 4;
    if (n > r.left() || !r.Take(static_cast<size_t>(n), &o.output)) return Short("ATTEND reply", i, "output", n, r.left());
    if (nl > r.left() || !r.Take(static_cast<size_t>(nl), &o.lse)) return Short("ATTEND reply", i, "lse", nl, r.left());
  }
  if (r.left() != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ucx ATTEND reply: ", r.left(),
                                                   " bytes after the last of ", count, " outputs"));
  }
  return out;
}

}  // namespace kvshade::transport::frame
