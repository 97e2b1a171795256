// Named POSIX shared-memory segments under /dev/shm with one owner.
//
// Every afore segment starts with SegmentHeader. The owner creates it (O_EXCL), publishes
// `state = kReady` with release ordering once the layout is initialised, and unlinks it on
// close. A segment left behind by a crashed run (owner pid gone, or another format version)
// is detected at create time and replaced; a segment whose owner is alive is never touched,
// nor one that another process is creating right now (empty or all-zero header, younger than
// kCreateGraceNs): create() waits for it to become ready or to age into a crashed creation.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <stdexcept>
#include <string>

#include <algorithm>
#include <climits>

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace afore::shm {

constexpr uint64_t kMagic = 0x4d48535245524f46ULL;  // "FORESHM" + 'M', little-endian
constexpr uint32_t kFormatVersion = 2;
constexpr size_t kCacheLine = 64;
constexpr uint64_t kCreateGraceNs = 2000000000ULL;  // a creation takes microseconds; 2 s means it crashed

enum class SegmentKind : uint32_t { kMailbox = 1, kPlanRing = 2 };
enum SegmentState : uint32_t { kInitializing = 0, kReady = 1, kClosed = 2 };

struct alignas(kCacheLine) SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t kind;
  std::atomic<uint32_t> state;
  int32_t owner_pid;
  uint64_t total_size;
  uint64_t created_unix_ns;
  uint64_t instance;  // random per creation: lets attachers notice a replaced segment
};
static_assert(sizeof(SegmentHeader) == kCacheLine, "header must be one cache line");

inline uint64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ULL + uint64_t(ts.tv_nsec);
}

inline uint64_t realtime_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ULL + uint64_t(ts.tv_nsec);
}

inline bool pid_alive(int32_t pid) {
  if (pid <= 0) return false;
  return kill(pid, 0) == 0 || errno == EPERM;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Seqlock payloads: the writer stores and the readers load the bytes of a slot with relaxed
// atomic word accesses, so a reader that races an overwrite reads stale or mixed words (and
// then rejects them on the commit re-check) instead of being a C++ data race. `shared` must
// be 8-byte aligned (slot payloads are cache-line aligned).
template <class T>
inline T load_relaxed(const T& field) {
  return __atomic_load_n(&field, __ATOMIC_RELAXED);
}
template <class T>
inline void store_relaxed(T& field, T value) {
  __atomic_store_n(&field, value, __ATOMIC_RELAXED);
}
inline void copy_to_shared(uint8_t* shared, const uint8_t* src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, src + i, 8);
    __atomic_store_n(reinterpret_cast<uint64_t*>(shared + i), w, __ATOMIC_RELAXED);
  }
  for (; i < n; ++i) __atomic_store_n(shared + i, src[i], __ATOMIC_RELAXED);
}
inline void copy_from_shared(uint8_t* dst, const uint8_t* shared, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w = __atomic_load_n(reinterpret_cast<const uint64_t*>(shared + i), __ATOMIC_RELAXED);
    std::memcpy(dst + i, &w, 8);
  }
  for (; i < n; ++i) dst[i] = __atomic_load_n(shared + i, __ATOMIC_RELAXED);
}

inline void sleep_ns(uint64_t ns) {
  timespec ts{time_t(ns / 1000000000ULL), long(ns % 1000000000ULL)};
  nanosleep(&ts, nullptr);
}

// Futex doorbells. A writer that publishes bumps a 32-bit word of the shared segment and wakes
// the processes sleeping on it (FUTEX_WAKE without the private flag: the word lives in a
// MAP_SHARED mapping of several processes); a waiter reads the word *before* it checks for
// data and sleeps only while the word still holds that value, so no publish is missed.
inline const uint32_t* low_word(const std::atomic<uint64_t>& counter) {
  static_assert(sizeof(std::atomic<uint64_t>) == 8, "a lock-free 64-bit atomic");
  return reinterpret_cast<const uint32_t*>(&counter);  // the low half on little-endian x86-64 / aarch64
}
inline uint32_t load_word(const uint32_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }
inline void futex_wait(const uint32_t* word, uint32_t expected, uint64_t timeout_ns) {
  timespec ts{time_t(timeout_ns / 1000000000ULL), long(timeout_ns % 1000000000ULL)};
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);  // EAGAIN/EINTR/ETIMEDOUT: the caller re-checks
}
inline void futex_wake(const uint32_t* word) { syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0); }

