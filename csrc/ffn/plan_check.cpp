// afore._ffn: the checks an FFN worker runs on every plan it reads, in one call each.
//
//   migrator_check  Migrator._check (afore/migrator/migrator.py): the plan is consistent with
//                   this worker's slot tables (rows sum to demand, work only where a slot is bound,
//                   primaries at their fixed slots, copies from primaries into redundant slots,
//                   every redundant slot it reads resident or copied); the slots it reads
//   worker_table    afore.ffn.device_plan.worker_table: this worker's eq. 11 table of the plan
//
// The Python versions stay the reference (and serve plans that are not the ring's int32 views);
// tests hold both equal, reasons and messages included. Each is ~15 whole-array numpy calls
// (30-50 us per plan on the 2-core machine); here a pass over E x F integers.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace {

constexpr int64_t kInt32Max = 2147483647;

std::string s(int64_t v) { return std::to_string(v); }

// (reason, reads): reason "" = valid; reads [(slot, expert)] ascending by slot.
std::pair<std::string, std::vector<std::pair<int64_t, int64_t>>> migrator_check(
    int64_t e, int64_t f, int64_t worker, int64_t num_primaries, int64_t k_w, uintptr_t assignment_ptr,
    uintptr_t slot_ptr, uintptr_t demand_ptr, uintptr_t copies_ptr, int64_t num_copies, uintptr_t owner_ptr,
    uintptr_t primary_flat_ptr, uintptr_t primary_slot_ptr, uintptr_t projected_ptr, int64_t redundant,
    bool demand_int32) {
  const int32_t* a = reinterpret_cast<const int32_t*>(assignment_ptr);
  const int32_t* sl = reinterpret_cast<const int32_t*>(slot_ptr);
  // int64[E] (a Plan's demand) or int32[E] (the demand of an encoded plan's body, read in place)
  auto demand = [demand_ptr, demand_int32](int64_t x) -> int64_t {
    return demand_int32 ? int64_t(reinterpret_cast<const int32_t*>(demand_ptr)[x])
                        : reinterpret_cast<const int64_t*>(demand_ptr)[x];
  };
  const int32_t* copies = reinterpret_cast<const int32_t*>(copies_ptr);
  const int64_t* owner = reinterpret_cast<const int64_t*>(owner_ptr);
  const int64_t* primary_flat = reinterpret_cast<const int64_t*>(primary_flat_ptr);
  const int64_t* primary_slot = reinterpret_cast<const int64_t*>(primary_slot_ptr);
  const int32_t* projected_in = reinterpret_cast<const int32_t*>(projected_ptr);
  std::vector<std::pair<int64_t, int64_t>> reads;
  if (worker < 0 || worker >= f || e < 0 || num_copies < 0 || redundant < 0) return {"bad sizes", reads};
  for (int64_t x = 0; x < e; ++x) {
    int64_t sum = 0;
    for (int64_t w = 0; w < f; ++w) sum += a[x * f + w];
    if (sum != demand(x)) return {"assignment: rows do not sum to demand", reads};
  }
  for (int64_t i = 0; i < e * f; ++i)
    if (a[i] > 0 && sl[i] < 0) return {"assignment: work on a worker without a slot binding", reads};
  for (int64_t x = 0; x < e; ++x)
    if (int64_t(sl[primary_flat[x]]) != primary_slot[x]) return {"slot: a primary is not at its fixed slot", reads};
  std::vector<int64_t> projected(projected_in, projected_in + redundant);  // int32 resident ids, widened
  for (int64_t c = 0; c < num_copies; ++c) {
    const int64_t ex = copies[4 * c], src = copies[4 * c + 1], dst = copies[4 * c + 2], slot = copies[4 * c + 3];
    if (!(0 <= ex && ex < e && 0 <= dst && dst < f))
      return {"copies: row (" + s(ex) + ", " + s(src) + ", " + s(dst) + ", " + s(slot) + ") out of range", reads};
    if (src != owner[ex])
      return {"copies: expert " + s(ex) + " copied from " + s(src) + ", not its primary " + s(owner[ex]), reads};
    if (dst == worker) {
      if (!(num_primaries <= slot && slot < k_w))
        return {"copies: slot " + s(slot) + " is not a redundant slot of worker " + s(dst), reads};
      projected[size_t(slot - num_primaries)] = ex;
    }
  }
  for (int64_t ex = 0; ex < e; ++ex) {
    const int64_t slot = sl[ex * f + worker];
    if (a[ex * f + worker] > 0 && slot < num_primaries && owner[ex] != worker) {
      // a primary slot holds its own primary only: another expert's pairs there would run on its weights
      reads.clear();
      return {"slot: expert " + s(ex) + " on worker " + s(worker) + " bound to primary slot " + s(slot) +
                  " of another expert",
              reads};
    }
    if (!(slot >= num_primaries && a[ex * f + worker] > 0)) continue;
    if (slot >= k_w) {
      reads.clear();
      return {"slot: expert " + s(ex) + " bound to slot " + s(slot) + " beyond K_w=" + s(k_w), reads};
    }
    if (projected[size_t(slot - num_primaries)] != ex) {
      reads.clear();
      return {"slot: expert " + s(ex) + " on worker " + s(worker) + " slot " + s(slot) +
                  " is neither resident nor copied",
              reads};
    }
    reads.emplace_back(slot, ex);
  }
  std::sort(reads.begin(), reads.end());
  return {"", reads};
}

