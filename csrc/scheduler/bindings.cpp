// Python bindings of the scheduler core: module afore._scheduler_core.
//
// Arrays cross as numpy arrays without copies (nanobind ndarray views in, owned arrays out);
// afore/scheduler/core.py wraps them into Plan and SlotTable.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "scheduler/scheduler.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

template <typename T, size_t D>
using In = nb::ndarray<const T, nb::ndim<D>, nb::c_contig, nb::device::cpu>;
template <typename T, size_t D>
using Out = nb::ndarray<nb::numpy, T, nb::ndim<D>>;

template <typename T>
struct Buffer {
  T* data;
  nb::capsule owner;
  explicit Buffer(size_t n)
      : data(new T[n > 0 ? n : 1]),
        owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); }) {}
};

template <typename Array>
void check_shape(const Array& a, const char* field, std::initializer_list<int64_t> expected) {
  bool ok = a.ndim() == expected.size();
  std::string want = "(", got = "(";
  size_t i = 0;
  for (int64_t n : expected) {
    if (ok && static_cast<int64_t>(a.shape(i)) != n) ok = false;
    want += std::to_string(n) + (i + 1 < expected.size() ? ", " : ")");
    ++i;
  }
  for (size_t j = 0; j < a.ndim(); ++j) got += std::to_string(a.shape(j)) + (j + 1 < a.ndim() ? ", " : ")");
  if (!ok)
    throw std::invalid_argument(std::string(field) + ": expected shape " + want + ", got " + got);
}

afore::ScheduleInputs make_inputs(const afore::Scheduler& s, const In<int64_t, 1>& demand,
                                  const In<int32_t, 2>& table_expert,
                                  const In<int64_t, 2>& table_last_used,
                                  const In<bool, 2>& protected_slots,
                                  const std::optional<In<int32_t, 2>>& prev_assignment,
                                  int64_t theta, int64_t copy_budget, double beta_tile_ms,
                                  double copy_ms, double window_ms, int64_t seq, bool chains) {
  const int64_t E = s.num_experts(), F = s.num_workers(), R = s.redundant_slots();
  if (static_cast<int64_t>(demand.shape(0)) != E)
    throw std::invalid_argument("demand: expected a vector of length " + std::to_string(E) +
                                " (num_experts), got shape (" + std::to_string(demand.shape(0)) +
                                ",)");
  check_shape(table_expert, "slot_table.expert", {F, R});
  check_shape(table_last_used, "slot_table.last_used", {F, R});
  check_shape(protected_slots, "protected", {F, R});
  if (prev_assignment) check_shape(*prev_assignment, "prev_assignment", {E, F});
  afore::ScheduleInputs in;
  in.demand = demand.data();
  in.table_expert = table_expert.data();
  in.table_last_used = table_last_used.data();
  in.protected_slots = protected_slots.data();
  in.prev_assignment = prev_assignment ? prev_assignment->data() : nullptr;
  in.theta = theta;
  in.copy_budget = copy_budget;
  in.beta_tile_ms = beta_tile_ms;
  in.copy_ms = copy_ms;
  in.window_ms = window_ms;
  in.seq = seq;
  in.chains = chains;
  return in;
}

nb::tuple schedule(afore::Scheduler& s, const In<int64_t, 1>& demand,
                   const In<int32_t, 2>& table_expert, const In<int64_t, 2>& table_last_used,
                   const In<bool, 2>& protected_slots,
                   const std::optional<In<int32_t, 2>>& prev_assignment, int64_t theta,
                   int64_t copy_budget, double beta_tile_ms, double copy_ms, double window_ms,
                   int64_t seq, bool chains) {
  const afore::ScheduleInputs in =
      make_inputs(s, demand, table_expert, table_last_used, protected_slots, prev_assignment,
                  theta, copy_budget, beta_tile_ms, copy_ms, window_ms, seq, chains);
  const size_t E = s.num_experts(), F = s.num_workers(), R = s.redundant_slots();
  const size_t max_copies = static_cast<size_t>(std::max<int64_t>(0, std::min<int64_t>(copy_budget, F * R)));
  Buffer<bool> replicas(E * F);
  Buffer<int32_t> assignment(E * F), tiles(E * F), slot(E * F), tile_load(F), new_expert(F * R),
      copies(4 * max_copies);
  Buffer<int64_t> new_last_used(F * R);
  afore::ScheduleOutputs out{replicas.data,  assignment.data, tiles.data,        slot.data,
                             tile_load.data, new_expert.data, new_last_used.data, copies.data};
  s.run(in, out);
  return nb::make_tuple(
      Out<bool, 2>(replicas.data, {E, F}, replicas.owner),
      Out<int32_t, 2>(assignment.data, {E, F}, assignment.owner),
      Out<int32_t, 2>(tiles.data, {E, F}, tiles.owner),
      Out<int32_t, 2>(slot.data, {E, F}, slot.owner),
      Out<int32_t, 2>(copies.data, {static_cast<size_t>(out.num_copies), 4}, copies.owner),
      Out<int32_t, 1>(tile_load.data, {F}, tile_load.owner),
      Out<int32_t, 2>(new_expert.data, {F, R}, new_expert.owner),
      Out<int64_t, 2>(new_last_used.data, {F, R}, new_last_used.owner), out.gain_ms,
      out.exposed_ms);
}

