// kvshade_storage_bench: host value store and spill tier throughput on this machine, each
// figure printed beside its reference measured in the same run.
//   gather   : HostValueStore::Gather of random chunk lists (one decode step's misses of
//              one layer: h heads x k chunks) from ~1 GiB of values (beyond the LLC),
//              vs memcpy of the same number of bytes from a 1 GiB buffer (contiguous), and
//              a 256 MiB memcpy (DRAM to DRAM copy bandwidth).
//   spill    : LRU spill of cache segments through the store (RocksDB, no WAL, flushed to
//              files) vs write()+fdatasync of the same bytes to a file in the same directory.
//   page-in  : Pin of spilled segments, page cache warm and dropped (posix_fadvise
//              DONTNEED on the database files) vs read() of a file, page cache dropped.
//   durable  : Seal(durable) = WriteBatch through the WAL + fsync, vs write()+fdatasync.
// Usage: kvshade_storage_bench [--dir=PATH] [--spill_mb=N] [--quick]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "kvshade/kernels/backend.h"
#include "kvshade/storage/host_value_store.h"
#include "kvshade/storage/spill_tier.h"
#include "kvshade/version.h"

namespace {

using namespace kvshade;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

template <typename F>
double MedianSeconds(int reps, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto a = Clock::now();
    f();
    t.push_back(Seconds(a, Clock::now()));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void Fill(absl::Span<std::byte> v, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i + 8 <= v.size(); i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(&v[i], &x, 8);
  }
}

void Die(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, std::string(s.ToString()).c_str());
    std::exit(1);
  }
}

void DropPageCache(const std::string& path) {
  auto drop = [](const std::filesystem::path& p) {
    const int fd = open(p.c_str(), O_RDONLY);
    if (fd < 0) return;
    fdatasync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
  };
  if (std::filesystem::is_regular_file(path)) return drop(path);
  for (const auto& e : std::filesystem::recursive_directory_iterator(path)) {
    if (e.is_regular_file()) drop(e.path());
  }
}

// write() + fdatasync of `bytes` in 1 MiB writes; returns seconds.
double FileWrite(const std::string& path, const std::vector<std::byte>& buf, size_t bytes) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) std::exit(1);
  auto a = Clock::now();
  for (size_t off = 0; off < bytes; off += buf.size()) {
    if (write(fd, buf.data(), std::min(buf.size(), bytes - off)) < 0) std::exit(1);
  }
  fdatasync(fd);
  const double s = Seconds(a, Clock::now());
  close(fd);
  return s;
}

