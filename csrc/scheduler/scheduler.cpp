// Algorithm 1 of the AFORE paper plus afore's ejection chains: the C++ production core (see
// scheduler.hpp).
//
// The scan rules, tie-breaks and arithmetic follow afore/scheduler/algorithm.py line for line;
// what differs is bookkeeping only:
//  - the chain search visits each worker once with stamps instead of cleared flags, and finds
//    each worker's placement edges through the replica lists of the experts on it;
//  - donors/receivers are kept sorted incrementally (two workers change load per move);
//  - within a donor, the first receiver in scan order that some movable expert reaches is the
//    minimum over the replica sets of the movable experts, so no receiver loop is needed;
//  - candidates of the beyond phase are restored by undoing the moves after the best one,
//    instead of copying the state at every improvement.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
// Gains must be bit-identical to the Python reference: no fused multiply-add.
#pragma GCC optimize("fp-contract=off")
#endif

#include "scheduler/scheduler.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

namespace afore {

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

// OR of all values: negative iff some value is. No early exit, so it vectorises (the build
// is -O2, where GCC does not vectorise by itself); A[t-1] is E*F values read on every call.
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("tree-vectorize")))
#endif
int32_t or_all(const int32_t* values, int64_t n) {
  int32_t bits = 0;
  for (int64_t i = 0; i < n; ++i) bits |= values[i];
  return bits;
}

}  // namespace

Scheduler::Scheduler(int64_t num_experts, int64_t num_workers, int64_t redundant_slots,
                     int64_t m_tile, const std::vector<int32_t>& primary_owner)
    : E_(num_experts), F_(num_workers), R_(redundant_slots), M_(m_tile) {
  if (E_ < 1) fail("num_experts: expected >= 1, got " + std::to_string(E_));
  if (F_ < 1) fail("num_workers: expected >= 1, got " + std::to_string(F_));
  if (R_ < 0) fail("redundant_slots: expected >= 0, got " + std::to_string(R_));
  if (M_ < 1) fail("m_tile: expected >= 1, got " + std::to_string(M_));
  if (E_ > kInt32Max || F_ > kInt32Max || E_ * F_ > (int64_t{1} << 34))
    fail("num_experts * num_workers: expected <= 2**34, got " + std::to_string(E_ * F_));
  // Primaries: the given layout, else contiguous blocks with the first E % F workers owning
  // one more (ClusterShape). A worker's primaries take slots 0.. in ascending expert id.
  owner_.resize(E_);
  if (primary_owner.empty()) {
    const int64_t base = E_ / F_, extra = E_ % F_;
    for (int64_t w = 0, e = 0; w < F_; ++w)
      for (int64_t s = 0; s < base + (w < extra ? 1 : 0); ++s, ++e) owner_[e] = static_cast<int32_t>(w);
  } else {
    if (static_cast<int64_t>(primary_owner.size()) != E_)
      fail("primaries: expected one owner worker per expert, a vector of length " +
           std::to_string(E_) + " (num_experts), got length " + std::to_string(primary_owner.size()));
    for (int64_t e = 0; e < E_; ++e) {
      if (primary_owner[e] < 0 || primary_owner[e] >= F_)
        fail("primaries: expected worker ids in [0, " + std::to_string(F_) + ") (num_workers), got " +
             std::to_string(primary_owner[e]) + " for expert " + std::to_string(e));
      owner_[e] = primary_owner[e];
    }
  }
  pcount_.assign(F_, 0);
  primary_slot_.resize(E_);
  for (int64_t e = 0; e < E_; ++e) primary_slot_[e] = pcount_[owner_[e]]++;
  pstart_.assign(F_ + 1, 0);
  for (int64_t w = 0; w < F_; ++w) pstart_[w + 1] = pstart_[w] + pcount_[w];
  pexperts_.resize(E_);
  for (int64_t e = 0; e < E_; ++e) pexperts_[pstart_[owner_[e]] + primary_slot_[e]] = static_cast<int32_t>(e);
  k_.assign(E_, 0);
  tiles_.assign(E_ * F_, 0);
  has_.assign(E_ * F_, 0);
  load_.assign(F_, 0);
  binding_.assign(F_ * R_, -1);
  reserved_.assign(F_ * R_, 0);
  rep_count_.assign(E_, 0);
  rep_.assign(E_ * F_, 0);
  on_count_.assign(F_, 0);
  on_.assign(F_ * E_, 0);
  on_pos_.assign(E_ * F_, 0);
  donors_.resize(F_);
  receivers_.resize(F_);
  donor_pos_.resize(F_);
  receiver_pos_.resize(F_);
  safe_list_.resize(F_);
  safe_slot_.assign(F_, -1);
  stuck_.assign(F_, 0);
  copies_into_.assign(F_, 0);
  max_hops_ = 4 * F_ * (R_ + 1);  // algorithm.max_beyond_hops
  moves_.reserve(static_cast<size_t>(max_hops_));
  kept_.reserve(static_cast<size_t>(max_hops_));
  by_tiles_.assign(E_, 0);
  over_.assign(F_, 0);
  needy_.assign(E_, 0);
  needy_rest_.assign(F_, 0);
  needy_count_.assign(F_, 0);
  chain_.resize(F_);
  bfs_queue_.assign(F_, 0);
  bfs_parent_.assign(F_, -1);
  bfs_copied_.assign(F_, 0);
  bfs_via_copy_.assign(F_, 0);
  bfs_seen_.assign(F_, 0);
  bfs_pending_.assign(F_, 0);
  push_from_.assign(F_, -1);
  bfs_expanded_.assign(E_, 0);
  remainder_.assign(F_, 0);
  lr_workers_.assign(F_, 0);
  seen_stamp_.assign(E_, -1);
}