int64_t schedule_bench(afore::Scheduler& s, const In<int64_t, 1>& demand,
                       const In<int32_t, 2>& table_expert, const In<int64_t, 2>& table_last_used,
                       const In<bool, 2>& protected_slots,
                       const std::optional<In<int32_t, 2>>& prev_assignment, int64_t theta,
                       int64_t copy_budget, double beta_tile_ms, double copy_ms,
                       double window_ms, int64_t seq, bool chains, int64_t repeats) {
  if (repeats < 1) throw std::invalid_argument("repeats: expected >= 1, got " + std::to_string(repeats));
  const afore::ScheduleInputs in =
      make_inputs(s, demand, table_expert, table_last_used, protected_slots, prev_assignment,
                  theta, copy_budget, beta_tile_ms, copy_ms, window_ms, seq, chains);
  const size_t E = s.num_experts(), F = s.num_workers(), R = s.redundant_slots();
  const size_t max_copies = static_cast<size_t>(std::max<int64_t>(0, std::min<int64_t>(copy_budget, F * R)));
  std::vector<uint8_t> replicas(E * F);
  std::vector<int32_t> assignment(E * F), tiles(E * F), slot(E * F), tile_load(F),
      new_expert(F * R), copies(4 * max_copies + 4);
  std::vector<int64_t> new_last_used(F * R);
  afore::ScheduleOutputs out{reinterpret_cast<bool*>(replicas.data()),
                             assignment.data(),
                             tiles.data(),
                             slot.data(),
                             tile_load.data(),
                             new_expert.data(),
                             new_last_used.data(),
                             copies.data()};
  std::vector<int64_t> samples(static_cast<size_t>(repeats));
  {
    nb::gil_scoped_release release;
    for (auto& sample : samples) {
      const auto t0 = std::chrono::steady_clock::now();
      s.run(in, out);
      const auto t1 = std::chrono::steady_clock::now();
      sample = std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
    }
  }
  std::nth_element(samples.begin(), samples.begin() + samples.size() / 2, samples.end());
  return samples[samples.size() / 2];
}

constexpr int64_t kInt32Max = 2147483647;

// Reductions without early exit, so that they vectorise (the build is -O2, where GCC does not
// vectorise by itself): a plan body is a few thousand int32 read by every worker per target.
#if defined(__GNUC__) && !defined(__clang__)
#define AFORE_VECTORIZE __attribute__((optimize("tree-vectorize")))
#else
#define AFORE_VECTORIZE
#endif
AFORE_VECTORIZE int32_t or_all(const int32_t* v, int64_t n) {  // negative iff some value is
  int32_t bits = 0;
  for (int64_t i = 0; i < n; ++i) bits |= v[i];
  return bits;
}
AFORE_VECTORIZE uint32_t any_outside(const int32_t* v, int64_t n, uint32_t limit) {
  uint32_t bad = 0;  // -1 <= v < limit - 1  <=>  (uint32)(v + 1) < limit
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<uint32_t>(v[i]) + 1u >= limit;
  return bad;
}

