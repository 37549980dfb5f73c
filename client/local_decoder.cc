// LocalDecoder (local_decoder.h): maps export generations, keeps slot tables and slot
// buffers in the worker's backend memory, and runs Backend::Select, Reconstruct (straight
// into the slot buffers) and Attend per layer for the whole batch.
#include "kvshade/client/local_decoder.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/kernels/decode_step.h"
#include "kvshade/kernels/devices.h"

namespace kvshade::client {
namespace {

using kernels::bf16;

// KVSHADE_DECODER_TRACE=1 (docs/OPERATIONS.md "Worker-side trace"): Open, Prepare and Join print
// one line each to stderr with where their time went: the daemon's export call, mapping
// the exported regions (how many were imported and their bytes), the slot memory, adding
// to the batch and the first step's probe. A trace belongs to the thread that opened it;
// the steps in between mark their phases on the innermost open trace of their thread.
class PhaseTrace {
 public:
  explicit PhaseTrace(const char* what) : what_(what) {
    const char* v = std::getenv("KVSHADE_DECODER_TRACE");
    if (v == nullptr || *v == '\0' || std::strcmp(v, "0") == 0) return;
    on_ = true;
    start_ = last_ = Clock::now();
    outer_ = current_;
    current_ = this;
  }
  ~PhaseTrace() {
    if (!on_) return;
    current_ = outer_;
    std::fprintf(stderr, "kvshade decoder %s: %.2f ms:%s\n", what_, Ms(Clock::now() - start_), line_.c_str());
  }
  PhaseTrace(const PhaseTrace&) = delete;
  PhaseTrace& operator=(const PhaseTrace&) = delete;

  // The time since the last mark (or the start) as `phase`, on the thread's open trace.
  static void Mark(const char* phase, const std::string& detail = "") {
    PhaseTrace* t = current_;
    if (t == nullptr) return;
    const auto now = Clock::now();
    absl::StrAppend(&t->line_, " ", phase, " ", absl::StrFormat("%.2f", Ms(now - t->last_)),
                    detail.empty() ? "" : " (", detail, detail.empty() ? "" : ")");
    t->last_ = now;
  }
  static bool On() { return current_ != nullptr; }

 private:
  using Clock = std::chrono::steady_clock;
  static double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }
  static thread_local PhaseTrace* current_;
  bool on_ = false;
  const char* what_;
  Clock::time_point start_, last_;
  PhaseTrace* outer_ = nullptr;
  std::string line_;
};
thread_local PhaseTrace* PhaseTrace::current_ = nullptr;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// One backend per name for the whole process, and the regions it has mapped: a CUDA IPC
// handle may be opened only once per process, and several decoders may read one daemon.
//
// Shared host regions stay mapped after the last decoder using them closes, up to
// LocalDecoderOptions::idle_mapped_bytes, least recently released first out: mapping host
// memory costs 0.01 s per GiB (driver host memory) to 0.2-0.3 s per GiB (a memory file the
// worker registers), and the daemon reuses its value buffers for later sessions, so the
// next session's decoder finds them ready. Device regions (CUDA IPC: the daemon's device
// arena, allocated once) stay mapped too, the kIdleDeviceRegions most recently released:
// opening a 48 GiB arena costs about 0.33 s per decoder on an H200, and a mapping costs the
// worker only address space. Region ids are never reused by a daemon, so a kept mapping
// can never stand for another buffer. Idle mappings of another daemon instance (a daemon
// that restarted) are closed when a decoder maps a generation of a different one.
struct WorkerContext {
  using Key = std::pair<std::string, uint64_t>;  // (daemon instance, region id)
  std::unique_ptr<kernels::Backend> backend;
  std::mutex mu;
  struct Mapping {
    kernels::ImportedMemory memory;
    int refs = 0;
    uint64_t released_at = 0;  // release order of an idle mapping (refs == 0)
    // The daemon may free the region while it runs (device memory on demand): never kept
    // idle, since CUDA IPC memory must be unmapped here before its owner frees it.
    bool transient = false;
  };
  std::map<Key, Mapping> mappings;
  // Decoder geometries whose probe (LocalDecoder::Impl::Probe) passed on this backend: a
  // later decoder of the same geometry and profile skips it.
  std::set<std::string> probed;
  size_t idle_bytes = 0;
  uint64_t releases = 0;

  static constexpr int kIdleDeviceRegions = 4;

  static bool IsDevice(const Mapping& m) {
    return m.memory.kind == kernels::ExportedMemory::Kind::kDeviceIpc;
  }
  // Idle bytes that count against idle_mapped_bytes: host mappings only.
  static size_t CountedBytes(const Mapping& m) { return IsDevice(m) ? 0 : m.memory.bytes; }

  // One reference to `key` fewer; the mapping is closed or kept idle (see above): idle host
  // mappings beyond `idle_cap` bytes and idle device mappings beyond kIdleDeviceRegions are
  // closed, oldest first.
  void Unref(const Key& key, size_t idle_cap) {
    auto it = mappings.find(key);
    if (it == mappings.end() || --it->second.refs > 0) return;
    if (idle_cap == 0 || it->second.transient) {
      (void)backend->ReleaseImported(it->second.memory);
      mappings.erase(it);
      return;
    }
    it->second.released_at = ++releases;
    idle_bytes += CountedBytes(it->second);
    const bool device = IsDevice(it->second);
    for (;;) {
      int idle_device = 0;
      auto oldest = mappings.end();
      for (auto m = mappings.begin(); m != mappings.end(); ++m) {
        if (m->second.refs != 0 || IsDevice(m->second) != device) continue;
        if (device) ++idle_device;
        if (oldest == mappings.end() || m->second.released_at < oldest->second.released_at) {
          oldest = m;
        }
      }
      const bool over = device ? idle_device > kIdleDeviceRegions : idle_bytes > idle_cap;
      if (!over || oldest == mappings.end()) break;
      idle_bytes -= CountedBytes(oldest->second);
      (void)backend->ReleaseImported(oldest->second.memory);
      mappings.erase(oldest);
    }
  }
  // Closes the idle mappings of daemon instances other than `daemon`: a restarted daemon's
  // memory is never read again, and a kept mapping would keep it allocated.
  void DropIdleOfOtherDaemons(const std::string& daemon) {
    for (auto m = mappings.begin(); m != mappings.end();) {
      if (m->second.refs == 0 && m->first.first != daemon) {
        idle_bytes -= CountedBytes(m->second);
        (void)backend->ReleaseImported(m->second.memory);
        m = mappings.erase(m);
      } else {
        ++m;
      }
    }
  }
  // One reference more to a mapping found in `mappings` (an idle one is in use again).
  void Ref(Mapping& m) {
    if (m.refs++ == 0 && m.released_at != 0) {
      idle_bytes -= CountedBytes(m);
      m.released_at = 0;
    }
  }
};

absl::StatusOr<WorkerContext*> ContextFor(const std::string& name) {
  static std::mutex mu;
  static auto* contexts = new std::map<std::string, std::unique_ptr<WorkerContext>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& c = (*contexts)[name];
  if (!c) {
    KVSHADE_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> b, kernels::CreateBackend(name));
    c = std::make_unique<WorkerContext>();
    c->backend = std::move(b);
  }
  return c.get();
}

// Lets the daemon free a generation this process no longer reads (best effort: a detach
// releases every generation of the attachment too).
void ReleaseGeneration(Client* client, const std::string& attachment_id, uint64_t generation) {
  if (generation == 0) return;
  v1::ExportSessionRequest rel;
  rel.set_attachment_id(attachment_id);
  rel.set_renew_only(true);
  rel.add_release_generations(generation);
  (void)client->ExportSession(rel);
}

kernels::RopeSpec FromWire(const v1::RopeSpec& r) {
  kernels::RopeSpec k;
  k.theta = r.theta();
  k.rotary_dim = static_cast<int>(r.rotary_dim());
  k.scaling = static_cast<kernels::RopeScaling>(static_cast<int>(r.scaling()));
  k.pairing = static_cast<kernels::RopePairing>(static_cast<int>(r.pairing()));
  k.factor = r.factor();
  k.low_freq_factor = r.low_freq_factor();
  k.high_freq_factor = r.high_freq_factor();
  k.original_max_position = static_cast<int>(r.original_max_position());
  k.beta_fast = r.beta_fast();
  k.beta_slow = r.beta_slow();
  return k;
}

absl::StatusOr<kernels::ValueCodec> FromWire(v1::ValueCodec c) {
  switch (c) {
    case v1::VALUE_CODEC_UNSPECIFIED:
    case v1::VALUE_CODEC_BF16: return kernels::ValueCodec::kBF16;
    case v1::VALUE_CODEC_FP8: return kernels::ValueCodec::kFP8;
    case v1::VALUE_CODEC_INT4: return kernels::ValueCodec::kINT4;
    case v1::VALUE_CODEC_INT2: return kernels::ValueCodec::kINT2;
    default: return absl::InvalidArgumentError(absl::StrCat("unknown value codec ", int(c)));
  }
}

// The selection policy of an exported session (its resolved profile).
decode::SelectionPolicy PolicyFromWire(const v1::Profile& p) {
  decode::SelectionPolicy o;
  o.sparse_budget = static_cast<int>(p.sparse_budget());
  o.rerank_factor = std::max<int>(1, static_cast<int>(p.rerank_factor()));
  o.mass_top_p = p.mass_top_p();
  o.mass_min_chunks = static_cast<int>(p.mass_min_chunks());
  o.recall_sample_rate = p.recall_sample_rate();
  o.recall_floor = p.recall_floor();
  o.recall_action = static_cast<decode::RecallAction>(static_cast<int>(p.recall_action()));
  o.selection_unit = static_cast<int>(p.selection_unit());
  return o;
}

}  // namespace

