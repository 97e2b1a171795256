#include "shm/plan_ring.hpp"

#include <algorithm>
#include <new>

namespace afore::shm {

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

RingLayout::RingLayout(uint32_t f, uint32_t n, uint32_t cap) : readers(f), slots(n), capacity(cap) {
  readers_offset = sizeof(SegmentHeader) + sizeof(RingHeader);
  slots_offset = readers_offset + sizeof(ReaderRecord) * size_t(f);
  stamps_size = round_up(sizeof(uint64_t) * size_t(f), kCacheLine);
  slot_size = round_up(sizeof(SlotHead) + stamps_size + size_t(cap), kCacheLine);
  total = slots_offset + slot_size * size_t(n);
}

RingWriter::RingWriter(const std::string& name, uint32_t readers, uint32_t slots, uint32_t capacity,
                       uint64_t liveness_timeout_ns, bool pid_check, uint64_t writer_timeout_ns) {
  require(readers >= 1 && readers <= kMaxReaders, "num_readers: expected in [1, 64], got " + std::to_string(readers));
  require(slots >= 2 && slots <= 4096, "num_slots: expected in [2, 4096], got " + std::to_string(slots));
  require(capacity >= 1 && capacity <= (64u << 20), "slot_capacity: expected in [1, 64 MiB], got " + std::to_string(capacity));
  require(liveness_timeout_ns >= 1000000, "liveness_timeout: expected >= 1 ms");
  layout_ = RingLayout(readers, slots, capacity);
  seg_.create(name, layout_.total, SegmentKind::kPlanRing);
  hdr_ = new (seg_.base() + sizeof(SegmentHeader)) RingHeader;
  hdr_->num_readers = readers;
  hdr_->num_slots = slots;
  hdr_->slot_capacity = capacity;
  hdr_->pid_check = pid_check ? 1 : 0;
  hdr_->slot_size = layout_.slot_size;
  hdr_->liveness_timeout_ns = liveness_timeout_ns;
  hdr_->writer_pid = int32_t(getpid());
  hdr_->writer_timeout_ns = writer_timeout_ns;
  hdr_->last_seq.store(-1);
  hdr_->writer_heartbeat_ns.store(monotonic_ns());
  for (uint32_t r = 0; r < readers; ++r) new (reader(r)) ReaderRecord;
  seg_.publish_ready();
}

void RingWriter::heartbeat() {
  require(hdr_ != nullptr, "plan ring: closed");
  hdr_->writer_heartbeat_ns.store(monotonic_ns(), std::memory_order_relaxed);
}

void RingWriter::close() {
  if (!hdr_) return;
  seg_.close_and_unlink();
  seg_.unmap();
  hdr_ = nullptr;
}

uint32_t RingWriter::live_readers() const {
  uint32_t n = 0;
  for (uint32_t r = 0; r < layout_.readers; ++r)
    n += reader(r)->state.load(std::memory_order_acquire) == kLive;
  return n;
}

// True when every live reader has acknowledged entry `index - slots`; evicts readers that are
// dead or silent beyond the liveness timeout while they hold the slot.
bool RingWriter::slot_free(uint64_t index, uint64_t now) {
  if (index < layout_.slots) return true;
  uint64_t need = index - layout_.slots + 1;
  bool free = true;
  for (uint32_t r = 0; r < layout_.readers; ++r) {
    ReaderRecord* rec = reader(r);
    if (rec->state.load(std::memory_order_acquire) != kLive) continue;
    if (rec->next_index.load(std::memory_order_acquire) >= need) continue;
    int32_t pid = rec->pid.load(std::memory_order_relaxed);
    uint64_t hb = rec->heartbeat_ns.load(std::memory_order_relaxed);
    bool dead = (hdr_->pid_check && !pid_alive(pid)) || (now > hb && now - hb > hdr_->liveness_timeout_ns);
    uint32_t live = kLive;
    if (dead && rec->state.compare_exchange_strong(live, kEvicted, std::memory_order_acq_rel)) {
      hdr_->evictions.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    free = false;
  }
  return free;
}

void RingWriter::collect_until(uint64_t limit, bool force) {
  for (; collected_ < limit; ++collected_) {
    uint32_t live = 0, done = 0;
    for (uint32_t r = 0; r < layout_.readers; ++r) {
      ReaderRecord* rec = reader(r);
      if (rec->state.load(std::memory_order_acquire) != kLive) continue;
      ++live;
      done += rec->next_index.load(std::memory_order_acquire) > collected_;
    }
    if (done < live && !force) return;
    SlotHead* s = slot(collected_);
    CopyLatency lat{s->seq, s->publish_ns, 0, 0, live};
    auto* st = stamps(s);
    for (uint32_t r = 0; r < layout_.readers; ++r) {
      uint64_t t = st[r].load(std::memory_order_relaxed);
      if (t) {
        lat.all_copied_ns = std::max(lat.all_copied_ns, t);
        ++lat.readers_copied;
      }
    }
    latencies_.push_back(lat);
    if (latencies_.size() > 65536) latencies_.erase(latencies_.begin(), latencies_.begin() + 32768);
  }
}

std::vector<CopyLatency> RingWriter::collect() {
  require(hdr_ != nullptr, "plan ring: closed");
  collect_until(hdr_->write_index.load(std::memory_order_relaxed), false);
  std::vector<CopyLatency> out;
  out.swap(latencies_);
  return out;
}

int64_t RingWriter::publish(int64_t seq, int64_t step, int32_t layer, int32_t microbatch, const uint8_t* data,
                            size_t length, uint64_t timeout_ns) {
  require(hdr_ != nullptr, "plan ring: closed");
  require(length <= layout_.capacity, "payload: expected at most " + std::to_string(layout_.capacity) +
                                          " bytes (slot capacity), got " + std::to_string(length));
  int64_t last = hdr_->last_seq.load(std::memory_order_relaxed);
  require(seq > last, "seq: expected > " + std::to_string(last) + " (each plan is published once, in order), got " +
                          std::to_string(seq));
  uint64_t index = hdr_->write_index.load(std::memory_order_relaxed);
  uint64_t start = monotonic_ns();
  hdr_->writer_heartbeat_ns.store(start, std::memory_order_relaxed);
  if (!slot_free(index, start)) {
    Backoff backoff(20000);
    for (;;) {
      backoff.pause();
      uint64_t now = monotonic_ns();
      hdr_->writer_heartbeat_ns.store(now, std::memory_order_relaxed);  // waiting on a reader is not dead
      if (slot_free(index, now)) break;
      if (now - start >= timeout_ns) {
        hdr_->publish_timeouts.fetch_add(1, std::memory_order_relaxed);
        return -1;
      }
    }
    hdr_->wait_ns_total.fetch_add(monotonic_ns() - start, std::memory_order_relaxed);
  }
  if (index >= layout_.slots) collect_until(index - layout_.slots + 1, true);

  SlotHead* s = slot(index);
  s->commit.store(2 * index + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);  // odd commit visible before any payload store
  store_relaxed(s->seq, seq);
  store_relaxed(s->step, step);
  store_relaxed(s->layer, layer);
  store_relaxed(s->microbatch, microbatch);
  store_relaxed(s->length, uint32_t(length));
  auto* st = stamps(s);
  for (uint32_t r = 0; r < layout_.readers; ++r) st[r].store(0, std::memory_order_relaxed);
  copy_to_shared(payload(s), data, length);
  store_relaxed(s->publish_ns, monotonic_ns());
  s->commit.store(2 * index + 2, std::memory_order_release);
  hdr_->write_index.store(index + 1, std::memory_order_release);
  futex_wake(low_word(hdr_->write_index));  // readers sleeping in wait_read
  hdr_->last_seq.store(seq, std::memory_order_relaxed);
  hdr_->published.fetch_add(1, std::memory_order_relaxed);
  return int64_t(index);
}

RingReader::RingReader(const std::string& name, uint32_t reader_id) : id_(reader_id) {
  seg_.attach(name, SegmentKind::kPlanRing, true);
  hdr_ = reinterpret_cast<RingHeader*>(seg_.base() + sizeof(SegmentHeader));
  layout_ = RingLayout(hdr_->num_readers, hdr_->num_slots, hdr_->slot_capacity);
  require(layout_.total == seg_.size(), "segment " + name + ": layout does not match its size");
  require(reader_id < hdr_->num_readers,
          "reader_id: expected in [0, " + std::to_string(hdr_->num_readers) + "), got " + std::to_string(reader_id));
  rec_ = reader(reader_id);
  // Claim the record by compare-and-swap, so two processes attaching as one id cannot both win.
  int32_t me = int32_t(getpid());
  int32_t holder = rec_->pid.load(std::memory_order_acquire);
  if (holder != me) {
    if (rec_->state.load(std::memory_order_acquire) == kLive && pid_alive(holder)) {
      rec_ = nullptr;
      throw std::invalid_argument("reader_id: " + std::to_string(reader_id) + " is held by live pid " + std::to_string(holder));
    }
    if (!rec_->pid.compare_exchange_strong(holder, me, std::memory_order_acq_rel)) {
      rec_ = nullptr;
      throw std::invalid_argument("reader_id: " + std::to_string(reader_id) + " was claimed concurrently by pid " +
                                  std::to_string(holder));
    }
  }
  resync();
}

// (Re)join at the newest entry: what was published before cannot be relied on any more.
void RingReader::resync() {
  rec_->heartbeat_ns.store(monotonic_ns(), std::memory_order_relaxed);
  cursor_ = hdr_->write_index.load(std::memory_order_acquire);
  rec_->next_index.store(cursor_, std::memory_order_release);
  rec_->state.store(kLive, std::memory_order_release);
}

void RingReader::detach() {
  if (!rec_) return;
  if (rec_->pid.load(std::memory_order_relaxed) == int32_t(getpid()))
    rec_->state.store(kDetached, std::memory_order_release);
  rec_ = nullptr;
  seg_.unmap();
}

bool RingReader::writer_alive(uint64_t now) const {
  if (hdr_->pid_check && !pid_alive(hdr_->writer_pid)) return false;
  uint64_t limit = hdr_->writer_timeout_ns;
  if (limit == 0) return true;
  uint64_t beat = hdr_->writer_heartbeat_ns.load(std::memory_order_relaxed);
  return now <= beat || now - beat <= limit;
}

RingReader::Result RingReader::read(int64_t want) {
  require(rec_ != nullptr, "plan ring reader: detached");
  Result res{kNotYet, -1, 0, 0, 0, {}, 0};
  uint64_t now = monotonic_ns();
  rec_->heartbeat_ns.store(now, std::memory_order_relaxed);
  if (rec_->state.load(std::memory_order_acquire) != kLive) {
    rec_->evicted.fetch_add(1, std::memory_order_relaxed);
    resync();
  }
  for (;;) {
    uint64_t published = hdr_->write_index.load(std::memory_order_acquire);
    if (cursor_ >= published) {
      if (seg_.header()->state.load(std::memory_order_acquire) == kClosed) {
        res.status = kRingClosed;
      } else if (!writer_alive(now)) {
        res.status = kWriterDead;
        rec_->writer_dead.fetch_add(1, std::memory_order_relaxed);
      }
      return res;
    }
    SlotHead* s = slot(cursor_);
    uint64_t c1 = s->commit.load(std::memory_order_acquire);
    if (c1 != 2 * cursor_ + 2) {
      // Overwritten under us: we were evicted and lapped. Rejoin at the newest entry.
      rec_->torn.fetch_add(1, std::memory_order_relaxed);
      resync();
      continue;
    }
    int64_t seq = load_relaxed(s->seq);
    if (seq > want) {
      // Only a seq read under an unchanged commit is evidence that `want` was skipped.
      std::atomic_thread_fence(std::memory_order_acquire);
      if (s->commit.load(std::memory_order_relaxed) != c1) continue;  // overwritten: the next pass resyncs
      res.status = kMissed;
      res.seq = seq;
      rec_->missed.fetch_add(1, std::memory_order_relaxed);
      return res;
    }
    if (seq < want) {  // stale plan (a target this reader skipped): acknowledge without copying
      std::atomic_thread_fence(std::memory_order_acquire);
      if (s->commit.load(std::memory_order_relaxed) != c1) continue;  // re-check on the next pass
      rec_->stale_skipped.fetch_add(1, std::memory_order_relaxed);
      ++cursor_;
      rec_->next_index.store(cursor_, std::memory_order_release);
      continue;
    }
    uint32_t length = std::min<uint32_t>(load_relaxed(s->length), layout_.capacity);
    res.step = load_relaxed(s->step);
    res.layer = load_relaxed(s->layer);
    res.microbatch = load_relaxed(s->microbatch);
    res.payload.resize(length);
    copy_from_shared(reinterpret_cast<uint8_t*>(res.payload.data()), payload(s), length);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s->commit.load(std::memory_order_relaxed) != c1) {
      rec_->torn.fetch_add(1, std::memory_order_relaxed);
      resync();
      continue;
    }
    res.status = kFound;
    res.seq = seq;
    res.copied_ns = monotonic_ns();
    stamps(s)[id_].store(res.copied_ns, std::memory_order_relaxed);
    ++cursor_;
    rec_->next_index.store(cursor_, std::memory_order_release);  // ack: the writer may reuse the slot
    rec_->copied.fetch_add(1, std::memory_order_relaxed);
    return res;
  }
}

RingReader::Result RingReader::wait_read(int64_t want, uint64_t timeout_ns, uint64_t spin_ns) {
  uint64_t start = monotonic_ns();
  Backoff backoff(spin_ns, low_word(hdr_->write_index));  // woken by the publish
  for (;;) {
    uint32_t seen = backoff.observe();
    Result r = read(want);  // kWriterDead returns at once: no plan is coming
    uint64_t waited = monotonic_ns() - start;
    if (r.status != kNotYet || waited >= timeout_ns) return r;
    backoff.pause(seen, timeout_ns - waited);
  }
}

}  // namespace afore::shm