// The plan checksum (format version 3): "stripe64", an XXH3-style accumulator of our own that
// every reader pays for every plan. Eight 64-bit lanes take a 64-byte stripe at a time; lane j
// adds lo32(d ^ k) * hi32(d ^ k) of its word d and the neighbour lane's word (j ^ 1), with a
// key k that moves on by kQ every stripe (so the sum is not invariant under reordered stripes);
// every 16 stripes the lanes are scrambled; a partial last stripe is zero-padded (the length
// enters the final merge). XXH64, latency-bound on its four multiply chains, took 1.2 us for
// 13 KB on the 2-core dev CPU; the multiplies here are independent (scalar and AVX2 paths, the
// same arithmetic; afore/scheduler/plan_codec.py's stripe64_reference is the specification).
constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL, kP2 = 0xC2B2AE3D27D4EB4FULL, kQ = 0x165667B19E3779F9ULL,
                   kAvalanche = 0x165667919E3779F9ULL, kP32 = 0x9E3779B1ULL;
constexpr uint64_t kKey[8] = {0xBE4BA423396CFEB8ULL, 0x1CAD21F72C81017CULL, 0xDB979083E96DD4DEULL,
                              0x1F67B3B7A4A44072ULL, 0x78E5C0CC4EE679CBULL, 0x2172FFCC7DD05A82ULL,
                              0x8E2443F7744608B8ULL, 0x4C263A81E69035E0ULL};
constexpr uint64_t kInit[8] = {0x00000000C2B2AE3DULL, 0x9E3779B185EBCA87ULL, 0xC2B2AE3D27D4EB4FULL,
                               0x165667B19E3779F9ULL, 0x85EBCA77C2B2AE63ULL, 0x0000000085EBCA77ULL,
                               0x27D4EB2F165667C5ULL, 0x000000009E3779B1ULL};
constexpr size_t kStripe = 64, kBlockStripes = 16;
inline uint64_t read64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }

inline void stripe_scalar(uint64_t* acc, const uint8_t* p, uint64_t step) {
  uint64_t d[8];
  for (int j = 0; j < 8; ++j) d[j] = read64(p + 8 * j);
  for (int j = 0; j < 8; ++j) {
    const uint64_t dk = d[j] ^ (kKey[j] + step);
    acc[j] += (dk & 0xFFFFFFFFULL) * (dk >> 32) + d[j ^ 1];
  }
}

inline void scramble_scalar(uint64_t* acc) {
  for (int j = 0; j < 8; ++j) acc[j] = (acc[j] ^ (acc[j] >> 47) ^ kKey[j]) * kP32;
}

void stripes_scalar(uint64_t* acc, const uint8_t* p, size_t stripes, uint64_t& step) {
  // the lanes in locals: stores through acc could alias the uint8_t input and force reloads
  uint64_t a[8];
  for (int j = 0; j < 8; ++j) a[j] = acc[j];
  uint64_t st = step;
  for (size_t s = 0; s < stripes; ++s, st += kQ) {
    stripe_scalar(a, p + s * kStripe, st);
    if (s % kBlockStripes == kBlockStripes - 1) scramble_scalar(a);
  }
  for (int j = 0; j < 8; ++j) acc[j] = a[j];
  step = st;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define AFORE_STRIPE_AVX2 1
__attribute__((target("avx2"))) void stripes_avx2(uint64_t* acc, const uint8_t* p, size_t stripes, uint64_t& step) {
  __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc));
  __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 4));
  const __m256i k0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kKey));
  const __m256i k1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kKey + 4));
  const __m256i q = _mm256_set1_epi64x(static_cast<long long>(kQ));
  const __m256i p32 = _mm256_set1_epi64x(static_cast<long long>(kP32));
  __m256i st = _mm256_set1_epi64x(static_cast<long long>(step));
  for (size_t s = 0; s < stripes; ++s) {
    const __m256i d0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + s * kStripe));
    const __m256i d1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + s * kStripe + 32));
    const __m256i dk0 = _mm256_xor_si256(d0, _mm256_add_epi64(k0, st));
    const __m256i dk1 = _mm256_xor_si256(d1, _mm256_add_epi64(k1, st));
    // lo32 * hi32 of each 64-bit lane; the neighbour's word: swap the 64-bit halves of each 128-bit lane
    a0 = _mm256_add_epi64(a0, _mm256_add_epi64(_mm256_mul_epu32(dk0, _mm256_srli_epi64(dk0, 32)),
                                               _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2))));
    a1 = _mm256_add_epi64(a1, _mm256_add_epi64(_mm256_mul_epu32(dk1, _mm256_srli_epi64(dk1, 32)),
                                               _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2))));
    st = _mm256_add_epi64(st, q);
    if (s % kBlockStripes == kBlockStripes - 1) {
      // (a ^ a >> 47 ^ key) * P32 (mod 2**64) = lo * P32 + (hi * P32 << 32)
      const __m256i x0 = _mm256_xor_si256(_mm256_xor_si256(a0, _mm256_srli_epi64(a0, 47)), k0);
      const __m256i x1 = _mm256_xor_si256(_mm256_xor_si256(a1, _mm256_srli_epi64(a1, 47)), k1);
      a0 = _mm256_add_epi64(_mm256_mul_epu32(x0, p32), _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x0, 32), p32), 32));
      a1 = _mm256_add_epi64(_mm256_mul_epu32(x1, p32), _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x1, 32), p32), 32));
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + 4), a1);
  step += kQ * stripes;
}
#endif

