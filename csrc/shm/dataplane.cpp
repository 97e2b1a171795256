// The shm transport's per-target hot path (afore.transport.shm): waits on the ready words,
// header writes and checks, the copies of rows, ids and weights, the reply scatter and sum,
// and the FFN workers' agree barrier, over the segment that afore.transport.shm maps and lays
// out (ShmLayout: this file never decides an offset, it is handed every one).
//
// Tensors arrive as data pointers of contiguous host buffers that the Python side checked
// (dtype, shape, contiguity); every index read from shared memory is range-checked here
// before it addresses anything. Waiting calls run without the GIL.
//
// Memory order as the Python path: x86-64 TSO; the header's closing counter and the ready word
// are stored with release order after the payload, and read with acquire order before it.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <atomic>
#include <cstdio>
#include <deque>
#include <mutex>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "shm/mailbox.hpp"
#include "shm/segment.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace afore::shm {
namespace {

constexpr int kHead = 8;  // int64 words per header: [counter, seq, step, layer, microbatch, n, counter, 0]

// Raised as afore.transport.shm.PeerGone / TimeoutError (translator below).
struct PeerGoneError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct WaitTimeout : std::runtime_error {
  using std::runtime_error::runtime_error;
};
PyObject* g_peer_gone = nullptr;  // the Python class, set once by afore.transport.shm

// A process that exists and has not exited: a zombie (exited, not reaped) still answers kill(0),
// so its /proc state is read too (afore.procs.pid_alive).
bool process_running(int64_t pid) {
  if (kill(pid_t(pid), 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  int fd = open(path, O_RDONLY);
  if (fd < 0) return true;  // no /proc: trust kill(0)
  char buf[512];
  ssize_t got = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (got <= 0) return true;
  buf[got] = 0;
  const char* paren = strrchr(buf, ')');
  if (!paren || paren[1] != ' ' || !paren[2]) return true;
  return paren[2] != 'Z' && paren[2] != 'X';
}

// FUTEX_WAIT while *word == expected, at most timeout_ns. A signal that interrupts it runs its
// Python handler now (under the GIL), as the ctypes wait of the Python path does: Ctrl-C or a
// handler that raises ends the wait with that exception instead of after the timeout.
// On a CUDA host-node thread (StreamExchange) no Python runs: an interrupted wait just waits on,
// since the thread that holds the GIL may be the one waiting for this node.
thread_local bool t_no_python = false;

void futex_sleep(const uint32_t* word, uint32_t expected, uint64_t timeout_ns) {
  timespec ts{time_t(timeout_ns / 1000000000ULL), long(timeout_ns % 1000000000ULL)};
  if (syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0) == -1 && errno == EINTR && !t_no_python) {
    nb::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() != 0) throw nb::python_error();
  }
}

uint32_t ready_word(int64_t counter) { return uint32_t(counter % 0x7FFFFFFE + 1); }

double now_s() { return double(monotonic_ns()) * 1e-9; }

std::string head_text(const int64_t* h) {
  std::string s = "[";
  for (int i = 0; i < kHead; ++i) s += (i ? ", " : "") + std::to_string(load_relaxed(h[i]));
  return s + "]";
}

std::string target_text(int64_t step, int64_t layer, int64_t mb) {
  return "Target(step=" + std::to_string(step) + ", layer=" + std::to_string(layer) +
         ", microbatch=" + std::to_string(mb) + ")";
}

// float32 from the layout's element types, exactly as torch converts (c10's fp16 routine).
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float half_to_float(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normalized = bits_float((two_w >> 4) + (0xE0u << 23)) * bits_float(0x7800000u);  // 2^-112
  const float denormalized = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
  return bits_float(sign | (two_w < (1u << 27) ? float_bits(denormalized) : float_bits(normalized)));
}

enum Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

class DataPlane {
 public:
  // base: the mapping's address; offsets: ShmLayout.offsets() plus req_slot and rep_slot (bytes).
  DataPlane(uintptr_t base, int num_attention, int num_ffn, int hidden, int top_k, int max_tokens, int depth,
            int dtype, bool exact, const std::map<std::string, int64_t>& offsets)
      : base_(reinterpret_cast<uint8_t*>(base)), A_(num_attention), F_(num_ffn), H_(hidden), K_(top_k),
        T_(max_tokens), D_(depth), dtype_(dtype), exact_(exact) {
    if (dtype < 0 || dtype > 2) throw std::invalid_argument("dtype: expected 0 (float32), 1 (bfloat16) or 2 (float16)");
    es_ = dtype == kFloat32 ? 4 : 2;
    auto at = [&](const char* k) {
      auto it = offsets.find(k);
      if (it == offsets.end()) throw std::invalid_argument(std::string("offsets: missing ") + k);
      return size_t(it->second);
    };
    pids_ = reinterpret_cast<int64_t*>(base_ + at("pids"));
    req_ready_ = reinterpret_cast<uint32_t*>(base_ + at("req_ready"));
    req_head_ = reinterpret_cast<int64_t*>(base_ + at("req_head"));
    rep_ready_ = reinterpret_cast<uint32_t*>(base_ + at("rep_ready"));
    rep_head_ = reinterpret_cast<int64_t*>(base_ + at("rep_head"));
    votes_ = reinterpret_cast<uint32_t*>(base_ + at("votes"));
    digests_ = reinterpret_cast<int64_t*>(base_ + at("digests"));
    req_data_ = base_ + at("req_data");
    rep_data_ = base_ + at("rep_data");
    req_slot_ = at("req_slot");
    rep_slot_ = at("rep_slot");
    reply_rows_ = int64_t(T_) * (exact_ ? K_ : 1);
  }