void Scheduler::validate(const ScheduleInputs& in) {
  if (in.seq < 0) fail("seq: expected an integer in [0, 2**63), got " + std::to_string(in.seq));
  if (in.theta < 0) fail("theta: expected >= 0, got " + std::to_string(in.theta));
  if (in.copy_budget < 0) fail("copy_budget: expected >= 0, got " + std::to_string(in.copy_budget));
  const double costs[3] = {in.beta_tile_ms, in.copy_ms, in.window_ms};
  const char* names[3] = {"beta_tile_ms", "copy_ms", "window_ms"};
  for (int i = 0; i < 3; ++i)
    if (!std::isfinite(costs[i]) || costs[i] < 0)
      fail(std::string(names[i]) + ": expected a finite value >= 0, got " + std::to_string(costs[i]));
  int64_t total = 0, min_d = 0, max_d = 0;
  for (int64_t e = 0; e < E_; ++e) {
    const int64_t d = in.demand[e];
    min_d = std::min(min_d, d);
    max_d = std::max(max_d, d);
    if (d > 0) total += std::min(d, kInt32Max + 1);
  }
  if (min_d < 0) fail("demand: expected non-negative counts, got min " + std::to_string(min_d));
  if (max_d > kInt32Max)
    fail("demand: expected counts <= " + std::to_string(kInt32Max) + ", got " + std::to_string(max_d));
  if (total > kInt32Max)
    fail("demand: expected a total <= " + std::to_string(kInt32Max) + ", got " + std::to_string(total));
  for (int64_t w = 0; w < F_; ++w)
    for (int64_t r = 0; r < R_; ++r) {
      const int32_t b = in.table_expert[w * R_ + r];
      if (b < -1 || b >= E_)
        fail("slot_table.expert: expected values in [-1, " + std::to_string(E_) + "), got " +
             std::to_string(b));
    }
  for (int64_t w = 0; w < F_; ++w) {
    const int64_t stamp = stamp_++;  // unique per (call, worker): no reset between calls
    for (int64_t r = 0; r < R_; ++r) {
      const int32_t b = in.table_expert[w * R_ + r];
      if (b < 0) continue;
      if (owner_[b] == w)
        fail("slot_table.expert: expert " + std::to_string(b) +
             " bound to a redundant slot on its own primary worker " + std::to_string(w));
      if (seen_stamp_[b] == stamp)
        fail("slot_table.expert: expert " + std::to_string(b) + " bound twice on worker " +
             std::to_string(w));
      seen_stamp_[b] = stamp;
    }
  }
  for (int64_t i = 0; i < F_ * R_; ++i)
    if (in.table_last_used[i] < -1)
      fail("slot_table.last_used: expected values >= -1, got " + std::to_string(in.table_last_used[i]));
  if (in.prev_assignment != nullptr) {
    if (or_all(in.prev_assignment, E_ * F_) < 0) {
      const int32_t bad = *std::min_element(in.prev_assignment, in.prev_assignment + E_ * F_);
      fail("prev_assignment: expected counts in [0, " + std::to_string(kInt32Max) + "], got " +
           std::to_string(bad));
    }
  }
}

void Scheduler::add_replica(int32_t e, int32_t w) {
  has_[e * F_ + w] = 1;
  rep_[e * F_ + rep_count_[e]++] = w;
}

void Scheduler::remove_replica(int32_t e, int32_t w) {
  has_[e * F_ + w] = 0;
  int32_t* reps = &rep_[e * F_];
  const int32_t n = rep_count_[e];
  for (int32_t i = 0; i < n; ++i)
    if (reps[i] == w) {
      reps[i] = reps[n - 1];
      break;
    }
  rep_count_[e] = n - 1;
}

void Scheduler::add_tiles(int32_t e, int32_t w, int64_t n) {
  const int64_t idx = e * F_ + w;
  const int64_t before = tiles_[idx], after = before + n;
  tiles_[idx] = static_cast<int32_t>(after);
  if (before == 0 && after > 0) {
    on_pos_[idx] = on_count_[w];
    on_[w * E_ + on_count_[w]++] = e;
  } else if (before > 0 && after == 0) {
    const int32_t pos = on_pos_[idx];
    const int32_t last = on_[w * E_ + --on_count_[w]];
    on_[w * E_ + pos] = last;
    on_pos_[last * F_ + w] = pos;
  }
  load_[w] += n;
}

void Scheduler::fix_order_after_decrease(int32_t w) {
  int64_t p = donor_pos_[w];
  while (p + 1 < F_ && donor_before(donors_[p + 1], w)) {
    donors_[p] = donors_[p + 1];
    donor_pos_[donors_[p]] = static_cast<int32_t>(p);
    ++p;
  }
  donors_[p] = w;
  donor_pos_[w] = static_cast<int32_t>(p);
  p = receiver_pos_[w];
  while (p > 0 && receiver_before(w, receivers_[p - 1])) {
    receivers_[p] = receivers_[p - 1];
    receiver_pos_[receivers_[p]] = static_cast<int32_t>(p);
    --p;
  }
  receivers_[p] = w;
  receiver_pos_[w] = static_cast<int32_t>(p);
}

void Scheduler::fix_order_after_increase(int32_t w) {
  int64_t p = donor_pos_[w];
  while (p > 0 && donor_before(w, donors_[p - 1])) {
    donors_[p] = donors_[p - 1];
    donor_pos_[donors_[p]] = static_cast<int32_t>(p);
    --p;
  }
  donors_[p] = w;
  donor_pos_[w] = static_cast<int32_t>(p);
  p = receiver_pos_[w];
  while (p + 1 < F_ && receiver_before(receivers_[p + 1], w)) {
    receivers_[p] = receivers_[p + 1];
    receiver_pos_[receivers_[p]] = static_cast<int32_t>(p);
    ++p;
  }
  receivers_[p] = w;
  receiver_pos_[w] = static_cast<int32_t>(p);
}

void Scheduler::move_tiles(int32_t e, int32_t h, int32_t c, int64_t q) {
  add_tiles(e, h, -q);
  fix_order_after_decrease(h);
  add_tiles(e, c, q);
  fix_order_after_increase(c);
}

