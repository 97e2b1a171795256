// afore._ffn: a CPU FFN worker's sparse step (afore.ffn.experts.host_sparse_step) in one call.
//
// At decode loads a CPU worker runs a handful of pairs on small experts, and the step that
// does it in numpy and torch pays a few microseconds for each of its ~40 small ops (measured:
// 238 us median per target on the built-in checkpoint, 2 cores, `python -m afore.bench.hotpath`).
// Here the same step is two calls without the GIL:
//
//   route    eq. 11 for this worker over the host ids (the partition of afore.ffn.device_plan's
//            table: lo[e], hi[e] ordinal bounds, slot[e]); the tokens it computes, ascending
//   compute  per slot, each weight row read once against every pair of the slot (gate/up, SiLU,
//            down), the routing weight, and the sum over a token's k pairs into its output row
//
// Numerics follow the torch path step for step (fp32 accumulation; in bfloat16 the gate/up
// product, the activation and the down product are each rounded to bfloat16 where torch rounds
// them; the weighted sum over k in fp32, rounded once). Only the order of the additions inside a
// dot product differs: the results agree to fp32 rounding, not bit for bit.
//
// Every pointer comes from the Python side after its checks (dtype, shape, contiguity); every id
// read here is range-checked before it indexes anything.
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace {

enum Dtype : int { kF32 = 0, kBF16 = 1 };

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// round to nearest even, as torch's float -> bfloat16 (NaN stays NaN)
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float round_to(float f, int dtype) { return dtype == kBF16 ? bf16_to_f32(f32_to_bf16(f)) : f; }

// dot(w[0:n], x[0:n]) with w in `dtype`, x fp32
float dot_generic(const void* w, const float* x, int64_t n, int dtype) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  if (dtype == kF32) {
    const float* p = static_cast<const float*>(w);
    for (; i + 8 <= n; i += 8)
      for (int j = 0; j < 8; ++j) acc[j] += p[i + j] * x[i + j];
    for (; i < n; ++i) acc[0] += p[i] * x[i];
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(w);
    for (; i + 8 <= n; i += 8)
      for (int j = 0; j < 8; ++j) acc[j] += bf16_to_f32(p[i + j]) * x[i + j];
    for (; i < n; ++i) acc[0] += bf16_to_f32(p[i]) * x[i];
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) inline __m256 load_bf16x8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,fma"))) float dot_avx2(const void* w, const float* x, int64_t n, int dtype) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  if (dtype == kF32) {
    const float* p = static_cast<const float*>(w);
    for (; i + 16 <= n; i += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(x + i), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(p + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(x + i), a0);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(w);
    for (; i + 16 <= n; i += 16) {
      a0 = _mm256_fmadd_ps(load_bf16x8(p + i), _mm256_loadu_ps(x + i), a0);
      a1 = _mm256_fmadd_ps(load_bf16x8(p + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load_bf16x8(p + i), _mm256_loadu_ps(x + i), a0);
  }
  __m256 s = _mm256_add_ps(a0, a1);
  __m128 lo = _mm256_castps256_ps128(s), hi = _mm256_extractf128_ps(s, 1);
  __m128 q = _mm_add_ps(lo, hi);
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  float acc = _mm_cvtss_f32(q);
  if (dtype == kF32) {
    const float* p = static_cast<const float*>(w);
    for (; i < n; ++i) acc += p[i] * x[i];
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(w);
    for (; i < n; ++i) acc += bf16_to_f32(p[i]) * x[i];
  }
  return acc;
}
#endif

using DotFn = float (*)(const void*, const float*, int64_t, int);

DotFn pick_dot() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return dot_avx2;
#endif
  return dot_generic;
}

const DotFn g_dot = pick_dot();

// One worker's scratch, reused from target to target (no allocation on the step once warm).
class HostStep {
 public:
  // Eq. 11 over ids int32[n*k] under table int32[3*ep + 1]: writes the ascending tokens this
  // worker computes a pair of into tokens_out (int64, room for n) and returns (U, bad ids).
  std::tuple<int64_t, int64_t> route(uintptr_t ids_ptr, int64_t n, int64_t k, uintptr_t table_ptr, int64_t num_experts,
                                     int64_t ep, int64_t num_slots, uintptr_t tokens_out) {
    if (n < 0 || k < 1 || num_experts < 0 || ep < num_experts || num_slots < 0)
      throw std::invalid_argument("route: bad sizes");
    const int32_t* ids = reinterpret_cast<const int32_t*>(ids_ptr);
    const int32_t* table = reinterpret_cast<const int32_t*>(table_ptr);
    int64_t* tokens = reinterpret_cast<int64_t*>(tokens_out);
    n_ = n, k_ = k;
    seen_.assign(size_t(num_experts), 0);
    pair_slot_.clear();
    pair_index_.clear();
    token_row_.assign(size_t(n), -1);
    int64_t bad = 0, u = 0;
    nb::gil_scoped_release release;
    for (int64_t p = 0; p < n * k; ++p) {
      const int32_t e = ids[p];
      if (e < 0 || e >= num_experts) {
        ++bad;
        continue;
      }
      const int64_t ord = seen_[size_t(e)]++;
      if (ord < table[e] || ord >= table[ep + e]) continue;
      const int32_t slot = table[2 * ep + e];
      if (slot < 0 || slot >= num_slots)
        throw std::invalid_argument("route: expert " + std::to_string(e) + " bound to slot " + std::to_string(slot) +
                                    ", outside [0, " + std::to_string(num_slots) + ")");
      pair_slot_.push_back(slot);
      pair_index_.push_back(p);
      token_row_[size_t(p / k)] = 0;
    }
    for (int64_t t = 0; t < n; ++t)
      if (token_row_[size_t(t)] == 0) {
        token_row_[size_t(t)] = u;
        tokens[u++] = t;
      }
    u_ = u;
    // pairs grouped by slot (counting sort: routing order inside a slot)
    slot_offs_.assign(size_t(num_slots) + 1, 0);
    for (int32_t s : pair_slot_) ++slot_offs_[size_t(s) + 1];
    for (int64_t s = 0; s < num_slots; ++s) slot_offs_[size_t(s) + 1] += slot_offs_[size_t(s)];
    by_slot_.resize(pair_slot_.size());
    fill_.assign(slot_offs_.begin(), slot_offs_.end() - 1);
    for (size_t i = 0; i < pair_slot_.size(); ++i) by_slot_[size_t(fill_[size_t(pair_slot_[i])]++)] = int64_t(i);
    return {u, bad};
  }

  // The step after route: x rows (row `t` of token t, row_stride elements apart, `dtype`),
  // w13 [S, 2I, H], w2 [S, H, I] (`dtype`; each slot contiguous, slots w13_stride and
  // w2_stride elements apart: the slot pool's one storage), weights fp32 [n*k]; out [U, H].
  void compute(uintptr_t x_ptr, int64_t row_stride, uintptr_t weights_ptr, uintptr_t w13_ptr, int64_t w13_stride,
               uintptr_t w2_ptr, int64_t w2_stride, int64_t hidden, int64_t inter, int dtype, uintptr_t out_ptr) {
    if (dtype != kF32 && dtype != kBF16) throw std::invalid_argument("compute: dtype code must be 0 (fp32) or 1 (bf16)");
    if (hidden < 1 || inter < 1 || row_stride < hidden || w13_stride < 2 * inter * hidden || w2_stride < hidden * inter) throw std::invalid_argument("compute: bad sizes");
    const size_t elt = dtype == kF32 ? 4 : 2;
    const char* x = reinterpret_cast<const char*>(x_ptr);
    const float* weights = reinterpret_cast<const float*>(weights_ptr);
    const char* w13 = reinterpret_cast<const char*>(w13_ptr);
    const char* w2 = reinterpret_cast<const char*>(w2_ptr);
    nb::gil_scoped_release release;
    const size_t npairs = pair_slot_.size();
    // per (token row, k) the weighted down product; zero where another worker runs the pair
    acc_.assign(size_t(u_ * k_ * hidden), 0.0f);
    xs_.resize(npairs * size_t(hidden));
    gu_.resize(npairs * size_t(2 * inter));
    act_.resize(npairs * size_t(inter));
    // the pairs' input rows in fp32 (in the pool's dtype first: torch's `.to(dtype)`)
    for (size_t i = 0; i < npairs; ++i) {
      const int64_t t = pair_index_[i] / k_;
      const char* row = x + size_t(t * row_stride) * elt;
      float* dst = xs_.data() + i * size_t(hidden);
      if (dtype == kF32)
        std::memcpy(dst, row, size_t(hidden) * 4);
      else
        for (int64_t h = 0; h < hidden; ++h) dst[h] = bf16_to_f32(reinterpret_cast<const uint16_t*>(row)[h]);
    }
    const size_t slots = slot_offs_.size() - 1;
    for (size_t s = 0; s < slots; ++s) {
      const int64_t b = slot_offs_[s], e = slot_offs_[s + 1];
      if (b == e) continue;
      const char* w13s = w13 + s * size_t(w13_stride) * elt;
      const char* w2s = w2 + s * size_t(w2_stride) * elt;
      for (int64_t j = 0; j < 2 * inter; ++j) {  // gate/up: each weight row against every pair of the slot
        const void* wrow = w13s + size_t(j * hidden) * elt;
        for (int64_t q = b; q < e; ++q) {
          const size_t i = size_t(by_slot_[size_t(q)]);
          gu_[i * size_t(2 * inter) + size_t(j)] = round_to(g_dot(wrow, xs_.data() + i * size_t(hidden), hidden, dtype), dtype);
        }
      }
      for (int64_t q = b; q < e; ++q) {  // SiLU(gate) * up in fp32, in the pool's dtype
        const size_t i = size_t(by_slot_[size_t(q)]);
        const float* g = gu_.data() + i * size_t(2 * inter);
        float* a = act_.data() + i * size_t(inter);
        for (int64_t c = 0; c < inter; ++c) {
          const float gate = g[c];
          a[c] = round_to(gate / (1.0f + std::exp(-gate)) * g[inter + c], dtype);
        }
      }
      for (int64_t h = 0; h < hidden; ++h) {  // down, times the routing weight
        const void* wrow = w2s + size_t(h * inter) * elt;
        for (int64_t q = b; q < e; ++q) {
          const size_t i = size_t(by_slot_[size_t(q)]);
          const int64_t p = pair_index_[i];
          const float y = round_to(g_dot(wrow, act_.data() + i * size_t(inter), inter, dtype), dtype);
          acc_[(size_t(token_row_[size_t(p / k_)] * k_ + p % k_)) * size_t(hidden) + size_t(h)] = y * weights[p];
        }
      }
    }
    // sum over a token's k pairs in k order (torch: per_pair.view(U, k, H).sum(1)), then the dtype
    for (int64_t r = 0; r < u_; ++r)
      for (int64_t h = 0; h < hidden; ++h) {
        float sum = 0.0f;
        for (int64_t j = 0; j < k_; ++j) sum += acc_[size_t((r * k_ + j) * hidden + h)];
        if (dtype == kF32)
          reinterpret_cast<float*>(out_ptr)[r * hidden + h] = sum;
        else
          reinterpret_cast<uint16_t*>(out_ptr)[r * hidden + h] = f32_to_bf16(sum);
      }
  }

  int64_t pairs() const { return int64_t(pair_slot_.size()); }

 private:
  int64_t n_ = 0, k_ = 1, u_ = 0;
  std::vector<int64_t> seen_, pair_index_, token_row_, slot_offs_, fill_, by_slot_;
  std::vector<int32_t> pair_slot_;
  std::vector<float> acc_, xs_, gu_, act_;
};


// Eq. 11 for one GPU worker fed by a host transport (afore.ffn.layer.host_route): over ids
// int32[n*k] under this worker's plan table int32[3*ep + 1], the ascending tokens it computes a
// pair of (tokens_out int64, room for n), their ids and routing weights packed in that order
// (ids_out int32 / weights_out fp32, room for n*k, from weights fp32[n*k]) and the local table
// (local_out int32[3*ep + 1]) under which the device step, given only those tokens, runs exactly
// this worker's pairs: for each expert e it runs, lo = the kept pairs of e ranked below its
// interval [lo_e, hi_e), hi = lo + its pairs of e; slots as in the table; n = U * k. Returns
// (U, ids outside [0, E) on the tokens left out: the step counts those of the kept tokens).
std::tuple<int64_t, int64_t> route_local(uintptr_t ids_ptr, uintptr_t weights_ptr, int64_t n, int64_t k,
                                         uintptr_t table_ptr, int64_t num_experts, int64_t ep, uintptr_t tokens_out,
                                         uintptr_t ids_out, uintptr_t weights_out, uintptr_t local_out) {
  if (n < 0 || k < 1 || num_experts < 0 || ep < num_experts) throw std::invalid_argument("route_local: bad sizes");
  const int32_t* ids = reinterpret_cast<const int32_t*>(ids_ptr);
  const float* weights = reinterpret_cast<const float*>(weights_ptr);
  const int32_t* table = reinterpret_cast<const int32_t*>(table_ptr);
  int64_t* tokens = reinterpret_cast<int64_t*>(tokens_out);
  int32_t* ids_o = reinterpret_cast<int32_t*>(ids_out);
  float* weights_o = reinterpret_cast<float*>(weights_out);
  int32_t* local = reinterpret_cast<int32_t*>(local_out);
  nb::gil_scoped_release release;
  thread_local std::vector<int64_t> seen, start, count;
  thread_local std::vector<int32_t> ord;
  thread_local std::vector<uint8_t> keep;
  seen.assign(size_t(num_experts), 0);
  start.assign(size_t(num_experts), 0);
  count.assign(size_t(num_experts), 0);
  ord.resize(size_t(n * k));
  keep.assign(size_t(n), 0);
  // ordinals and this worker's pairs (a token is kept if it has one)
  for (int64_t p = 0; p < n * k; ++p) {
    const int32_t e = ids[p];
    if (e < 0 || e >= num_experts) { ord[size_t(p)] = -1; continue; }
    const int64_t o = seen[size_t(e)]++;
    ord[size_t(p)] = int32_t(o);
    if (o >= table[e] && o < table[ep + e]) keep[size_t(p / k)] = 1, ++count[size_t(e)];
  }
  int64_t u = 0, dropped = 0;
  for (int64_t t = 0; t < n; ++t) {
    if (!keep[size_t(t)]) {
      for (int64_t j = 0; j < k; ++j) dropped += ord[size_t(t * k + j)] < 0;
      continue;
    }
    for (int64_t j = 0; j < k; ++j) {  // kept pairs of e ranked below this worker's interval
      const int64_t p = t * k + j;
      const int32_t e = ids[p];
      if (ord[size_t(p)] >= 0 && ord[size_t(p)] < table[e]) ++start[size_t(e)];
      ids_o[u * k + j] = e;
      weights_o[u * k + j] = weights[p];
    }
    tokens[u++] = t;
  }
  for (int64_t x = 0; x < 3 * ep + 1; ++x) local[x] = table[x];
  for (int64_t e = 0; e < num_experts; ++e) {
    const bool works = table[2 * ep + e] >= 0;
    local[e] = works ? int32_t(start[size_t(e)]) : 0;
    local[ep + e] = works ? int32_t(start[size_t(e)] + count[size_t(e)]) : 0;
  }
  local[3 * ep] = int32_t(u * k);
  return {u, dropped};
}

}  // namespace

void bind_plan_check(nb::module_& m);  // plan_check.cpp

NB_MODULE(_ffn, m) {
  m.doc() = "afore._ffn: a CPU FFN worker's sparse step (afore.ffn.experts.host_sparse_step)";
  nb::class_<HostStep>(m, "HostStep")
      .def(nb::init<>())
      .def("route", &HostStep::route, "ids"_a, "n"_a, "k"_a, "table"_a, "num_experts"_a, "ep"_a, "num_slots"_a,
           "tokens_out"_a)
      .def("compute", &HostStep::compute, "x"_a, "row_stride"_a, "weights"_a, "w13"_a, "w13_stride"_a, "w2"_a, "w2_stride"_a, "hidden"_a, "inter"_a,
           "dtype"_a, "out"_a)
      .def_prop_ro("pairs", &HostStep::pairs);
  m.def("route_local", &route_local, "ids"_a, "weights"_a, "n"_a, "k"_a, "table"_a, "num_experts"_a, "ep"_a,
        "tokens_out"_a, "ids_out"_a, "weights_out"_a, "local_out"_a);
  bind_plan_check(m);
  m.def("simd", []() { return g_dot != dot_generic; }, "whether the AVX2/FMA dot product is in use");
}