  // ------------------------------------------------------------------ attention end

  // Publish message `counter` of attention worker `a`: n rows [n, H] (layout dtype), ids int32
  // [n, k], weights fp32 [n, k], all contiguous host buffers.
  void send_request(int a, int64_t counter, int64_t seq, int64_t step, int64_t layer, int64_t mb, int64_t n,
                    uintptr_t rows, uintptr_t ids, uintptr_t weights) {
    check_rank(a, A_, "attention rank");
    if (n < 0 || n > T_) throw std::invalid_argument("n: expected in [0, max_tokens=" + std::to_string(T_) + "], got " + std::to_string(n));
    const int d = int(counter % D_);
    int64_t* head = req_head_ + (int64_t(a) * D_ + d) * kHead;
    store_relaxed(head[0], counter);
    if (n) {
      uint8_t* slot = req_data_ + (size_t(a) * D_ + d) * req_slot_;
      const size_t hb = size_t(T_) * H_ * es_;
      std::memcpy(slot, reinterpret_cast<const void*>(rows), size_t(n) * H_ * es_);
      std::memcpy(slot + hb, reinterpret_cast<const void*>(ids), size_t(n) * K_ * 4);
      std::memcpy(slot + hb + size_t(T_) * K_ * 4, reinterpret_cast<const void*>(weights), size_t(n) * K_ * 4);
    }
    publish(head, req_ready_ + int64_t(a) * D_ + d, counter, {seq, step, layer, mb, n});
  }

  // Wait for FFN worker f's reply to message `counter` of attention worker `a` and check its header;
  // returns its rows (the reply slot's first rows and token indices hold them; they are not checked
  // against the target's tokens here: the caller that reads them does so, as ``combine`` does).
  int64_t wait_reply(int a, int f, int64_t counter, int64_t seq, int64_t step, int64_t layer, int64_t mb, double deadline,
                     double poll_s, double spin_s) {
    check_rank(a, A_, "attention rank");
    check_rank(f, F_, "FFN rank");
    const int64_t index = (int64_t(f) * A_ + a) * D_ + int(counter % D_);
    wait_word(rep_ready_ + index, ready_word(counter), deadline, poll_s, spin_s, A_ + f,
              [&] { return "reply to seq " + std::to_string(seq) + " from FFN worker " + std::to_string(f); });
    const int64_t* head = rep_head_ + index * kHead;
    if (!(load_relaxed(head[0]) == counter && load_relaxed(head[6]) == counter) || load_relaxed(head[1]) != seq ||
        load_relaxed(head[2]) != step || load_relaxed(head[3]) != layer || load_relaxed(head[4]) != mb)
      throw std::invalid_argument("reply from FFN worker " + std::to_string(f) + ": expected seq " + std::to_string(seq) +
                                  " " + target_text(step, layer, mb) + " (message " + std::to_string(counter) +
                                  "), got header " + head_text(head) + " (torn or stale slot)");
    const int64_t rows = load_relaxed(head[5]);
    if (rows < 0 || rows > reply_rows_)
      throw std::invalid_argument("reply from FFN worker " + std::to_string(f) + ": rows: expected in [0, " +
                                  std::to_string(reply_rows_) + "], got " + std::to_string(rows));
    return rows;
  }