// -1: the CPU's best path (AVX2 where it has it), 0: scalar, 1: AVX2 (tests run both)
int g_stripe_path = -1;

bool use_avx2() {
#ifdef AFORE_STRIPE_AVX2
  static const bool has = __builtin_cpu_supports("avx2");
  return g_stripe_path == 1 ? has : (g_stripe_path == 0 ? false : has);
#else
  return false;
#endif
}

inline uint64_t fold_mul(uint64_t a, uint64_t b) {
  const unsigned __int128 m = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(m) ^ static_cast<uint64_t>(m >> 64);
}

uint64_t stripe64(const uint8_t* p, size_t n) {
  uint64_t acc[8];
  std::memcpy(acc, kInit, sizeof acc);
  uint64_t step = 0;
  const size_t full = n / kStripe;
#ifdef AFORE_STRIPE_AVX2
  if (use_avx2()) {
    // whole blocks keep the scramble schedule aligned; the rest goes the scalar way
    const size_t blocks = full / kBlockStripes * kBlockStripes;
    stripes_avx2(acc, p, blocks, step);
    stripes_scalar(acc, p + blocks * kStripe, full - blocks, step);
  } else {
    stripes_scalar(acc, p, full, step);
  }
#else
  stripes_scalar(acc, p, full, step);
#endif
  if (const size_t rest = n % kStripe) {
    uint8_t last[kStripe] = {};
    std::memcpy(last, p + full * kStripe, rest);
    stripe_scalar(acc, last, step);
  }
  uint64_t h = static_cast<uint64_t>(n) * kP1;
  for (int i = 0; i < 4; ++i) h += fold_mul(acc[2 * i] ^ kKey[7 - 2 * i], acc[2 * i + 1] ^ (kKey[6 - 2 * i] + kP2));
  h ^= h >> 37;
  h *= kAvalanche;
  h ^= h >> 32;
  return h;
}

using Bytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

uint32_t plan_checksum(const Bytes& data, size_t start) {
  if (start > data.shape(0)) throw std::invalid_argument("plan: checksum start beyond the data");
  return static_cast<uint32_t>(stripe64(data.data() + start, data.shape(0) - start));
}

// The int32 body of an encoded plan (afore/scheduler/plan_codec.py), checked in place (no copy):
// every value a worker indexes with, counts (demand, assignment, tiles) >= 0, slots in
// [-1, k_max), copies' expert < E, workers < F, slot < k_max. The reader's arrays are views of
// the buffer the ring copied the entry into.
void check_plan_body(const Bytes& data, size_t offset, int64_t e, int64_t f, int64_t c, int64_t k_max) {
  const int64_t ef = e * f, counts = e + 2 * ef, n = counts + ef + f + 4 * c;
  const size_t size = data.shape(0);
  if (e < 0 || f < 0 || c < 0 || offset > size || size - offset != static_cast<size_t>(4 * n))
    throw std::invalid_argument("plan.body: expected " + std::to_string(4 * n) + " bytes");
  const uint8_t* base = data.data() + offset;
  if (reinterpret_cast<uintptr_t>(base) % alignof(int32_t) != 0)
    throw std::invalid_argument("plan.body: expected a 4-byte aligned buffer");
  const int32_t* v = reinterpret_cast<const int32_t*>(base);
  if (or_all(v, counts) < 0) throw std::invalid_argument("plan: negative demand, assignment or tiles");
  if (k_max < 0 || k_max >= kInt32Max || any_outside(v + counts, ef, static_cast<uint32_t>(k_max) + 1u))
    throw std::invalid_argument("plan.slot: expected values in [-1, " + std::to_string(k_max) + ")");
  const int64_t bound[4] = {e, f, f, k_max};
  for (int64_t i = 0; i < 4 * c; ++i) {
    const int32_t x = v[counts + ef + f + i];
    if (x < 0 || x >= bound[i % 4]) throw std::invalid_argument("plan.copies: expert, worker or slot out of range");
  }
}