// One sequence's mapped generation and per-layer decode state.
struct SeqLayer {
  kernels::SessionLayerView view;
  int k = 0;                           // slots per head (0: nothing to select): the
                                       // budget's chunks, or its units (k = budget*C/u)
  int budget = 0;                      // chunks per head: the profile's budget, or the
                                       // recall guard's wider one
  int base_budget = 0;                 // the profile's budget (chunks)
  std::vector<int32_t> selectable;     // [h] chunks each head may select
  bool primed = false;                 // every slot holds a chunk (PrimeSlots)
  std::vector<int32_t> slot_len_host;  // [h] m_hh * U (U: tokens per slot)
  const bf16* static_k = nullptr;      // [h, s, d]
  const bf16* static_v = nullptr;
  const int32_t* static_len = nullptr; // [h]
  int s = 0;
  const bf16* tail_k = nullptr;        // [t, h, d]
  const bf16* tail_v = nullptr;
  int t = 0;
  // Worker-owned (backend memory), allocated per generation.
  kernels::Buffer slots;       // [h, k] int32 slot table
  kernels::Buffer slot_len;    // [h] int32
  kernels::Buffer slot_k, slot_v;  // [h, k, U, d] bf16
  kernels::Buffer outs;        // selected, miss_slot, miss_chunk [h, k] each; miss_count [h]
};

struct Seq {
  std::string attachment_id;
  v1::SessionExport exp;  // the generation in use (regions, geometry)
  std::vector<std::pair<std::string, uint64_t>> regions;  // mapped regions it holds
  std::vector<SeqLayer> layers;
  uint64_t session_tokens = 0;  // tokens the generation covers
  int n_local = 0;              // tokens decoded here since the generation (local tail)
  std::atomic<int64_t> lease_expires_ms{0};
  decode::SelectionGuard guard;  // this decoder's recall guard of the sequence
};

struct LocalDecoder::Impl {
  // Unique in the process (never reused, unlike an address): what a PreparedSequence names.
  const uint64_t id = [] {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1);
  }();
  Client* client = nullptr;
  LocalDecoderOptions options;
  WorkerContext* ctx = nullptr;
  kernels::Backend* be = nullptr;
  // The batch, in batch order (Join appends, Leave removes and closes the gap). Shared
  // with the renewal thread, which copies the list under renew_mu.
  std::vector<std::shared_ptr<Seq>> seqs;
  // Set by the first sequence's export (SetGeometry, under geom_mu, with the fields it
  // sets); Prepare reads it under geom_mu, and the fields once it is true (they no longer
  // change).
  bool geometry = false;
  std::mutex geom_mu;
  bool probed = false;    // the first step's kernels ran (Probe)
  int L = 0, h = 0, hq = 0, g = 0, d = 0, C = 0;
  int U = 0;    // tokens per slot: C, or the profile's selection unit
  int upc = 1;  // slots per chunk: C / U
  kernels::RopeSpec rope;
  kernels::ValueCodecSpec codec;
  kernels::LayerShape shape;
  decode::SelectionPolicy policy;  // the sessions' selection options and recall guard
  v1::SessionExport first_export;  // the first sequence's geometry, which later ones match
  kernels::Buffer zero_q;          // [hq, d] zeros: PrimeSlots' query
  kernels::Buffer guard_ws;        // the recall guard's oracle scratch, grown on need
  // Exact local tails: [L][seq_cap][local_capacity][h][d] bf16 K and V; sequence b's first
  // seqs[b]->n_local tokens are valid. seq_cap sequences fit before they are reallocated.
  kernels::Buffer local_k, local_v;
  int seq_cap = 0;
  // Step counters in backend memory, so that a captured step (CUDA graph) reads the
  // current values at replay: per sequence a row of CounterBytes() with [h] int32
  // n_local+1 and [h] int32 n_local (the local tail's length with and without the step's
  // token); `rows` holds int64 [seq_cap] 0..seq_cap-1 (the new tokens' rows of k_new), then
  // int64 [seq_cap] b*local_capacity + n_local (where they go in the local tails). Advance,
  // Join, Leave and Refresh (never captured) upload them (UploadCounters): a step itself
  // costs no host synchronisation.
  kernels::Buffer counters, rows;
  kernels::Buffer workspace;
  size_t workspace_bytes = 0;
  kernels::Stream last_stream;
  LocalDecoderStats stats;
  // Renewal thread.
  std::mutex renew_mu;
  std::condition_variable renew_cv;
  bool stop = false;
  std::thread renewer;

  absl::Status MapGeneration(Seq& seq, v1::SessionExport exp);
  // (Re)allocates sequence layers' slot tables (empty) and slot buffers, each at its
  // budget of chunks per head (budget*C/u slots with selection units): one backend
  // allocation, one fill and one copy for all the layers given (a join allocates every
  // layer of its sequence at once; the device allocator and its synchronisation are paid
  // once, not per layer and buffer).
  absl::Status AllocSlots(absl::Span<const std::pair<SeqLayer*, int>> layers);
  absl::Status AllocSlots(SeqLayer& sl, int budget) { return AllocSlots({{&sl, budget}}); }
  // Fills every slot of the layer with a selectable chunk (a selection of a zero query):
  // a step that selects fewer than k chunks (a mass budget, model-native ids) then still
  // attends only chunks, never an empty slot. In `stream`'s order, in the decoder's
  // workspace.
  absl::Status PrimeSlots(SeqLayer& sl, kernels::Stream stream);
  // The decode core's group of a sequence layer at its slot width; PrimeGroupOf: the
  // plain selection PrimeSlots runs.
  decode::SelectionGroup GroupOf(const SeqLayer& sl, bool native) const;
  decode::SelectionGroup PrimeGroupOf(const SeqLayer& sl) const;
  // The recall guard after a step of `layer` (docs/ALGORITHM.md "Recall guard"): sampled
  // sequences' selections against the oracle; a widened layer gets wider slots, primed.
  absl::Status GuardAfterStep(int layer, const bf16* q, kernels::Stream stream);
  // One layer of a step for the whole batch (LocalDecoder::Attend, AttendChunks).
  absl::Status Step(int layer, const bf16* q, const int32_t* chunks, int n_chunks,
                    const bf16* k_new, const bf16* v_new, float* out, kernels::Stream stream,
                    float* lse);
  void UnmapRegions(Seq& seq);
  absl::Status CheckLeases() const;
  void RenewLoop();
  absl::Status SizeWorkspace();
  // Sets the geometry, backend and selection policy from the first sequence's export.
  absl::Status SetGeometry(const v1::SessionExport& e);
  // Whether a later sequence's export fits this decoder (InvalidArgument naming `id`).
  absl::Status CheckCompatible(const v1::SessionExport& e, const std::string& id) const;
  // Room for `n` sequences in the local tails and counters (reallocated, kept, between
  // steps).
  absl::Status EnsureCapacity(int n);
  absl::Status UploadCounters(kernels::Stream stream);
  // Adds a sequence (its attachment's current generation) at the end of the batch.
  absl::StatusOr<int> Join(const std::string& attachment_id, v1::SessionExport exp);
  // Join's mapping, without the batch: the geometry checked (or set, with set_geometry),
  // the generation mapped and its slot memory allocated. On failure nothing of it stays
  // (mappings and generation released). Without set_geometry it may run on another thread
  // than the steps' (Prepare), once the geometry is set.
  absl::StatusOr<std::shared_ptr<Seq>> MapNew(const std::string& attachment_id, v1::SessionExport exp,
                                              bool set_geometry);
  // Adds a mapped sequence at the end of the batch; returns its index.
  absl::StatusOr<int> Add(std::shared_ptr<Seq> seq);
  absl::Status CheckNotMember(const std::string& attachment_id) const;  // under renew_mu
  // One step of layer 0 with a zero query over the whole batch, so that a geometry this
  // backend's kernels do not take fails at the first Open/Join, where a caller can still
  // pick another path, and not at the first decode step. The slot tables it filled are
  // reset; the recall guard does not sample it. Once per process for a geometry and
  // profile (WorkerContext::probed): a later decoder of the same skips it.
  absl::Status Probe(LocalDecoder& dec);
  // Closes the gap a sequence leaves at batch index b in the local tails.
  absl::Status RemoveSeq(int b);
  // The local tail of sequence b in `layer` (K or V buffer).
  bf16* LocalRows(const kernels::Buffer& buf, int layer, int b) const {
    return static_cast<bf16*>(buf.data()) +
           (size_t(layer) * seq_cap + b) * size_t(options.local_capacity) * h * d;
  }
  size_t CounterBytes() const { return (size_t(2 * h) * 4 + 15) / 16 * 16; }
  const int32_t* len_with(int b) const {
    return reinterpret_cast<const int32_t*>(static_cast<const char*>(counters.data()) + size_t(b) * CounterBytes());
  }
  const int32_t* len_without(int b) const { return len_with(b) + h; }
  const int64_t* iota_rows() const { return static_cast<const int64_t*>(rows.data()); }
  const int64_t* new_rows() const { return iota_rows() + seq_cap; }
};