  // Wait for the F replies to message `counter` of attention worker `a` and combine them into
  // `out`: fp32 [n, H] partial sums (each reply added in FFN-rank order, as index_add_), or in
  // exact layouts the layout dtype [n * k, H], every pair's row at its place (others zero).
  // Returns the rows received (all replies).
  int64_t combine(int a, int64_t counter, int64_t seq, int64_t step, int64_t layer, int64_t mb, int64_t n,
                  uintptr_t out_ptr, double deadline, double poll_s, double spin_s) {
    check_rank(a, A_, "attention rank");
    const int d = int(counter % D_);
    const int64_t places = n * (exact_ ? K_ : 1);
    uint8_t* out = reinterpret_cast<uint8_t*>(out_ptr);
    const size_t out_row = size_t(H_) * (exact_ ? es_ : 4);
    // a row's first reply is stored (as 0 + x: the bits of zeros().index_add_), later ones added;
    // rows no reply touched are zeroed at the end: out is written once, not zeroed and re-read
    std::vector<uint8_t> touched(size_t(places), 0);
    int64_t total = 0;
    for (int f = 0; f < F_; ++f) {
      const int64_t index = (int64_t(f) * A_ + a) * D_ + d;
      const int64_t rows = wait_reply(a, f, counter, seq, step, layer, mb, deadline, poll_s, spin_s);
      const uint8_t* data = rep_data_ + size_t(index) * rep_slot_;
      const int32_t* token = reinterpret_cast<const int32_t*>(data + size_t(reply_rows_) * H_ * es_);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = token[r];
        if (t < 0 || t >= places)
          throw std::invalid_argument("reply from FFN worker " + std::to_string(f) + " to seq " + std::to_string(seq) +
                                      ": token index " + std::to_string(t) + " out of range [0, " + std::to_string(places) + ")");
        const uint8_t* src = data + size_t(r) * H_ * es_;
        if (exact_)
          std::memcpy(out + size_t(t) * out_row, src, out_row);
        else
          add_row(reinterpret_cast<float*>(out) + size_t(t) * H_, src, touched[t] != 0);
        touched[t] = 1;
      }
      total += rows;
    }
    for (int64_t t = 0; t < places; ++t)
      if (!touched[t]) std::memset(out + size_t(t) * out_row, 0, out_row);
    return total;
  }

  // ------------------------------------------------------------------ FFN end

  // Every attention worker published message `c` (no wait).
  bool requests_ready(int64_t c) const {
    const int d = int(c % D_);
    for (int a = 0; a < A_; ++a)
      if (load_word(req_ready_ + int64_t(a) * D_ + d) != ready_word(c)) return false;
    return true;
  }

  // Block until every attention worker published message `c`; TimeoutError at `deadline`.
  void wait_requests(int64_t c, double deadline, double poll_s, double spin_s) {
    const int d = int(c % D_);
    for (int a = 0; a < A_; ++a)
      wait_word(req_ready_ + int64_t(a) * D_ + d, ready_word(c), deadline, poll_s, spin_s, -1,
                [&] { return "request " + std::to_string(c) + " from attention worker " + std::to_string(a); });
  }

  // The checked headers of message `c`: (seq, step, layer, microbatch, splits [A]).
  std::tuple<int64_t, int64_t, int64_t, int64_t, std::vector<int64_t>> read_request(int64_t c) const {
    const int d = int(c % D_);
    std::vector<int64_t> splits(A_);
    int64_t key[4] = {0, 0, 0, 0};
    for (int a = 0; a < A_; ++a) {
      const int64_t* head = req_head_ + (int64_t(a) * D_ + d) * kHead;
      if (!(load_relaxed(head[0]) == c && load_relaxed(head[6]) == c))
        throw std::invalid_argument("request from attention worker " + std::to_string(a) + ": expected message " +
                                    std::to_string(c) + ", got header " + head_text(head) + " (torn or stale slot)");
      int64_t got[4] = {load_relaxed(head[1]), load_relaxed(head[2]), load_relaxed(head[3]), load_relaxed(head[4])};
      const int64_t n = load_relaxed(head[5]);
      if (n < 0 || n > T_)
        throw std::invalid_argument("request from attention worker " + std::to_string(a) + ": num_tokens: expected in [0, " +
                                    std::to_string(T_) + "], got " + std::to_string(n));
      if (a == 0) {
        std::memcpy(key, got, sizeof(key));
      } else if (std::memcmp(key, got, sizeof(key)) != 0) {
        throw std::invalid_argument("request from attention worker " + std::to_string(a) + ": target: expected seq " +
                                    std::to_string(key[0]) + " " + target_text(key[1], key[2], key[3]) +
                                    " (as attention worker 0), got seq " + std::to_string(got[0]) + " " +
                                    target_text(got[1], got[2], got[3]));
      }
      splits[a] = n;
    }
    return {key[0], key[1], key[2], key[3], std::move(splits)};
  }