// Fills table (int32[3*ep + 1]) as device_plan.worker_table does; returns "" or its ValueError text.
std::string worker_table(int64_t e, int64_t f, int64_t worker, int64_t num_slots, int64_t ep, uintptr_t assignment_ptr,
                         uintptr_t slot_ptr, uintptr_t owner_ptr, uintptr_t primary_slot_ptr, uintptr_t table_ptr) {
  const int32_t* a = reinterpret_cast<const int32_t*>(assignment_ptr);
  const int32_t* sl = reinterpret_cast<const int32_t*>(slot_ptr);
  const int64_t* owner = reinterpret_cast<const int64_t*>(owner_ptr);
  const int64_t* primary_slot = reinterpret_cast<const int64_t*>(primary_slot_ptr);
  int32_t* table = reinterpret_cast<int32_t*>(table_ptr);
  if (worker < 0 || worker >= f || e < 0 || ep < e) return "bad sizes";
  for (int64_t i = 0; i < e * f; ++i)
    if (a[i] < 0) {
      int64_t lowest = a[i];
      for (int64_t j = 0; j < e * f; ++j) lowest = std::min<int64_t>(lowest, a[j]);
      return "plan.assignment: expected counts >= 0, got " + s(lowest);
    }
  // the checks in worker_table's order (each over every expert), so the first error is the same
  std::vector<int64_t> lo(static_cast<size_t>(e)), hi(static_cast<size_t>(e));
  for (int64_t x = 0; x < e; ++x) {
    int64_t total = 0, upto = 0, mine_np = 0;
    for (int64_t w = 0; w < f; ++w) {
      const int64_t v = w == owner[x] ? 0 : a[x * f + w];
      total += v;
      if (w == worker) upto = total, mine_np = v;
    }
    if (total >= kInt32Max) return "plan.assignment: expected fewer than " + s(kInt32Max) + " pairs per expert";
    const bool mine_primary = owner[x] == worker;
    lo[size_t(x)] = mine_primary ? total : upto - mine_np;
    hi[size_t(x)] = mine_primary ? kInt32Max : upto;
  }
  for (int64_t x = 0; x < e; ++x) {
    const int64_t slot = sl[x * f + worker];
    if (hi[size_t(x)] > lo[size_t(x)] && (slot < 0 || slot >= num_slots))
      return "plan.slot: expert " + s(x) + " runs on worker " + s(worker) + " but is bound to slot " + s(slot) +
             ", outside [0, " + s(num_slots) + ")";
  }
  for (int64_t x = 0; x < e; ++x) {
    const int64_t slot = sl[x * f + worker];
    if (owner[x] == worker && slot != primary_slot[x])
      return "plan.slot: primary " + s(x) + " of worker " + s(worker) + " is bound to slot " + s(slot) +
             ", not its fixed slot " + s(primary_slot[x]);
  }
  for (int64_t x = 0; x < e; ++x) {
    const bool works = hi[size_t(x)] > lo[size_t(x)];
    table[x] = works ? int32_t(lo[size_t(x)]) : 0;
    table[ep + x] = works ? int32_t(hi[size_t(x)]) : 0;
    table[2 * ep + x] = works ? int32_t(sl[x * f + worker]) : -1;
  }
  for (int64_t x = e; x < ep; ++x) table[x] = 0, table[ep + x] = 0, table[2 * ep + x] = -1;
  table[3 * ep] = 0;
  return "";
}

}  // namespace

void bind_plan_check(nb::module_& m) {
  m.def("migrator_check", &migrator_check, "e"_a, "f"_a, "worker"_a, "num_primaries"_a, "k_w"_a, "assignment"_a,
        "slot"_a, "demand"_a, "copies"_a, "num_copies"_a, "owner"_a, "primary_flat"_a, "primary_slot"_a,
        "projected"_a, "redundant"_a, "demand_int32"_a = false);
  m.def("worker_table", &worker_table, "e"_a, "f"_a, "worker"_a, "num_slots"_a, "ep"_a, "assignment"_a, "slot"_a,
        "owner"_a, "primary_slot"_a, "table"_a);
}