void Scheduler::initialize(const ScheduleInputs& in) {
  // Demand < 2**31 (validated): 32-bit division, or a shift for the usual power-of-two tile.
  const uint32_t m = static_cast<uint32_t>(M_);
  const bool pow2 = (m & (m - 1)) == 0;
  const int shift = __builtin_ctz(m);
  for (int64_t e = 0; e < E_; ++e) {
    const uint32_t d = static_cast<uint32_t>(in.demand[e]);
    k_[e] = pow2 ? (d >> shift) + ((d & (m - 1)) != 0) : d / m + (d % m != 0);
    add_replica(static_cast<int32_t>(e), owner_[e]);
  }
  for (int64_t i = 0; i < F_ * R_; ++i) {
    binding_[i] = in.table_expert[i];
    reserved_[i] = 0;
    if (binding_[i] >= 0) add_replica(binding_[i], static_cast<int32_t>(i / R_));
  }
  for (int64_t w = 0; w < F_; ++w) load_[w] = 0;

  // InitializeAssignment: largest remainder over e's current replicas, exact integers.
  for (int32_t e = 0; e < E_; ++e) {
    const int64_t k = k_[e];
    if (k == 0) continue;
    int64_t total = 0;
    int32_t n = 0;
    if (in.prev_assignment != nullptr && k > in.theta) {
      const int32_t* prev = in.prev_assignment + e * F_;
      for (int32_t i = 0; i < rep_count_[e]; ++i) {
        const int32_t w = rep_[e * F_ + i];
        if (prev[w] > 0) {
          lr_workers_[n++] = w;
          total += prev[w];
        }
      }
    }
    if (total == 0) {
      add_tiles(e, owner_[e], k);
      continue;
    }
    if (n == 1) {  // one worker carried all previous pairs
      add_tiles(e, lr_workers_[0], k);
      continue;
    }
    const int32_t* prev = in.prev_assignment + e * F_;
    int64_t assigned = 0;
    // quota = k * prev[w] < 2**62 (k, prev < 2**31); 32-bit division when it fits.
    const bool narrow = total <= UINT32_MAX && k * total <= UINT32_MAX;  // quota <= k * total
    for (int32_t i = 0; i < n; ++i) {
      const int32_t w = lr_workers_[i];
      const int64_t quota = k * prev[w];
      int64_t floor_q, rem;
      if (narrow) {
        const uint32_t a = static_cast<uint32_t>(quota), b = static_cast<uint32_t>(total);
        floor_q = a / b;
        rem = a - static_cast<uint32_t>(floor_q) * b;
      } else {
        floor_q = quota / total;
        rem = quota - floor_q * total;
      }
      remainder_[w] = rem;
      assigned += floor_q;
      add_tiles(e, w, floor_q);
    }
    // Extra tiles to the largest remainders, ties to the lower worker index.
    std::sort(lr_workers_.begin(), lr_workers_.begin() + n, [&](int32_t a, int32_t b) {
      return remainder_[a] > remainder_[b] || (remainder_[a] == remainder_[b] && a < b);
    });
    for (int64_t i = 0; i < k - assigned; ++i) add_tiles(e, lr_workers_[i], 1);
  }

  for (int32_t w = 0; w < F_; ++w) donors_[w] = receivers_[w] = w;
  std::sort(donors_.begin(), donors_.end(), [&](int32_t a, int32_t b) { return donor_before(a, b); });
  std::sort(receivers_.begin(), receivers_.end(),
            [&](int32_t a, int32_t b) { return receiver_before(a, b); });
  for (int32_t i = 0; i < F_; ++i) {
    donor_pos_[donors_[i]] = i;
    receiver_pos_[receivers_[i]] = i;
  }
}

// A donor without a move stays without one until its own tiles or load change or the load of
// a replica worker of one of its movable experts drops: after a move (e, h, c, q) that is h
// (lower load) and donors h and c themselves; c's load only rose. unstick_after_move clears
// exactly those flags, so skipping stuck donors never changes the result.
void Scheduler::unstick_after_move(int64_t theta, int32_t h, int32_t c) {
  stuck_[h] = 0;
  stuck_[c] = 0;
  const auto unstick_holders = [&](int32_t x) {
    const int32_t* reps = &rep_[x * F_];
    for (int32_t i = 0; i < rep_count_[x]; ++i)
      if (tiles_[x * F_ + reps[i]] > theta) stuck_[reps[i]] = 0;
  };
  for (int32_t i = pstart_[h]; i < pstart_[h + 1]; ++i) unstick_holders(pexperts_[i]);
  for (int64_t r = 0; r < R_; ++r)
    if (binding_[h * R_ + r] >= 0) unstick_holders(binding_[h * R_ + r]);
}

bool Scheduler::find_within_move(int64_t theta, int32_t& e, int32_t& h, int32_t& c,
                                 int64_t& q) {
  const int64_t need = 2 * theta + 2;  // floor(gap / 2) > theta  <=>  gap >= 2 theta + 2
  const int64_t min_load = load_[receivers_[0]];
  for (int64_t i = 0; i < F_; ++i) {
    const int32_t donor = donors_[i];
    const int64_t donor_load = load_[donor];
    if (donor_load - min_load < need) break;  // no lighter receiver left for this or later donors
    if (stuck_[donor]) continue;
    const int32_t* on = &on_[donor * E_];
    const int32_t n_on = on_count_[donor];
    // The first receiver in scan order that a movable expert reaches.
    int32_t receiver = -1;
    const int32_t first = receivers_[0];
    for (int32_t j = 0; j < n_on && receiver != first; ++j) {
      const int32_t x = on[j];
      if (tiles_[x * F_ + donor] <= theta) continue;
      const int32_t* reps = &rep_[x * F_];
      for (int32_t i2 = 0; i2 < rep_count_[x]; ++i2) {
        const int32_t w = reps[i2];
        if (w != donor && (receiver < 0 || receiver_before(w, receiver))) receiver = w;
      }
    }
    const int64_t gap = receiver < 0 ? 0 : donor_load - load_[receiver];
    if (gap < need) {
      stuck_[donor] = 1;
      continue;
    }
    const int64_t half = gap / 2;
    int32_t best = -1;
    int64_t best_q = 0;
    for (int32_t j = 0; j < n_on; ++j) {
      const int32_t x = on[j];
      const int64_t n = tiles_[x * F_ + donor];
      if (n <= theta || !has_[x * F_ + receiver]) continue;
      const int64_t qx = std::min(n, half);
      if (best < 0 || qx > best_q || (qx == best_q && x < best)) {
        best = x;
        best_q = qx;
      }
    }
    e = best;
    h = donor;
    c = receiver;
    q = best_q;
    return true;
  }
  return false;
}

// Stage 2: pair moves until none is left; with chains, then one ejection chain within the
// placement and again.
void Scheduler::rebalance_within(int64_t theta, bool chains) {
  int32_t e, h, c, n_hops;
  int64_t q;
  std::fill(stuck_.begin(), stuck_.end(), 0);
  while (true) {
    while (find_within_move(theta, e, h, c, q)) {
      move_tiles(e, h, c, q);
      unstick_after_move(theta, h, c);
      ++within_moves_;
    }
    if (!chains || !find_chain(theta, false, n_hops)) return;
    // Each hop is a one-tile move: unsticking for each covers the chain's changes.
    for (int32_t i = 0; i < n_hops; ++i) {
      move_tiles(chain_[i].expert, chain_[i].from, chain_[i].to, 1);
      unstick_after_move(theta, chain_[i].from, chain_[i].to);
    }
    ++within_chains_;
  }
}

bool Scheduler::has_copy_edge(int32_t u, int32_t v, int64_t theta) const {
  const int32_t* on = &on_[u * E_];
  for (int32_t j = 0; j < on_count_[u]; ++j) {
    const int32_t x = on[j];
    if (tiles_[x * F_ + u] > theta && !has_[x * F_ + v]) return true;
  }
  return false;
}