  // Concatenate the ids int32 [N, k] and weights fp32 [N, k] of message `c` in sender order.
  void gather_routing(int64_t c, const std::vector<int64_t>& splits, uintptr_t ids_out, uintptr_t weights_out) const {
    check_splits(splits);
    const int d = int(c % D_);
    auto* ids = reinterpret_cast<uint8_t*>(ids_out);
    auto* w = reinterpret_cast<uint8_t*>(weights_out);
    const size_t hb = size_t(T_) * H_ * es_, row = size_t(K_) * 4;
    for (int a = 0; a < A_; ++a) {
      const uint8_t* slot = req_data_ + (size_t(a) * D_ + d) * req_slot_;
      std::memcpy(ids, slot + hb, size_t(splits[a]) * row);
      std::memcpy(w, slot + hb + size_t(T_) * row, size_t(splits[a]) * row);
      ids += size_t(splits[a]) * row;
      w += size_t(splits[a]) * row;
    }
  }

  // Hidden rows [U, H] of gathered token indices `tokens` int64 [U] (ascending) of message `c`.
  void gather_rows(int64_t c, const std::vector<int64_t>& splits, uintptr_t tokens_ptr, int64_t count, uintptr_t out_ptr) const {
    check_splits(splits);
    const int d = int(c % D_);
    const auto* tokens = reinterpret_cast<const int64_t*>(tokens_ptr);
    auto* out = reinterpret_cast<uint8_t*>(out_ptr);
    const size_t row = size_t(H_) * es_;
    int a = 0;
    int64_t lo = 0, total = 0;
    for (int64_t s : splits) total += s;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t t = tokens[i];
      if (t < 0 || t >= total || (i && t < tokens[i - 1]))
        throw std::invalid_argument("tokens: expected ascending gathered token indices in [0, " + std::to_string(total) +
                                    "), got " + std::to_string(t) + " at position " + std::to_string(i));
      while (t >= lo + splits[a]) lo += splits[a++];
      std::memcpy(out + size_t(i) * row, req_data_ + (size_t(a) * D_ + d) * req_slot_ + size_t(t - lo) * row, row);
    }
  }

  // FFN worker `rank` replies to message `c` (every attention worker, an empty reply where it
  // has no row): rows [U, H] (layout dtype) of gathered indices `tokens` int64 [U] ascending
  // (pair indices t * k + j in exact layouts). Returns the rows written. rows_ptr 0: the rows are
  // in the reply slots already (copied there by the device, ShmFFNEnd._send_in_place): only the
  // token indices and the headers are written.
  int64_t send_replies(int rank, int64_t c, int64_t seq, int64_t step, int64_t layer, int64_t mb,
                       const std::vector<int64_t>& splits, uintptr_t tokens_ptr, int64_t count, uintptr_t rows_ptr) {
    check_rank(rank, F_, "FFN rank");
    check_splits(splits);
    const int64_t kk = exact_ ? K_ : 1;
    const auto* tokens = reinterpret_cast<const int64_t*>(tokens_ptr);
    int64_t total = 0;
    for (int64_t s : splits) total += s * kk;
    for (int64_t i = 0; i < count; ++i)
      if (tokens[i] < 0 || tokens[i] >= total || (i && tokens[i] < tokens[i - 1]))
        throw std::invalid_argument("partial.tokens: expected ascending gathered " + std::string(exact_ ? "pair" : "token") +
                                    " indices in [0, " + std::to_string(total) + "), got " + std::to_string(tokens[i]) +
                                    " at position " + std::to_string(i));
    std::vector<int64_t> cut(A_ + 1, 0);  // rows [cut[a], cut[a + 1]) go to attention worker a
    for (int64_t a = 0, bound = 0; a < A_; ++a) {
      bound += splits[a] * kk;
      int64_t hi = cut[a];
      while (hi < count && tokens[hi] < bound) ++hi;
      if (hi - cut[a] > reply_rows_)
        throw std::invalid_argument("partial.tokens: " + std::to_string(hi - cut[a]) + " rows for attention worker " +
                                    std::to_string(a) + ", a reply slot holds " + std::to_string(reply_rows_));
      cut[a + 1] = hi;
    }
    const auto* rows = reinterpret_cast<const uint8_t*>(rows_ptr);
    const int d = int(c % D_);
    const size_t row = size_t(H_) * es_;
    int64_t bound = 0;
    for (int a = 0; a < A_; ++a) {
      const int64_t lo = cut[a], k = cut[a + 1] - lo;
      const int64_t index = (int64_t(rank) * A_ + a) * D_ + d;
      int64_t* head = rep_head_ + index * kHead;
      store_relaxed(head[0], c);
      if (k) {
        uint8_t* data = rep_data_ + size_t(index) * rep_slot_;
        if (rows) std::memcpy(data, rows + size_t(lo) * row, size_t(k) * row);
        auto* token = reinterpret_cast<int32_t*>(data + size_t(reply_rows_) * row);
        for (int64_t i = 0; i < k; ++i) token[i] = int32_t(tokens[lo + i] - bound);
      }
      publish(head, rep_ready_ + index, c, {seq, step, layer, mb, k});
      bound += splits[a] * kk;
    }
    return count;
  }

  // Vote `flag` for the plan of digest `digest` on agreement round `v`: 1 (agreed) if every FFN
  // worker voted yes with the same digest, 2 (diverged) if all voted yes but for different plans,
  // 0 (vetoed) if one voted no. The digest is stored before the vote word (release), and read after
  // the other's word was seen (acquire): a reader that sees a word sees its digest.
  int agree(int rank, int64_t v, bool flag, int64_t digest, double timeout_s, double poll_s, double spin_s,
            const std::string& timeout_text) {
    check_rank(rank, F_, "FFN rank");
    if (F_ == 1) return flag ? 1 : 0;
    const uint32_t word = uint32_t((v % 0x3FFFFFFE) + 1) << 1;
    const int slot = int(v % 2);
    uint32_t* mine = votes_ + rank * 2 + slot;
    __atomic_store_n(digests_ + rank * 2 + slot, digest, __ATOMIC_RELAXED);
    __atomic_store_n(mine, word | uint32_t(flag), __ATOMIC_RELEASE);
    futex_wake(mine);
    const double deadline = now_s() + timeout_s;
    bool result = flag, same = true;
    for (int g = 0; g < F_; ++g) {
      if (g == rank) continue;
      const uint32_t* theirs = votes_ + g * 2 + slot;
      spin(theirs, spin_s, [&](uint32_t cur) { return (cur >> 1) << 1 == word; });
      while (true) {
        // one read serves the test and the futex's expected value (commit 7b3a187: a vote stored
        // between two reads left the wait sleeping on the new value until poll_s)
        const uint32_t cur = load_word(theirs);
        if ((cur >> 1) << 1 == word) {
          result = result && (cur & 1);
          same = same && __atomic_load_n(digests_ + g * 2 + slot, __ATOMIC_RELAXED) == digest;
          break;
        }
        if (now_s() > deadline)
          throw WaitTimeout("agree: FFN worker " + std::to_string(g) + " did not vote on target " + std::to_string(v) +
                            " within " + timeout_text + " s");
        futex_sleep(theirs, cur, ns(poll_s));
        const int64_t pid = load_relaxed(pids_[A_ + g]);
        if (pid && !process_running(pid))
          throw PeerGoneError("agree: FFN worker " + std::to_string(g) + " (pid " + std::to_string(pid) + ") exited");
      }
    }
    return result ? (same ? 1 : 2) : 0;
  }

 private:
  static void check_rank(int r, int n, const char* what) {
    if (r < 0 || r >= n) throw std::invalid_argument(std::string(what) + ": expected in [0, " + std::to_string(n) + "), got " + std::to_string(r));
  }
  void check_splits(const std::vector<int64_t>& splits) const {
    if (int(splits.size()) != A_) throw std::invalid_argument("splits: expected " + std::to_string(A_) + " entries, got " + std::to_string(splits.size()));
    for (int64_t s : splits)
      if (s < 0 || s > T_) throw std::invalid_argument("splits: expected entries in [0, " + std::to_string(T_) + "], got " + std::to_string(s));
  }
  static uint64_t ns(double s) { return s <= 0 ? 0 : s >= 1e6 ? uint64_t(1e15) : uint64_t(s * 1e9); }

  // [counter, fields..., counter], then the ready word (both release: after the payload), wake.
  static void publish(int64_t* head, uint32_t* ready, int64_t counter, std::initializer_list<int64_t> fields) {
    int i = 1;
    for (int64_t x : fields) store_relaxed(head[i++], x);
    __atomic_store_n(&head[6], counter, __ATOMIC_RELEASE);
    __atomic_store_n(ready, ready_word(counter), __ATOMIC_RELEASE);
    futex_wake(ready);
  }

  // Block until *word == want; `peer` (a pids index, -1: none) is checked after every wake-up
  // that did not bring it. PeerGone / TimeoutError name `what()`.
  // Busy-poll *word for at most spin_s (0: not at all) until done(value): the lowest latency,
  // at the price of a core for that long; the caller then blocks on the futex as usual.
  template <class Done>
  static void spin(const uint32_t* word, double spin_s, Done done) {
    if (!(spin_s > 0)) return;
    const uint64_t until = monotonic_ns() + ns(spin_s);
    do {
      for (int i = 0; i < 16; ++i) {
        if (done(load_word(word))) return;
        cpu_relax();
      }
    } while (monotonic_ns() < until);
  }

  template <class What>
  void wait_word(const uint32_t* word, uint32_t want, double deadline, double poll_s, double spin_s, int peer,
                 What what) const {
    spin(word, spin_s, [want](uint32_t cur) { return cur == want; });
    while (true) {
      const uint32_t cur = load_word(word);
      if (cur == want) return;
      const double left = deadline - now_s();
      if (left <= 0) throw WaitTimeout(what() + ": nothing after the timeout");
      futex_sleep(word, cur, ns(std::min(poll_s, left)));
      if (peer >= 0 && load_word(word) != want) {
        const int64_t pid = load_relaxed(pids_[peer]);
        if (pid && !process_running(pid)) throw PeerGoneError(what() + ": the peer process " + std::to_string(pid) + " exited");
      }
    }
  }

  // o (+)= float(src): `add` false for a row's first reply, stored as 0.0f + x (-0 becomes +0,
  // as in zeros + x)
  void add_row(float* o, const uint8_t* src, bool add) const {
    if (dtype_ == kFloat32) {
      const auto* s = reinterpret_cast<const float*>(src);
      if (add)
        for (int h = 0; h < H_; ++h) o[h] += s[h];
      else
        for (int h = 0; h < H_; ++h) o[h] = 0.0f + s[h];
    } else if (dtype_ == kBFloat16) {
      const auto* s = reinterpret_cast<const uint16_t*>(src);
      if (add)
        for (int h = 0; h < H_; ++h) o[h] += bits_float(uint32_t(s[h]) << 16);
      else
        for (int h = 0; h < H_; ++h) o[h] = 0.0f + bits_float(uint32_t(s[h]) << 16);
    } else {
      const auto* s = reinterpret_cast<const uint16_t*>(src);
      if (add)
        for (int h = 0; h < H_; ++h) o[h] += half_to_float(s[h]);
      else
        for (int h = 0; h < H_; ++h) o[h] = 0.0f + half_to_float(s[h]);
    }
  }

  uint8_t* base_;
  int A_, F_, H_, K_, T_, D_, dtype_;
  bool exact_;
  size_t es_ = 4;
  int64_t* pids_;
  uint32_t* req_ready_;
  int64_t* req_head_;
  uint32_t* rep_ready_;
  int64_t* rep_head_;
  uint32_t* votes_;
  int64_t* digests_;
  uint8_t* req_data_;
  uint8_t* rep_data_;
  size_t req_slot_ = 0, rep_slot_ = 0;
  int64_t reply_rows_ = 0;
};

