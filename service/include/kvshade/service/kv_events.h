// KV-events for cache-aware routers: the daemon's prefix index published as vLLM's KV
// events (ZMQ PUB, msgpack), the format the llm-d KV-cache indexer consumes, so that a
// router can send a request to the node that holds its prefix. docs/API.md
// ("KV-events") documents the wire format field by field.
//
// Each ZMQ message has three frames: the topic (kv_events.topic), the sequence number (8
// bytes big-endian, from 0, +1 per message) and the payload, a msgpack EventBatch:
//   [ts (float64, Unix seconds), [event, ...]]
// with each event a tagged array:
//   ["BlockStored", [block_hash, ...], parent_block_hash | nil, [token_id, ...],
//    block_size, lora_id (nil), medium ("GPU" | "CPU"), lora_name (nil)]
//   ["BlockRemoved", [block_hash, ...], medium]
//   ["AllBlocksCleared"]
// A block hash is the low 64 bits of the block's prefix key (storage/README.md "Prefix
// keys"; the last 8 bytes of its canonical form, big-endian). Events are queued by the
// engine and sent by one thread, which batches what has accumulated into one message.
// Nothing is sent before the first subscriber has subscribed (the socket is an XPUB): the
// events of start-up (AllBlocksCleared, restored prefixes) wait for it, up to
// max_queued_events.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace kvshade::service {

struct KvEventsOptions {
  // ZMQ endpoint. Bound when it holds '*' or '::' or is ipc:// or inproc:// (a publisher
  // that subscribers connect to: "tcp://*:5557"); connected otherwise (to an indexer that
  // binds its SUB socket: "tcp://indexer:5557"). The same rule as vLLM's publisher.
  std::string endpoint;
  std::string topic;          // first frame of every message; "" = none
  std::string medium = "GPU"; // BlockStored/BlockRemoved medium
  int send_hwm = 100000;      // ZMQ_SNDHWM: messages queued per subscriber before drops
  size_t max_queued_events = 1 << 20;  // beyond: the oldest are dropped (counted)
};

class KvEventPublisher {
 public:
  // Creates the socket, binds or connects, starts the sending thread. The first message is
  // an AllBlocksCleared batch: whatever a subscriber knew of this endpoint is stale.
  static absl::StatusOr<std::unique_ptr<KvEventPublisher>> Start(const KvEventsOptions& options);
  ~KvEventPublisher();  // sends what is queued (up to 1 s), then closes
  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  // A segment of the prefix index was registered: its blocks (hashes in chain order), the
  // hash of the block before its first (nullopt for a chain's first segment), the tokens of
  // its blocks (block_size per hash). `segment` names it for Removed().
  void Stored(const std::string& segment, std::vector<uint64_t> block_hashes,
              std::optional<uint64_t> parent_hash, std::vector<int32_t> token_ids, uint32_t block_size);
  // The segment left the prefix index (evicted): BlockRemoved of the hashes Stored() gave.
  // Unknown segments are ignored.
  void Removed(const std::string& segment);
  // Another segment took over these blocks of `segment` (a segment split off its front:
  // docs/DESIGN.md "Segment ends"): its Removed() leaves them out, since they stay cached.
  void HandedOver(const std::string& segment, const std::vector<uint64_t>& block_hashes);
  void AllCleared();

  uint64_t messages_sent() const;
  uint64_t events_dropped() const;

  // The msgpack payload of one batch (exposed for tests).
  struct Event {
    enum Kind { kStored, kRemoved, kCleared } kind = kCleared;
    std::vector<uint64_t> hashes;
    std::optional<uint64_t> parent;
    std::vector<int32_t> tokens;
    uint32_t block_size = 0;
  };
  static std::string EncodeBatch(double ts, const std::vector<Event>& events, const std::string& medium);

 private:
  KvEventPublisher() = default;
  void Push(Event e);
  void Loop();
  bool ReadSubscriptions();  // the sending thread only
  bool subscribed_ = false;  // the sending thread only

  KvEventsOptions options_;
  void* context_ = nullptr;
  void* socket_ = nullptr;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> queue_;
  std::map<std::string, std::vector<uint64_t>> stored_;  // segment -> its block hashes
  bool stop_ = false;
  uint64_t seq_ = 0;
  uint64_t sent_ = 0;
  uint64_t dropped_ = 0;
  std::thread thread_;
};

}  // namespace kvshade::service