absl::Status LocalDecoder::Impl::EnsureCapacity(int n) {
  if (n <= seq_cap) return absl::OkStatus();
  const int cap = std::max({n, 2 * seq_cap, 4});
  const size_t per_seq = size_t(options.local_capacity) * h * d;  // elements
  KVSHADE_RETURN_IF_ERROR(be->Synchronize(last_stream));
  for (kernels::Buffer* buf : {&local_k, &local_v}) {
    KVSHADE_ASSIGN_OR_RETURN(kernels::Buffer grown, be->Allocate(size_t(L) * cap * per_seq * 2));
    if (seq_cap > 0) {
      for (int l = 0; l < L; ++l) {
        KVSHADE_RETURN_IF_ERROR(be->Copy(static_cast<bf16*>(grown.data()) + size_t(l) * cap * per_seq,
                                         static_cast<const bf16*>(buf->data()) + size_t(l) * seq_cap * per_seq,
                                         size_t(seq_cap) * per_seq * 2));
      }
      KVSHADE_RETURN_IF_ERROR(be->Synchronize());
    }
    *buf = std::move(grown);
  }
  KVSHADE_ASSIGN_OR_RETURN(counters, be->Allocate(size_t(cap) * CounterBytes()));
  KVSHADE_ASSIGN_OR_RETURN(rows, be->Allocate(size_t(cap) * 2 * 8));
  std::vector<int64_t> host(size_t(cap) * 2, 0);
  for (int i = 0; i < cap; ++i) host[i] = i;
  KVSHADE_RETURN_IF_ERROR(be->CopyFromHost(rows.data(), host.data(), host.size() * 8));
  seq_cap = cap;
  return UploadCounters({});
}

absl::Status LocalDecoder::Impl::UploadCounters(kernels::Stream stream) {
  const int B = static_cast<int>(seqs.size());
  if (B == 0 || seq_cap == 0) return absl::OkStatus();
  // Pageable host memory: the copy is staged at the call, so these may be reused at once.
  std::vector<char> block(size_t(B) * CounterBytes(), 0);
  std::vector<int64_t> dst(B);
  for (int b = 0; b < B; ++b) {
    int32_t* r = reinterpret_cast<int32_t*>(block.data() + size_t(b) * CounterBytes());
    const int n = seqs[b]->n_local;
    for (int i = 0; i < h; ++i) {
      r[i] = n + 1;
      r[h + i] = n;
    }
    dst[b] = int64_t(b) * options.local_capacity + n;
  }
  KVSHADE_RETURN_IF_ERROR(be->CopyFromHost(counters.data(), block.data(), block.size(), stream));
  return be->CopyFromHost(const_cast<int64_t*>(new_rows()), dst.data(), dst.size() * 8, stream);
}


void UnmapRegions(WorkerContext* ctx, Seq& seq, size_t idle_mapped_bytes) {
  if (ctx == nullptr) return;
  std::lock_guard<std::mutex> lock(ctx->mu);
  for (const auto& key : seq.regions) {
    ctx->Unref(key, idle_mapped_bytes);
  }
  seq.regions.clear();
}

void LocalDecoder::Impl::UnmapRegions(Seq& seq) { client::UnmapRegions(ctx, seq, options.idle_mapped_bytes); }

struct PreparedSequence::State {
  uint64_t owner = 0;  // the id of the decoder that prepared it (Impl::id)
  Client* client = nullptr;
  std::string attachment_id;
  uint64_t generation = 0;  // held until it joins (then 0) or this is destroyed
  // Mapped (the decoder had its geometry): the sequence, and where its regions are mapped.
  std::shared_ptr<Seq> seq;
  WorkerContext* ctx = nullptr;
  size_t idle_mapped_bytes = 0;
  // Not mapped (the decoder's first sequence): its export, mapped by Join.
  v1::SessionExport exp;
};

PreparedSequence::PreparedSequence(std::unique_ptr<State> state) : state_(std::move(state)) {}

PreparedSequence::~PreparedSequence() {
  if (state_ == nullptr) return;
  State& s = *state_;
  if (s.seq != nullptr) UnmapRegions(s.ctx, *s.seq, s.idle_mapped_bytes);
  ReleaseGeneration(s.client, s.attachment_id, s.generation);
}

const std::string& PreparedSequence::attachment_id() const { return state_->attachment_id; }

absl::Status LocalDecoder::Impl::MapGeneration(Seq& seq, v1::SessionExport exp) {
  // Map every region (once per process), then translate every reference.
  std::map<uint64_t, char*> base;
  std::vector<std::pair<std::string, uint64_t>> held;
  int imported_device = 0, imported_host = 0;
  size_t imported_bytes = 0;
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    ctx->DropIdleOfOtherDaemons(exp.daemon_instance());
    for (const v1::SharedRegion& r : exp.regions()) {
      auto key = std::make_pair(exp.daemon_instance(), r.id());
      auto it = ctx->mappings.find(key);
      if (it == ctx->mappings.end()) {
        kernels::ExportedMemory m;
        m.kind = r.device()     ? kernels::ExportedMemory::Kind::kDeviceIpc
                 : r.host_vmm() ? kernels::ExportedMemory::Kind::kHostVmm
                                : kernels::ExportedMemory::Kind::kHostFile;
        m.region_id = r.id();
        m.pid = r.pid();
        m.fd = r.fd();
        m.broker = r.descriptor_broker();
        m.ipc_handle = r.cuda_ipc_handle();
        m.region_bytes = r.bytes();
        absl::StatusOr<kernels::ImportedMemory> im = be->ImportMemory(m);
        if (!im.ok()) {
          for (const auto& k : held) ctx->Unref(k, options.idle_mapped_bytes);
          return im.status();
        }
        it = ctx->mappings.emplace(key, WorkerContext::Mapping{*im, 0, 0, r.transient()}).first;
        ++(r.device() ? imported_device : imported_host);
        imported_bytes += r.bytes();
      }
      ctx->Ref(it->second);
      held.push_back(key);
      base[r.id()] = static_cast<char*>(it->second.memory.base);
    }
  }
  seq.regions = std::move(held);
  if (PhaseTrace::On()) {
    PhaseTrace::Mark("map", absl::StrFormat("%d regions, imported %d device + %d host, %.1f MiB",
                                            exp.regions_size(), imported_device, imported_host,
                                            imported_bytes / 1048576.0));
  }
  auto ptr = [&](const v1::RegionRef& ref, size_t bytes) -> absl::StatusOr<const void*> {
    auto it = base.find(ref.region());
    const v1::SharedRegion* r = nullptr;
    for (const auto& x : exp.regions()) {
      if (x.id() == ref.region()) r = &x;
    }
    if (it == base.end() || r == nullptr || ref.offset() + bytes > r->bytes()) {
      return absl::InternalError(absl::StrCat("export references region ", ref.region(),
                                              " at offset ", ref.offset(), " (+", bytes,
                                              " bytes) outside what it exported"));
    }
    return static_cast<const void*>(it->second + ref.offset());
  };
  if (static_cast<int>(exp.layers_size()) != L) {
    return absl::InternalError("export has the wrong number of layers");
  }
  KVSHADE_ASSIGN_OR_RETURN(const size_t chunk_bytes, kernels::ValueChunkBytes(codec, C, d));
  seq.layers.clear();
  seq.layers.resize(L);
  std::vector<std::pair<SeqLayer*, int>> slot_layers;  // layers that select, their budgets
  for (int l = 0; l < L; ++l) {
    const v1::ExportedLayer& el = exp.layers(l);
    SeqLayer& sl = seq.layers[l];
    sl.k = static_cast<int>(el.slots_per_head());  // units with selection units
    if (sl.k > 0) {
      sl.view.r = static_cast<int>(el.rank());
      // Key signatures (the profile's width; segments exported without them leave sig null).
      const int sig_bits = static_cast<int>(exp.profile().key_signature_bits());
      sl.view.sig_bits = kernels::ValidSignatureBits(sig_bits) ? sig_bits : 0;
      const void* p;
      KVSHADE_ASSIGN_OR_RETURN(p, ptr(el.b(), size_t(h) * sl.view.r * d * 2));
      sl.view.b = static_cast<const bf16*>(p);
      for (const v1::ExportedSegment& es : el.segments()) {
        if (sl.view.n_segments == kernels::kMaxSegments) {
          return absl::InternalError("export has too many segments");
        }
        kernels::SegmentView& sv = sl.view.segments[sl.view.n_segments++];
        const size_t n = es.n_chunks();
        sv.n_chunks = static_cast<int32_t>(n);
        sv.first_position = es.first_position();
        KVSHADE_ASSIGN_OR_RETURN(p, ptr(es.landmarks(), n * h * d * 2));
        sv.landmarks = static_cast<const bf16*>(p);
        KVSHADE_ASSIGN_OR_RETURN(p, ptr(es.a(), n * C * sl.view.r * 2));
        sv.a = static_cast<const bf16*>(p);
        if (es.has_excluded()) {
          KVSHADE_ASSIGN_OR_RETURN(p, ptr(es.excluded(), n * h));
          sv.excluded = static_cast<const uint8_t*>(p);
        }
        if (es.has_sig() && sl.view.sig_bits > 0) {
          KVSHADE_ASSIGN_OR_RETURN(
              p, ptr(es.sig(), n * C * h * kernels::SignatureRecordBytes(sl.view.sig_bits, d)));
          sv.sig = static_cast<const std::byte*>(p);
        }
        const size_t vbytes = size_t(es.value_head_stride()) * (h - 1) +
                              size_t(es.value_chunk_stride()) * (n > 0 ? n - 1 : 0) + chunk_bytes;
        KVSHADE_ASSIGN_OR_RETURN(p, ptr(es.values(), vbytes));
        sv.values = static_cast<const std::byte*>(p);
        sv.value_head_stride = es.value_head_stride();
        sv.value_chunk_stride = es.value_chunk_stride();
      }
      sl.selectable.assign(el.selectable_per_head().begin(), el.selectable_per_head().end());
      sl.selectable.resize(h, 0);
      sl.base_budget = sl.k / upc;  // chunks
      // The recall guard's budget: the daemon's (a layer it widened), or this decoder's.
      if (el.guard_budget() > static_cast<uint32_t>(sl.base_budget)) {
        seq.guard.Adopt(l, static_cast<int>(el.guard_budget()),
                        static_cast<decode::RecallAction>(static_cast<int>(el.guard_fallback())));
      }
      slot_layers.emplace_back(&sl, seq.guard.Budget(l, sl.base_budget, sl.view.total_chunks()));
    }
    sl.s = static_cast<int>(el.static_rows());
    if (sl.s > 0) {
      const size_t sb = size_t(h) * sl.s * d * 2;
      const void* p;
      KVSHADE_ASSIGN_OR_RETURN(p, ptr(el.static_k(), sb));
      sl.static_k = static_cast<const bf16*>(p);
      KVSHADE_ASSIGN_OR_RETURN(p, ptr(el.static_v(), sb));
      sl.static_v = static_cast<const bf16*>(p);
      KVSHADE_ASSIGN_OR_RETURN(p, ptr(el.static_lengths(), size_t(h) * 4));
      sl.static_len = static_cast<const int32_t*>(p);
    }
    sl.t = static_cast<int>(el.tail_tokens());
    if (sl.t > 0) {
      const size_t tb = size_t(sl.t) * h * d * 2;
      const void* p;
      KVSHADE_ASSIGN_OR_RETURN(p, ptr(el.tail_k(), tb));
      sl.tail_k = static_cast<const bf16*>(p);
      KVSHADE_ASSIGN_OR_RETURN(p, ptr(el.tail_v(), tb));
      sl.tail_v = static_cast<const bf16*>(p);
    }
  }
  PhaseTrace::Mark("translate");
  KVSHADE_RETURN_IF_ERROR(AllocSlots(slot_layers));
  PhaseTrace::Mark("slots");
  seq.session_tokens = exp.tokens();
  seq.lease_expires_ms = static_cast<int64_t>(exp.lease_expires_unix_ms());
  seq.exp = std::move(exp);
  seq.exp.clear_layers();  // the translated pointers are what is used from here on
  return absl::OkStatus();
}