// The wire form of a plan (afore/scheduler/plan_codec.py encode_plan), byte for byte: the prefix,
// PlanHeader as msgspec writes it (a fixarray of 10: the smallest msgpack integers, float64
// floats, booleans), zero padding to 4 bytes, the int32 body and the XXH64 checksum. The
// scheduler's publish path (one call instead of six array copies, a msgpack encode and a join).
struct MsgpackWriter {
  std::string out;
  void uint(uint64_t v) {
    if (v < 128) {
      out.push_back(char(v));
    } else if (v <= 0xff) {
      out.push_back(char(0xcc)), be(v, 1);
    } else if (v <= 0xffff) {
      out.push_back(char(0xcd)), be(v, 2);
    } else if (v <= 0xffffffffULL) {
      out.push_back(char(0xce)), be(v, 4);
    } else {
      out.push_back(char(0xcf)), be(v, 8);
    }
  }
  void f64(double d) {
    uint64_t v;
    std::memcpy(&v, &d, 8);
    out.push_back(char(0xcb)), be(v, 8);
  }
  void be(uint64_t v, int n) {
    for (int i = n - 1; i >= 0; --i) out.push_back(char((v >> (8 * i)) & 0xff));
  }
};

using I32 = nb::ndarray<const int32_t, nb::c_contig, nb::device::cpu>;
using I64 = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

nb::bytes encode_plan_entry(int64_t step, int64_t layer, int64_t microbatch, int64_t seq, double gain_ms,
                            double exposed_ms, bool primary_only, const I64& demand, const I32& assignment,
                            const I32& tiles, const I32& slot, const I32& tile_load, const I32& copies,
                            int version) {
  const int64_t e = int64_t(demand.shape(0));
  if (assignment.ndim() != 2 || int64_t(assignment.shape(0)) != e)
    throw std::invalid_argument("plan.assignment: expected shape [E, F]");
  const int64_t f = int64_t(assignment.shape(1)), ef = e * f;
  if (int64_t(tiles.size()) != ef || int64_t(slot.size()) != ef || int64_t(tile_load.size()) != f)
    throw std::invalid_argument("plan: tiles, slot expected [E, F], tile_load [F]");
  if (copies.size() % 4) throw std::invalid_argument("plan.copies: expected rows of 4");
  const int64_t c = int64_t(copies.size() / 4);
  if (step < 0 || layer < 0 || microbatch < 0 || seq < 0) throw std::invalid_argument("plan: negative target or seq");
  const int64_t* d = demand.data();
  for (int64_t i = 0; i < e; ++i)
    if (d[i] > kInt32Max) throw std::invalid_argument("demand: expected counts <= 2147483647 (int32 on the wire)");
  MsgpackWriter w;
  w.out.push_back(char(0x9a));
  for (int64_t v : {step, layer, microbatch, seq, e, f, c}) w.uint(uint64_t(v));
  w.f64(gain_ms), w.f64(exposed_ms);
  w.out.push_back(char(primary_only ? 0xc3 : 0xc2));
  while (w.out.size() % 4) w.out.push_back('\0');
  const size_t head = w.out.size(), body = size_t(4 * (e + 3 * ef + f + 4 * c)), total = 12 + head + body;
  std::string buf(total, '\0');
  uint8_t* b = reinterpret_cast<uint8_t*>(buf.data());
  std::memcpy(b + 12, w.out.data(), head);
  int32_t* o = reinterpret_cast<int32_t*>(b + 12 + head);
  for (int64_t i = 0; i < e; ++i) o[i] = int32_t(d[i]);
  o += e;
  std::memcpy(o, assignment.data(), size_t(4 * ef)), o += ef;
  std::memcpy(o, tiles.data(), size_t(4 * ef)), o += ef;
  std::memcpy(o, slot.data(), size_t(4 * ef)), o += ef;
  std::memcpy(o, tile_load.data(), size_t(4 * f)), o += f;
  std::memcpy(o, copies.data(), size_t(16 * c));
  std::memcpy(b, "AFPL", 4);
  const uint16_t ver = uint16_t(version), hl = uint16_t(head);
  std::memcpy(b + 4, &ver, 2), std::memcpy(b + 6, &hl, 2);
  const uint32_t crc = uint32_t(stripe64(b + 12, total - 12));
  std::memcpy(b + 8, &crc, 4);
  return nb::bytes(buf.data(), buf.size());
}

