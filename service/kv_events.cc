// KvEventPublisher (kv_events.h): a ZMQ PUB socket owned by one thread, fed by a queue.
#include "kvshade/service/kv_events.h"

#include <algorithm>

#include <zmq.h>

#include <chrono>
#include <cstring>
#include <utility>

#include <msgpack.hpp>

#include "absl/strings/str_cat.h"
#include "kvshade/service/log.h"

namespace kvshade::service {
namespace {

bool Binds(const std::string& endpoint) {
  return endpoint.find('*') != std::string::npos || endpoint.find("::") != std::string::npos ||
         endpoint.rfind("ipc://", 0) == 0 || endpoint.rfind("inproc://", 0) == 0;
}

void PackStr(msgpack::packer<msgpack::sbuffer>& p, const std::string& s) {
  p.pack_str(static_cast<uint32_t>(s.size()));
  p.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

}  // namespace

std::string KvEventPublisher::EncodeBatch(double ts, const std::vector<Event>& events,
                                          const std::string& medium) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> p(buf);
  p.pack_array(2);
  p.pack_double(ts);
  p.pack_array(static_cast<uint32_t>(events.size()));
  for (const Event& e : events) {
    switch (e.kind) {
      case Event::kStored:
        p.pack_array(8);
        PackStr(p, "BlockStored");
        p.pack_array(static_cast<uint32_t>(e.hashes.size()));
        for (uint64_t h : e.hashes) p.pack_uint64(h);
        if (e.parent) {
          p.pack_uint64(*e.parent);
        } else {
          p.pack_nil();
        }
        p.pack_array(static_cast<uint32_t>(e.tokens.size()));
        for (int32_t t : e.tokens) {
          if (t >= 0) {
            p.pack_uint32(static_cast<uint32_t>(t));
          } else {
            p.pack_int32(t);
          }
        }
        p.pack_uint32(e.block_size);
        p.pack_nil();  // lora_id
        PackStr(p, medium);
        p.pack_nil();  // lora_name
        break;
      case Event::kRemoved:
        p.pack_array(3);
        PackStr(p, "BlockRemoved");
        p.pack_array(static_cast<uint32_t>(e.hashes.size()));
        for (uint64_t h : e.hashes) p.pack_uint64(h);
        PackStr(p, medium);
        break;
      case Event::kCleared:
        p.pack_array(1);
        PackStr(p, "AllBlocksCleared");
        break;
    }
  }
  return std::string(buf.data(), buf.size());
}

absl::StatusOr<std::unique_ptr<KvEventPublisher>> KvEventPublisher::Start(const KvEventsOptions& options) {
  if (options.endpoint.empty()) return absl::InvalidArgumentError("kv_events.endpoint is empty");
  std::unique_ptr<KvEventPublisher> p(new KvEventPublisher());
  p->options_ = options;
  p->context_ = zmq_ctx_new();
  if (p->context_ == nullptr) {
    return absl::InternalError(absl::StrCat("kv_events: zmq_ctx_new: ", zmq_strerror(zmq_errno())));
  }
  // XPUB: a PUB that also reports subscriptions, so nothing is sent before a subscriber
  // has subscribed (a PUB drops what it sends while no subscriber is connected).
  p->socket_ = zmq_socket(p->context_, ZMQ_XPUB);
  if (p->socket_ == nullptr) {
    return absl::InternalError(absl::StrCat("kv_events: zmq_socket: ", zmq_strerror(zmq_errno())));
  }
  const int hwm = options.send_hwm, linger = 1000;
  zmq_setsockopt(p->socket_, ZMQ_SNDHWM, &hwm, sizeof(hwm));
  zmq_setsockopt(p->socket_, ZMQ_LINGER, &linger, sizeof(linger));
  const bool bind = Binds(options.endpoint);
  const int rc = bind ? zmq_bind(p->socket_, options.endpoint.c_str())
                      : zmq_connect(p->socket_, options.endpoint.c_str());
  if (rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("kv_events: cannot ", bind ? "bind" : "connect", " '",
                                                   options.endpoint, "': ", zmq_strerror(zmq_errno())));
  }
  log::Event(spdlog::level::info, "kv_events_started")
      .Str("endpoint", options.endpoint)
      .Str("mode", bind ? "bind" : "connect")
      .Str("topic", options.topic);
  p->AllCleared();
  p->thread_ = std::thread([raw = p.get()] { raw->Loop(); });
  return p;
}

