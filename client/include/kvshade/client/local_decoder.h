// LocalDecoder: same-node decode with no RPC per step (docs/DESIGN.md "Same-node decode").
//
// A worker on the daemon's node maps the session state of its attachments (ExportSession:
// factors, landmarks, static sets and exact tails by CUDA IPC or shared host memory,
// values in shared host memory) and runs selection, reconstruction and attention itself,
// in its own stream, with the slot tables (the temporal cache) on its own device. One
// LocalDecoder serves a batch of B attachments (one session each, any mix of sessions of
// the same model geometry, value codec and selection options); every call covers the whole
// batch in one launch per kernel.
//
// Continuous batching: sequences Join() and Leave() the batch between steps, without
// reopening the decoder. The batch order is the join order; Leave(b) closes the gap (the
// later sequences move down one index) and frees the sequence's slot tables and mapped
// generation at once. Each sequence keeps its own local tail (its tokens decoded here),
// so sequences of different lengths and ages decode together. A captured step (CUDA
// graph) is valid for the batch it was captured with: capture again after Join/Leave
// (one graph per batch size is enough when the runtime keeps its batch order).
//
// Decode step, per layer l (in order), then Advance():
//   Attend(l, q, k_new, v_new, out)
//     q     : [B, hq, d] bf16, post-RoPE query of each sequence's newest token
//     k_new : [B, h, d]  bf16, post-RoPE key of that token;  v_new: [B, h, d] bf16
//     out   : [B, hq, d] f32, softmax(q K^T / sqrt(d)) V over the session (static set +
//             selected chunks + the daemon's exact tail) + the tokens decoded locally since
//             the export + the new token
//   k_new and v_new may both be null: no new token this step (e.g. the daemon already
//   holds it); then do not call Advance() for the step.
//   All pointers are in the decoder's backend memory (device memory for cuda, host for
//   cpu); nothing is copied to or from the host, and nothing waits on the daemon.
//
// Tokens decoded here stay exact in the decoder (local_capacity per sequence). The daemon
// learns of them when the runtime appends them (AppendTokens, off the critical path);
// Refresh() then maps the new generation and drops the local tokens it covers.
//
// Leases: a background thread renews the attachments' leases (lease/3). Attend fails with
// FAILED_PRECONDITION once a lease is within `lease_margin` of expiring (renewal failing,
// daemon gone): the decoder never reads memory the daemon may have freed.
//
// Threading: one thread drives Attend/Advance/Refresh/Join/Leave; the renewal thread is
// internal. Prepare() may run on other threads meanwhile (see there).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvshade/client/client.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/decode_step.h"

namespace kvshade::client {

struct LocalDecoderOptions {
  // "auto" picks the daemon's backend kind ("cuda" -> this process's device 0, "cpu").
  std::string backend = "auto";
  int local_capacity = 1024;  // tokens per sequence decoded locally between refreshes
  absl::Duration lease_margin = absl::Seconds(1);
  bool renew_leases = true;   // background renewal thread
  // Count slot-table hits: Advance() then reads every layer's miss counts back (one small
  // device-to-host copy per layer; off by default, for measurement).
  bool count_hits = false;
  // Shared host memory of the daemon (the sessions' values) stays mapped in this process
  // after the decoders reading it close, up to this many bytes, so that a later session's
  // decoder does not map it again (0.01-0.3 s per GiB); so do the daemon's last few device
  // regions (its arena: about 0.33 s to open 48 GiB). The pages are the daemon's; only
  // memory the daemon has since freed is held by a kept mapping. 0 = unmap at once.
  size_t idle_mapped_bytes = size_t{64} << 30;
};

struct LocalDecoderStats {
  uint64_t selected = 0;  // selected chunks (all layers, heads, sequences, steps)
  uint64_t hits = 0;      // of those, already in a slot
  uint64_t steps = 0;
};

// A sequence made ready to join a batch (LocalDecoder::Prepare): its attachment's current
// generation exported and, once the decoder has its geometry, mapped with its slot memory
// allocated. Destroying one that never joined lets go of all that (its attachment stays).
// Free it before the client, as a decoder.
class PreparedSequence {
 public:
  ~PreparedSequence();
  PreparedSequence(const PreparedSequence&) = delete;
  PreparedSequence& operator=(const PreparedSequence&) = delete;
  const std::string& attachment_id() const;
  struct State;