absl::Status LocalDecoder::Impl::AllocSlots(absl::Span<const std::pair<SeqLayer*, int>> layers) {
  if (layers.empty()) return absl::OkStatus();
  constexpr size_t kAlign = 256;
  const auto up = [](size_t x) { return (x + kAlign - 1) / kAlign * kAlign; };
  // Layout: every layer's slot table (one fill), every layer's lengths back to back (one
  // copy), then per layer its K and V slot rows and select outputs.
  struct At {
    size_t slots, len, k, v, outs;
  };
  std::vector<At> at(layers.size());
  std::vector<int32_t> lengths;
  size_t off = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    SeqLayer& sl = *layers[i].first;
    sl.budget = layers[i].second;
    sl.k = policy.Slots(sl.budget, C);
    sl.primed = false;
    sl.slot_len_host.resize(h);
    for (int hh = 0; hh < h; ++hh) {
      sl.slot_len_host[hh] = std::min<int>(sl.k, sl.selectable[hh] * upc) * U;
    }
    lengths.insert(lengths.end(), sl.slot_len_host.begin(), sl.slot_len_host.end());
    at[i].slots = off;
    off += up(size_t(h) * sl.k * 4);
  }
  const size_t slots_end = off;
  for (size_t i = 0; i < layers.size(); ++i) at[i].len = off + i * size_t(h) * 4;
  off = up(off + lengths.size() * 4);
  for (size_t i = 0; i < layers.size(); ++i) {
    const size_t hk = size_t(h) * layers[i].first->k;
    at[i].k = off;
    off += up(hk * U * d * 2);
    at[i].v = off;
    off += up(hk * U * d * 2);
    at[i].outs = off;
    off += up(decode::SelectOutputWords(h, layers[i].first->k) * 4);
  }
  KVSHADE_ASSIGN_OR_RETURN(kernels::Buffer one, be->Allocate(off));
  auto block = std::make_shared<kernels::Buffer>(std::move(one));
  char* base = static_cast<char*>(block->data());
  if (slots_end > 0) KVSHADE_RETURN_IF_ERROR(be->Fill(base, 0xff, slots_end));  // -1: empty
  KVSHADE_RETURN_IF_ERROR(be->CopyFromHost(base + at[0].len, lengths.data(), lengths.size() * 4));
  // Each buffer is a view of the block; the block is freed with the last of them.
  const auto carve = [&](size_t offset, size_t bytes) {
    return bytes == 0 ? kernels::Buffer() : kernels::Buffer(base + offset, bytes, [block](void*) {});
  };
  for (size_t i = 0; i < layers.size(); ++i) {
    SeqLayer& sl = *layers[i].first;
    const size_t hk = size_t(h) * sl.k;
    sl.slots = carve(at[i].slots, hk * 4);
    sl.slot_len = carve(at[i].len, size_t(h) * 4);
    sl.slot_k = carve(at[i].k, hk * U * d * 2);
    sl.slot_v = carve(at[i].v, hk * U * d * 2);
    sl.outs = carve(at[i].outs, decode::SelectOutputWords(h, sl.k) * 4);
  }
  return absl::OkStatus();
}

decode::SelectionGroup LocalDecoder::Impl::GroupOf(const SeqLayer& sl, bool native) const {
  decode::SelectionGroup g;
  g.shape = shape;
  g.k = sl.k;
  g.C = C;
  g.rope = rope;
  g.codec = codec;
  g.native = native;
  if (!native) g.options = policy.OptionsAt(sl.budget, C, rope, decode::HasSignatures(sl.view));
  return g;
}

decode::SelectionGroup LocalDecoder::Impl::PrimeGroupOf(const SeqLayer& sl) const {
  decode::SelectionGroup g = GroupOf(sl, false);
  if (g.options.units()) {
    // Units take two stages: a zero query ranks the chunks, then their units, by id.
    g.options.top_p = 0;
    g.options.min_k = 0;
  } else {
    g.options = kernels::SelectOptions{};  // plain: a zero query ranks chunks by id
  }
  return g;
}

absl::Status LocalDecoder::Impl::PrimeSlots(SeqLayer& sl, kernels::Stream stream) {
  if (sl.k == 0 || sl.primed) return absl::OkStatus();
  const decode::SelectionGroup g = PrimeGroupOf(sl);
  kernels::SelectItem si;
  si.view = sl.view;
  si.q = static_cast<const bf16*>(zero_q.data());
  si.slots = static_cast<int32_t*>(sl.slots.data());
  decode::BindOutputs(static_cast<int32_t*>(sl.outs.data()), h, sl.k, &si);
  const kernels::ReconstructItem ri = decode::ReconstructOf(
      g, si, static_cast<bf16*>(sl.slot_k.data()), static_cast<bf16*>(sl.slot_v.data()), true);
  // The decoder's workspace (SizeWorkspace counts this selection too), in stream order
  // before the step's own selection.
  const kernels::Workspace ws{workspace.data(), workspace_bytes};
  KVSHADE_RETURN_IF_ERROR(decode::RunSelection(*be, g, {&si, 1}, ws, stream));
  KVSHADE_RETURN_IF_ERROR(decode::RunReconstruct(*be, g, {&ri, 1}, ws, stream));
  sl.primed = true;
  return absl::OkStatus();
}

absl::Status LocalDecoder::Impl::GuardAfterStep(int layer, const bf16* q, kernels::Stream stream) {
  if (!policy.guard()) return absl::OkStatus();
  const size_t qstride = size_t(hq) * d;
  for (size_t b = 0; b < seqs.size(); ++b) {
    Seq& seq = *seqs[b];
    SeqLayer& sl = seq.layers[layer];
    if (sl.k == 0 || !decode::GuardSamples(seq.guard, policy, layer)) continue;
    // The selection this step attends, on the host (the one wait of a sampled step).
    std::vector<int32_t> selected(size_t(h) * sl.k);
    KVSHADE_RETURN_IF_ERROR(be->CopyToHost(selected.data(), sl.outs.data(), selected.size() * 4, stream));
    const decode::SelectionGroup g = GroupOf(sl, false);
    const int k0 = decode::OracleBudget(policy, sl.view.total_chunks());
    const size_t need = decode::OracleWorkspaceBytes(*be, g, sl.view, k0);
    if (guard_ws.bytes() < need) {
      KVSHADE_ASSIGN_OR_RETURN(guard_ws, be->Allocate(need));
    }
    KVSHADE_ASSIGN_OR_RETURN(decode::GuardOutcome o,
                             decode::GuardStep(*be, seq.guard, policy, g, layer, sl.view, q + b * qstride,
                                               selected.data(), sl.k, guard_ws.workspace(), stream));
    const int k = seq.guard.Budget(layer, sl.base_budget, sl.view.total_chunks());
    if (o.action != decode::RecallAction::kNone && k > sl.budget) {
      // Wider from the next step on: new slots (this step's attention has been queued on
      // `stream` over the old ones; wait for it before they are freed).
      KVSHADE_RETURN_IF_ERROR(be->Synchronize(stream));
      KVSHADE_RETURN_IF_ERROR(AllocSlots(sl, k));
      KVSHADE_RETURN_IF_ERROR(SizeWorkspace());
      KVSHADE_RETURN_IF_ERROR(PrimeSlots(sl, stream));
    }
  }
  return absl::OkStatus();
}

