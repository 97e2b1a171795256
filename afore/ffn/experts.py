"""Expert compute: the SiLU-gated MLP of every routed pair, grouped over a worker's slots.

For pair p (token t_p, physical slot s_p, routing weight g_p):

    y_p = g_p * (silu(x[t_p] W_gate[s_p]^T) * (x[t_p] W_up[s_p]^T)) W_down[s_p]^T
    out[t] = sum of y_p over the pairs of token t

with ``w13[s] = [W_gate; W_up]`` of shape [2I, H] and ``w2[s] = W_down`` of shape [H, I]
(the slot pool's layout, ``afore.migrator.slot_pool``).

Backends:
  ``triton``  grouped GEMM on the GPU: pairs are sorted by slot and padded per slot to the
              M tile (``block_m`` pairs), one program per (tile, N block); gate/up and SiLU are
              fused in the first kernel, the routing weight in the second. No host sync.
  ``torch``   one matmul pair per non-empty slot (CPU, and the reference on the GPU).
  ``auto``    triton on CUDA tensors when Triton imports, else torch.
Accumulation is fp32 in both; the output has the input's dtype.

``routed_expert_step`` is the FFN worker's whole step (partition + grouped GEMM + combine)
from a device plan table (``afore.ffn.device_plan``), with no value read back to the host:

  ``triton``  four launches (route, gate/up, down, combine; ``afore.ffn._triton_kernels``);
              deterministic (no atomics in the sums), so a CUDA-graph replay equals it bit for bit
  ``torch``   torch ops (stable sort, ``torch._grouped_mm``): the CPU path
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import numpy as np
import torch
import torch.nn.functional as F

from afore.ffn.device_plan import table_width
from afore.ffn.partition import pair_ordinals
from afore.routing import bin_counts

BACKENDS = ("auto", "triton", "torch")
STEP_BACKENDS = ("auto", "triton", "torch")
LAYER_BACKENDS = ("auto", "triton", "torch", "loop")


def grouped_expert_mlp(x: torch.Tensor, pair_token: torch.Tensor, pair_slot: torch.Tensor,
                       pair_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       backend: str = "auto", block_m: int = 16) -> torch.Tensor:
    """Weighted sum of expert MLP outputs per token.

    x: [N, H]; pair_token, pair_slot: int64[P]; pair_weight: fp32[P];
    w13: [K, 2I, H]; w2: [K, H, I] (same dtype as x). Returns [N, H] in x.dtype.
    Pairs whose slot is outside [0, K) are skipped (another worker's pairs, kept in the
    list so that the partition needs no host sync).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    n, h = x.shape
    k_slots, two_i, h13 = w13.shape
    if h13 != h or w2.shape != (k_slots, h, two_i // 2):
        raise ValueError(f"w13/w2: expected [K, 2I, {h}] and [K, {h}, I], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    if backend == "auto":
        backend = "triton" if x.is_cuda and triton_available() else "torch"
    if backend == "triton":
        return _triton_grouped(x, pair_token, pair_slot, pair_weight, w13, w2, block_m)
    return _torch_grouped(x, pair_token, pair_slot, pair_weight, w13, w2)


def expert_mlp_loop(x: torch.Tensor, pair_token: torch.Tensor, pair_slot: torch.Tensor,
                    pair_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The torch backend under its benchmark name: one matmul pair per non-empty slot."""
    return _torch_grouped(x, pair_token, pair_slot, pair_weight, w13, w2)


def _torch_grouped(x, pair_token, pair_slot, pair_weight, w13, w2):
    n, h = x.shape
    inter = w2.shape[2]
    out = torch.zeros(n, h, dtype=torch.float32, device=x.device)
    keep = (pair_slot >= 0) & (pair_slot < w13.shape[0])
    if not bool(keep.all()):
        pair_token, pair_slot, pair_weight = pair_token[keep], pair_slot[keep], pair_weight[keep]
    if pair_token.numel() == 0:
        return out.to(x.dtype)
    order = torch.sort(pair_slot, stable=True).indices
    slots_sorted = pair_slot[order]
    counts = torch.bincount(slots_sorted, minlength=w13.shape[0]).tolist()  # one host sync per call
    start = 0
    for slot, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start:start + count]
        start += count
        xs = x[pair_token[rows]]
        gate_up = xs @ w13[slot].t()
        act = F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
        y = act.to(x.dtype) @ w2[slot].t()
        out.index_add_(0, pair_token[rows], y.float() * pair_weight[rows, None])
    return out.to(x.dtype)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def align_pairs_to_tiles(pair_slot: torch.Tensor, num_slots: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort pairs by slot and pad every slot's run to a multiple of ``block_m``.

    Pairs with a slot outside [0, num_slots) are dropped. Sizes are the static upper bound
    P + K*(block_m - 1) so that no host sync is needed.
    Returns (sorted_pair int64[num_blocks*block_m], pad value P; block_slot int32[num_blocks], -1 = unused block).
    """
    p = pair_slot.numel()
    device = pair_slot.device
    slot = pair_slot.long()
    slot = torch.where((slot >= 0) & (slot < num_slots), slot, num_slots)  # bin K = dropped
    counts = bin_counts(slot, num_slots + 1)[:num_slots]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    run_start = torch.cumsum(counts, 0) - counts
    order = torch.sort(slot, stable=True).indices
    slot_sorted = slot[order]
    kept = slot_sorted < num_slots
    slot_kept = slot_sorted.clamp(max=num_slots - 1)
    pos = padded_start[slot_kept] + torch.arange(p, device=device) - run_start[slot_kept]
    num_blocks = (p + num_slots * (block_m - 1) + block_m - 1) // block_m
    sorted_pair = torch.full((num_blocks * block_m + 1,), p, dtype=torch.int64, device=device)
    # dropped pairs are written to the spare last element, which no block reads
    sorted_pair[torch.where(kept, pos, num_blocks * block_m)] = order
    sorted_pair = sorted_pair[:-1]
    block_first_row = torch.arange(num_blocks, device=device) * block_m
    block_slot = torch.searchsorted(padded_end, block_first_row, right=True)
    block_slot = torch.where(block_slot < num_slots, block_slot, torch.full_like(block_slot, -1)).to(torch.int32)
    return sorted_pair, block_slot


def _triton_grouped(x, pair_token, pair_slot, pair_weight, w13, w2, block_m):
    from afore.ffn import _triton_kernels as kernels

    n, h = x.shape
    k_slots, two_i, _ = w13.shape
    inter = two_i // 2
    p = pair_token.numel()
    out = torch.zeros(n, h, dtype=torch.float32, device=x.device)
    if p == 0:
        return out.to(x.dtype)
    sorted_pair, block_slot = align_pairs_to_tiles(pair_slot, k_slots, block_m)
    num_blocks = block_slot.numel()
    act = torch.empty(num_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    y = torch.zeros(p, h, dtype=torch.float32, device=x.device)  # skipped pairs add zero
    kernels.gate_up_silu(x, pair_token, sorted_pair, block_slot, w13, act, p, block_m)
    kernels.down_weighted(act, sorted_pair, block_slot, pair_weight, w2, y, p, block_m)
    out.index_add_(0, pair_token, y)
    return out.to(x.dtype)


# ---------------------------------------------------------------------------- the FFN step


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Tile sizes of the Triton step. ``block_m``: rows per block (pairs of one slot; >= 16
    for the tensor cores, independent of the scheduler's M tile); ``gate_up_n`` / ``down_n``:
    output columns per program of each GEMM; ``block_k``: reduction step."""

    block_m: int = 16
    gate_up_n: int = 32
    down_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "gate_up_n", "down_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}: expected a power of two >= 16, got {value}")


#: Candidates that ``afore.ffn.graphs`` times at capture (decode) and the benchmark sweeps.
DECODE_CONFIGS = (
    StepConfig(16, 32, 64, 64, 4, 3),
    StepConfig(16, 16, 32, 128, 4, 4),
    StepConfig(16, 64, 64, 64, 4, 3),
    StepConfig(16, 32, 32, 128, 4, 4),
    StepConfig(32, 32, 64, 64, 4, 3),
    StepConfig(64, 64, 64, 64, 4, 3),
    StepConfig(16, 16, 16, 256, 2, 4),
    StepConfig(16, 16, 32, 128, 2, 4),
    # bench/device/decode_sweep.py on an H100 (2026-12-07, bench/results/decode_sweep_h100_s22): the
    # best of 163 configs at 512 pairs (Qwen3-30B-A3B 9.2%, GLM-4.5-Air 4.0% below the eight above)
    # and at GLM's 16 / Qwen's 64 pairs (3.9% / 1.9%), the same output bits.
    StepConfig(16, 32, 64, 128, 4, 3),
    StepConfig(16, 64, 64, 128, 4, 3),
)
PREFILL_CONFIGS = (
    StepConfig(64, 128, 128, 64, 8, 3),
    StepConfig(128, 128, 128, 64, 8, 3),
    StepConfig(64, 64, 128, 64, 4, 4),
    StepConfig(128, 64, 128, 64, 8, 4),
    # bench/device/prefill_sweep.py on an H100 (2026-12-06, bench/results/prefill_sweep_h100_s21):
    # the best of 64 configs at 4k/16k pairs (F = 8 share), 9-18% below the four above at 16k pairs
    # and GLM's 4k, the same output bits.
    StepConfig(128, 128, 256, 64, 8, 4),
    StepConfig(128, 64, 128, 64, 4, 3),
)


def default_step_config(pairs_per_slot: float) -> StepConfig:
    """A reasonable config for about ``pairs_per_slot`` pairs on each active slot."""
    if pairs_per_slot <= 24:
        return DECODE_CONFIGS[0]
    if pairs_per_slot <= 48:
        return DECODE_CONFIGS[4]
    if pairs_per_slot <= 256:
        return DECODE_CONFIGS[5]
    return PREFILL_CONFIGS[0]


class StepBuffers:
    """Scratch of the Triton step for up to ``capacity`` pairs (device tensors, reused).

    pair_pos int32[capacity]; sorted_pair int32[rows]; block_slot, block_rows int32[blocks];
    used_blocks int32[1]; act [rows, I] (dtype); y fp32[rows, H]; hist int32[chunks, EP],
    with blocks = ceil(capacity / block_m) + K and rows = blocks * block_m."""

    def __init__(self, capacity: int, num_slots: int, hidden: int, intermediate: int, num_experts: int,
                 dtype: torch.dtype, device: torch.device | str, block_m: int) -> None:
        from afore.ffn._triton_kernels import route_chunk

        self.capacity = int(capacity)
        self.block_m = int(block_m)
        blocks = -(-self.capacity // block_m) + num_slots
        rows = blocks * block_m
        i32 = dict(dtype=torch.int32, device=device)
        self.pair_pos = torch.empty(max(1, self.capacity), **i32)
        self.sorted_pair = torch.empty(rows, **i32)
        self.block_slot = torch.empty(blocks, **i32)
        self.block_rows = torch.empty(blocks, **i32)
        self.used_blocks = torch.zeros(1, **i32)
        self.act = torch.empty(rows, intermediate, dtype=dtype, device=device)
        self.y = torch.empty(rows, hidden, dtype=torch.float32, device=device)
        chunks = max(1, -(-self.capacity // route_chunk(self.capacity)))
        self.hist = torch.empty(chunks, table_width(num_experts), **i32)


def routed_expert_step(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, table: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor, errors: torch.Tensor, num_experts: int,
                       backend: str = "auto", config: StepConfig | None = None, buffers: StepBuffers | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """This worker's partial MoE output for one step, without reading anything back to the host.

    x: [T, H]; topk_ids: int32/int64 [T, k]; topk_weights: fp32 [T, k] (contiguous);
    table: the device plan table (``afore.ffn.device_plan``; its n = the pairs to run, the
    first n of the row-major [T, k] pairs: T*k, or fewer when T is a padded bucket, triton
    only); w13: [K, 2I, H]; w2: [K, H, I]; errors: int32[1] on x's device, incremented by the
    number of ids outside [0, E) (those pairs run nowhere).
    Returns out [T, H] in x.dtype (rows t >= n / k are left as they are, triton only).
    """
    if backend not in STEP_BACKENDS:
        raise ValueError(f"backend: expected one of {STEP_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if x.is_cuda and triton_available() else "torch"
    t, k = topk_ids.shape
    if out is None:
        out = torch.empty(t, x.shape[1], dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    if backend == "torch":
        out.copy_(_torch_step(x, topk_ids, topk_weights, table, w13, w2, errors, num_experts))
        return out
    from afore.ffn import _triton_kernels as kernels

    cfg = config or default_step_config(t * k / max(1, w13.shape[0]))
    if buffers is None:
        buffers = StepBuffers(t * k, w13.shape[0], x.shape[1], w2.shape[2], num_experts, x.dtype, x.device, cfg.block_m)
    elif buffers.block_m != cfg.block_m or buffers.capacity < t * k:
        raise ValueError(f"buffers: expected block_m {cfg.block_m} and capacity >= {t * k}, "
                         f"got {buffers.block_m} and {buffers.capacity}")
    ep = table_width(num_experts)
    kernels.launch_route(topk_ids.reshape(-1), table, buffers, errors, num_experts, ep, cfg.block_m)
    kernels.launch_experts(x, topk_weights.reshape(-1), w13, w2, buffers, k, cfg)
    kernels.launch_combine(buffers, table, out, ep, k)
    return out


def _torch_step(x, topk_ids, topk_weights, table, w13, w2, errors, num_experts):
    t, k = topk_ids.shape
    ep = table_width(num_experts)
    num_slots, inter = w13.shape[0], w2.shape[2]
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    errors.add_((~valid).sum().to(errors.dtype))
    ordinals = pair_ordinals(torch.where(valid, flat, num_experts), num_experts + 1)  # bad ids: a bin of their own
    ids = torch.where(valid, flat, 0)
    tbl = table.long()
    lo, hi, slot = tbl[:ep][ids], tbl[ep:2 * ep][ids], tbl[2 * ep:3 * ep][ids]
    key = torch.where(valid & (ordinals >= lo) & (ordinals < hi), slot, num_slots)
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    offs = torch.cumsum(bin_counts(key, num_slots + 1)[:num_slots], 0).to(torch.int32)
    gate_up = _grouped_mm(x[order // k], w13, offs, sorted_key)
    act = (F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(x.dtype)
    y = _grouped_mm(act, w2, offs, sorted_key).float() * topk_weights.reshape(-1).float()[order, None]
    y = torch.where((sorted_key < num_slots)[:, None], y, 0.0)  # rows past the last group are not written
    per_pair = torch.empty_like(y)
    per_pair[order] = y
    return per_pair.view(t, k, -1).sum(1).to(x.dtype)


def _grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, row_slot: torch.Tensor) -> torch.Tensor:
    """rows of group g (offs[g-1] <= row < offs[g]) times w[g]^T; a: [M, D], w: [K, N, D].
    Rows past offs[-1] are undefined. ``torch._grouped_mm`` where its alignment holds (16-byte
    strides), else one batched matmul over gathered weights (small shapes only)."""
    elt = a.element_size()
    aligned = (a.shape[1] * elt) % 16 == 0 and (w.shape[1] * elt) % 16 == 0
    if aligned and hasattr(torch, "_grouped_mm") and (a.device.type == "cpu" or a.dtype == torch.bfloat16):
        return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
    gathered = w[row_slot.clamp(max=w.shape[0] - 1)]
    return torch.bmm(gathered, a.unsqueeze(2)).squeeze(2)


def host_pairs(topk_ids: np.ndarray, table: np.ndarray, num_experts: int) -> tuple[np.ndarray, ...]:
    """Eq. 11 for one worker in numpy, over the flattened [N*k] pairs of the host ids ``topk_ids``
    under this worker's plan ``table`` (``afore.ffn.device_plan`` layout): (valid: the id is in
    [0, E); ex: the id, 0 where invalid; ordinals: rank among the earlier pairs of the same id,
    invalid ids ranking in a bin of their own; mine: the pairs this worker runs). The step's rule
    (``routed_expert_step``), so both agree on every pair."""
    ep = table_width(num_experts)
    flat = topk_ids.reshape(-1).astype(np.int64, copy=False)
    valid = (flat >= 0) & (flat < num_experts)
    binned = np.where(valid, flat, num_experts)   # bad ids: a bin of their own, never run
    order = np.argsort(binned, kind="stable")
    counts = np.bincount(binned, minlength=num_experts + 1)
    ordinals = np.empty(flat.size, np.int64)
    ordinals[order] = np.arange(flat.size) - (np.cumsum(counts) - counts)[binned[order]]
    ex = np.where(valid, flat, 0)
    mine = valid & (ordinals >= table[ex]) & (ordinals < table[ep + ex])
    return valid, ex, ordinals, mine


try:
    from afore._ffn import HostStep as _HostStep
except ImportError:  # an older build of the extension: the numpy/torch step serves alone
    _HostStep = None

#: the largest step (multiply-adds, pairs x 3 x H x I, counting every pair of the target) that
#: runs in ``afore._ffn``: its per-pair dot products beat the ~40 small numpy/torch ops below at
#: decode loads, while a batched matmul (torch, MKL) wins on large experts
NATIVE_MAX_MACS = 1 << 24
_NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_host_steps = threading.local()


def _native_fits(pairs: int, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    return (_HostStep is not None and w13.dtype in _NATIVE_DTYPES and w2.dtype == w13.dtype
            and w13.device.type == "cpu" and w13.stride()[1:] == (w13.shape[2], 1) and w2.stride()[1:] == (w2.shape[2], 1)
            and pairs * 3 * w13.shape[2] * w2.shape[2] <= NATIVE_MAX_MACS)


def _native_sparse_step(rows_for, topk_ids: np.ndarray, topk_weights: torch.Tensor, table: np.ndarray,
                        w13: torch.Tensor, w2: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``host_sparse_step`` in ``afore._ffn`` (csrc/ffn/host_step.cpp): the same pairs and
    rounding points; only the order of additions inside a dot product differs."""
    n, k = topk_ids.shape
    step = getattr(_host_steps, "step", None)
    if step is None:
        step = _host_steps.step = _HostStep()
    ids = np.ascontiguousarray(topk_ids, dtype=np.int32)
    table = np.ascontiguousarray(table, dtype=np.int32)
    if table.size < 3 * table_width(num_experts) + 1:
        raise ValueError(f"table: expected int32[{3 * table_width(num_experts) + 1}], got {table.size} entries")
    tokens = np.empty(n, np.int64)
    u, bad = step.route(ids.ctypes.data, n, k, table.ctypes.data, num_experts, table_width(num_experts), w13.shape[0],
                        tokens.ctypes.data)
    hidden = w2.shape[1]
    rows = torch.empty(u, hidden, dtype=w13.dtype)
    if u == 0:
        return torch.zeros(0, dtype=torch.int64), rows, bad
    tokens_t = torch.from_numpy(tokens[:u])
    x = rows_for(tokens_t)
    if x.dtype != w13.dtype or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != hidden or x.stride(1) != 1 \
            or x.shape[0] < n:
        x = x.to(device="cpu", dtype=w13.dtype).contiguous()
        if x.dim() != 2 or x.shape[0] < n or x.shape[1] != hidden:
            raise ValueError(f"rows_for: expected a hidden tensor [{n}, {hidden}], got {tuple(x.shape)}")
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    if weights.numel() != n * k:
        raise ValueError(f"topk_weights: expected {n * k} weights, got {weights.numel()}")
    step.compute(x.data_ptr(), x.stride(0), weights.data_ptr(), w13.data_ptr(), w13.stride(0), w2.data_ptr(), w2.stride(0),
                 hidden, w2.shape[2],
                 _NATIVE_DTYPES[w13.dtype], rows.data_ptr())
    return tokens_t, rows, bad


def host_sparse_step(rows_for, topk_ids: np.ndarray, topk_weights: torch.Tensor, table: np.ndarray,
                     w13: torch.Tensor, w2: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This worker's partial sums for the tokens it computes, on the host (CPU workers).

    The same pairs, slots and arithmetic as ``routed_expert_step``'s torch backend (the eq. 11
    partition read from this worker's plan ``table``, int32[3*EP + 1] from ``DevicePlan.stage``),
    with the bookkeeping in numpy on the host ids (a few microseconds per op, against several
    for each small torch op) and torch only for the expert matmuls. Only the rows of the tokens
    this worker computes are read (``rows_for(tokens)``: a hidden tensor whose rows ``tokens``
    hold the inputs) and returned.

    topk_ids: int [N, k] on the host; topk_weights: fp32 [N, k]. Returns (tokens int64 [U]
    ascending, rows [U, H] in w13's dtype, the number of ids outside [0, E)).
    """
    n, k = topk_ids.shape
    ep = table_width(num_experts)
    num_slots, inter = w13.shape[0], w2.shape[2]
    if _native_fits(n * k, w13, w2):
        return _native_sparse_step(rows_for, topk_ids, topk_weights, table, w13, w2, num_experts)
    valid, ids, ordinals, mine = host_pairs(topk_ids, table, num_experts)
    bad = int(valid.size - np.count_nonzero(valid))
    slot = table[2 * ep + ids]
    pairs = np.flatnonzero(mine)   # routing order
    dtype = w13.dtype
    if pairs.size == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, w2.shape[1], dtype=dtype), bad
    pair_slot = slot[pairs].astype(np.int64)
    by_slot = np.argsort(pair_slot, kind="stable")   # groups in slot order, routing order inside
    pairs, pair_slot = pairs[by_slot], pair_slot[by_slot]
    pair_token = pairs // k
    has = np.bincount(pair_token, minlength=n) > 0
    tokens = np.flatnonzero(has)                      # ascending
    local = (np.cumsum(has) - 1)[pair_token]          # row of each pair's token in ``tokens``
    x = rows_for(torch.from_numpy(tokens)).to(dtype)
    offs = torch.from_numpy(np.cumsum(np.bincount(pair_slot, minlength=num_slots)).astype(np.int32))
    sorted_key = torch.from_numpy(pair_slot)
    gate_up = _grouped_mm(x[torch.from_numpy(pair_token)], w13, offs, sorted_key)
    act = (F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(dtype)
    y = _grouped_mm(act, w2, offs, sorted_key).float() * topk_weights.reshape(-1).float()[torch.from_numpy(pairs), None]
    # per (token, k) slot as the torch backend sums them: [U, k, H], zeros where another worker runs the pair
    per_pair = torch.zeros(tokens.size * k, y.shape[1], dtype=y.dtype)
    per_pair[torch.from_numpy(local * k + pairs % k)] = y
    return torch.from_numpy(tokens), per_pair.view(tokens.size, k, -1).sum(1).to(dtype), bad