 private:
  friend class LocalDecoder;
  explicit PreparedSequence(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

class LocalDecoder {
 public:
  // attachment_ids may be empty: sequences then Join later (the first one sets the model
  // geometry, the profile's selection options and, for backend "auto", the backend). The
  // first sequence is probed (one step of layer 0) so that a geometry the backend's kernels
  // do not take fails here; once per process for a geometry and profile. With
  // KVSHADE_DECODER_TRACE=1, Open, Prepare and Join print where their time went to stderr
  // (docs/OPERATIONS.md "Worker-side trace").
  static absl::StatusOr<std::unique_ptr<LocalDecoder>> Open(
      Client* client, const std::vector<std::string>& attachment_ids,
      const LocalDecoderOptions& options = {});
  ~LocalDecoder();
  LocalDecoder(const LocalDecoder&) = delete;
  LocalDecoder& operator=(const LocalDecoder&) = delete;

  // Adds the attachment's session at the end of the batch (its current generation, no
  // local tokens yet) and returns its batch index. Between steps. InvalidArgument when its
  // model, profile or backend differ from the batch's; AlreadyExists when it is in it.
  absl::StatusOr<int> Join(const std::string& attachment_id);
  // Join in two parts, so that a runtime keeps its steps going while a sequence gets ready:
  // Prepare makes the daemon's calls and the mapping (ExportSession, opening its memory,
  // allocating its slot tables) and may run on another thread while this decoder steps;
  // Join(prepared) then only adds it to the batch, between steps, on the stepping thread.
  // Prepare fails as Join would (InvalidArgument for another geometry, AlreadyExists for a
  // member); before the decoder's first sequence it only exports (the first Join sets the
  // geometry and maps). Prepare allocates device memory: not while this process captures a
  // CUDA graph. A prepared sequence holds its generation (the daemon keeps that memory)
  // until it joins or is destroyed; join it within the attachment's lease.
  absl::StatusOr<std::unique_ptr<PreparedSequence>> Prepare(const std::string& attachment_id);
  absl::StatusOr<int> Join(std::unique_ptr<PreparedSequence> prepared);
  // Removes sequence b (or the attachment's) from the batch between steps: its local tokens
  // are dropped (append them to the session first to keep them), its memory is freed and
  // its generation released. Later sequences move down one index.
  absl::Status Leave(int b);
  absl::Status Leave(const std::string& attachment_id);
  // The batch's attachments, in batch order.
  std::vector<std::string> attachment_ids() const;

  int batch() const;
  int layers() const;
  int kv_heads() const;
  int query_heads() const;
  int head_dim() const;
  // Tokens each sequence attends over before the next step's token (session + local).
  std::vector<uint64_t> tokens() const;
  // The backend the decoder runs on (set at Open for a named backend, else by the first
  // sequence); backend() only once it is set.
  kernels::Backend& backend();
  std::string_view backend_name() const;  // "cpu", "cuda", or "" before it is set

  // lse: [B, hq] f32 or null: the log-sum-exp of each query head's scaled scores over
  // what it attended (to merge with attention over tokens the decoder does not hold).
  absl::Status Attend(int layer, const kernels::bf16* q, const kernels::bf16* k_new,
                      const kernels::bf16* v_new, float* out, kernels::Stream stream = {},
                      float* lse = nullptr);
  // Model-native selection (docs/ALGORITHM.md "Selection options"): the chunks each
  // sequence attends in this layer are the caller's (a model's own indexer) instead of the
  // profile's selection. chunks: [B, h, m] int32 in the decoder's memory space, -1 = none,
  // m <= slots_per_head of every sequence's layer. Served through the slot tables as the
  // daemon serves kvshade_select_chunks (hits stay, misses reconstructed); ids out of range,
  // static for the head or repeated are ignored (the daemon's RPC refuses them; the decoder
  // does not read the ids on the host). The recall guard does not sample these steps.
  // Sessions that select units (profile selection_unit) refuse them (InvalidArgument).
  absl::Status AttendChunks(int layer, const kernels::bf16* q, const int32_t* chunks, int m,
                            const kernels::bf16* k_new, const kernels::bf16* v_new, float* out,
                            kernels::Stream stream = {}, float* lse = nullptr);
  // Ends a step: the tokens given to every layer's Attend join the local tail.
  absl::Status Advance();
  // Adds n exact tokens at the end of sequence b's local tail, between steps: tokens the
  // session does not hold (a prompt's last part, e.g. a question after a shared document
  // the session covers), so that the sequence decodes over them at once instead of after
  // an ingest. k, v: [L, n, h, d] bf16, post-RoPE keys, layer-major, in the decoder's memory
  // space; copied in `stream`'s order (they may be reused once that stream has passed the
  // call). The next step attends them as it attends the tokens of earlier steps (tokens()
  // counts them; Refresh drops those a later generation covers). InvalidArgument for a bad
  // b, n < 1 or null rows; ResourceExhausted when they do not fit in local_capacity
  // (nothing is added).
  absl::Status Extend(int b, int n, const kernels::bf16* k, const kernels::bf16* v,
                      kernels::Stream stream = {});
  // Maps the daemon's current generation of every session (after appends or a new turn),
  // drops each sequence's local tokens it covers (sequences may have appended different
  // counts), resets the slot tables, releases the old generations.
  absl::Status Refresh();
  // Selection counters (hits are counted only with options.count_hits).
  absl::StatusOr<LocalDecoderStats> Stats();
  // The chunk ids sequence b's last step of `layer` selected, [h, slots_per_head] (-1 =
  // none), after the step's work (synchronizes); unit ids with selection units. For tests
  // and inspection.
  absl::StatusOr<std::vector<int32_t>> Selected(int b, int layer);
  // Slots per KV head of sequence b's layer: the profile's budget, or the recall guard's
  // (in units of the profile's selection_unit, budget * C/u, with selection units).
  int slots_per_head(int b, int layer) const;
  // The recall guard's figures for sequence b (docs/ALGORITHM.md "Recall guard"), the
  // lowest mean recall first: layers this decoder sampled, and layers under a fallback
  // (the daemon's, carried by the export, or this decoder's).
  absl::StatusOr<std::vector<decode::LayerHealth>> Selection(int b) const;

  struct Impl;

 private:
  explicit LocalDecoder(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvshade::client