// Waits with a spin phase (lowest latency, burns a core), then sleeps on the writer's doorbell
// (woken by the publish itself, at most kMaxSleepNs at a time so that the caller re-checks the
// writer's liveness and its deadlines), or without a doorbell sleeps growing from 20 us to 1 ms.
// Use: `uint32_t seen = backoff.observe();` before checking for data, `backoff.pause(seen)` after.
class Backoff {
 public:
  static constexpr uint64_t kMaxSleepNs = 1000000;
  explicit Backoff(uint64_t spin_ns, const uint32_t* doorbell = nullptr)
      : spin_ns_(spin_ns), start_(monotonic_ns()), doorbell_(doorbell) {}
  uint32_t observe() const { return doorbell_ ? load_word(doorbell_) : 0; }
  void pause(uint32_t seen = 0, uint64_t left_ns = kMaxSleepNs) {
    if (monotonic_ns() - start_ < spin_ns_) {
      for (int i = 0; i < 4; ++i) cpu_relax();  // a pause is ~100 cycles on recent x86: keep the poll tight
      return;
    }
    if (doorbell_ != nullptr) {
      futex_wait(doorbell_, seen, std::min<uint64_t>(std::max<uint64_t>(left_ns, 1000), kMaxSleepNs));
      return;
    }
    sleep_ns(sleep_);
    if (sleep_ < kMaxSleepNs) sleep_ *= 2;
  }

 private:
  uint64_t spin_ns_;
  uint64_t start_;
  const uint32_t* doorbell_;
  uint64_t sleep_ = 20000;
};

inline std::string shm_path(const std::string& name) { return "/dev/shm/" + name; }

inline void check_name(const std::string& name) {
  if (name.empty() || name.size() > 200 || name.find('/') != std::string::npos || name[0] == '.')
    throw std::invalid_argument("name: expected a segment name without '/' (1-200 chars), got '" + name + "'");
}

// A mapping of one segment; owns the mapping, not the name (see Segment::unlink).
class Segment {
 public:
  Segment() = default;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() { unmap(); }

