#include "shm/mailbox.hpp"

#include <new>

namespace afore::shm {

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

MailboxLayout::MailboxLayout(uint32_t a, uint32_t e, uint32_t l, uint32_t m, uint32_t cap)
    : producers(a), experts(e), layers(l), microbatches(m), capacity(cap) {
  entry_size = round_up(sizeof(EntryHead) + sizeof(int32_t) * size_t(e), kCacheLine);
  ring_size = sizeof(ProducerRing) + entry_size * size_t(cap);
  rings_offset = sizeof(SegmentHeader) + sizeof(MailboxHeader);
  total = rings_offset + ring_size * size_t(a);
}

static void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

static EntryHead* entry_at(ProducerRing* ring, const MailboxLayout& lay, uint64_t index) {
  auto* first = reinterpret_cast<uint8_t*>(ring) + sizeof(ProducerRing);
  return reinterpret_cast<EntryHead*>(first + lay.entry_size * (index % lay.capacity));
}

MailboxConsumer::MailboxConsumer(const std::string& name, uint32_t producers, uint32_t experts,
                                 uint32_t layers, uint32_t microbatches, uint32_t capacity,
                                 uint64_t deadline_ns, uint32_t max_pending, uint32_t max_ready, uint32_t run_lag)
    : layout_(producers, experts, layers, microbatches, capacity),
      deadline_ns_(deadline_ns),
      max_pending_(max_pending),
      max_ready_(max_ready),
      run_lag_(run_lag) {
  require(producers >= 1 && producers <= kMaxProducers,
          "num_producers: expected in [1, 64], got " + std::to_string(producers));
  require(experts >= 1, "num_experts: expected >= 1");
  require(layers >= 1, "num_layers: expected >= 1");
  require(microbatches >= 1, "num_microbatches: expected >= 1");
  require(capacity >= 1 && capacity <= (1u << 20), "capacity: expected in [1, 1048576], got " + std::to_string(capacity));
  require(max_pending >= 1, "max_pending: expected >= 1");
  require(max_ready >= 1, "max_ready: expected >= 1");
  seg_.create(name, layout_.total, SegmentKind::kMailbox);
  hdr_ = new (seg_.base() + sizeof(SegmentHeader)) MailboxHeader;
  hdr_->num_producers = producers;
  hdr_->num_experts = experts;
  hdr_->num_layers = layers;
  hdr_->num_microbatches = microbatches;
  hdr_->capacity = capacity;
  hdr_->entry_size = uint32_t(layout_.entry_size);
  hdr_->ring_size = layout_.ring_size;
  hdr_->consumer_pid = int32_t(getpid());
  hdr_->consumer_heartbeat_ns.store(monotonic_ns());
  for (uint32_t w = 0; w < producers; ++w) {
    auto* r = new (seg_.base() + layout_.rings_offset + layout_.ring_size * w) ProducerRing;
    r->last_seq.store(-1);
  }
  seg_.publish_ready();
}

ProducerRing* MailboxConsumer::ring(uint32_t w) const {
  return reinterpret_cast<ProducerRing*>(seg_.base() + layout_.rings_offset + layout_.ring_size * w);
}

void MailboxConsumer::close() {
  if (!hdr_) return;
  seg_.close_and_unlink();
  seg_.unmap();
  hdr_ = nullptr;
}

void MailboxConsumer::miss(std::map<int64_t, Pending>::iterator it, const char* reason) {
  missed_.push_back({it->first, it->second.step, it->second.layer, it->second.microbatch, it->second.count, reason});
  if (missed_.size() > 65536) missed_.erase(missed_.begin(), missed_.begin() + 32768);  // bounded log
  pending_.erase(it);
}

void MailboxConsumer::accept(const EntryHead& h, const int32_t* counts, uint32_t worker) {
  if (h.seq > newest_reported_) newest_reported_ = h.seq;
  if (h.seq <= last_emitted_) {
    hdr_->late.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  auto it = pending_.find(h.seq);
  if (it == pending_.end()) {
    if (pending_.size() >= max_pending_) {
      miss(pending_.begin(), "overflow");
      hdr_->overflow.fetch_add(1, std::memory_order_relaxed);
    }
    Pending p;
    p.step = h.step;
    p.layer = h.layer;
    p.microbatch = h.microbatch;
    p.first_ns = monotonic_ns();
    p.sum.assign(layout_.experts, 0);
    it = pending_.emplace(h.seq, std::move(p)).first;
  }
  Pending& p = it->second;
  uint64_t bit = 1ULL << worker;
  if (p.mask & bit) {
    hdr_->duplicate.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  p.mask |= bit;
  p.count += 1;
  if (h.written_ns > p.last_written_ns) p.last_written_ns = h.written_ns;
  int64_t* sum = p.sum.data();
  for (uint32_t e = 0; e < layout_.experts; ++e) sum[e] += counts[e];
  if (p.count < layout_.producers) return;
  // Complete: every producer has moved past all earlier seqs, so those can never complete.
  while (pending_.begin()->first < h.seq) {
    miss(pending_.begin(), "incomplete");
    hdr_->incomplete_skipped.fetch_add(1, std::memory_order_relaxed);
  }
  if (ready_.size() >= max_ready_) {
    ready_.pop_front();
    hdr_->ready_overflow.fetch_add(1, std::memory_order_relaxed);
  }
  ready_.push_back({h.seq, p.step, p.layer, p.microbatch, std::move(p.sum), p.last_written_ns, monotonic_ns()});
  pending_.erase(it);
  last_emitted_ = h.seq;
  hdr_->completed.fetch_add(1, std::memory_order_relaxed);
}

void MailboxConsumer::drain() {
  for (uint32_t w = 0; w < layout_.producers; ++w) {
    ProducerRing* r = ring(w);
    uint64_t tail = r->tail.load(std::memory_order_relaxed);
    uint64_t head = r->head.load(std::memory_order_acquire);
    if (tail == head) continue;
    for (; tail < head; ++tail) {
      EntryHead* e = entry_at(r, layout_, tail);
      accept(*e, reinterpret_cast<const int32_t*>(e + 1), w);
    }
    r->tail.store(tail, std::memory_order_release);
  }
  hdr_->pending.store(pending_.size(), std::memory_order_relaxed);
}

void MailboxConsumer::expire(uint64_t now) {
  if (deadline_ns_ == 0) return;
  while (!pending_.empty() && now - pending_.begin()->second.first_ns > deadline_ns_) {
    // Expiring the oldest also retires its seq: a late report for it is rejected.
    int64_t seq = pending_.begin()->first;
    miss(pending_.begin(), "deadline");
    hdr_->expired.fetch_add(1, std::memory_order_relaxed);
    if (seq > last_emitted_) last_emitted_ = seq;
  }
}

bool MailboxConsumer::wait_complete(uint64_t timeout_ns, uint64_t spin_ns, Complete& out) {
  require(hdr_ != nullptr, "mailbox: closed");
  uint64_t start = monotonic_ns();
  Backoff backoff(spin_ns, reinterpret_cast<const uint32_t*>(&hdr_->doorbell));  // woken by every put
  for (;;) {
    uint32_t seen = backoff.observe();
    drain();
    uint64_t now = monotonic_ns();
    hdr_->consumer_heartbeat_ns.store(now, std::memory_order_relaxed);
    while (!ready_.empty() && run_lag_ > 0 && ready_.front().seq + int64_t(run_lag_) <= newest_reported_) {
      ready_.pop_front();
      hdr_->ran_before_plan.fetch_add(1, std::memory_order_relaxed);
    }
    if (!ready_.empty()) {
      out = std::move(ready_.front());
      ready_.pop_front();
      return true;
    }
    expire(now);
    if (now - start >= timeout_ns) return false;
    backoff.pause(seen, timeout_ns - (now - start));
  }
}

std::vector<MailboxConsumer::Missed> MailboxConsumer::take_missed() {
  std::vector<Missed> out;
  out.swap(missed_);
  return out;
}

MailboxProducer::MailboxProducer(const std::string& name) {
  seg_.attach(name, SegmentKind::kMailbox, true);
  hdr_ = reinterpret_cast<MailboxHeader*>(seg_.base() + sizeof(SegmentHeader));
  layout_ = MailboxLayout(hdr_->num_producers, hdr_->num_experts, hdr_->num_layers, hdr_->num_microbatches,
                          hdr_->capacity);
  require(layout_.total == seg_.size(), "segment " + name + ": layout does not match its size");
}

ProducerRing* MailboxProducer::ring(uint32_t w) const {
  return reinterpret_cast<ProducerRing*>(seg_.base() + layout_.rings_offset + layout_.ring_size * w);
}

bool MailboxProducer::put(int64_t step, int32_t layer, int32_t microbatch, int32_t worker, const int32_t* counts,
                          size_t length, uint64_t timeout_ns) {
  if (worker < 0 || uint32_t(worker) >= layout_.producers) {
    hdr_->rejected_unknown_worker.fetch_add(1, std::memory_order_relaxed);
    throw std::invalid_argument("worker: expected in [0, " + std::to_string(layout_.producers) + "), got " +
                                std::to_string(worker));
  }
  ProducerRing* r = ring(uint32_t(worker));
  auto reject = [&](const std::string& msg) {
    r->rejected_invalid.fetch_add(1, std::memory_order_relaxed);
    throw std::invalid_argument(msg);
  };
  if (layer < 0 || uint32_t(layer) >= layout_.layers)
    reject("layer: expected in [0, " + std::to_string(layout_.layers) + "), got " + std::to_string(layer));
  if (microbatch < 0 || uint32_t(microbatch) >= layout_.microbatches)
    reject("microbatch: expected in [0, " + std::to_string(layout_.microbatches) + "), got " + std::to_string(microbatch));
  if (step < 0 || step > (int64_t(1) << 40)) reject("step: expected in [0, 2**40], got " + std::to_string(step));
  if (length != layout_.experts)
    reject("counts: expected a vector of length " + std::to_string(layout_.experts) + " (num_experts), got " +
           std::to_string(length));
  for (size_t e = 0; e < length; ++e)
    if (counts[e] < 0) reject("counts: expected non-negative counts, got " + std::to_string(counts[e]) + " at expert " + std::to_string(e));

  // One process per worker id (single producer per ring): claim it, or take over from a dead one.
  int32_t me = int32_t(getpid());
  int32_t holder = r->writer_pid.load(std::memory_order_acquire);
  if (holder != me) {
    if (holder != 0 && pid_alive(holder))
      reject("worker: ring of worker " + std::to_string(worker) + " is owned by live pid " + std::to_string(holder));
    if (!r->writer_pid.compare_exchange_strong(holder, me, std::memory_order_acq_rel))
      reject("worker: ring of worker " + std::to_string(worker) + " was claimed concurrently by pid " + std::to_string(holder));
  }

  int64_t seq = (step * int64_t(layout_.layers) + layer) * int64_t(layout_.microbatches) + microbatch;
  int64_t last = r->last_seq.load(std::memory_order_relaxed);
  if (seq <= last) {
    r->rejected_duplicate.fetch_add(1, std::memory_order_relaxed);
    throw std::invalid_argument("target: duplicate or out-of-order report from worker " + std::to_string(worker) +
                                " (seq " + std::to_string(seq) + " after seq " + std::to_string(last) + ")");
  }

  // The scheduler closed this segment, or stopped polling it and a successor replaced it (crash
  // and restart): report "not accepted" so that the caller re-attaches. The stat() behind
  // replaced() only runs while the consumer's heartbeat is older than a second.
  if (seg_.header()->state.load(std::memory_order_acquire) != kReady) return false;
  uint64_t now = monotonic_ns();
  uint64_t beat = hdr_->consumer_heartbeat_ns.load(std::memory_order_relaxed);
  if (now > beat + 1000000000ULL && seg_.replaced()) return false;
  uint64_t head = r->head.load(std::memory_order_relaxed);
  if (head - r->tail.load(std::memory_order_acquire) >= layout_.capacity) {
    // A consumer silent for a second is not coming back soon: drop at once rather than stall
    // the attention worker on every report (serving must not depend on the scheduler).
    if (now > beat + 1000000000ULL) {
      r->dropped_full.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    uint64_t start = monotonic_ns();
    Backoff backoff(std::min<uint64_t>(timeout_ns, 50000));
    while (head - r->tail.load(std::memory_order_acquire) >= layout_.capacity) {
      if (monotonic_ns() - start >= timeout_ns || seg_.header()->state.load(std::memory_order_acquire) == kClosed) {
        r->dropped_full.fetch_add(1, std::memory_order_relaxed);
        return false;
      }
      backoff.pause();
    }
  }
  EntryHead* e = entry_at(r, layout_, head);
  e->seq = seq;
  e->step = step;
  e->layer = layer;
  e->microbatch = microbatch;
  std::memcpy(e + 1, counts, sizeof(int32_t) * length);
  e->written_ns = monotonic_ns();
  r->head.store(head + 1, std::memory_order_release);  // publish: payload visible before head
  r->last_seq.store(seq, std::memory_order_relaxed);
  r->accepted.fetch_add(1, std::memory_order_relaxed);
  hdr_->doorbell.fetch_add(1, std::memory_order_release);  // wake the consumer sleeping in wait_complete
  futex_wake(reinterpret_cast<const uint32_t*>(&hdr_->doorbell));
  return true;
}

}  // namespace afore::shm
