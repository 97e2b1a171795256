// Algorithm 1 of the AFORE paper, plus afore's ejection chains: the C++ production core.
//
// Same result as the Python reference afore/scheduler/algorithm.py on every input (all arrays
// equal; gain and exposed cost computed by the same IEEE operations in the same order).
// A Scheduler holds the scratch of one cluster shape (E experts, F workers, R redundant slots,
// M_tile) so that a call allocates nothing on the heap: planning state lives in preallocated
// arrays that are reset incrementally (only touched entries) at the end of each call.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

namespace afore {

struct ScheduleInputs {
  const int64_t* demand;          // [E]
  const int32_t* table_expert;    // [F, R], -1 = empty
  const int64_t* table_last_used; // [F, R], -1 = never
  const bool* protected_slots;    // [F, R]
  const int32_t* prev_assignment; // [E, F] or nullptr
  int64_t theta;                  // compactness threshold (tiles)
  int64_t copy_budget;            // B
  double beta_tile_ms;
  double copy_ms;
  double window_ms;
  int64_t seq;
  bool chains = true;             // ejection chains (beyond the paper); false = Algorithm 1 only
};

// Dense outputs, written in full by Scheduler::run.
struct ScheduleOutputs {
  bool* replicas;          // [E, F]
  int32_t* assignment;     // [E, F]
  int32_t* tiles;          // [E, F]
  int32_t* slot;           // [E, F]
  int32_t* tile_load;      // [F]
  int32_t* new_expert;     // [F, R]
  int64_t* new_last_used;  // [F, R]
  int32_t* copies;         // [min(B, F*R), 4] capacity; num_copies rows written
  int64_t num_copies = 0;
  double gain_ms = 0.0;
  double exposed_ms = 0.0;
};

class Scheduler {
 public:
  // primary_owner: the fixed primary worker of each expert ([E], ClusterShape.primaries);
  // empty = contiguous blocks, the first E % F workers owning one more.
  Scheduler(int64_t num_experts, int64_t num_workers, int64_t redundant_slots, int64_t m_tile,
            const std::vector<int32_t>& primary_owner = {});

  int64_t num_experts() const { return E_; }
  int64_t num_workers() const { return F_; }
  int64_t redundant_slots() const { return R_; }
  int64_t m_tile() const { return M_; }
  // Moves of the last call: within the placement (pair moves), ejection chains applied within
  // the placement, and tile moves beyond it (explored, kept or not; a chain counts its hops).
  int64_t last_within_moves() const { return within_moves_; }
  int64_t last_within_chains() const { return within_chains_; }
  int64_t last_beyond_moves() const { return beyond_moves_; }

  // Validates the inputs (throws std::invalid_argument naming the field), then plans.
  // Calls on one object are serialised (the scratch is shared); use one object per thread
  // for parallel planning.
  void run(const ScheduleInputs& in, ScheduleOutputs& out);

 private:
  struct Move {  // one tile move of the beyond phase (slot -1: onto an existing replica)
    int32_t expert, donor, receiver, slot, old_expert;
    int64_t tiles;
  };
  struct Hop {  // one hop of an ejection chain: one tile of expert from -> to (slot -1: no copy)
    int32_t expert, from, to, slot;
  };

  void validate(const ScheduleInputs& in);
  void initialize(const ScheduleInputs& in);
  bool find_within_move(int64_t theta, int32_t& e, int32_t& h, int32_t& c, int64_t& q);
  void unstick_after_move(int64_t theta, int32_t h, int32_t c);
  void rebalance_within(int64_t theta, bool chains);
  void search_beyond(const ScheduleInputs& in, double f0, int64_t level, int64_t floor,
                     double& best_gain, double& best_exposed);
  bool search_level(const ScheduleInputs& in, double f0, int64_t level, double& gain,
                    double& exposed);
  int64_t budget_bound(const ScheduleInputs& in, int64_t budget);
  int32_t sort_movable(int32_t u, int64_t theta);
  bool find_level_move(const ScheduleInputs& in, int32_t h, int64_t excess, int64_t level,
                       bool copy, int32_t& e, int32_t& c, int32_t& r, int64_t& q);
  int32_t expand_level(int32_t begin, int32_t end, int32_t n, int64_t theta, int64_t stamp);
  bool find_level_path(const ScheduleInputs& in, int32_t h, int64_t excess, int64_t level,
                       bool copy, int32_t& n_hops, int64_t& q);
  bool find_push_path(const ScheduleInputs& in, int64_t excess, int64_t level, int32_t n,
                      int32_t& n_hops, int64_t& q);
  int32_t placement_path_length(int32_t v) const;
  int64_t placement_hops(int32_t v, int64_t theta, int32_t end);
  void apply_chain(const ScheduleInputs& in, int32_t n_hops, int64_t tiles, int64_t& n_copies,
                   int64_t& max_into);
  void redo_move(const Move& m);
  void undo_moves(size_t keep);
  int32_t safe_slot(int32_t c, const ScheduleInputs& in) const;
  bool find_beyond_move(const ScheduleInputs& in, int32_t& e, int32_t& h, int32_t& c,
                        int32_t& r, int64_t& q);
  bool find_chain(int64_t theta, bool allow_copy, int32_t& n_hops);
  bool has_copy_edge(int32_t u, int32_t v, int64_t theta) const;
  int32_t hop_expert(int32_t u, int32_t v, int64_t theta, bool copy) const;
  void move_tiles(int32_t e, int32_t h, int32_t c, int64_t q);
  void add_tiles(int32_t e, int32_t w, int64_t n);
  void add_replica(int32_t e, int32_t w);
  void remove_replica(int32_t e, int32_t w);
  void fix_order_after_decrease(int32_t w);
  void fix_order_after_increase(int32_t w);
  void write_outputs(const ScheduleInputs& in, ScheduleOutputs& out) const;
  void reset();