// The lowest-index expert with more than theta tiles on u and (copy ? no : a) replica on v.
int32_t Scheduler::hop_expert(int32_t u, int32_t v, int64_t theta, bool copy) const {
  const int32_t* on = &on_[u * E_];
  int32_t best = -1;
  for (int32_t j = 0; j < on_count_[u]; ++j) {
    const int32_t x = on[j];
    if (tiles_[x * F_ + u] > theta && (has_[x * F_ + v] != 0) != copy && (best < 0 || x < best))
      best = x;
  }
  return best;
}

// FindChain (algorithm.find_chain): breadth-first search from the max-load workers over
// placement edges, then (allow_copy) copy edges into workers with a safe slot, to the first
// level holding a worker at least 2 tiles below the max; the hops go to chain_[0, n_hops).
bool Scheduler::find_chain(int64_t theta, bool allow_copy, int32_t& n_hops) {
  if (theta >= 1 || F_ < 2) return false;
  const int64_t t_max = load_[donors_[0]];
  if (load_[receivers_[0]] > t_max - 2) return false;
  const int64_t stamp = ++bfs_stamp_;
  int32_t n = 0;
  const auto visit = [&](int32_t v, int32_t parent, uint8_t copied, uint8_t via_copy) {
    bfs_seen_[v] = stamp;
    bfs_parent_[v] = parent;
    bfs_copied_[v] = copied;
    bfs_via_copy_[v] = via_copy;
    bfs_queue_[n++] = v;
  };
  // Level 0: the max-load workers; donors_ orders equal loads by index.
  for (int64_t i = 0; i < F_ && load_[donors_[i]] == t_max; ++i) visit(donors_[i], -1, 0, 0);
  int32_t pending = 0;
  if (allow_copy)
    for (int32_t w = 0; w < F_; ++w)
      if (safe_slot_[w] >= 0 && bfs_seen_[w] != stamp) bfs_pending_[pending++] = w;
  int32_t begin = 0, end = n;
  while (begin < end) {
    for (int32_t i = begin; i < end; ++i) {  // placement edges
      const int32_t u = bfs_queue_[i];
      const int32_t* on = &on_[u * E_];
      for (int32_t j = 0; j < on_count_[u]; ++j) {
        const int32_t x = on[j];
        // After its first expansion every replica of x is visited: skip x from then on.
        if (tiles_[x * F_ + u] <= theta || bfs_expanded_[x] == stamp) continue;
        bfs_expanded_[x] = stamp;
        const int32_t* reps = &rep_[x * F_];
        for (int32_t k = 0; k < rep_count_[x]; ++k)
          if (bfs_seen_[reps[k]] != stamp) visit(reps[k], u, bfs_copied_[u], 0);
      }
    }
    for (int32_t i = begin; i < end && pending > 0; ++i) {  // copy edges
      const int32_t u = bfs_queue_[i];
      if (bfs_copied_[u]) continue;
      int32_t keep = 0;
      for (int32_t p = 0; p < pending; ++p) {
        const int32_t v = bfs_pending_[p];
        if (bfs_seen_[v] == stamp) continue;
        if (has_copy_edge(u, v, theta))
          visit(v, u, 1, 1);
        else
          bfs_pending_[keep++] = v;
      }
      pending = keep;
    }
    int32_t best = -1;
    for (int32_t i = end; i < n; ++i) {
      const int32_t v = bfs_queue_[i];
      if (load_[v] > t_max - 2) continue;
      if (best < 0 || load_[v] < load_[best] ||
          (load_[v] == load_[best] &&
           (bfs_copied_[v] < bfs_copied_[best] || (bfs_copied_[v] == bfs_copied_[best] && v < best))))
        best = v;
    }
    if (best >= 0) {
      int32_t len = 0;
      for (int32_t v = best; bfs_parent_[v] >= 0; v = bfs_parent_[v]) ++len;
      n_hops = len;
      for (int32_t v = best; bfs_parent_[v] >= 0; v = bfs_parent_[v]) {
        const int32_t u = bfs_parent_[v];
        const bool copy = bfs_via_copy_[v] != 0;
        chain_[--len] = Hop{hop_expert(u, v, theta, copy), u, v, copy ? safe_slot_[v] : -1};
      }
      return true;
    }
    std::sort(bfs_queue_.begin() + end, bfs_queue_.begin() + n);
    begin = end;
    end = n;
  }
  return false;
}

int32_t Scheduler::safe_slot(int32_t c, const ScheduleInputs& in) const {
  const int64_t base = c * R_;
  for (int64_t r = 0; r < R_; ++r)
    if (binding_[base + r] < 0 && !in.protected_slots[base + r] && !reserved_[base + r])
      return static_cast<int32_t>(r);
  int32_t best = -1;
  for (int64_t r = 0; r < R_; ++r) {
    const int32_t b = binding_[base + r];
    if (b < 0 || in.protected_slots[base + r] || reserved_[base + r]) continue;
    if (tiles_[b * F_ + c] > 0) continue;
    if (best < 0 || in.table_last_used[base + r] < in.table_last_used[base + best])
      best = static_cast<int32_t>(r);
  }
  return best;
}

bool Scheduler::find_beyond_move(const ScheduleInputs& in, int32_t& e, int32_t& h, int32_t& c,
                                 int32_t& r, int64_t& q) {
  const int64_t theta = in.theta;
  const int64_t need = 2 * theta + 2;
  int64_t n_safe = 0;  // safe_slot_ is current: refreshed for the two workers of each move
  for (int64_t i = 0; i < F_; ++i)
    if (safe_slot_[receivers_[i]] >= 0) safe_list_[n_safe++] = receivers_[i];
  if (n_safe == 0) return false;
  const int64_t min_load = load_[safe_list_[0]];
  for (int64_t i = 0; i < F_; ++i) {
    const int32_t donor = donors_[i];
    const int64_t donor_load = load_[donor];
    if (donor_load - min_load < need) break;
    const int32_t* on = &on_[donor * E_];
    const int32_t n_on = on_count_[donor];
    for (int64_t j = 0; j < n_safe; ++j) {
      const int32_t receiver = safe_list_[j];
      const int64_t gap = donor_load - load_[receiver];
      if (gap < need) break;
      const int64_t half = gap / 2;
      int32_t best = -1;
      int64_t best_q = 0;
      for (int32_t k = 0; k < n_on; ++k) {
        const int32_t x = on[k];
        const int64_t n = tiles_[x * F_ + donor];
        if (n <= theta || has_[x * F_ + receiver]) continue;
        const int64_t qx = std::min(n, half);
        if (best < 0 || qx > best_q || (qx == best_q && x < best)) {
          best = x;
          best_q = qx;
        }
      }
      if (best >= 0) {
        e = best;
        h = donor;
        c = receiver;
        r = safe_slot_[receiver];
        q = best_q;
        return true;
      }
    }
  }
  return false;
}