absl::Status LocalDecoder::Impl::SizeWorkspace() {
  // The largest Select / Reconstruct / Attend workspace of any layer for the whole batch at
  // the full local tail.
  size_t need = 0;
  const int B = static_cast<int>(seqs.size());
  for (int l = 0; l < L; ++l) {
    std::map<int, std::vector<kernels::SelectItem>> sel;
    std::map<int, std::vector<kernels::ReconstructItem>> rec;
    std::map<int, const SeqLayer*> any;  // one sequence layer of each width
    std::vector<kernels::AttendItem> att(B);
    for (int b = 0; b < B; ++b) {
      const SeqLayer& sl = seqs[b]->layers[l];
      if (sl.k > 0) {
        kernels::SelectItem si;
        si.view = sl.view;
        sel[sl.k].push_back(si);
        any[sl.k] = &sl;
        kernels::ReconstructItem ri;
        ri.view = sl.view;
        ri.unit = GroupOf(sl, false).options.unit;
        rec[sl.k].push_back(ri);
      }
      kernels::AttendItem& ai = att[b];
      ai.n_blocks = 0;
      if (sl.s > 0) ai.blocks[ai.n_blocks++] = kernels::KvBlock{nullptr, nullptr, sl.s, nullptr, 0, 0};
      if (sl.k > 0) ai.blocks[ai.n_blocks++] = kernels::KvBlock{nullptr, nullptr, int64_t(sl.k) * U, nullptr, 0, 0};
      if (sl.t > 0) ai.blocks[ai.n_blocks++] = kernels::KvBlock{nullptr, nullptr, sl.t, nullptr, 0, 0};
      ai.blocks[ai.n_blocks++] = kernels::KvBlock{nullptr, nullptr, options.local_capacity, nullptr, 0, 0};
    }
    for (const auto& [k, items] : sel) {
      // Whatever a step of this width may run: the profile's selection, the caller's ids,
      // or the plain selection that primes the slots.
      need = std::max(need, decode::SelectionWorkspaceBytes(*be, GroupOf(*any[k], false), items));
      need = std::max(need, decode::SelectionWorkspaceBytes(*be, GroupOf(*any[k], true), items));
      need = std::max(need, decode::SelectionWorkspaceBytes(*be, PrimeGroupOf(*any[k]), items));
    }
    for (const auto& [k, items] : rec) {
      need = std::max(need, decode::ReconstructWorkspaceBytes(*be, GroupOf(*any[k], false), items));
    }
    need = std::max(need, be->AttendWorkspaceBytes(shape, att));
  }
  need = std::max<size_t>(need, 256);
  if (need > workspace_bytes) {
    KVSHADE_ASSIGN_OR_RETURN(workspace, be->Allocate(need));
    workspace_bytes = need;
  }
  return absl::OkStatus();
}

absl::Status LocalDecoder::Impl::CheckLeases() const {
  const int64_t now = NowMs();
  const int64_t margin = absl::ToInt64Milliseconds(options.lease_margin);
  for (const auto& s : seqs) {
    if (now + margin >= s->lease_expires_ms.load()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the lease of attachment '", s->attachment_id,
          "' has expired or is about to (renewal failed or stopped); its exported memory may "
          "be freed: attach again and open a new decoder"));
    }
  }
  return absl::OkStatus();
}

void LocalDecoder::Impl::RenewLoop() {
  std::unique_lock<std::mutex> lock(renew_mu);
  for (;;) {
    int64_t lease_ms = 0;
    for (const auto& s : seqs) lease_ms = std::max<int64_t>(lease_ms, s->exp.lease_ms());
    const auto wait = std::chrono::milliseconds(std::max<int64_t>(lease_ms / 3, 50));
    if (renew_cv.wait_for(lock, wait, [&] { return stop; })) return;
    // A copy: sequences may join or leave while a renewal is in flight.
    const std::vector<std::shared_ptr<Seq>> batch = seqs;
    for (const auto& s : batch) {
      if (stop) return;
      v1::ExportSessionRequest req;
      req.set_attachment_id(s->attachment_id);
      req.set_renew_only(true);
      lock.unlock();
      absl::StatusOr<v1::SessionExport> r = client->ExportSession(req);
      lock.lock();
      if (r.ok()) s->lease_expires_ms = static_cast<int64_t>(r->lease_expires_unix_ms());
      // A failed renewal leaves the old expiry: Attend refuses once it is reached.
    }
  }
}

LocalDecoder::LocalDecoder(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

LocalDecoder::~LocalDecoder() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.renew_mu);
    m.stop = true;
  }
  m.renew_cv.notify_all();
  if (m.renewer.joinable()) m.renewer.join();
  if (m.be != nullptr) (void)m.be->Synchronize(m.last_stream);
  for (auto& s : m.seqs) {
    m.UnmapRegions(*s);
    ReleaseGeneration(m.client, s->attachment_id, s->exp.generation());
  }
}

absl::Status LocalDecoder::Impl::SetGeometry(const v1::SessionExport& e0) {
  std::string backend = options.backend;
  if (backend == "auto") backend = e0.backend();
  if (options.backend == "auto" && e0.backend() == "cuda" && !e0.device_pci_bus_id().empty()) {
    // The daemon names the GPU that holds the session (docs/OPERATIONS.md "Devices"): decode
    // on this process's ordinal of it, whatever this process's device order.
    const int ordinal = kernels::CudaOrdinalOfPciBusId(e0.device_pci_bus_id());
    if (ordinal < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "LocalDecoder: the session is on the daemon's GPU ", e0.device(), " (PCI ",
          e0.device_pci_bus_id(), "), which this process does not see; decode on that GPU"));
    }
    backend = absl::StrCat("cuda:", ordinal);
  }
  KVSHADE_ASSIGN_OR_RETURN(ctx, ContextFor(backend));
  be = ctx->backend.get();
  L = static_cast<int>(e0.num_layers());
  h = static_cast<int>(e0.num_kv_heads());
  hq = static_cast<int>(e0.num_query_heads());
  g = hq / std::max(h, 1);
  d = static_cast<int>(e0.head_dim());
  C = static_cast<int>(e0.chunk_size());
  shape = kernels::LayerShape{h, g, d};
  rope = FromWire(e0.rope());
  KVSHADE_ASSIGN_OR_RETURN(codec.codec, FromWire(e0.value_codec()));
  codec.group = static_cast<int>(e0.value_group());
  policy = PolicyFromWire(e0.profile());
  U = policy.units(C) ? policy.selection_unit : C;
  upc = C / U;
  // Selection units need this backend's kernels for them (the CUDA backend's refusal,
  // until it has them, comes here rather than at the first step).
  if (absl::Status st = decode::CheckUnitsSupported(*be, shape, policy, C, rope); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("LocalDecoder: the session selects units of ",
                                                policy.selection_unit, " tokens (profile.selection_unit), which the ",
                                                std::string(be->name()), " backend does not run: ", st.message()));
  }
  // What later sequences must match (CheckCompatible): the geometry fields, not the state.
  first_export = e0;
  first_export.clear_regions();
  first_export.clear_layers();
  if ((size_t(h) * d * 2) % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LocalDecoder: kv_heads * head_dim * 2 bytes must be a multiple of 16, got ", size_t(h) * d * 2));
  }
  KVSHADE_ASSIGN_OR_RETURN(zero_q, be->Allocate(size_t(hq) * d * 2));
  KVSHADE_RETURN_IF_ERROR(be->Fill(zero_q.data(), 0, zero_q.bytes()));
  geometry = true;
  return absl::OkStatus();
}

absl::Status LocalDecoder::Impl::CheckCompatible(const v1::SessionExport& e, const std::string& id) const {
  const v1::SessionExport& e0 = first_export;
  if (e.num_layers() != e0.num_layers() || e.num_kv_heads() != e0.num_kv_heads() ||
      e.num_query_heads() != e0.num_query_heads() || e.head_dim() != e0.head_dim() ||
      e.chunk_size() != e0.chunk_size() || e.value_codec() != e0.value_codec() ||
      e.value_group() != e0.value_group() || e.backend() != e0.backend() ||
      e.device_pci_bus_id() != e0.device_pci_bus_id() ||
      e.rope().SerializeAsString() != e0.rope().SerializeAsString()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attachment '", id, "' differs from the batch's first session in model geometry, RoPE, chunk "
        "size, value codec, backend or GPU; one decoder batches sessions of one model and profile, "
        "on one GPU"));
  }
  if (!(PolicyFromWire(e.profile()) == policy)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attachment '", id, "' differs from the batch's first session in its profile's selection options "
        "(sparse_budget, rerank_factor, mass_top_p, mass_min_chunks, selection_unit, recall guard); one decoder batches "
        "sessions of one profile"));
  }
  return absl::OkStatus();
}