  // Scan orders: donors by (load desc, index asc), receivers by (load asc, index asc).
  bool donor_before(int32_t a, int32_t b) const {
    return load_[a] > load_[b] || (load_[a] == load_[b] && a < b);
  }
  bool receiver_before(int32_t a, int32_t b) const {
    return load_[a] < load_[b] || (load_[a] == load_[b] && a < b);
  }

  std::mutex mutex_;  // guards the scratch below: bench runs release the GIL
  int64_t E_, F_, R_, M_;
  std::vector<int32_t> owner_;        // [E] primary worker
  std::vector<int32_t> primary_slot_; // [E]
  std::vector<int32_t> pcount_;       // [F] primaries per worker
  std::vector<int32_t> pstart_;       // [F+1] worker w's primaries: pexperts_[pstart_[w] ..]
  std::vector<int32_t> pexperts_;     // [E] experts by (owner, id)

  std::vector<int64_t> k_;            // [E] tiles per expert
  std::vector<int32_t> tiles_;        // [E*F] N (< 2**31: demand is), zero outside this call
  std::vector<uint8_t> has_;          // [E*F] placement, zero outside this call
  std::vector<int64_t> load_;         // [F] T
  std::vector<int32_t> binding_;      // [F*R]
  std::vector<uint8_t> reserved_;     // [F*R]

  std::vector<int32_t> rep_count_;    // [E] replica workers of e (primary first, any order)
  std::vector<int32_t> rep_;          // [E*F]
  std::vector<int32_t> on_count_;     // [F] experts with tiles on w (any order)
  std::vector<int32_t> on_;           // [F*E]
  std::vector<int32_t> on_pos_;       // [E*F] index of e in on_[w], -1 if absent

  std::vector<int32_t> donors_, receivers_;        // [F]
  std::vector<int32_t> donor_pos_, receiver_pos_;  // [F]

  std::vector<int32_t> safe_list_;    // [F] receivers with a safe slot, in receiver order
  std::vector<int32_t> safe_slot_;    // [F] cached safe slot of each worker (-1: none)
  std::vector<uint8_t> stuck_;        // [F] donor known to have no within move
  std::vector<int64_t> copies_into_;  // [F]
  std::vector<Move> moves_;           // undo log of stage 3, capacity max_hops_: 4 F (R + 1)
  std::vector<Move> kept_;            // the first search's candidate while the second one runs
  int64_t searched_moves_ = 0;        // moves explored by the last search_beyond
  int64_t max_hops_ = 0;              // cap on the tile moves of the beyond phase
  std::vector<int64_t> needy_;        // [E] budget_bound: per worker, copy-needing primaries' k, summed
  std::vector<int64_t> needy_rest_;   // [F]
  std::vector<int32_t> needy_count_;  // [F]
  std::vector<int32_t> by_tiles_;     // [E] search_level: the donor's movable experts by (N desc, id)
  std::vector<int32_t> over_;         // [F] find_level_move: the workers above the level
  std::vector<Hop> chain_;            // [F] hops of the last chain found
  std::vector<int32_t> bfs_queue_;    // [F] chain search: visited workers, level by level
  std::vector<int32_t> bfs_parent_;   // [F]
  std::vector<uint8_t> bfs_copied_;   // [F] the path to the worker holds a copy
  std::vector<uint8_t> bfs_via_copy_; // [F] the hop into the worker is the copy
  std::vector<int64_t> bfs_seen_;     // [F] stamp of the search that visited the worker
  std::vector<int32_t> bfs_pending_;  // [F] workers with a safe slot not visited yet
  std::vector<int32_t> push_from_;    // [F] find_push_path: the worker a copy target's copy comes from
  std::vector<int64_t> bfs_expanded_; // [E] stamp of the search that expanded the expert's replicas
  int64_t bfs_stamp_ = 0;
  std::vector<int64_t> remainder_;    // [F] scratch for largest remainder
  std::vector<int32_t> lr_workers_;   // [F]
  std::vector<int64_t> seen_stamp_;   // [E] duplicate-binding check: stamp of (call, worker)
  int64_t stamp_ = 0;
  int64_t within_moves_ = 0, within_chains_ = 0, beyond_moves_ = 0;
};

}  // namespace afore