// The subset of msgpack that msgspec writes for PlanHeader: integers, floats, booleans.
struct MsgpackReader {
  const uint8_t* p;
  const uint8_t* end;
  bool ok = true;
  uint8_t byte() {
    if (p >= end) {
      ok = false;
      return 0;
    }
    return *p++;
  }
  uint64_t big_endian(int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v = (v << 8) | byte();
    return v;
  }
  bool integer(int64_t& out) {
    const uint8_t b = byte();
    if (b <= 0x7f) out = b;
    else if (b >= 0xe0) out = static_cast<int8_t>(b);
    else if (b == 0xcc) out = static_cast<int64_t>(big_endian(1));
    else if (b == 0xcd) out = static_cast<int64_t>(big_endian(2));
    else if (b == 0xce) out = static_cast<int64_t>(big_endian(4));
    else if (b == 0xcf) {
      const uint64_t v = big_endian(8);
      if (v > static_cast<uint64_t>(INT64_MAX)) return false;
      out = static_cast<int64_t>(v);
    } else if (b == 0xd0) out = static_cast<int8_t>(big_endian(1));
    else if (b == 0xd1) out = static_cast<int16_t>(big_endian(2));
    else if (b == 0xd2) out = static_cast<int32_t>(big_endian(4));
    else if (b == 0xd3) out = static_cast<int64_t>(big_endian(8));
    else return false;
    return ok;
  }
  bool number(double& out) {
    if (p < end && (*p == 0xcb || *p == 0xca)) {
      const bool wide = byte() == 0xcb;
      const uint64_t bits = big_endian(wide ? 8 : 4);
      if (wide) {
        std::memcpy(&out, &bits, 8);
      } else {
        const uint32_t narrow = static_cast<uint32_t>(bits);
        float f;
        std::memcpy(&f, &narrow, 4);
        out = f;
      }
      return ok;
    }
    int64_t v;
    if (!integer(v)) return false;
    out = static_cast<double>(v);
    return true;
  }
  bool boolean(bool& out) {
    const uint8_t b = byte();
    out = b == 0xc3;
    return ok && (b == 0xc2 || b == 0xc3);
  }
};