absl::Status LocalDecoder::Impl::CheckNotMember(const std::string& attachment_id) const {
  for (const auto& s : seqs) {
    if (s->attachment_id == attachment_id) {
      return absl::AlreadyExistsError(absl::StrCat("attachment '", attachment_id, "' is already in the batch"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Seq>> LocalDecoder::Impl::MapNew(const std::string& attachment_id,
                                                                 v1::SessionExport exp, bool set_geometry) {
  auto seq = std::make_shared<Seq>();
  seq->attachment_id = attachment_id;
  const uint64_t generation = exp.generation();
  absl::Status st;
  if (set_geometry) {
    std::lock_guard<std::mutex> lock(geom_mu);
    st = geometry ? CheckCompatible(exp, attachment_id) : SetGeometry(exp);
    PhaseTrace::Mark("geometry");
  } else {
    st = CheckCompatible(exp, attachment_id);
  }
  if (st.ok()) st = MapGeneration(*seq, std::move(exp));
  if (!st.ok()) {
    // Nothing of the sequence stays: its mappings and its generation are released.
    if (ctx != nullptr) UnmapRegions(*seq);
    ReleaseGeneration(client, attachment_id, generation);
    return st;
  }
  return seq;
}

absl::StatusOr<int> LocalDecoder::Impl::Add(std::shared_ptr<Seq> seq) {
  {
    std::lock_guard<std::mutex> lock(renew_mu);
    KVSHADE_RETURN_IF_ERROR(CheckNotMember(seq->attachment_id));
  }
  KVSHADE_RETURN_IF_ERROR(be->Synchronize(last_stream));  // the last step may still read
  KVSHADE_RETURN_IF_ERROR(EnsureCapacity(static_cast<int>(seqs.size()) + 1));
  {
    std::lock_guard<std::mutex> lock(renew_mu);
    seqs.push_back(std::move(seq));
  }
  absl::Status st = UploadCounters({});
  if (st.ok()) st = SizeWorkspace();
  if (st.ok()) st = be->Synchronize();
  PhaseTrace::Mark("add");
  if (!st.ok()) {
    // Not added: the caller still owns the sequence's mappings and generation.
    {
      std::lock_guard<std::mutex> lock(renew_mu);
      seqs.pop_back();
    }
    (void)UploadCounters({});
    return st;
  }
  return static_cast<int>(seqs.size()) - 1;
}

absl::StatusOr<int> LocalDecoder::Impl::Join(const std::string& attachment_id, v1::SessionExport exp) {
  {
    std::lock_guard<std::mutex> lock(renew_mu);
    if (absl::Status st = CheckNotMember(attachment_id); !st.ok()) {
      ReleaseGeneration(client, attachment_id, exp.generation());
      return st;
    }
  }
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Seq> seq, MapNew(attachment_id, std::move(exp), /*set_geometry=*/true));
  const uint64_t generation = seq->exp.generation();
  absl::StatusOr<int> b = Add(seq);
  if (!b.ok()) {
    UnmapRegions(*seq);
    ReleaseGeneration(client, attachment_id, generation);
  }
  return b;
}

absl::Status LocalDecoder::Impl::Probe(LocalDecoder& dec) {
  if (probed || seqs.empty()) return absl::OkStatus();
  // What the kernels' acceptance depends on: the model geometry, chunk and slot widths,
  // value codec, RoPE, the profile's selection options and the local tail's capacity.
  const std::string key =
      absl::StrCat(h, "/", hq, "/", d, "/", C, "/", U, "/", static_cast<int>(codec.codec), "/", codec.group, "/",
                   options.local_capacity, "/", first_export.rope().SerializeAsString(), "/",
                   first_export.profile().SerializeAsString());
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    if (ctx->probed.count(key) != 0) {
      probed = true;
      PhaseTrace::Mark("probe", "passed earlier in this process");
      return absl::OkStatus();
    }
  }
  const size_t qn = seqs.size() * size_t(hq) * d;
  KVSHADE_ASSIGN_OR_RETURN(kernels::Buffer q0, be->Allocate(qn * 2));
  KVSHADE_ASSIGN_OR_RETURN(kernels::Buffer o0, be->Allocate(qn * 4));
  KVSHADE_RETURN_IF_ERROR(be->Fill(q0.data(), 0, qn * 2));
  const float rate = policy.recall_sample_rate;
  policy.recall_sample_rate = 0;
  absl::Status probe = dec.Attend(0, static_cast<const bf16*>(q0.data()), nullptr, nullptr,
                                  static_cast<float*>(o0.data()));
  policy.recall_sample_rate = rate;
  KVSHADE_RETURN_IF_ERROR(probe);
  for (auto& s : seqs) {
    SeqLayer& sl = s->layers[0];
    if (sl.k > 0) KVSHADE_RETURN_IF_ERROR(be->Fill(sl.slots.data(), 0xff, size_t(h) * sl.k * 4));
    sl.primed = false;
  }
  KVSHADE_RETURN_IF_ERROR(be->Synchronize());
  probed = true;
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    ctx->probed.insert(key);
  }
  PhaseTrace::Mark("probe");
  return absl::OkStatus();
}

absl::Status LocalDecoder::Impl::RemoveSeq(int b) {
  const int B = static_cast<int>(seqs.size());
  const size_t tok = size_t(h) * d;
  // Later sequences move one place down, their local tails with them (slot blocks are
  // disjoint, so each copy is between distinct blocks).
  for (int j = b + 1; j < B; ++j) {
    const size_t bytes = size_t(seqs[j]->n_local) * tok * 2;
    if (bytes == 0) continue;
    for (int l = 0; l < L; ++l) {
      for (const kernels::Buffer* buf : {&local_k, &local_v}) {
        KVSHADE_RETURN_IF_ERROR(be->Copy(LocalRows(*buf, l, j - 1), LocalRows(*buf, l, j), bytes));
      }
    }
  }
  std::shared_ptr<Seq> gone;
  {
    std::lock_guard<std::mutex> lock(renew_mu);
    gone = seqs[b];
    seqs.erase(seqs.begin() + b);
  }
  KVSHADE_RETURN_IF_ERROR(UploadCounters({}));
  KVSHADE_RETURN_IF_ERROR(be->Synchronize());
  UnmapRegions(*gone);
  ReleaseGeneration(client, gone->attachment_id, gone->exp.generation());
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LocalDecoder>> LocalDecoder::Open(
    Client* client, const std::vector<std::string>& attachment_ids,
    const LocalDecoderOptions& options) {
  if (client == nullptr) return absl::InvalidArgumentError("LocalDecoder::Open: client is null");
  PhaseTrace trace("open");
  if (options.local_capacity < 1) {
    return absl::InvalidArgumentError(absl::StrCat("local_capacity must be >= 1, got ",
                                                   options.local_capacity));
  }
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.client = client;
  m.options = options;
  std::vector<v1::SessionExport> exports;
  for (const std::string& id : attachment_ids) {
    v1::ExportSessionRequest req;
    req.set_attachment_id(id);
    KVSHADE_ASSIGN_OR_RETURN(v1::SessionExport e, client->ExportSession(req));
    exports.push_back(std::move(e));
  }
  PhaseTrace::Mark("export");
  std::unique_ptr<LocalDecoder> dec(new LocalDecoder(std::move(impl)));
  if (options.backend != "auto") {
    KVSHADE_ASSIGN_OR_RETURN(m.ctx, ContextFor(options.backend));
    m.be = m.ctx->backend.get();
  }
  for (size_t i = 0; i < exports.size(); ++i) {
    KVSHADE_RETURN_IF_ERROR(m.Join(attachment_ids[i], std::move(exports[i])).status());
  }
  KVSHADE_RETURN_IF_ERROR(m.Probe(*dec));
  if (options.renew_leases) m.renewer = std::thread([&m] { m.RenewLoop(); });
  PhaseTrace::Mark("renewer");
  return dec;
}

absl::StatusOr<int> LocalDecoder::Join(const std::string& attachment_id) {
  KVSHADE_ASSIGN_OR_RETURN(std::unique_ptr<PreparedSequence> p, Prepare(attachment_id));
  return Join(std::move(p));
}

absl::StatusOr<std::unique_ptr<PreparedSequence>> LocalDecoder::Prepare(const std::string& attachment_id) {
  Impl& m = *impl_;
  PhaseTrace trace("prepare");
  {
    std::lock_guard<std::mutex> lock(m.renew_mu);
    KVSHADE_RETURN_IF_ERROR(m.CheckNotMember(attachment_id));
  }
  v1::ExportSessionRequest req;
  req.set_attachment_id(attachment_id);
  KVSHADE_ASSIGN_OR_RETURN(v1::SessionExport e, m.client->ExportSession(req));
  PhaseTrace::Mark("export");
  auto st = std::make_unique<PreparedSequence::State>();
  st->owner = m.id;
  st->client = m.client;
  st->attachment_id = attachment_id;
  st->generation = e.generation();
  bool geometry;
  {
    std::lock_guard<std::mutex> lock(m.geom_mu);
    geometry = m.geometry;
  }
  if (!geometry) {
    st->exp = std::move(e);
  } else {
    st->generation = 0;  // MapNew releases it on failure
    KVSHADE_ASSIGN_OR_RETURN(st->seq, m.MapNew(attachment_id, std::move(e), /*set_geometry=*/false));
    st->generation = st->seq->exp.generation();
    st->ctx = m.ctx;
    st->idle_mapped_bytes = m.options.idle_mapped_bytes;
  }
  return std::unique_ptr<PreparedSequence>(new PreparedSequence(std::move(st)));
}

absl::StatusOr<int> LocalDecoder::Join(std::unique_ptr<PreparedSequence> prepared) {
  Impl& m = *impl_;
  PhaseTrace trace("join");
  if (prepared == nullptr || prepared->state_ == nullptr) {
    return absl::InvalidArgumentError("Join: the prepared sequence is null");
  }
  PreparedSequence::State& p = *prepared->state_;
  if (p.owner != m.id) {
    return absl::InvalidArgumentError(absl::StrCat("Join: attachment '", p.attachment_id,
                                                   "' was prepared by another decoder"));
  }
  absl::StatusOr<int> b;
  if (p.seq != nullptr) {
    b = m.Add(p.seq);  // on failure `prepared` lets go of the sequence
    if (b.ok()) {
      p.seq.reset();  // the batch holds its mappings and generation now
      p.generation = 0;
    }
  } else {
    p.generation = 0;  // Impl::Join holds or releases it
    b = m.Join(p.attachment_id, std::move(p.exp));
  }
  if (!b.ok()) return b;
  absl::Status probe = m.Probe(*this);
  if (!probe.ok()) {
    (void)m.RemoveSeq(*b);
    return probe;
  }
  return b;
}

absl::Status LocalDecoder::Leave(int b) {
  Impl& m = *impl_;
  if (b < 0 || b >= batch()) {
    return absl::InvalidArgumentError(absl::StrCat("Leave: sequence ", b, " is not in the batch (batch ", batch(), ")"));
  }
  if (m.be != nullptr) KVSHADE_RETURN_IF_ERROR(m.be->Synchronize(m.last_stream));
  return m.RemoveSeq(b);
}

absl::Status LocalDecoder::Leave(const std::string& attachment_id) {
  for (int b = 0; b < batch(); ++b) {
    if (impl_->seqs[b]->attachment_id == attachment_id) return Leave(b);
  }
  return absl::NotFoundError(absl::StrCat("attachment '", attachment_id, "' is not in the batch"));
}

std::vector<std::string> LocalDecoder::attachment_ids() const {
  std::vector<std::string> out;
  for (const auto& s : impl_->seqs) out.push_back(s->attachment_id);
  return out;
}

int LocalDecoder::batch() const { return static_cast<int>(impl_->seqs.size()); }
int LocalDecoder::layers() const { return impl_->L; }
int LocalDecoder::kv_heads() const { return impl_->h; }
int LocalDecoder::query_heads() const { return impl_->hq; }
int LocalDecoder::head_dim() const { return impl_->d; }
kernels::Backend& LocalDecoder::backend() { return *impl_->be; }
std::string_view LocalDecoder::backend_name() const {
  return impl_->be == nullptr ? std::string_view() : impl_->be->name();
}

std::vector<uint64_t> LocalDecoder::tokens() const {
  std::vector<uint64_t> t;
  for (const auto& s : impl_->seqs) t.push_back(s->session_tokens + s->n_local);
  return t;
}

absl::Status LocalDecoder::Attend(int layer, const bf16* q, const bf16* k_new, const bf16* v_new,
                                  float* out, kernels::Stream stream, float* lse) {
  return impl_->Step(layer, q, nullptr, 0, k_new, v_new, out, stream, lse);
}

absl::Status LocalDecoder::AttendChunks(int layer, const bf16* q, const int32_t* chunks, int m,
                                        const bf16* k_new, const bf16* v_new, float* out,
                                        kernels::Stream stream, float* lse) {
  if (chunks == nullptr) return absl::InvalidArgumentError("AttendChunks: chunks must be set");
  return impl_->Step(layer, q, chunks, m, k_new, v_new, out, stream, lse);
}

absl::Status LocalDecoder::Impl::Step(int layer, const bf16* q, const int32_t* chunks, int n_chunks,
                                      const bf16* k_new, const bf16* v_new, float* out,
                                      kernels::Stream stream, float* lse) {
  Impl& m = *this;
  if (m.seqs.empty()) {
    return absl::FailedPreconditionError("the decoder has no sequences: Join one first");
  }
  if (layer < 0 || layer >= m.L) {
    return absl::InvalidArgumentError(absl::StrCat("layer must be in [0, ", m.L, "), got ", layer));
  }
  if (q == nullptr || out == nullptr || (k_new == nullptr) != (v_new == nullptr)) {
    return absl::InvalidArgumentError(
        "Attend: q and out must be set, and k_new and v_new both set or both null");
  }
  const int B = static_cast<int>(m.seqs.size());
  const bool with_new = k_new != nullptr;
  if (with_new) {
    for (int b = 0; b < B; ++b) {
      if (m.seqs[b]->n_local >= m.options.local_capacity) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "the local tail of sequence ", b, " (attachment '", m.seqs[b]->attachment_id,
            "') is full (local_capacity = ", m.options.local_capacity,
            " tokens): append its decoded tokens to the session and call Refresh()"));
      }
    }
  }
  // Model-native ids: at most the slot width of every sequence's layer; whole chunks only.
  if (chunks != nullptr && m.U != m.C) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AttendChunks: model-native chunk ids select whole chunks, but the sessions select units of ",
        m.U, " tokens (profile.selection_unit); use Attend, or a profile without selection units"));
  }
  if (chunks != nullptr) {
    for (int b = 0; b < B; ++b) {
      const int k = m.seqs[b]->layers[layer].k;
      if (n_chunks < 0 || (k > 0 && n_chunks > k)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "AttendChunks: chunks per head must be in [0, slots per head = ", k, "] for layer ",
            layer, " of sequence ", b, ", got ", n_chunks));
      }
    }
  }
  KVSHADE_RETURN_IF_ERROR(m.CheckLeases());
  m.last_stream = stream;
  const int h = m.h, d = m.d, U = m.U;
  const size_t tok = size_t(h) * d;  // elements of one token of one sequence

  // The new tokens join the local tails of this layer: row b of k_new/v_new to row
  // b*local_capacity + n_local[b]. The destination rows are read on the device (the
  // counters), so that a captured step writes where the replayed step is.
  if (with_new) {
    KVSHADE_RETURN_IF_ERROR(m.be->CopyRows(k_new, m.LocalRows(m.local_k, layer, 0), tok * 2, B,
                                           m.iota_rows(), m.new_rows(), stream));
    KVSHADE_RETURN_IF_ERROR(m.be->CopyRows(v_new, m.LocalRows(m.local_v, layer, 0), tok * 2, B,
                                           m.iota_rows(), m.new_rows(), stream));
  }

  // Select + reconstruct into the slot buffers (the decode core), one launch each per group
  // of sequences with equal slot width and options.
  std::map<std::string, std::pair<decode::SelectionGroup, std::vector<int>>> groups;
  for (int b = 0; b < B; ++b) {
    SeqLayer& sl = m.seqs[b]->layers[layer];
    if (sl.k == 0) continue;
    // A step that may select fewer than k chunks attends primed slots (PrimeSlots).
    if (chunks != nullptr || m.policy.mass_top_p > 0) KVSHADE_RETURN_IF_ERROR(m.PrimeSlots(sl, stream));
    decode::SelectionGroup g = m.GroupOf(sl, chunks != nullptr);
    auto& e = groups[g.Key()];
    e.first = g;
    e.second.push_back(b);
  }
  const size_t qstride = size_t(m.hq) * d;
  kernels::Workspace ws{m.workspace.data(), m.workspace_bytes};
  for (const auto& [key, entry] : groups) {
    const decode::SelectionGroup& g = entry.first;
    std::vector<kernels::SelectItem> sel;
    std::vector<kernels::ReconstructItem> rec;
    for (int b : entry.second) {
      SeqLayer& sl = m.seqs[b]->layers[layer];
      kernels::SelectItem si;
      si.view = sl.view;
      si.q = q + b * qstride;
      si.slots = static_cast<int32_t*>(sl.slots.data());
      decode::BindOutputs(static_cast<int32_t*>(sl.outs.data()), h, sl.k, &si);
      if (chunks != nullptr) {
        // The caller's ids [h, n_chunks] into `selected` [h, k], -1 padded.
        KVSHADE_RETURN_IF_ERROR(m.be->Fill(si.selected, 0xff, size_t(h) * sl.k * 4, stream));
        if (n_chunks > 0) {
          KVSHADE_RETURN_IF_ERROR(m.be->Copy2D(si.selected, size_t(sl.k) * 4,
                                               chunks + size_t(b) * h * n_chunks, size_t(n_chunks) * 4,
                                               size_t(n_chunks) * 4, h, stream));
        }
      }
      sel.push_back(si);
      rec.push_back(decode::ReconstructOf(g, si, static_cast<bf16*>(sl.slot_k.data()),
                                          static_cast<bf16*>(sl.slot_v.data()), /*into_slots=*/true));
    }
    KVSHADE_RETURN_IF_ERROR(decode::RunSelection(*m.be, g, sel, ws, stream));
    KVSHADE_RETURN_IF_ERROR(decode::RunReconstruct(*m.be, g, rec, ws, stream));
  }

  std::vector<kernels::AttendItem> items(B);
  for (int b = 0; b < B; ++b) {
    const SeqLayer& sl = m.seqs[b]->layers[layer];
    // The decode core's order: static set, selected chunks, exact tail, local tokens.
    decode::AttendRows rows;
    KVSHADE_RETURN_IF_ERROR(rows.AddStatic(sl.static_k, sl.static_v, sl.s, sl.static_len, d));
    if (sl.k > 0) {
      KVSHADE_RETURN_IF_ERROR(rows.AddSelected(static_cast<const bf16*>(sl.slot_k.data()),
                                               static_cast<const bf16*>(sl.slot_v.data()), int64_t(sl.k) * U,
                                               static_cast<const int32_t*>(sl.slot_len.data()), d));
    }
    KVSHADE_RETURN_IF_ERROR(rows.AddTokens(sl.tail_k, sl.tail_v, sl.t, nullptr, int64_t(tok), d));
    // The local tail's length per head comes from the device counters (len is only the
    // bound the kernels size their grid by): a captured step attends over the tokens of
    // the step it replays.
    if (with_new || m.seqs[b]->n_local > 0) {
      KVSHADE_RETURN_IF_ERROR(rows.AddTokens(m.LocalRows(m.local_k, layer, b), m.LocalRows(m.local_v, layer, b),
                                             m.options.local_capacity,
                                             with_new ? m.len_with(b) : m.len_without(b), int64_t(tok), d));
    }
    if (rows.size() == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "attachment '", m.seqs[b]->attachment_id, "' has no tokens to attend in layer ", layer));
    }
    items[b] = rows.Item(q + b * qstride, out + b * qstride, lse == nullptr ? nullptr : lse + size_t(b) * m.hq);
  }
  KVSHADE_RETURN_IF_ERROR(m.be->Attend(m.shape, 1.0f / std::sqrt(float(d)), items, ws, stream));
  // The recall guard samples kvshade's own selections (not the caller's ids).
  if (chunks == nullptr) KVSHADE_RETURN_IF_ERROR(m.GuardAfterStep(layer, q, stream));
  return absl::OkStatus();
}