double FileRead(const std::string& path, std::vector<std::byte>& buf) {
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) std::exit(1);
  auto a = Clock::now();
  while (read(fd, buf.data(), buf.size()) > 0) {
  }
  const double s = Seconds(a, Clock::now());
  close(fd);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = std::filesystem::temp_directory_path().string();
  size_t spill_mb = 512;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--version") {
      std::printf("%s\n", kvshade::VersionLine("kvshade_storage_bench").c_str());
      return 0;
    }
    if (a.rfind("--dir=", 0) == 0) dir = a.substr(6);
    else if (a.rfind("--spill_mb=", 0) == 0) spill_mb = std::strtoull(a.c_str() + 11, nullptr, 10);
    else if (a == "--quick") quick = true;
    else {
      std::fprintf(stderr, "usage: %s [--dir=PATH] [--spill_mb=N] [--quick]\n", argv[0]);
      return 2;
    }
  }
  if (quick) spill_mb = std::min<size_t>(spill_mb, 64);
  auto backend = kernels::CreateBackend("cpu");
  Die(backend.status(), "backend");
  kernels::Backend& cpu = **backend;
  const size_t gather_bytes = quick ? (size_t{256} << 20) : (size_t{1} << 30);

  // --- memcpy references -------------------------------------------------------------------
  std::vector<std::byte> src(gather_bytes), dst(size_t{256} << 20);
  Fill(absl::MakeSpan(src), 1);
  std::memset(dst.data(), 0, dst.size());
  size_t big_off = 0;
  const double t_big = MedianSeconds(quick ? 3 : 7, [&] {
    std::memcpy(dst.data(), src.data() + big_off, dst.size());
    big_off = (big_off + dst.size()) % (src.size() - dst.size() + 1);
  });
  const double memcpy_gbs = double(dst.size()) / t_big / 1e9;
  std::printf("| figure | value | reference (same run) | ratio |\n|---|---|---|---|\n");
  std::printf("| memcpy 256 MiB, DRAM to DRAM | %.2f GB/s | - | - |\n", memcpy_gbs);

  // --- gather ------------------------------------------------------------------------------
  // Segments of 4096 chunks (32k tokens) x 8 KV heads, d = 128, as many layers as fill
  // `gather_bytes`; each call gathers k = 256 random chunks per head of one random layer.
  const int h = 8, n_chunks = 4096, k = 256;
  for (kernels::ValueCodec codec : {kernels::ValueCodec::kBF16, kernels::ValueCodec::kINT4,
                                    kernels::ValueCodec::kINT2}) {
    auto probe = storage::SegmentValueLayout::Make(1, h, n_chunks, 8, 128, {codec, 16});
    Die(probe.status(), "layout");
    const int layers = int(std::max<size_t>(1, gather_bytes / probe->layer_bytes()));
    auto layout = storage::SegmentValueLayout::Make(layers, h, n_chunks, 8, 128, {codec, 16});
    storage::HostValueStoreOptions o;
    o.budget_bytes = layout->total_bytes() + (size_t{64} << 20);
    auto store = storage::HostValueStore::Create(cpu, o, nullptr);
    Die(store.status(), "store");
    const storage::SegmentId id{1, 2};
    Die((*store)->Create(id, *layout), "create");
    for (int l = 0; l < layers; ++l) {
      auto block = (*store)->MutableLayer(id, l);
      Die(block.status(), "layer");
      Fill(*block, 10 + l);
    }
    Die((*store)->Seal(id, {}), "seal");
    std::mt19937_64 rng(7);
    const int calls = 256;
    std::vector<std::vector<storage::ChunkRef>> lists(calls);
    for (auto& refs : lists) {
      const int layer = int(rng() % layers);
      for (int hh = 0; hh < h; ++hh) {
        for (int j = 0; j < k; ++j) refs.push_back({id, layer, hh, int32_t(rng() % n_chunks)});
      }
    }
    const size_t bytes_per_call = size_t(h) * k * layout->chunk_bytes;
    std::vector<std::byte> out(bytes_per_call), contiguous(bytes_per_call);
    int call = 0;
    const int reps = quick ? 101 : 1001;
    const double t_gather = MedianSeconds(reps, [&] {
      Die((*store)->Gather(lists[call++ % calls], absl::MakeSpan(out)), "gather");
    });
    size_t off = 0;
    const double t_copy = MedianSeconds(reps, [&] {
      std::memcpy(contiguous.data(), src.data() + off, bytes_per_call);
      off = (off + 7 * bytes_per_call + 4096) % (src.size() - bytes_per_call);
    });
    const double g = double(bytes_per_call) / t_gather / 1e9;
    const double c = double(bytes_per_call) / t_copy / 1e9;
    std::printf("| gather %s: %d heads x %d random chunks of %zu B (%.2f MiB/call) from %.2f GiB | "
                "%.2f GB/s (%.0f us/call) | memcpy of the same bytes %.2f GB/s | %.2f |\n",
                std::string(kernels::ValueCodecName(codec)).c_str(), h, k, layout->chunk_bytes,
                double(bytes_per_call) / (1 << 20), double(layout->total_bytes()) / (1 << 30), g,
                t_gather * 1e6, c, g / c);
  }
  src.clear();
  src.shrink_to_fit();
  dst.clear();
  dst.shrink_to_fit();

  // --- spill, page-in, durable commit --------------------------------------------------------
  const std::string base = dir + "/kvshade-storage-bench-" + std::to_string(getpid());
  std::filesystem::remove_all(base);
  std::filesystem::create_directories(base);
  {
    // Segments of 16.8 MB of int4 values (4 layers x 8 heads x 683 chunks of 768 B).
    auto layout = storage::SegmentValueLayout::Make(4, 8, 683, 8, 128, {kernels::ValueCodec::kINT4, 16});
    Die(layout.status(), "layout");
    const size_t seg = layout->total_bytes();
    const int n = std::max<int>(2, int((spill_mb << 20) / seg));
    const double total_mb = double(n) * double(seg) / 1e6;

    // Raw file references over the same number of bytes.
    std::vector<std::byte> io(size_t{1} << 20);
    Fill(absl::MakeSpan(io), 3);
    const std::string raw = base + "/raw";
    const double raw_write = total_mb / FileWrite(raw, io, size_t(n) * seg);
    DropPageCache(raw);
    const double raw_read = total_mb / FileRead(raw, io);
    std::filesystem::remove(raw);

    auto tier = storage::RocksSpillTier::Open(storage::RocksSpillOptions{.path = base + "/db"});
    Die(tier.status(), "open spill tier");
    storage::HostValueStoreOptions o;
    o.budget_bytes = size_t(n + 1) * seg + (size_t{1} << 20);
    auto store = storage::HostValueStore::Create(cpu, o, tier->get());
    Die(store.status(), "store");
    auto make = [&](storage::SegmentId id, bool durable, double* seal_seconds) {
      Die((*store)->Create(id, *layout), "create");
      for (int l = 0; l < layout->n_layers; ++l) {
        auto block = (*store)->MutableLayer(id, l);
        Die(block.status(), "layer");
        Fill(*block, id.lo * 31 + l);
      }
      auto a = Clock::now();
      Die((*store)->Seal(id, storage::SealOptions{.durable = durable}), "seal");
      *seal_seconds += Seconds(a, Clock::now());
    };
    double unused = 0, durable_s = 0;
    for (int i = 0; i < n; ++i) make({1, uint64_t(i)}, false, &unused);
    auto a = Clock::now();
    for (int i = 0; i < n; ++i) Die((*store)->Spill({1, uint64_t(i)}), "spill");
    Die((*tier)->Flush(), "flush");
    const double spill = total_mb / Seconds(a, Clock::now());
    std::printf("| spill: %d cache segments of %.1f MB (RocksDB, no WAL, flushed) | %.0f MB/s | "
                "write()+fdatasync of the same bytes %.0f MB/s | %.2f |\n",
                n, double(seg) / 1e6, spill, raw_write, spill / raw_write);
    a = Clock::now();
    for (int i = 0; i < n; ++i) Die((*store)->Pin({1, uint64_t(i)}).status(), "page-in");
    const double warm = total_mb / Seconds(a, Clock::now());
    std::printf("| page-in, page cache warm | %.0f MB/s | memcpy %.0f MB/s | %.2f |\n", warm,
                memcpy_gbs * 1e3, warm / (memcpy_gbs * 1e3));
    for (int i = 0; i < n; ++i) Die((*store)->Spill({1, uint64_t(i)}), "spill again");  // on tier: free
    DropPageCache(base + "/db");
    a = Clock::now();
    for (int i = 0; i < n; ++i) Die((*store)->Pin({1, uint64_t(i)}).status(), "page-in");
    const double cold = total_mb / Seconds(a, Clock::now());
    std::printf("| page-in, page cache dropped | %.0f MB/s | read() of a file, cache dropped %.0f MB/s | %.2f |\n",
                cold, raw_read, cold / raw_read);
    const int nd = std::max(2, std::min(n, 8));
    for (int i = 0; i < nd; ++i) {
      Die((*store)->Erase({1, uint64_t(i)}), "erase");
      make({2, uint64_t(i)}, true, &durable_s);
    }
    const double dmb = double(nd) * double(seg) / 1e6;
    std::printf("| durable commit: %d segments of %.1f MB (WriteBatch, WAL + fsync) | %.0f MB/s | "
                "write()+fdatasync %.0f MB/s | %.2f |\n",
                nd, double(seg) / 1e6, dmb / durable_s, raw_write, dmb / durable_s / raw_write);
  }
  std::filesystem::remove_all(base);
  return 0;
}