void Scheduler::run(const ScheduleInputs& inputs, ScheduleOutputs& out) {
  const std::lock_guard<std::mutex> lock(mutex_);
  validate(inputs);
  // Tile counts are < 2**31, so a larger theta acts like 2**31 (and 2 theta + 2 cannot overflow).
  ScheduleInputs in = inputs;
  in.theta = std::min<int64_t>(in.theta, int64_t{1} << 31);
  initialize(in);

  // Stage 2: rebalancing within the placement, then (beyond the paper) ejection chains.
  within_moves_ = within_chains_ = 0;
  rebalance_within(in.theta, in.chains);

  // Stage 3: rebalancing beyond the placement; keep the best positive net gain. [chains] When
  // that ends above the average bound L, a second search aimed at L (algorithm.search_beyond),
  // and the better of the two (the first on ties).
  const double f0 = in.beta_tile_ms * static_cast<double>(load_[donors_[0]]);
  double best_gain = 0.0, best_exposed = 0.0;
  int64_t total_tiles = 0;
  for (int64_t x = 0; x < E_; ++x) total_tiles += k_[x];
  const int64_t level = (total_tiles + F_ - 1) / F_;
  // algorithm.replica_bound, on the placement after stage 2 (no copies yet).
  const int64_t budget = std::min(in.copy_budget, F_ * R_);
  int64_t replica_bound = 0;
  for (int64_t x = 0; x < E_; ++x) {
    if (k_[x] == 0) continue;
    const int64_t most = std::min<int64_t>(rep_count_[x] + std::min(budget, F_), F_);
    replica_bound = std::max(replica_bound, (k_[x] + most - 1) / most);
  }
  search_beyond(in, f0, -1, level, best_gain, best_exposed);
  beyond_moves_ = searched_moves_;
  if (in.chains && in.theta == 0 && load_[donors_[0]] > level) {
    kept_.assign(moves_.begin(), moves_.end());
    undo_moves(0);
    double gain = 0.0, exposed = 0.0;
    search_beyond(in, f0, level, level, gain, exposed);
    beyond_moves_ += searched_moves_;
    if (gain > best_gain) {
      best_gain = gain;
      best_exposed = exposed;
    } else {
      undo_moves(0);
      for (const Move& m : kept_) redo_move(m);
      moves_.assign(kept_.begin(), kept_.end());
    }
  }
  // [chains] Stage 3b (algorithm.search_level): copy-efficient searches to ever lower levels,
  // each from the state after stage 2, while one reaches its level with a better gain.
  int64_t target_level = load_[donors_[0]] - 1;
  int64_t floor = std::max(level, replica_bound);
  if (in.chains && in.theta == 0 && target_level >= floor)
    floor = std::max(floor, budget_bound(in, budget));  // no plan is below it (optimal.budget_bound)
  if (in.chains && in.theta == 0 && target_level >= floor) {
    kept_.assign(moves_.begin(), moves_.end());
    undo_moves(0);
    for (; target_level >= floor; --target_level) {
      double gain = 0.0, exposed = 0.0;
      const bool reached = search_level(in, f0, target_level, gain, exposed);
      beyond_moves_ += static_cast<int64_t>(moves_.size());
      const bool better = reached && gain > best_gain;
      if (better) {
        best_gain = gain;
        best_exposed = exposed;
        kept_.assign(moves_.begin(), moves_.end());
      }
      undo_moves(0);
      if (!better) break;
    }
    for (const Move& m : kept_) redo_move(m);
    moves_.assign(kept_.begin(), kept_.end());
  }
  out.gain_ms = best_gain;
  out.exposed_ms = best_exposed;
  write_outputs(in, out);
  reset();
}

// One search of stage 3 from the current state: moves go to the undo log moves_, and the state
// is left at the candidate with the best net gain > 0 (gain, exposed), else where it started.
// level < 0: the paper's search (plus chains); else aimed at that tile load: a move onto a new
// replica fills its receiver at most to it. The search stops once the max load reaches `floor`
// (the average bound): no later candidate can gain more, so the result is the same.
void Scheduler::search_beyond(const ScheduleInputs& in, double f0, int64_t level, int64_t floor,
                              double& best_gain, double& best_exposed) {
  const int64_t theta = in.theta;
  const double beta = in.beta_tile_ms;
  int32_t e, h, c, r, n_hops = 0;
  int64_t q;
  best_gain = best_exposed = 0.0;
  size_t best_len = 0;
  int64_t max_into = 0, n_copies = 0, hops_made = 0;
  moves_.clear();
  std::fill(reserved_.begin(), reserved_.end(), 0);
  std::fill(copies_into_.begin(), copies_into_.end(), 0);
  const int64_t budget = std::min(in.copy_budget, F_ * R_);  // each copy reserves a distinct slot
  if (budget > 0)
    for (int32_t w = 0; w < F_; ++w) safe_slot_[w] = safe_slot(w, in);
  while (in.chains || n_copies < budget) {
    const bool can_copy = n_copies < budget;
    int64_t hop_tiles = 1;
    if (can_copy && find_beyond_move(in, e, h, c, r, q)) {
      chain_[0] = Hop{e, h, c, r};
      n_hops = 1;
      hop_tiles = level < 0 ? q : std::min(q, std::max(theta + 1, level - load_[c]));
    } else if (!in.chains || !find_chain(theta, can_copy, n_hops)) {
      break;
    }
    if (hops_made + n_hops > max_hops_) break;  // moves_ never grows past its reservation
    hops_made += n_hops;
    apply_chain(in, n_hops, hop_tiles, n_copies, max_into);
    const double exposed = std::max(0.0, static_cast<double>(max_into) * in.copy_ms - in.window_ms);
    const double gain = f0 - beta * static_cast<double>(load_[donors_[0]]) - exposed;
    if (gain > best_gain) {
      best_gain = gain;
      best_exposed = exposed;
      best_len = moves_.size();
    }
    if (load_[donors_[0]] <= floor) break;
  }
  searched_moves_ = static_cast<int64_t>(moves_.size());
  undo_moves(best_len);
}