// The exchange of one attention worker as CUDA host nodes (``afore serve --exchange stream``,
// afore.attention.stream): the forward pass enqueues, per MoE layer call, the copies of the
// tokens into page-locked staging buffers, then a host node (cuLaunchHostFunc) that runs
// ``run`` below on the CUDA driver's thread when the stream reaches it, then the copy of the
// combined output back. No Python runs per layer, nothing blocks the thread that launched the
// work, and the whole thing is capturable: a decode step can be one CUDA graph, as in plain vLLM.
//
// ``run`` numbers the targets as the Python path does (``ForwardCounter``): the call of MoE layer
// position 0 starts a forward pass (step + 1), seq = step * L + layer (one microbatch), message
// counter + 1 per call; it posts the target (send_request), puts its demand into the scheduler's
// mailbox when there is one (the counts of the posted ids, as the host path emits them after the
// post; advisory: a full or replaced mailbox costs a primary-only plan, never the exchange), and
// waits for the F replies (combine) into the staging output. It cannot raise into anything: the first failure (a dead
// peer, a timeout, a torn slot) is kept in ``error`` and every later call only zeroes its output
// at once, until the attention worker reads the error (``check``) and fails the engine.
class StreamExchange {
 public:
  struct Call {
    StreamExchange* ex;
    int layer;
    int64_t n;
  };