absl::Status LocalDecoder::Advance() {
  Impl& m = *impl_;
  for (const auto& s : m.seqs) {
    if (s->n_local >= m.options.local_capacity) {
      return absl::ResourceExhaustedError(absl::StrCat("Advance: the local tail of attachment '",
                                                       s->attachment_id, "' is full; Refresh() first"));
    }
  }
  for (const auto& s : m.seqs) ++s->n_local;
  ++m.stats.steps;
  KVSHADE_RETURN_IF_ERROR(m.UploadCounters(m.last_stream));
  for (const auto& s : m.seqs) {
    for (int l = 0; l < m.L; ++l) {
      const SeqLayer& sl = s->layers[l];
      for (int32_t len : sl.slot_len_host) m.stats.selected += uint64_t(len / m.U);
    }
  }
  if (!m.options.count_hits) return absl::OkStatus();
  KVSHADE_RETURN_IF_ERROR(m.be->Synchronize(m.last_stream));
  for (const auto& s : m.seqs) {
    for (int l = 0; l < m.L; ++l) {
      const SeqLayer& sl = s->layers[l];
      if (sl.k == 0) continue;
      std::vector<int32_t> mc(m.h);
      KVSHADE_RETURN_IF_ERROR(m.be->CopyToHost(
          mc.data(), static_cast<const int32_t*>(sl.outs.data()) + 3 * size_t(m.h) * sl.k, mc.size() * 4));
      int64_t selected = 0;
      for (int32_t len : sl.slot_len_host) selected += len / m.U;
      int64_t misses = 0;
      for (int32_t x : mc) misses += x;
      m.stats.hits += uint64_t(std::max<int64_t>(0, selected - misses));
    }
  }
  return absl::OkStatus();
}