// algorithm.search_level from the current state: moves go to the undo log moves_ (the caller
// undoes them); true with (gain, exposed) when every worker ends at most `level` tiles.
bool Scheduler::search_level(const ScheduleInputs& in, double f0, int64_t level, double& gain,
                             double& exposed) {
  moves_.clear();
  std::fill(reserved_.begin(), reserved_.end(), 0);
  std::fill(copies_into_.begin(), copies_into_.end(), 0);
  const int64_t budget = std::min(in.copy_budget, F_ * R_);
  if (budget > 0)
    for (int32_t w = 0; w < F_; ++w) safe_slot_[w] = safe_slot(w, in);
  int64_t n_copies = 0, max_into = 0, hops_left = max_hops_;
  while (load_[donors_[0]] > level) {
    const int32_t h = donors_[0];
    const int64_t excess = load_[h] - level;
    int32_t n_hops = 0;
    int64_t q = 0;
    // Copies only when the placement cannot take the excess (algorithm.search_level).
    for (int copy = 0; copy < (n_copies < budget ? 2 : 1) && n_hops == 0; ++copy) {
      int32_t e, c, r;
      if (find_level_move(in, h, excess, level, copy != 0, e, c, r, q)) {
        chain_[0] = Hop{e, h, c, r};
        n_hops = 1;
      } else if (!find_level_path(in, h, excess, level, copy != 0, n_hops, q)) {
        n_hops = 0;
      }
    }
    if (n_hops == 0 || n_hops > hops_left) return false;
    hops_left -= n_hops;
    apply_chain(in, n_hops, q, n_copies, max_into);
  }
  exposed = std::max(0.0, static_cast<double>(max_into) * in.copy_ms - in.window_ms);
  gain = f0 - in.beta_tile_ms * static_cast<double>(load_[donors_[0]]) - exposed;
  return true;
}