  StreamExchange(DataPlane* plane, int rank, int layers, uintptr_t rows, uintptr_t ids, uintptr_t weights,
                 uintptr_t out, int64_t out_row_bytes, double timeout_s, double poll_s, double spin_s,
                 const std::string& mailbox, int num_experts, int top_k)
      : plane_(plane), rank_(rank), layers_(layers), rows_(rows), ids_(ids), weights_(weights), out_(out),
        out_row_bytes_(out_row_bytes), timeout_s_(timeout_s), poll_s_(poll_s), spin_s_(spin_s), mailbox_name_(mailbox),
        num_experts_(num_experts), top_k_(top_k) {
    if (layers < 1) throw std::invalid_argument("layers: expected >= 1, got " + std::to_string(layers));
    if (!mailbox.empty()) {
      if (num_experts < 1 || top_k < 1) throw std::invalid_argument("num_experts, top_k: expected >= 1 with a mailbox");
      mailbox_ = std::make_unique<MailboxProducer>(mailbox);
      counts_.assign(size_t(num_experts), 0);
    }
    if (!(timeout_s > 0)) throw std::invalid_argument("timeout_s: expected > 0");
    if (!(poll_s > 0)) throw std::invalid_argument("poll_s: expected > 0");
  }

  // The host node's argument for MoE layer position `layer` with `n` tokens (cached: a captured
  // graph keeps the address for its life, so a Call is never freed or moved).
  uintptr_t call(int layer, int64_t n) {
    if (layer < 0 || layer >= layers_)
      throw std::invalid_argument("layer: expected in [0, " + std::to_string(layers_) + "), got " + std::to_string(layer));
    if (n < 0) throw std::invalid_argument("n: expected >= 0, got " + std::to_string(n));
    std::lock_guard<std::mutex> lock(mu_);
    for (Call& c : calls_)
      if (c.layer == layer && c.n == n) return reinterpret_cast<uintptr_t>(&c);
    calls_.push_back(Call{this, layer, n});
    return reinterpret_cast<uintptr_t>(&calls_.back());
  }