// plan_codec.decode_worker_plan's checks in one pass over the entry, in place: prefix, checksum,
// header (msgpack, PlanHeader's 10 fields), shape, target, lengths and the body's value ranges.
// Returns (step, layer, microbatch, seq, num_copies, gain_ms, exposed_ms, primary_only, body offset,
// the checksum, the address of the entry's first byte).
nb::tuple decode_plan_entry(const Bytes& data, int64_t e_expected, int64_t f_expected,
                            int64_t num_layers, int64_t k_max, int64_t version) {
  const uint8_t* base = data.data();
  const size_t size = data.shape(0);
  constexpr size_t kPrefix = 12;
  if (size < kPrefix)
    throw std::invalid_argument("plan: expected at least 12 bytes, got " + std::to_string(size));
  if (std::memcmp(base, "AFPL", 4) != 0) throw std::invalid_argument("plan.magic: expected b'AFPL'");
  uint16_t got_version, head_len;
  uint32_t sum;
  std::memcpy(&got_version, base + 4, 2);
  std::memcpy(&head_len, base + 6, 2);
  std::memcpy(&sum, base + 8, 4);
  if (got_version != version)
    throw std::invalid_argument("plan.version: expected " + std::to_string(version) + ", got " +
                                std::to_string(got_version));
  if (head_len % 4 || kPrefix + head_len > size)
    throw std::invalid_argument("plan.header_length: expected a multiple of 4 within " +
                                std::to_string(size - kPrefix) + " bytes, got " + std::to_string(head_len));
  if (static_cast<uint32_t>(stripe64(base + kPrefix, size - kPrefix)) != sum)
    throw std::invalid_argument("plan.checksum: mismatch (torn or corrupted plan)");
  MsgpackReader r{base + kPrefix, base + kPrefix + head_len};
  int64_t v[7];
  double gain = 0, exposed = 0;
  bool primary_only = false;
  bool ok = r.byte() == 0x9a;  // fixarray of 10
  for (int i = 0; i < 7 && ok; ++i) ok = r.integer(v[i]);
  ok = ok && r.number(gain) && r.number(exposed) && r.boolean(primary_only);
  for (const uint8_t* q = r.p; ok && q < r.end; ++q) ok = *q == 0;  // zero padding only
  if (!ok) throw std::invalid_argument("plan.header: malformed (not a PlanHeader)");
  const int64_t step = v[0], layer = v[1], microbatch = v[2], seq = v[3], e = v[4], f = v[5], c = v[6];
  if (e != e_expected || f != f_expected)
    throw std::invalid_argument("plan.shape: expected (num_experts, num_workers) = (" + std::to_string(e_expected) +
                                ", " + std::to_string(f_expected) + "), got (" + std::to_string(e) + ", " +
                                std::to_string(f) + ")");
  if (c < 0 || c > e * f)
    throw std::invalid_argument("plan.num_copies: expected in [0, " + std::to_string(e * f) + "], got " +
                                std::to_string(c));
  if (step < 0 || layer < 0 || microbatch < 0 || seq < 0)
    throw std::invalid_argument("plan.target: expected non-negative step, layer, microbatch and seq");
  if (layer >= num_layers)
    throw std::invalid_argument("plan.layer: expected in [0, " + std::to_string(num_layers) + "), got " +
                                std::to_string(layer));
  const size_t offset = kPrefix + head_len;
  check_plan_body(data, offset, e, f, c, k_max);
  return nb::make_tuple(step, layer, microbatch, seq, c, gain, exposed, primary_only, offset, sum,
                        reinterpret_cast<uintptr_t>(base));
}

// bool[F, R]: redundant slot (w, r) holds an expert e (table_expert[w, r] >= 0) that has pairs on w
// in the plan (assignment[e, w] > 0) bound to that very slot (slot[e, w] == primary_counts[w] + r):
// the protected slots U of the layer's next target (policies/base.py slots_with_work).
Out<bool, 2> slots_with_work(const In<int32_t, 2>& table_expert, const In<int32_t, 2>& assignment,
                             const In<int32_t, 2>& slot, const In<int64_t, 1>& primary_counts) {
  const int64_t f = static_cast<int64_t>(table_expert.shape(0)), r = static_cast<int64_t>(table_expert.shape(1));
  const int64_t e = static_cast<int64_t>(assignment.shape(0));
  check_shape(assignment, "assignment", {e, f});
  check_shape(slot, "slot", {e, f});
  check_shape(primary_counts, "primary_counts", {f});
  Buffer<bool> out(static_cast<size_t>(f * r));
  const int32_t* ex = table_expert.data();
  const int32_t* a = assignment.data();
  const int32_t* sl = slot.data();
  const int64_t* pc = primary_counts.data();
  for (int64_t w = 0; w < f; ++w) {
    for (int64_t j = 0; j < r; ++j) {
      const int32_t x = ex[w * r + j];
      bool work = false;
      if (x >= 0) {
        if (x >= e) throw std::invalid_argument("table_expert: expert " + std::to_string(x) + " out of range");
        work = a[x * f + w] > 0 && sl[x * f + w] == pc[w] + j;
      }
      out.data[w * r + j] = work;
    }
  }
  size_t shape[2] = {static_cast<size_t>(f), static_cast<size_t>(r)};
  return Out<bool, 2>(out.data, 2, shape, out.owner);
}

}  // namespace