absl::Status LocalDecoder::Extend(int b, int n, const bf16* k, const bf16* v, kernels::Stream stream) {
  Impl& m = *impl_;
  if (b < 0 || b >= batch()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Extend: sequence ", b, " is not in the batch (batch ", batch(), ")"));
  }
  if (n < 1 || k == nullptr || v == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("Extend: needs n >= 1 tokens and their k and v rows, got n = ", n,
                     k == nullptr ? ", k null" : "", v == nullptr ? ", v null" : ""));
  }
  Seq& s = *m.seqs[b];
  if (n > m.options.local_capacity - s.n_local) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "Extend: ", n, " tokens do not fit in the local tail of attachment '", s.attachment_id,
        "' (", s.n_local, " of local_capacity = ", m.options.local_capacity, " in use)"));
  }
  const size_t row = size_t(m.h) * m.d;  // elements per token
  for (int l = 0; l < m.L; ++l) {
    const size_t src = size_t(l) * n * row;
    const size_t dst = size_t(s.n_local) * row;
    KVSHADE_RETURN_IF_ERROR(m.be->Copy(m.LocalRows(m.local_k, l, b) + dst, k + src, size_t(n) * row * 2, stream));
    KVSHADE_RETURN_IF_ERROR(m.be->Copy(m.LocalRows(m.local_v, l, b) + dst, v + src, size_t(n) * row * 2, stream));
  }
  s.n_local += n;
  m.last_stream = stream;
  return m.UploadCounters(stream);
}

absl::Status LocalDecoder::Refresh() {
  Impl& m = *impl_;
  if (m.seqs.empty()) return absl::OkStatus();
  KVSHADE_RETURN_IF_ERROR(m.be->Synchronize(m.last_stream));
  const int B = static_cast<int>(m.seqs.size());
  std::vector<v1::SessionExport> next;
  for (auto& s : m.seqs) {
    v1::ExportSessionRequest req;
    req.set_attachment_id(s->attachment_id);
    KVSHADE_ASSIGN_OR_RETURN(v1::SessionExport e, m.client->ExportSession(req));
    next.push_back(std::move(e));
  }
  std::lock_guard<std::mutex> lock(m.renew_mu);
  const size_t tok = size_t(m.h) * m.d;
  for (int b = 0; b < B; ++b) {
    Seq& s = *m.seqs[b];
    // The local tokens the daemon now holds (sequences join at different times and may
    // append different counts); the daemon may hold more (e.g. the token of the step about
    // to run).
    const uint64_t gained = next[b].tokens() - std::min(next[b].tokens(), s.session_tokens);
    const int covered = static_cast<int>(std::min<uint64_t>(gained, uint64_t(s.n_local)));
    const uint64_t old_gen = s.exp.generation();
    std::vector<std::pair<std::string, uint64_t>> old_regions = std::move(s.regions);
    s.regions.clear();
    KVSHADE_RETURN_IF_ERROR(m.MapGeneration(s, std::move(next[b])));
    // Release the old generation's mappings after the new ones took their references.
    std::swap(s.regions, old_regions);
    m.UnmapRegions(s);
    s.regions = std::move(old_regions);
    v1::ExportSessionRequest rel;
    rel.set_attachment_id(s.attachment_id);
    rel.set_renew_only(true);
    rel.add_release_generations(old_gen);
    KVSHADE_RETURN_IF_ERROR(m.client->ExportSession(rel).status());
    if (covered == 0) continue;
    // Drop the sequence's first `covered` local tokens in every layer: its rows move down
    // (one copy when source and destination do not overlap, else row by row, ascending).
    const int keep = s.n_local - covered;
    for (int l = 0; l < m.L; ++l) {
      for (const kernels::Buffer* buf : {&m.local_k, &m.local_v}) {
        bf16* base = m.LocalRows(*buf, l, b);
        if (keep <= covered) {
          if (keep > 0) KVSHADE_RETURN_IF_ERROR(m.be->Copy(base, base + covered * tok, keep * tok * 2));
        } else {
          for (int i = 0; i < keep; ++i) {
            KVSHADE_RETURN_IF_ERROR(m.be->Copy(base + i * tok, base + (i + covered) * tok, tok * 2));
          }
        }
      }
    }
    s.n_local = keep;
  }
  KVSHADE_RETURN_IF_ERROR(m.UploadCounters({}));
  KVSHADE_RETURN_IF_ERROR(m.SizeWorkspace());
  return m.be->Synchronize();
}

absl::StatusOr<LocalDecoderStats> LocalDecoder::Stats() { return impl_->stats; }

absl::StatusOr<std::vector<int32_t>> LocalDecoder::Selected(int b, int layer) {
  Impl& m = *impl_;
  if (b < 0 || b >= batch() || layer < 0 || layer >= m.L) {
    return absl::InvalidArgumentError(absl::StrCat("Selected: sequence ", b, " / layer ", layer,
                                                   " out of range (batch ", batch(), ", layers ", m.L, ")"));
  }
  const SeqLayer& sl = m.seqs[b]->layers[layer];
  std::vector<int32_t> out(size_t(m.h) * sl.k);
  if (sl.k == 0) return out;
  KVSHADE_RETURN_IF_ERROR(m.be->Synchronize(m.last_stream));
  KVSHADE_RETURN_IF_ERROR(m.be->CopyToHost(out.data(), sl.outs.data(), out.size() * 4));
  KVSHADE_RETURN_IF_ERROR(m.be->Synchronize());
  return out;
}

int LocalDecoder::slots_per_head(int b, int layer) const {
  if (b < 0 || b >= batch() || layer < 0 || layer >= impl_->L) return 0;
  return impl_->seqs[b]->layers[layer].k;
}

absl::StatusOr<std::vector<decode::LayerHealth>> LocalDecoder::Selection(int b) const {
  if (b < 0 || b >= batch()) {
    return absl::InvalidArgumentError(absl::StrCat("Selection: sequence ", b, " out of range (batch ",
                                                   batch(), ")"));
  }
  return impl_->seqs[b]->guard.Snapshot();
}

}  // namespace kvshade::client