  static void host_node(void* arg) {
    Call* c = static_cast<Call*>(arg);
    t_no_python = true;
    c->ex->run(*c);
  }

  // What the host node runs (also callable directly: tests, a CPU stream).
  void run(const Call& c) {
    const uint64_t enter = monotonic_ns();
    if (c.layer == 0) ++step_;
    const int64_t step = step_, counter = counter_++;
    const int64_t seq = step * layers_ + c.layer;
    if (failed_.load(std::memory_order_acquire)) {
      zero(c.n);
      return;
    }
    try {
      if (step < 0) throw std::invalid_argument("the first call was not MoE layer position 0");
      plane_->send_request(rank_, counter, seq, step, c.layer, 0, c.n, rows_, ids_, weights_);
      const uint64_t sent = monotonic_ns();
      if (mailbox_) emit(step, c.layer, c.n);
      const uint64_t demand = monotonic_ns();
      const int64_t rows = plane_->combine(rank_, counter, seq, step, c.layer, 0, c.n, out_, now_s() + timeout_s_,
                                           poll_s_, spin_s_);
      const uint64_t done = monotonic_ns();
      rows_received_ += rows;
      post_ns_ += sent - enter;
      wait_ns_ += done - demand;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (records_.size() < kMaxRecords)
          records_.push_back({step, c.layer, c.n, int64_t(prev_done_), int64_t(enter), int64_t(demand), int64_t(sent),
                              int64_t(done), rows, seq});
        else
          ++records_dropped_;
      }
      prev_done_ = done;
      done_calls_.fetch_add(1, std::memory_order_release);
    } catch (const std::exception& e) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        error_ = std::string(e.what()) + " (" + target_text(step, c.layer, 0) + ", seq " + std::to_string(seq) + ")";
      }
      failed_.store(true, std::memory_order_release);
      zero(c.n);
    }
  }

  // The per-call stamps since the last call (CLOCK_MONOTONIC ns, the clock of time.perf_counter_ns):
  // (step, layer, tokens, previous call done, enter, demand emitted, posted, combined, rows, seq);
  // at most kMaxRecords are kept between two takes (the rest only counted).
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>>
  take_records() {
    std::vector<Record> got;
    {
      std::lock_guard<std::mutex> lock(mu_);
      got.swap(records_);
    }
    std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>> out;
    out.reserve(got.size());
    for (const Record& r : got)
      out.emplace_back(r.step, r.layer, r.n, r.prev_done, r.enter, r.demand, r.sent, r.done, r.rows, r.seq);
    return out;
  }

  int64_t records_dropped() {
    std::lock_guard<std::mutex> lock(mu_);
    return records_dropped_;
  }

  nb::object error() {
    if (!failed_.load(std::memory_order_acquire)) return nb::none();
    std::lock_guard<std::mutex> lock(mu_);
    return nb::str(error_.c_str());
  }

  // (calls completed, next step, next message counter, rows received, post ns, wait ns, demand
  // reports put, demand reports lost) so far
  std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t> stats() const {
    return {done_calls_.load(std::memory_order_acquire), step_, counter_, rows_received_, int64_t(post_ns_),
            int64_t(wait_ns_), emitted_, demand_lost_};
  }

 private:
  // d[t, a]: the posted ids' counts per expert, into the mailbox (its ring full for 10 ms or a
  // scheduler restart that replaced it: reopened once, else the report is lost and counted)
  void emit(int64_t step, int layer, int64_t n) {
    std::fill(counts_.begin(), counts_.end(), 0);
    const int32_t* ids = reinterpret_cast<const int32_t*>(ids_);
    for (int64_t i = 0; i < n * top_k_; ++i)
      if (ids[i] >= 0 && ids[i] < num_experts_) ++counts_[size_t(ids[i])];
    try {
      bool ok = mailbox_->put(step, layer, 0, rank_, counts_.data(), counts_.size(), 10'000'000ULL);
      if (!ok && mailbox_->replaced()) {
        mailbox_ = std::make_unique<MailboxProducer>(mailbox_name_);
        ok = mailbox_->put(step, layer, 0, rank_, counts_.data(), counts_.size(), 10'000'000ULL);
      }
      ok ? ++emitted_ : ++demand_lost_;
    } catch (const std::exception&) {
      ++demand_lost_;
    }
  }

  void zero(int64_t n) {
    if (n > 0) std::memset(reinterpret_cast<void*>(out_), 0, size_t(n) * size_t(out_row_bytes_));
  }

  DataPlane* plane_;
  int rank_, layers_;
  uintptr_t rows_, ids_, weights_, out_;
  int64_t out_row_bytes_;
  double timeout_s_, poll_s_, spin_s_;
  // host nodes of one stream run one at a time, in order: these need no lock
  int64_t step_ = -1, counter_ = 0, rows_received_ = 0;
  uint64_t post_ns_ = 0, wait_ns_ = 0;
  std::atomic<int64_t> done_calls_{0};
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::string error_;
  std::deque<Call> calls_;
  struct Record {
    int64_t step, layer, n, prev_done, enter, demand, sent, done, rows, seq;
  };
  static constexpr size_t kMaxRecords = 1 << 16;
  std::vector<Record> records_;
  int64_t records_dropped_ = 0;
  uint64_t prev_done_ = 0;
  std::string mailbox_name_;
  int num_experts_, top_k_;
  std::unique_ptr<MailboxProducer> mailbox_;
  std::vector<int32_t> counts_;
  int64_t emitted_ = 0, demand_lost_ = 0;
};

}  // namespace