// optimal.budget_bound on the input placement (C[t]'s bindings: stage 3 has not run from it):
// the smallest T for which the copies that bring every worker's copy-needing primaries (those
// with no other replica) down to T fit the budget.
int64_t Scheduler::budget_bound(const ScheduleInputs& in, int64_t budget) {
  const int64_t stamp = stamp_++;  // seen_stamp_[e] == stamp: e is bound in C[t]
  for (int64_t i = 0; i < F_ * R_; ++i)
    if (in.table_expert[i] >= 0) seen_stamp_[in.table_expert[i]] = stamp;
  int64_t hi = 0;
  for (int32_t w = 0; w < F_; ++w) {
    int64_t* seg = &needy_[pstart_[w]];
    int32_t n = 0;
    for (int32_t i = pstart_[w]; i < pstart_[w + 1]; ++i)
      if (seen_stamp_[pexperts_[i]] != stamp) seg[n++] = k_[pexperts_[i]];
    std::sort(seg, seg + n, [](int64_t a, int64_t b) { return a > b; });
    for (int32_t i = 1; i < n; ++i) seg[i] += seg[i - 1];  // prefix sums, nondecreasing
    needy_rest_[w] = n > 0 ? seg[n - 1] : 0;
    needy_count_[w] = n;
    hi = std::max(hi, needy_rest_[w]);
  }
  const auto copies_needed = [&](int64_t t) {
    int64_t total = 0;
    for (int32_t w = 0; w < F_; ++w) {
      if (needy_rest_[w] <= t) continue;
      const int64_t* seg = &needy_[pstart_[w]];
      total += (std::lower_bound(seg, seg + needy_count_[w], needy_rest_[w] - t) - seg) + 1;
    }
    return total;
  };
  int64_t lo = 0;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (copies_needed(mid) <= budget) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// by_tiles_[0, n): the experts with more than theta tiles on u by (N[e, u] desc, e asc).
int32_t Scheduler::sort_movable(int32_t u, int64_t theta) {
  const int32_t* on = &on_[u * E_];
  int32_t n = 0;
  for (int32_t j = 0; j < on_count_[u]; ++j)
    if (tiles_[on[j] * F_ + u] > theta) by_tiles_[n++] = on[j];
  const int32_t* tiles_u = &tiles_[u];
  const int64_t stride = F_;
  std::sort(by_tiles_.begin(), by_tiles_.begin() + n, [&](int32_t a, int32_t b) {
    const int32_t na = tiles_u[a * stride], nb = tiles_u[b * stride];
    return na > nb || (na == nb && a < b);
  });
  return n;
}

// algorithm.find_level_move: the direct move out of h of search_level, onto an existing replica
// (copy false) or onto a new replica in a safe slot (copy true); order (q desc, T_c desc, c asc,
// N[e, h] desc, e asc); for a copy (q desc, min(pooled excess of e, slack) desc, T_c desc, c asc).
bool Scheduler::find_level_move(const ScheduleInputs& in, int32_t h, int64_t excess,
                                int64_t level, bool copy, int32_t& e, int32_t& c,
                                int32_t& r, int64_t& q) {
  const int64_t theta = in.theta;
  const int32_t n = sort_movable(h, theta);
  if (n == 0) return false;
  int32_t best_c = -1, best_e = -1;
  int64_t best_q = 0, best_room = 0;
  int32_t n_over = 0;  // copy: the holders whose excess counts toward an expert's pooled excess
  if (copy)
    for (int32_t u = 0; u < F_; ++u)
      if (load_[u] > level) over_[n_over++] = u;
  for (int32_t w = 0; w < F_; ++w) {
    const int64_t slack = level - load_[w];
    if (w == h || slack <= theta || (copy && safe_slot_[w] < 0)) continue;
    int32_t x = -1;
    for (int32_t j = 0; j < n; ++j)
      if ((has_[by_tiles_[j] * F_ + w] != 0) != copy) {
        x = by_tiles_[j];
        break;
      }
    if (x < 0) continue;
    const int64_t qx = std::min<int64_t>(std::min<int64_t>(tiles_[x * F_ + h], excess), slack);
    if (qx <= theta) continue;
    if (best_c >= 0 && qx < best_q) continue;
    int64_t room = 0;  // copy: min(pooled excess of x over its holders, slack)
    if (copy) {
      int64_t pooled = 0;
      for (int32_t j = 0; j < n_over; ++j) {
        const int32_t u = over_[j];
        if (has_[x * F_ + u]) pooled += std::min<int64_t>(tiles_[x * F_ + u], load_[u] - level);
      }
      room = std::min<int64_t>(pooled, slack);
    }
    if (best_c < 0 || qx > best_q || (room > best_room) ||
        (room == best_room && load_[w] > load_[best_c])) {
      best_c = w;
      best_e = x;
      best_q = qx;
      best_room = room;
    }
  }
  if (best_c < 0) return false;
  e = best_e;
  c = best_c;
  r = copy ? safe_slot_[best_c] : -1;
  q = best_q;
  return true;
}

// One level of the hop search: from the workers bfs_queue_[begin, end), through every expert
// they hold more than theta tiles of, to its other replicas not seen yet in this search (stamp);
// appends them from n on, sorted (the first minimum then has the lowest index), returns the new n.
int32_t Scheduler::expand_level(int32_t begin, int32_t end, int32_t n, int64_t theta, int64_t stamp) {
  for (int32_t i = begin; i < end; ++i) {
    const int32_t u = bfs_queue_[i];
    const int32_t* on = &on_[u * E_];
    for (int32_t j = 0; j < on_count_[u]; ++j) {
      const int32_t x = on[j];
      if (tiles_[x * F_ + u] <= theta || bfs_expanded_[x] == stamp) continue;
      bfs_expanded_[x] = stamp;  // every replica of x is visited from here on
      const int32_t* reps = &rep_[x * F_];
      for (int32_t k = 0; k < rep_count_[x]; ++k) {
        const int32_t v = reps[k];
        if (bfs_seen_[v] == stamp) continue;
        bfs_seen_[v] = stamp;
        bfs_parent_[v] = u;
        bfs_queue_[n++] = v;
      }
    }
  }
  std::sort(bfs_queue_.begin() + end, bfs_queue_.begin() + n);
  return n;
}

// algorithm.find_level_path: a path of hops from h through existing replicas to a worker below
// the level, or (copy) ending in a new replica; hops to chain_[0, n_hops), q tiles each.
bool Scheduler::find_level_path(const ScheduleInputs& in, int32_t h, int64_t excess,
                                int64_t level, bool copy, int32_t& n_hops, int64_t& q) {
  const int64_t theta = in.theta;
  const int64_t stamp = ++bfs_stamp_;
  int32_t n = 0;
  bfs_seen_[h] = stamp;
  bfs_parent_[h] = -1;
  bfs_queue_[n++] = h;
  int32_t begin = 0, end = n, last = -1;
  while (begin < end && last < 0) {
    n = expand_level(begin, end, n, theta, stamp);
    for (int32_t i = end; i < n; ++i) {
      const int32_t v = bfs_queue_[i];
      if (level - load_[v] > theta && (last < 0 || load_[v] < load_[last])) last = v;
    }
    begin = end;
    end = n;
  }
  int32_t copy_e = -1, copy_from = -1, copy_to = -1;
  if (last < 0) {
    if (!copy) return false;
    for (int32_t i = 1; i < n && copy_to < 0; ++i) {  // h's own copies were the direct moves
      const int32_t u = bfs_queue_[i];
      const int32_t m = sort_movable(u, theta);
      int64_t best_q = 0;
      for (int32_t c = 0; c < F_; ++c) {
        const int64_t slack = level - load_[c];
        if (bfs_seen_[c] == stamp || safe_slot_[c] < 0 || slack <= theta) continue;
        int32_t x = -1;
        for (int32_t j = 0; j < m; ++j)
          if (!has_[by_tiles_[j] * F_ + c]) {
            x = by_tiles_[j];
            break;
          }
        if (x < 0) continue;
        const int64_t qx = std::min<int64_t>(tiles_[x * F_ + u], slack);
        if (copy_to < 0 || qx > best_q || (qx == best_q && load_[c] > load_[copy_to])) {
          copy_e = x;
          copy_from = u;
          copy_to = c;
          best_q = qx;
        }
      }
    }
    if (copy_to < 0) return find_push_path(in, excess, level, n, n_hops, q);
    last = copy_from;
  }
  const int32_t len = placement_path_length(last);
  n_hops = len + (copy_to >= 0 ? 1 : 0);
  int64_t amount = std::min<int64_t>(excess, placement_hops(last, theta, len));
  int32_t end_worker = last;
  if (copy_to >= 0) {
    chain_[n_hops - 1] = Hop{copy_e, copy_from, copy_to, safe_slot_[copy_to]};
    amount = std::min<int64_t>(amount, tiles_[copy_e * F_ + copy_from]);
    end_worker = copy_to;
  }
  q = std::min<int64_t>(amount, level - load_[end_worker]);
  return q > theta;
}

// algorithm.find_push_path: after the placement search of find_level_path (its n workers in
// bfs_queue_[0, n), stamp bfs_stamp_, none below the level), a copy onto a worker with a safe
// slot outside it that passes q tiles of its own on through existing replicas to a worker below
// the level; hops to chain_[0, n_hops).
bool Scheduler::find_push_path(const ScheduleInputs& in, int64_t excess, int64_t level,
                               int32_t n, int32_t& n_hops, int64_t& q) {
  const int64_t theta = in.theta;
  const int64_t stamp = bfs_stamp_;
  const int32_t reached = n;
  for (int32_t c = 0; c < F_; ++c) {  // copy targets in increasing index, parent -1
    if (bfs_seen_[c] == stamp || safe_slot_[c] < 0) continue;
    for (int32_t i = 0; i < reached; ++i)
      if (has_copy_edge(bfs_queue_[i], c, theta)) {
        push_from_[c] = bfs_queue_[i];
        bfs_parent_[c] = -1;
        bfs_queue_[n++] = c;
        break;
      }
  }
  for (int32_t i = reached; i < n; ++i) bfs_seen_[bfs_queue_[i]] = stamp;
  int32_t begin = reached, end = n, last = -1;
  while (begin < end) {
    for (int32_t i = begin; i < end; ++i) {  // sorted: the first minimum has the lowest index
      const int32_t v = bfs_queue_[i];
      if (level - load_[v] > theta && (last < 0 || load_[v] < load_[last])) last = v;
    }
    if (last >= 0) break;
    n = expand_level(begin, end, n, theta, stamp);
    begin = end;
    end = n;
  }
  if (last < 0) return false;
  // last <- ... <- c (parent -1) <-copy- u <- ... <- h
  const int32_t after = placement_path_length(last);
  int32_t c = last;
  while (bfs_parent_[c] >= 0) c = bfs_parent_[c];
  const int32_t u = push_from_[c];
  const int32_t before = placement_path_length(u);
  n_hops = before + 1 + after;
  // The expert with the most tiles on u and no replica on c (ties: lower index).
  const int32_t* on = &on_[u * E_];
  int32_t e = -1;
  for (int32_t j = 0; j < on_count_[u]; ++j) {
    const int32_t x = on[j];
    const int32_t t = tiles_[x * F_ + u];
    if (t <= theta || has_[x * F_ + c]) continue;
    if (e < 0 || t > tiles_[e * F_ + u] || (t == tiles_[e * F_ + u] && x < e)) e = x;
  }
  int64_t amount = std::min<int64_t>(excess, tiles_[e * F_ + u]);
  amount = std::min<int64_t>(amount, placement_hops(last, theta, n_hops));  // c -> .. -> last
  amount = std::min<int64_t>(amount, placement_hops(u, theta, before));     // h -> .. -> u
  chain_[before] = Hop{e, u, c, safe_slot_[c]};
  q = std::min<int64_t>(amount, level - load_[last]);
  return q > theta;
}

// Hops along bfs_parent_ from the path's root (parent -1) to v.
int32_t Scheduler::placement_path_length(int32_t v) const {
  int32_t len = 0;
  for (; bfs_parent_[v] >= 0; v = bfs_parent_[v]) ++len;
  return len;
}

// The hops of the placement path to v (algorithm.placement_hops) into chain_[end - length, end),
// each moving the expert with the most tiles on u and a replica on v (ties: lower index);
// returns the smallest of their N[e, u] (INT64_MAX for no hop).
int64_t Scheduler::placement_hops(int32_t v, int64_t theta, int32_t end) {
  int64_t amount = std::numeric_limits<int64_t>::max();
  for (; bfs_parent_[v] >= 0; v = bfs_parent_[v]) {
    const int32_t u = bfs_parent_[v];
    const int32_t* on = &on_[u * E_];
    int32_t best = -1;
    for (int32_t j = 0; j < on_count_[u]; ++j) {
      const int32_t x = on[j];
      const int32_t t = tiles_[x * F_ + u];
      if (t <= theta || !has_[x * F_ + v]) continue;
      if (best < 0 || t > tiles_[best * F_ + u] || (t == tiles_[best * F_ + u] && x < best)) best = x;
    }
    chain_[--end] = Hop{best, u, v, -1};
    amount = std::min<int64_t>(amount, tiles_[best * F_ + u]);
  }
  return amount;
}

// algorithm.apply_hops: the hops chain_[0, n_hops) of one step of stage 3 or 3b, `tiles` each,
// logged to moves_; a hop with a slot reserves it and counts a copy into its worker.
void Scheduler::apply_chain(const ScheduleInputs& in, int32_t n_hops, int64_t tiles,
                            int64_t& n_copies, int64_t& max_into) {
  for (int32_t i = 0; i < n_hops; ++i) {
    const Hop hop = chain_[i];
    int32_t old = -1;
    if (hop.slot >= 0) {
      old = binding_[hop.to * R_ + hop.slot];
      reserved_[hop.to * R_ + hop.slot] = 1;
      max_into = std::max(max_into, ++copies_into_[hop.to]);
      ++n_copies;
    }
    const Move m{hop.expert, hop.from, hop.to, hop.slot, old, tiles};
    moves_.push_back(m);
    redo_move(m);
  }
  // Only the workers of the hops (binding, reservation, tiles) changed their safe slot.
  for (int32_t i = 0; i < n_hops; ++i) {
    safe_slot_[chain_[i].from] = safe_slot(chain_[i].from, in);
    safe_slot_[chain_[i].to] = safe_slot(chain_[i].to, in);
  }
}

// Apply one logged move: rebind the slot (if any) to its expert, then move the tiles.
void Scheduler::redo_move(const Move& m) {
  if (m.slot >= 0) {
    if (m.old_expert >= 0) remove_replica(m.old_expert, m.receiver);
    binding_[m.receiver * R_ + m.slot] = m.expert;
    add_replica(m.expert, m.receiver);
  }
  move_tiles(m.expert, m.donor, m.receiver, m.tiles);
}

// Undo the logged moves after the first `keep`, last first.
void Scheduler::undo_moves(size_t keep) {
  while (moves_.size() > keep) {
    const Move m = moves_.back();
    moves_.pop_back();
    move_tiles(m.expert, m.receiver, m.donor, m.tiles);
    if (m.slot < 0) continue;
    remove_replica(m.expert, m.receiver);
    if (m.old_expert >= 0) add_replica(m.old_expert, m.receiver);
    binding_[m.receiver * R_ + m.slot] = m.old_expert;
  }
}

void Scheduler::write_outputs(const ScheduleInputs& in, ScheduleOutputs& out) const {
  const int64_t n = E_ * F_;
  std::fill(out.replicas, out.replicas + n, false);
  std::fill(out.assignment, out.assignment + n, 0);
  std::fill(out.tiles, out.tiles + n, 0);
  std::fill(out.slot, out.slot + n, -1);
  for (int64_t e = 0; e < E_; ++e) {
    out.replicas[e * F_ + owner_[e]] = true;
    out.slot[e * F_ + owner_[e]] = primary_slot_[e];
  }
  for (int64_t w = 0; w < F_; ++w)
    for (int64_t r = 0; r < R_; ++r) {
      const int32_t b = binding_[w * R_ + r];
      out.new_expert[w * R_ + r] = b;
      out.new_last_used[w * R_ + r] = in.table_last_used[w * R_ + r];
      if (b < 0) continue;
      out.replicas[b * F_ + w] = true;
      out.slot[b * F_ + w] = static_cast<int32_t>(pcount_[w] + r);
      if (tiles_[b * F_ + w] > 0) out.new_last_used[w * R_ + r] = in.seq;
    }
  // Token fill: full tiles everywhere but one worker, which takes the partial tile.
  for (int64_t e = 0; e < E_; ++e) {
    const int64_t k = k_[e];
    if (k == 0) continue;
    const int32_t* reps = &rep_[e * F_];
    int32_t partial = owner_[e];
    if (tiles_[e * F_ + partial] == 0) {
      partial = -1;
      for (int32_t i = 0; i < rep_count_[e]; ++i)
        if (tiles_[e * F_ + reps[i]] > 0) partial = std::max(partial, reps[i]);
    }
    for (int32_t i = 0; i < rep_count_[e]; ++i) {
      const int32_t w = reps[i];
      const int64_t t = tiles_[e * F_ + w];
      if (t == 0) continue;
      out.tiles[e * F_ + w] = static_cast<int32_t>(t);
      out.assignment[e * F_ + w] =
          static_cast<int32_t>(w == partial ? in.demand[e] - (k - t) * M_ : t * M_);
    }
  }
  for (int64_t w = 0; w < F_; ++w) out.tile_load[w] = static_cast<int32_t>(load_[w]);
  int64_t i = 0;
  for (const Move& m : moves_) {
    if (m.slot < 0) continue;
    out.copies[4 * i + 0] = m.expert;
    out.copies[4 * i + 1] = owner_[m.expert];
    out.copies[4 * i + 2] = m.receiver;
    out.copies[4 * i + 3] = pcount_[m.receiver] + m.slot;
    ++i;
  }
  out.num_copies = i;
}

void Scheduler::reset() {
  for (int64_t w = 0; w < F_; ++w) {
    const int32_t* on = &on_[w * E_];
    for (int32_t j = 0; j < on_count_[w]; ++j) tiles_[on[j] * F_ + w] = 0;
    on_count_[w] = 0;
    copies_into_[w] = 0;
  }
  for (int64_t e = 0; e < E_; ++e) {
    const int32_t* reps = &rep_[e * F_];
    for (int32_t i = 0; i < rep_count_[e]; ++i) has_[e * F_ + reps[i]] = 0;
    rep_count_[e] = 0;
  }
  moves_.clear();
}

}  // namespace afore