  // Create `name` with `size` bytes, replacing a stale segment. Throws if a live owner holds it.
  void create(const std::string& name, size_t size, SegmentKind kind) {
    check_name(name);
    name_ = "/" + name;
    uint64_t give_up = monotonic_ns() + 2 * kCreateGraceNs;
    for (int attempt = 0; attempt < 3;) {
      int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0 && errno == EEXIST) {
        if (replace_if_stale(name)) {
          ++attempt;
        } else {  // another process is creating it: let it finish (then its owner is live) or age out
          if (monotonic_ns() > give_up)
            throw std::invalid_argument("segment " + name + ": still being created by another process");
          sleep_ns(1000000);
        }
        continue;
      }
      if (fd < 0) throw std::runtime_error("shm_open(" + name + "): " + std::strerror(errno));
      if (ftruncate(fd, off_t(size)) != 0) {
        int err = errno;
        close(fd);
        shm_unlink(name_.c_str());
        throw std::runtime_error("ftruncate(" + name + "): " + std::strerror(err));
      }
      map_fd(fd, size, true);
      std::memset(base_, 0, size);
      auto* h = header();
      h->owner_pid = int32_t(getpid());  // first: from here on a concurrent create sees a live owner
      h->magic = kMagic;
      h->version = kFormatVersion;
      h->kind = uint32_t(kind);
      h->total_size = size;
      h->created_unix_ns = realtime_ns();
      h->instance = (realtime_ns() ^ (uint64_t(getpid()) << 32)) | 1;
      owner_ = true;
      return;
    }
    throw std::runtime_error("segment " + name + ": could not create after replacing a stale copy");
  }

  // Attach to a ready segment of `kind` created by someone else.
  void attach(const std::string& name, SegmentKind kind, bool writable = true) {
    check_name(name);
    name_ = "/" + name;
    int fd = shm_open(name_.c_str(), writable ? O_RDWR : O_RDONLY, 0);
    if (fd < 0) throw std::invalid_argument("segment " + name + ": cannot open (" + std::strerror(errno) + ")");
    struct stat st;
    if (fstat(fd, &st) != 0 || size_t(st.st_size) < sizeof(SegmentHeader)) {
      close(fd);
      throw std::invalid_argument("segment " + name + ": too small to be an afore segment");
    }
    map_fd(fd, size_t(st.st_size), writable);
    auto* h = header();
    if (h->magic != kMagic) throw std::invalid_argument("segment " + name + ": not an afore segment (bad magic)");
    if (h->version != kFormatVersion)
      throw std::invalid_argument("segment " + name + ": format version " + std::to_string(h->version) +
                                  ", expected " + std::to_string(kFormatVersion));
    if (h->kind != uint32_t(kind)) throw std::invalid_argument("segment " + name + ": wrong kind");
    if (h->state.load(std::memory_order_acquire) != kReady)
      throw std::invalid_argument("segment " + name + ": not ready (being created or closed)");
    if (h->total_size != size_) throw std::invalid_argument("segment " + name + ": size does not match its header");
  }

  void publish_ready() { header()->state.store(kReady, std::memory_order_release); }

  // Owner only: mark closed (attachers notice) and remove the name.
  void close_and_unlink() {
    if (!base_ || !owner_) return;
    header()->state.store(kClosed, std::memory_order_release);
    // Only unlink the name if it still refers to our segment (a successor may own it now).
    struct stat by_name, mine;
    std::string path = shm_path(name_.substr(1));
    if (stat(path.c_str(), &by_name) == 0 && fstat(fd_, &mine) == 0 && by_name.st_ino == mine.st_ino)
      shm_unlink(name_.c_str());
    owner_ = false;
  }

  // True when the name now refers to another segment (or none): this mapping is orphaned.
  bool replaced() const {
    if (!base_) return true;
    struct stat by_name, mine;
    std::string path = shm_path(name_.substr(1));
    if (stat(path.c_str(), &by_name) != 0) return true;
    if (fstat(fd_, &mine) != 0) return true;
    return by_name.st_ino != mine.st_ino || header()->state.load(std::memory_order_acquire) == kClosed;
  }

  void unmap() {
    if (base_) munmap(base_, size_);
    if (fd_ >= 0) close(fd_);
    base_ = nullptr;
    fd_ = -1;
  }

  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(base_); }
  uint8_t* base() const { return static_cast<uint8_t*>(base_); }
  size_t size() const { return size_; }
  bool owner() const { return owner_; }
  const std::string& name() const { return name_; }

 private:
  void map_fd(int fd, size_t size, bool writable) {
    void* p = mmap(nullptr, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      close(fd);
      throw std::runtime_error("mmap(" + name_ + "): " + std::strerror(err));
    }
    base_ = p;
    size_ = size;
    fd_ = fd;
  }

  // An existing segment is stale when it is not ours (bad magic), of another format version,
  // or its owner process is gone. A live owner's segment is never replaced. A segment with no
  // header yet (size 0, or magic and owner pid still 0) is being created by another process
  // unless it is older than kCreateGraceNs: returns false (not replaced; the caller waits).
  // Returns true when the name was removed (or vanished meanwhile): retry the create.
  static bool replace_if_stale(const std::string& name) {
    std::string slash = "/" + name;
    int fd = shm_open(slash.c_str(), O_RDONLY, 0);
    if (fd < 0) return true;  // vanished meanwhile: retry create
    struct stat st;
    bool stale = true, creating = false;
    int32_t owner = 0;
    if (fstat(fd, &st) == 0) {
      uint64_t changed_ns = uint64_t(st.st_ctim.tv_sec) * 1000000000ULL + uint64_t(st.st_ctim.tv_nsec);
      bool young = realtime_ns() < changed_ns + kCreateGraceNs;
      if (size_t(st.st_size) >= sizeof(SegmentHeader)) {
        void* p = mmap(nullptr, sizeof(SegmentHeader), PROT_READ, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) {
          auto* h = static_cast<SegmentHeader*>(p);
          owner = h->owner_pid;
          uint64_t magic = h->magic;
          bool ours = magic == kMagic && h->version == kFormatVersion;
          uint32_t state = h->state.load(std::memory_order_acquire);
          creating = young && ((magic == 0 && owner == 0) || (ours && state == kInitializing && owner == 0));
          stale = !creating && (!ours || state == kClosed || !pid_alive(owner));
          munmap(p, sizeof(SegmentHeader));
        }
      } else {
        creating = young;  // between shm_open and ftruncate; an old one: its creator crashed there
        stale = !creating;
      }
    }
    close(fd);
    if (creating) return false;
    if (!stale)
      throw std::invalid_argument("segment " + name + ": in use by live owner pid " + std::to_string(owner));
    shm_unlink(slash.c_str());
    return true;
  }

  void* base_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
  bool owner_ = false;
  std::string name_;
};

}  // namespace afore::shm