KvEventPublisher::~KvEventPublisher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (socket_ != nullptr) zmq_close(socket_);  // linger: 1 s for what is still queued
  if (context_ != nullptr) zmq_ctx_term(context_);
}

void KvEventPublisher::Push(Event e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (queue_.size() >= options_.max_queued_events) {
      queue_.pop_front();
      ++dropped_;
    }
    queue_.push_back(std::move(e));
  }
  cv_.notify_one();
}

void KvEventPublisher::Stored(const std::string& segment, std::vector<uint64_t> block_hashes,
                              std::optional<uint64_t> parent_hash, std::vector<int32_t> token_ids,
                              uint32_t block_size) {
  if (block_hashes.empty()) return;
  Event e;
  e.kind = Event::kStored;
  e.hashes = std::move(block_hashes);
  e.parent = parent_hash;
  e.tokens = std::move(token_ids);
  e.block_size = block_size;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stored_[segment] = e.hashes;
  }
  Push(std::move(e));
}

void KvEventPublisher::Removed(const std::string& segment) {
  Event e;
  e.kind = Event::kRemoved;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = stored_.find(segment);
    if (it == stored_.end()) return;
    e.hashes = std::move(it->second);
    stored_.erase(it);
  }
  Push(std::move(e));
}

void KvEventPublisher::HandedOver(const std::string& segment, const std::vector<uint64_t>& block_hashes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = stored_.find(segment);
  if (it == stored_.end()) return;
  std::vector<uint64_t>& kept = it->second;
  for (uint64_t h : block_hashes) kept.erase(std::remove(kept.begin(), kept.end(), h), kept.end());
}

void KvEventPublisher::AllCleared() { Push(Event{}); }

uint64_t KvEventPublisher::messages_sent() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sent_;
}

uint64_t KvEventPublisher::events_dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

// Reads the subscription messages XPUB delivers (never blocks); true once any arrived.
bool KvEventPublisher::ReadSubscriptions() {
  char buf[256];
  for (;;) {
    const int n = zmq_recv(socket_, buf, sizeof(buf), ZMQ_DONTWAIT);
    if (n < 0) break;
    if (n >= 1 && buf[0] == 1 && !subscribed_) {
      subscribed_ = true;
      log::Event(spdlog::level::info, "kv_events_subscriber").Str("endpoint", options_.endpoint);
    }
  }
  return subscribed_;
}

void KvEventPublisher::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    // Until a subscriber has subscribed, events wait in the queue (bounded): checked every
    // 20 ms. Afterwards the queue is sent as soon as it fills.
    if (!subscribed_) {
      cv_.wait_for(lock, std::chrono::milliseconds(20), [&] { return stop_; });
      lock.unlock();
      const bool ready = ReadSubscriptions();
      lock.lock();
      if (!ready) {
        if (stop_) return;
        continue;
      }
    }
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) {
      if (stop_) return;
      continue;
    }
    std::vector<Event> batch(std::make_move_iterator(queue_.begin()), std::make_move_iterator(queue_.end()));
    queue_.clear();
    const uint64_t seq = seq_++;
    lock.unlock();
    ReadSubscriptions();  // keep XPUB's incoming queue empty
    const double ts =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    const std::string payload = EncodeBatch(ts, batch, options_.medium);
    unsigned char seq_be[8];
    for (int i = 0; i < 8; ++i) seq_be[i] = static_cast<unsigned char>(seq >> (8 * (7 - i)));
    // PUB never blocks: a subscriber over its high-water mark loses the message.
    bool ok = zmq_send(socket_, options_.topic.data(), options_.topic.size(), ZMQ_SNDMORE) >= 0 &&
              zmq_send(socket_, seq_be, sizeof(seq_be), ZMQ_SNDMORE) >= 0 &&
              zmq_send(socket_, payload.data(), payload.size(), 0) >= 0;
    if (!ok) {
      log::Event(spdlog::level::warn, "kv_events_send_failed")
          .Uint("seq", seq)
          .Uint("events", batch.size())
          .Str("error", zmq_strerror(zmq_errno()));
    } else {
      log::Event(spdlog::level::trace, "kv_events_sent").Uint("seq", seq).Uint("events", batch.size());
    }
    lock.lock();
    if (ok) ++sent_;
  }
}

}  // namespace kvshade::service
