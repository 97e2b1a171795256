// nanobind bindings: afore._shm. Waiting calls release the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "shm/mailbox.hpp"
#include "shm/plan_ring.hpp"

namespace nb = nanobind;
using namespace nb::literals;
using namespace afore::shm;

namespace afore::shm {
void bind_dataplane(nb::module_& m);  // dataplane.cpp: the shm transport's hot path
}

namespace {

nb::ndarray<nb::numpy, int64_t, nb::ndim<1>> to_numpy(std::vector<int64_t>&& v) {
  auto* heap = new std::vector<int64_t>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<int64_t>*>(p); });
  return nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>(heap->data(), {heap->size()}, owner);
}

uint64_t seconds_to_ns(double s, const char* field) {
  if (!(s >= 0) || s > 1e6) throw std::invalid_argument(std::string(field) + ": expected seconds in [0, 1e6], got " + std::to_string(s));
  return uint64_t(s * 1e9);
}

nb::dict segment_dict(const SegmentHeader* h, const std::string& name) {
  nb::dict d;
  d["name"] = name;
  d["version"] = h->version;
  d["kind"] = h->kind == uint32_t(SegmentKind::kMailbox) ? "mailbox" : h->kind == uint32_t(SegmentKind::kPlanRing) ? "plan_ring" : "unknown";
  uint32_t st = h->state.load(std::memory_order_acquire);
  d["state"] = st == kReady ? "ready" : st == kClosed ? "closed" : "initializing";
  d["owner_pid"] = h->owner_pid;
  d["owner_alive"] = pid_alive(h->owner_pid);
  d["size_bytes"] = h->total_size;
  d["created_unix_ns"] = h->created_unix_ns;
  return d;
}

// Read-only view of any afore segment, for `afore status`. Never registers as a reader.
nb::dict inspect(const std::string& name) {
  check_name(name);
  std::string slash = "/" + name;
  int fd = shm_open(slash.c_str(), O_RDONLY, 0);
  if (fd < 0) throw std::invalid_argument("segment " + name + ": cannot open (" + std::strerror(errno) + ")");
  struct stat st;
  if (fstat(fd, &st) != 0 || size_t(st.st_size) < sizeof(SegmentHeader)) {
    close(fd);
    throw std::invalid_argument("segment " + name + ": not an afore segment (too small)");
  }
  size_t size = size_t(st.st_size);
  void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) throw std::invalid_argument("segment " + name + ": cannot map");
  struct Unmap {
    void* p;
    size_t n;
    ~Unmap() { munmap(p, n); }
  } guard{p, size};
  auto* h = static_cast<const SegmentHeader*>(p);
  if (h->magic != kMagic) throw std::invalid_argument("segment " + name + ": not an afore segment (bad magic)");
  nb::dict d = segment_dict(h, name);
  if (h->version != kFormatVersion || h->total_size != size) {
    d["compatible"] = false;
    return d;
  }
  d["compatible"] = true;
  const uint8_t* base = static_cast<const uint8_t*>(p);
  uint64_t now = monotonic_ns();
  if (h->kind == uint32_t(SegmentKind::kMailbox)) {
    auto* m = reinterpret_cast<const MailboxHeader*>(base + sizeof(SegmentHeader));
    MailboxLayout lay(m->num_producers, m->num_experts, m->num_layers, m->num_microbatches, m->capacity);
    if (lay.total != size) {
      d["compatible"] = false;
      return d;
    }
    d["num_producers"] = m->num_producers;
    d["num_experts"] = m->num_experts;
    d["num_layers"] = m->num_layers;
    d["num_microbatches"] = m->num_microbatches;
    d["capacity"] = m->capacity;
    d["consumer_heartbeat_age_s"] = double(now - std::min(now, m->consumer_heartbeat_ns.load())) * 1e-9;
    nb::dict c;
    c["completed"] = m->completed.load();
    c["incomplete_skipped"] = m->incomplete_skipped.load();
    c["expired"] = m->expired.load();
    c["late"] = m->late.load();
    c["duplicate"] = m->duplicate.load();
    c["overflow"] = m->overflow.load();
    c["pending"] = m->pending.load();
    c["rejected_unknown_worker"] = m->rejected_unknown_worker.load();
    c["ran_before_plan"] = m->ran_before_plan.load();
    c["ready_overflow"] = m->ready_overflow.load();
    d["counters"] = c;
    nb::list producers;
    for (uint32_t w = 0; w < m->num_producers; ++w) {
      auto* r = reinterpret_cast<const ProducerRing*>(base + lay.rings_offset + lay.ring_size * w);
      nb::dict pr;
      int32_t pid = r->writer_pid.load();
      pr["worker"] = w;
      pr["pid"] = pid;
      pr["alive"] = pid_alive(pid);
      pr["queued"] = r->head.load() - r->tail.load();
      pr["last_seq"] = r->last_seq.load();
      pr["accepted"] = r->accepted.load();
      pr["rejected_invalid"] = r->rejected_invalid.load();
      pr["rejected_duplicate"] = r->rejected_duplicate.load();
      pr["dropped_full"] = r->dropped_full.load();
      producers.append(pr);
    }
    d["producers"] = producers;
  } else if (h->kind == uint32_t(SegmentKind::kPlanRing)) {
    auto* rh = reinterpret_cast<const RingHeader*>(base + sizeof(SegmentHeader));
    RingLayout lay(rh->num_readers, rh->num_slots, rh->slot_capacity);
    if (lay.total != size) {
      d["compatible"] = false;
      return d;
    }
    uint64_t written = rh->write_index.load();
    d["num_readers"] = rh->num_readers;
    d["num_slots"] = rh->num_slots;
    d["slot_capacity"] = rh->slot_capacity;
    d["liveness_timeout_s"] = double(rh->liveness_timeout_ns) * 1e-9;
    d["writer_heartbeat_age_s"] = double(now - std::min(now, rh->writer_heartbeat_ns.load())) * 1e-9;
    d["writer_pid"] = rh->writer_pid;
    d["writer_alive"] = pid_alive(rh->writer_pid);
    d["writer_timeout_s"] = double(rh->writer_timeout_ns) * 1e-9;
    nb::dict c;
    c["published"] = rh->published.load();
    c["last_seq"] = rh->last_seq.load();
    c["evictions"] = rh->evictions.load();
    c["publish_timeouts"] = rh->publish_timeouts.load();
    c["writer_wait_s"] = double(rh->wait_ns_total.load()) * 1e-9;
    d["counters"] = c;
    nb::list readers;
    for (uint32_t r = 0; r < rh->num_readers; ++r) {
      auto* rec = reinterpret_cast<const ReaderRecord*>(base + lay.readers_offset) + r;
      nb::dict rd;
      uint32_t s = rec->state.load();
      int32_t pid = rec->pid.load();
      uint64_t next = rec->next_index.load();
      rd["reader"] = r;
      rd["state"] = s == kLive ? "live" : s == kEvicted ? "evicted" : "detached";
      rd["pid"] = pid;
      rd["alive"] = s == kLive && pid_alive(pid);
      rd["heartbeat_age_s"] = double(now - std::min(now, rec->heartbeat_ns.load())) * 1e-9;
      rd["lag"] = s == kLive && written > next ? written - next : 0;
      rd["copied"] = rec->copied.load();
      rd["stale_skipped"] = rec->stale_skipped.load();
      rd["missed"] = rec->missed.load();
      rd["torn"] = rec->torn.load();
      rd["rejected"] = rec->rejected.load();
      rd["evicted"] = rec->evicted.load();
      rd["writer_dead"] = rec->writer_dead.load();
      readers.append(rd);
    }
    d["readers"] = readers;
  }
  return d;
}

