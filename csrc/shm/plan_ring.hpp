// PlanRing: one writer (the scheduler) -> F readers (FFN workers), N slots of opaque bytes.
//
// Layout: SegmentHeader | RingHeader | F x ReaderRecord | N x Slot, where a Slot is a
// cache-line SlotHead, F copy stamps and `slot_capacity` payload bytes.
//
// Entry i (the i-th published plan) lives in slot i % N. It is written only after every live
// reader has acknowledged entry i - N (ReaderRecord::next_index > i - N), so live readers never
// race the writer (invariant 4). A reader that is dead (pid gone) or silent for longer than the
// liveness timeout is evicted while the writer waits for it, so it blocks the writer at most that
// long. The slot is also a seqlock (commit = 2i+1 while writing entry i, 2i+2 once published),
// so an evicted reader that wakes up mid-copy detects the overwrite instead of returning a torn
// entry; the payload's own checksum (plan codec) is a second line of defence.
//
// The writer can die too (invariant 5): a reader that finds nothing new checks the writer's
// pid (with pid_check) and its heartbeat (when the writer set a writer timeout and calls
// heartbeat() while idle), and returns kWriterDead at once instead of waiting out its timeout,
// so a dead scheduler costs the FFN workers one syscall per target, not a plan timeout.
#pragma once

#include <string>
#include <vector>

#include "shm/segment.hpp"

namespace afore::shm {

constexpr uint32_t kMaxReaders = 64;

enum ReaderState : uint32_t { kDetached = 0, kLive = 1, kEvicted = 2 };
enum ReadStatus : int { kFound = 0, kNotYet = 1, kMissed = 2, kRingClosed = 3, kWriterDead = 4 };

struct alignas(kCacheLine) RingHeader {
  uint32_t num_readers;
  uint32_t num_slots;
  uint32_t slot_capacity;  // payload bytes per slot
  uint32_t pid_check;
  uint64_t slot_size;
  uint64_t liveness_timeout_ns;
  int32_t writer_pid;
  uint32_t pad0;
  uint64_t writer_timeout_ns;  // readers call the writer dead after this long without a heartbeat (0 = pid only)
  alignas(kCacheLine) std::atomic<uint64_t> write_index;  // entries published
  alignas(kCacheLine) std::atomic<uint64_t> writer_heartbeat_ns;
  std::atomic<int64_t> last_seq;
  std::atomic<uint64_t> published;
  std::atomic<uint64_t> evictions;
  std::atomic<uint64_t> publish_timeouts;
  std::atomic<uint64_t> wait_ns_total;  // time the writer spent waiting for readers
};

struct alignas(kCacheLine) ReaderRecord {
  std::atomic<uint32_t> state;
  std::atomic<int32_t> pid;
  std::atomic<uint64_t> heartbeat_ns;
  std::atomic<uint64_t> next_index;  // acknowledged: entries before this one are done
  std::atomic<uint64_t> copied;
  std::atomic<uint64_t> stale_skipped;
  std::atomic<uint64_t> missed;
  std::atomic<uint64_t> torn;
  std::atomic<uint64_t> rejected;  // by the decoder (checksum, version, target mismatch)
  std::atomic<uint64_t> evicted;   // times this reader found itself evicted
  std::atomic<uint64_t> writer_dead;  // reads that found nothing new and the writer dead
};

struct alignas(kCacheLine) SlotHead {
  std::atomic<uint64_t> commit;
  int64_t seq;
  int64_t step;
  int32_t layer;
  int32_t microbatch;
  uint32_t length;
  uint32_t pad0;
  uint64_t publish_ns;
};

struct RingLayout {
  uint32_t readers, slots, capacity;
  size_t readers_offset, slots_offset, stamps_size, slot_size, total;
  RingLayout(uint32_t f, uint32_t n, uint32_t cap);
};

struct CopyLatency {
  int64_t seq;
  uint64_t publish_ns;
  uint64_t all_copied_ns;  // latest copy stamp among the readers that copied it (0 if none)
  uint32_t readers_copied;
  uint32_t readers_live;
};

class RingBase {
 public:
  RingHeader* header() const { return hdr_; }
  ReaderRecord* reader(uint32_t r) const {
    return reinterpret_cast<ReaderRecord*>(seg_.base() + layout_.readers_offset) + r;
  }
  SlotHead* slot(uint64_t index) const {
    return reinterpret_cast<SlotHead*>(seg_.base() + layout_.slots_offset + layout_.slot_size * (index % layout_.slots));
  }
  std::atomic<uint64_t>* stamps(SlotHead* s) const { return reinterpret_cast<std::atomic<uint64_t>*>(s + 1); }
  uint8_t* payload(SlotHead* s) const { return reinterpret_cast<uint8_t*>(s + 1) + layout_.stamps_size; }
  const RingLayout& layout() const { return layout_; }
  bool replaced() const { return seg_.replaced(); }

 protected:
  Segment seg_;
  RingHeader* hdr_ = nullptr;
  RingLayout layout_{1, 1, 1};
};

class RingWriter : public RingBase {
 public:
  RingWriter(const std::string& name, uint32_t readers, uint32_t slots, uint32_t capacity,
             uint64_t liveness_timeout_ns, bool pid_check, uint64_t writer_timeout_ns = 0);
  // Tell the readers the writer is alive while it has nothing to publish.
  void heartbeat();
  ~RingWriter() { close(); }
  // Publish one entry; returns its index, or -1 if live readers still held the slot after
  // timeout_ns (only possible with timeout_ns below the liveness timeout).
  int64_t publish(int64_t seq, int64_t step, int32_t layer, int32_t microbatch, const uint8_t* data, size_t length,
                  uint64_t timeout_ns);
  // Copy latencies of entries acknowledged by every live reader since the last call.
  std::vector<CopyLatency> collect();
  uint32_t live_readers() const;
  void close();

 private:
  bool slot_free(uint64_t index, uint64_t now);
  void collect_until(uint64_t limit, bool force);
  uint64_t collected_ = 0;
  std::vector<CopyLatency> latencies_;
};

class RingReader : public RingBase {
 public:
  RingReader(const std::string& name, uint32_t reader_id);
  ~RingReader() { detach(); }
  struct Result {
    int status;
    int64_t seq;
    int64_t step;
    int32_t layer, microbatch;
    std::string payload;
    uint64_t copied_ns;
  };
  // Entry with plan seq `want`: kFound (payload filled), kNotYet, kMissed (a later seq was
  // published, so `want` never will be), kRingClosed (the writer closed the ring), kWriterDead
  // (nothing new and the writer's process is gone or its heartbeat is older than its timeout).
  Result read(int64_t want);
  Result wait_read(int64_t want, uint64_t timeout_ns, uint64_t spin_ns);
  void note_rejected() { rec_->rejected.fetch_add(1, std::memory_order_relaxed); }
  bool writer_alive(uint64_t now) const;
  void detach();
  uint32_t reader_id() const { return id_; }

 private:
  void resync();
  uint32_t id_;
  ReaderRecord* rec_ = nullptr;
  uint64_t cursor_ = 0;
};

}  // namespace afore::shm