NB_MODULE(_scheduler_core, m) {
  m.def("slots_with_work", &slots_with_work, "table_expert"_a, "assignment"_a, "slot"_a, "primary_counts"_a,
        "bool[F, R]: the redundant slots whose expert has pairs on their worker in the plan, bound to that "
        "slot (int32 table_expert[F, R], assignment[E, F], slot[E, F], int64 primary_counts[F]).");
  m.def("decode_plan_entry", &decode_plan_entry, "data"_a, "num_experts"_a, "num_workers"_a,
        "num_layers"_a, "k_max"_a, "version"_a,
        "Every check of plan_codec.decode_worker_plan on an encoded plan (uint8[n]) in one pass, in "
        "place; returns (step, layer, microbatch, seq, num_copies, gain_ms, exposed_ms, "
        "primary_only, body_offset, checksum, address of data[0]). Raises ValueError.");
  m.def("encode_plan_entry", &encode_plan_entry, "step"_a, "layer"_a, "microbatch"_a, "seq"_a, "gain_ms"_a,
        "exposed_ms"_a, "primary_only"_a, "demand"_a, "assignment"_a, "tiles"_a, "slot"_a, "tile_load"_a,
        "copies"_a, "version"_a);
  m.def("plan_checksum", &plan_checksum, "data"_a, "start"_a,
        "uint32: the low 32 bits of stripe64 of data[start:] (uint8[n]): the plan checksum.");
  m.def("_set_checksum_path", [](int path) {
        if (path < -1 || path > 1) throw std::invalid_argument("path: expected -1 (best), 0 (scalar) or 1 (AVX2)");
        g_stripe_path = path;
        return use_avx2();
      }, "path"_a, "Tests: the stripe64 path (-1: the CPU's best, 0: scalar, 1: AVX2 where the CPU has it); "
         "returns whether AVX2 is used now.");
  m.def("check_plan_body", &check_plan_body, "data"_a, "offset"_a, "num_experts"_a, "num_workers"_a,
        "num_copies"_a, "k_max"_a,
        "The range checks of the plan body on data[offset:] (uint8[n], 4-byte aligned) in place, "
        "without a copy (plan_codec.decode_worker_plan). Raises ValueError.");
  m.doc() = "AFORE Algorithm 1 (C++ core); use afore.scheduler.core.schedule.";
  nb::class_<afore::Scheduler>(m, "Scheduler",
                               "Planner for one cluster shape; holds preallocated scratch. "
                               "Not thread-safe: one call at a time per object.")
      .def(nb::init<int64_t, int64_t, int64_t, int64_t, const std::vector<int32_t>&>(),
           "num_experts"_a, "num_workers"_a, "redundant_slots"_a, "m_tile"_a,
           "primary_owner"_a = std::vector<int32_t>(),
           "primary_owner: int[E] owner worker of each expert (ClusterShape.primaries); "
           "empty = contiguous blocks.")
      .def_prop_ro("num_experts", &afore::Scheduler::num_experts)
      .def_prop_ro("num_workers", &afore::Scheduler::num_workers)
      .def_prop_ro("redundant_slots", &afore::Scheduler::redundant_slots)
      .def_prop_ro("m_tile", &afore::Scheduler::m_tile)
      .def_prop_ro("last_within_moves", &afore::Scheduler::last_within_moves,
                   "Moves of the last call within the placement.")
      .def_prop_ro("last_within_chains", &afore::Scheduler::last_within_chains,
                   "Ejection chains of the last call applied within the placement.")
      .def_prop_ro("last_beyond_moves", &afore::Scheduler::last_beyond_moves,
                   "Tile moves of the last call beyond the placement (explored, kept or not; "
                   "a chain counts its hops).")
      .def("schedule", &schedule, "demand"_a, "table_expert"_a, "table_last_used"_a,
           "protected"_a, "prev_assignment"_a.none(), "theta"_a, "copy_budget"_a,
           "beta_tile_ms"_a, "copy_ms"_a, "window_ms"_a, "seq"_a, "chains"_a,
           "Plan one target. Returns (replicas bool[E,F], assignment int32[E,F], "
           "tiles int32[E,F], slot int32[E,F], copies int32[C,4], tile_load int32[F], "
           "new_expert int32[F,R], new_last_used int64[F,R], gain_ms, exposed_ms).")
      .def("schedule_bench", &schedule_bench, "demand"_a, "table_expert"_a,
           "table_last_used"_a, "protected"_a, "prev_assignment"_a.none(), "theta"_a,
           "copy_budget"_a, "beta_tile_ms"_a, "copy_ms"_a, "window_ms"_a, "seq"_a, "chains"_a,
           "repeats"_a,
           "Run the same call `repeats` times into reused buffers (GIL released) and return "
           "the median wall time of one call in ns: the core alone, validation and full "
           "dense plan output included, Python object creation excluded.");
}
