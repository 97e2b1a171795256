// DemandMailbox: A producers (attention workers) -> one consumer (the scheduler).
//
// Layout of the segment: SegmentHeader | MailboxHeader | A x ProducerRing, each ring a
// cache-line-aligned control block followed by `capacity` entries of (tag, stamp, int32[E]).
// Each attention worker id owns one single-producer/single-consumer ring, so the write path is
// lock-free: the producer fills an entry and then publishes it with a release store of `head`;
// the consumer reads `head` with acquire, so it never sees a half-written entry (no torn
// reads), and releases the entry by a release store of `tail`.
//
// Ordering: a producer reports targets in strictly increasing seq (the FFN execution order),
// seq = (step * num_layers + layer) * num_microbatches + microbatch. Hence when target s is
// complete (all A workers reported), every earlier incomplete target can never complete: it is
// counted as a miss and dropped, and complete targets come out in seq order.
//
// Full policy: put() blocks up to its timeout for the consumer to free an entry, then drops the
// report and counts it (`dropped_full`); the target then misses its plan (the FFN side runs
// the primary-only assignment, invariant 5).
//
// Backlog policy: complete targets wait in a queue of at most `max_ready` (the oldest is dropped
// beyond it, `ready_overflow`); with `run_lag` > 0, a complete target is dropped instead of
// handed out once some worker has reported seq + run_lag (`ran_before_plan`): with run_lag =
// num_microbatches that report is the next layer of the same microbatch, which the attention
// worker computes only after the FFN stage of this target returned, so a plan would be late.
#pragma once

#include <deque>
#include <map>
#include <vector>

#include "shm/segment.hpp"

namespace afore::shm {

constexpr uint32_t kMaxProducers = 64;

struct alignas(kCacheLine) MailboxHeader {
  uint32_t num_producers;
  uint32_t num_experts;
  uint32_t num_layers;
  uint32_t num_microbatches;
  uint32_t capacity;  // entries per producer ring
  uint32_t entry_size;
  uint64_t ring_size;
  int32_t consumer_pid;
  uint32_t pad0;
  std::atomic<uint64_t> consumer_heartbeat_ns;
  std::atomic<uint32_t> doorbell;  // bumped by every put (the consumer sleeps on it: a futex word)
  uint32_t pad1;
  // consumer-side counters (written by the consumer only; read by `afore status`)
  alignas(kCacheLine) std::atomic<uint64_t> completed;
  std::atomic<uint64_t> incomplete_skipped;  // a later target completed first: can never complete
  std::atomic<uint64_t> expired;             // incomplete at its deadline
  std::atomic<uint64_t> late;                // report for a target already completed or dropped
  std::atomic<uint64_t> duplicate;           // second report of one worker for one target
  std::atomic<uint64_t> overflow;            // pending targets beyond the bound, oldest dropped
  std::atomic<uint64_t> pending;             // gauge
  std::atomic<uint64_t> rejected_unknown_worker;  // producers: worker id out of range
  std::atomic<uint64_t> ran_before_plan;  // complete, but its FFN stage already ran (see run_lag)
  std::atomic<uint64_t> ready_overflow;   // complete targets beyond max_ready, oldest dropped
};

struct alignas(kCacheLine) ProducerRing {
  std::atomic<uint64_t> head;  // entries published (producer writes)
  alignas(kCacheLine) std::atomic<uint64_t> tail;  // entries consumed (consumer writes)
  alignas(kCacheLine) std::atomic<int32_t> writer_pid;  // process that owns this worker's ring
  uint32_t pad0;
  std::atomic<int64_t> last_seq;  // last accepted seq (-1 = none)
  std::atomic<uint64_t> accepted;
  std::atomic<uint64_t> rejected_invalid;
  std::atomic<uint64_t> rejected_duplicate;
  std::atomic<uint64_t> dropped_full;
};

struct EntryHead {
  int64_t seq;
  int64_t step;
  int32_t layer;
  int32_t microbatch;
  uint64_t written_ns;  // CLOCK_MONOTONIC when the producer published it
};

struct MailboxLayout {
  uint32_t producers, experts, layers, microbatches, capacity;
  size_t entry_size, ring_size, rings_offset, total;
  MailboxLayout(uint32_t a, uint32_t e, uint32_t l, uint32_t m, uint32_t cap);
};

// The scheduler side: creates and owns the segment, aggregates complete targets.
class MailboxConsumer {
 public:
  struct Complete {
    int64_t seq, step;
    int32_t layer, microbatch;
    std::vector<int64_t> demand;
    uint64_t last_written_ns, complete_ns;
  };
  struct Missed {
    int64_t seq, step;
    int32_t layer, microbatch;
    uint32_t reported;  // workers that reported
    const char* reason;
  };

  MailboxConsumer(const std::string& name, uint32_t producers, uint32_t experts, uint32_t layers,
                  uint32_t microbatches, uint32_t capacity, uint64_t deadline_ns, uint32_t max_pending,
                  uint32_t max_ready = 64, uint32_t run_lag = 0);
  ~MailboxConsumer() { close(); }

  // Next complete target in seq order, or false on timeout.
  bool wait_complete(uint64_t timeout_ns, uint64_t spin_ns, Complete& out);
  std::vector<Missed> take_missed();
  void close();
  const std::string& name() const { return seg_.name(); }
  MailboxHeader* header() const { return hdr_; }
  ProducerRing* ring(uint32_t w) const;

 private:
  struct Pending {
    int64_t step;
    int32_t layer, microbatch;
    uint64_t mask = 0;
    uint32_t count = 0;
    uint64_t first_ns = 0, last_written_ns = 0;
    std::vector<int64_t> sum;
  };
  void drain();
  void accept(const EntryHead& h, const int32_t* counts, uint32_t worker);
  void expire(uint64_t now);
  void miss(std::map<int64_t, Pending>::iterator it, const char* reason);

  Segment seg_;
  MailboxHeader* hdr_ = nullptr;
  MailboxLayout layout_;
  uint64_t deadline_ns_;
  uint32_t max_pending_;
  uint32_t max_ready_;
  uint32_t run_lag_;
  int64_t last_emitted_ = -1;
  int64_t newest_reported_ = -1;  // largest seq any producer has reported
  std::map<int64_t, Pending> pending_;
  std::deque<Complete> ready_;
  std::vector<Missed> missed_;
};

// An attention worker's (or the demand receiver's) handle.
class MailboxProducer {
 public:
  explicit MailboxProducer(const std::string& name);
  // Returns true when accepted, false when dropped because the ring stayed full for timeout_ns.
  // Throws std::invalid_argument (ValueError) on bad input; nothing else is lost.
  bool put(int64_t step, int32_t layer, int32_t microbatch, int32_t worker, const int32_t* counts,
           size_t length, uint64_t timeout_ns);
  bool replaced() const { return seg_.replaced(); }
  MailboxHeader* header() const { return hdr_; }
  ProducerRing* ring(uint32_t w) const;
  uint64_t instance() const { return seg_.header()->instance; }

 private:
  Segment seg_;
  MailboxHeader* hdr_ = nullptr;
  MailboxLayout layout_{1, 1, 1, 1, 1};
};

}  // namespace afore::shm