void bind_dataplane(nb::module_& m) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const PeerGoneError& e) {
      PyErr_SetString(g_peer_gone ? g_peer_gone : PyExc_RuntimeError, e.what());
    } catch (const WaitTimeout& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    }
  });
  m.def("set_peer_gone", [](nb::handle cls) {
    Py_XINCREF(cls.ptr());
    Py_XDECREF(g_peer_gone);
    g_peer_gone = cls.ptr();
  }, "cls"_a, "The exception class that a dead peer raises (afore.transport.shm.PeerGone).");

  using G = nb::call_guard<nb::gil_scoped_release>;
  nb::class_<DataPlane>(m, "DataPlane", "The shm transport's hot path over a mapped segment (afore.transport.shm).")
      .def(nb::init<uintptr_t, int, int, int, int, int, int, int, bool, const std::map<std::string, int64_t>&>(), "base"_a,
           "num_attention"_a, "num_ffn"_a, "hidden"_a, "top_k"_a, "max_tokens"_a, "depth"_a, "dtype"_a, "exact"_a, "offsets"_a)
      .def("send_request", &DataPlane::send_request, G())
      .def("combine", &DataPlane::combine, G())
      .def("wait_reply", &DataPlane::wait_reply, G())
      .def("requests_ready", &DataPlane::requests_ready)
      .def("wait_requests", &DataPlane::wait_requests, G())
      .def("read_request", &DataPlane::read_request)
      .def("gather_routing", &DataPlane::gather_routing, G())
      .def("gather_rows", &DataPlane::gather_rows, G())
      .def("send_replies", &DataPlane::send_replies, G())
      .def("agree", &DataPlane::agree, G());

  nb::class_<StreamExchange>(m, "StreamExchange",
                             "One attention worker's exchange as CUDA host nodes (afore.attention.stream).")
      .def(nb::init<DataPlane*, int, int, uintptr_t, uintptr_t, uintptr_t, uintptr_t, int64_t, double, double, double,
                    const std::string&, int, int>(),
           "plane"_a, "rank"_a, "layers"_a, "rows"_a, "ids"_a, "weights"_a, "out"_a, "out_row_bytes"_a, "timeout_s"_a,
           "poll_s"_a, "spin_s"_a, "mailbox"_a = "", "num_experts"_a = 0, "top_k"_a = 0, nb::keep_alive<1, 2>())
      .def("call", &StreamExchange::call, "layer"_a, "n"_a)
      .def("run", [](StreamExchange& self, int layer, int64_t n) {
             self.run(*reinterpret_cast<StreamExchange::Call*>(self.call(layer, n)));
           }, "layer"_a, "n"_a, G())
      .def_static("host_node_address", [] { return reinterpret_cast<uintptr_t>(&StreamExchange::host_node); })
      .def("error", &StreamExchange::error)
      .def("take_records", &StreamExchange::take_records)
      .def("records_dropped", &StreamExchange::records_dropped)
      .def("stats", &StreamExchange::stats);
}

}  // namespace afore::shm