// as_array: the payload as a writable numpy uint8 array that owns the buffer the ring copied the
// entry into (no second copy); the plan decoder's arrays are views of it.
nb::tuple result_tuple(RingReader::Result&& r, bool as_array = false) {
  nb::object payload = nb::none();
  if (r.status == kFound && as_array) {
    auto* heap = new std::string(std::move(r.payload));
    nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::string*>(p); });
    payload = nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(
        reinterpret_cast<uint8_t*>(heap->data()), {heap->size()}, owner));
  } else if (r.status == kFound) {
    payload = nb::bytes(r.payload.data(), r.payload.size());
  }
  return nb::make_tuple(r.status, r.seq, r.step, r.layer, r.microbatch, payload, r.copied_ns);
}

}  // namespace

NB_MODULE(_shm, m) {
  // Handles owned by daemon threads (demand receiver) may outlive the interpreter's teardown.
  nb::set_leak_warnings(false);
  m.doc() = "afore shared-memory control plane: demand mailbox and plan ring (C++ atomics in /dev/shm)";
  m.attr("FORMAT_VERSION") = kFormatVersion;
  // The Python side's expectations of this build (afore.transport.shm.SHM_ABI): bumped when a
  // binding's signature changes (2: votes carry plan digests; 3: StreamExchange)
  m.attr("ABI") = 3;
  m.attr("MAGIC") = kMagic;
  m.attr("FOUND") = int(kFound);
  m.attr("NOT_YET") = int(kNotYet);
  m.attr("MISSED") = int(kMissed);
  m.attr("CLOSED") = int(kRingClosed);
  m.attr("WRITER_DEAD") = int(kWriterDead);
  m.def("monotonic_ns", &monotonic_ns, "CLOCK_MONOTONIC in ns (the clock of every stamp in shm)");
  m.def("inspect", &inspect, "name"_a);
  bind_dataplane(m);

  nb::class_<MailboxConsumer>(m, "MailboxConsumer")
      .def(nb::init<const std::string&, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint64_t, uint32_t, uint32_t,
                    uint32_t>(),
           "name"_a, "num_producers"_a, "num_experts"_a, "num_layers"_a, "num_microbatches"_a, "capacity"_a,
           "deadline_ns"_a, "max_pending"_a, "max_ready"_a = 64, "run_lag"_a = 0,
           nb::call_guard<nb::gil_scoped_release>())  // create may wait for another process's creation
      .def("wait_complete",
           [](MailboxConsumer& self, double timeout_s, double spin_s) -> nb::object {
             uint64_t timeout = seconds_to_ns(timeout_s, "timeout_s"), spin = seconds_to_ns(spin_s, "spin_s");
             MailboxConsumer::Complete c;
             bool ok;
             {
               nb::gil_scoped_release release;
               ok = self.wait_complete(timeout, spin, c);
             }
             if (!ok) return nb::none();
             return nb::make_tuple(c.seq, c.step, c.layer, c.microbatch, to_numpy(std::move(c.demand)),
                                   c.last_written_ns, c.complete_ns);
           },
           "timeout_s"_a, "spin_s"_a = 0.0)
      .def("take_missed",
           [](MailboxConsumer& self) {
             nb::list out;
             for (auto& m : self.take_missed())
               out.append(nb::make_tuple(m.seq, m.step, m.layer, m.microbatch, m.reported, m.reason));
             return out;
           })
      .def("close", &MailboxConsumer::close)
      .def_prop_ro("name", [](const MailboxConsumer& s) { return s.name().substr(1); });

  nb::class_<MailboxProducer>(m, "MailboxProducer")
      .def(nb::init<const std::string&>(), "name"_a)
      .def("put",
           [](MailboxProducer& self, int64_t step, int32_t layer, int32_t microbatch, int32_t worker,
              nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> counts, double timeout_s) {
             uint64_t timeout = seconds_to_ns(timeout_s, "timeout_s");
             const int32_t* data = counts.data();
             size_t n = counts.shape(0);
             nb::gil_scoped_release release;
             return self.put(step, layer, microbatch, worker, data, n, timeout);
           },
           "step"_a, "layer"_a, "microbatch"_a, "worker"_a, "counts"_a, "timeout_s"_a)
      .def("replaced", &MailboxProducer::replaced)
      .def_prop_ro("num_producers", [](const MailboxProducer& s) { return s.header()->num_producers; })
      .def_prop_ro("num_experts", [](const MailboxProducer& s) { return s.header()->num_experts; })
      .def_prop_ro("num_layers", [](const MailboxProducer& s) { return s.header()->num_layers; })
      .def_prop_ro("num_microbatches", [](const MailboxProducer& s) { return s.header()->num_microbatches; });

  nb::class_<RingWriter>(m, "RingWriter")
      .def(nb::init<const std::string&, uint32_t, uint32_t, uint32_t, uint64_t, bool, uint64_t>(), "name"_a,
           "num_readers"_a, "num_slots"_a, "slot_capacity"_a, "liveness_timeout_ns"_a, "pid_check"_a = true,
           "writer_timeout_ns"_a = 0, nb::call_guard<nb::gil_scoped_release>())
      .def("heartbeat", &RingWriter::heartbeat)
      .def("publish",
           [](RingWriter& self, int64_t seq, int64_t step, int32_t layer, int32_t microbatch, nb::bytes data,
              double timeout_s) {
             uint64_t timeout = seconds_to_ns(timeout_s, "timeout_s");
             const uint8_t* p = reinterpret_cast<const uint8_t*>(data.c_str());
             size_t n = data.size();
             nb::gil_scoped_release release;
             return self.publish(seq, step, layer, microbatch, p, n, timeout);
           },
           "seq"_a, "step"_a, "layer"_a, "microbatch"_a, "data"_a, "timeout_s"_a)
      .def("collect",
           [](RingWriter& self) {
             nb::list out;
             for (auto& l : self.collect())
               out.append(nb::make_tuple(l.seq, l.publish_ns, l.all_copied_ns, l.readers_copied, l.readers_live));
             return out;
           })
      .def("live_readers", &RingWriter::live_readers)
      .def("close", &RingWriter::close);

  nb::class_<RingReader>(m, "RingReader")
      .def(nb::init<const std::string&, uint32_t>(), "name"_a, "reader_id"_a)
      .def("read",
           [](RingReader& self, int64_t want, bool as_array) {
             RingReader::Result r;
             {
               nb::gil_scoped_release release;
               r = self.read(want);
             }
             return result_tuple(std::move(r), as_array);
           },
           "want_seq"_a, "as_array"_a = false)
      .def("wait_read",
           [](RingReader& self, int64_t want, double timeout_s, double spin_s, bool as_array) {
             uint64_t timeout = seconds_to_ns(timeout_s, "timeout_s"), spin = seconds_to_ns(spin_s, "spin_s");
             RingReader::Result r;
             {
               nb::gil_scoped_release release;
               r = self.wait_read(want, timeout, spin);
             }
             return result_tuple(std::move(r), as_array);
           },
           "want_seq"_a, "timeout_s"_a, "spin_s"_a = 0.0, "as_array"_a = false)
      .def("note_rejected", &RingReader::note_rejected)
      .def("replaced", &RingReader::replaced)
      .def("detach", &RingReader::detach)
      .def_prop_ro("reader_id", &RingReader::reader_id)
      .def_prop_ro("num_readers", [](const RingReader& s) { return s.header()->num_readers; })
      .def_prop_ro("slot_capacity", [](const RingReader& s) { return s.header()->slot_capacity; });
}
