"""The A2F/F2A connector interface: what the attention side and the FFN workers call.

Two transports implement it (``--transport``):

- ``shm`` (``afore.transport.shm``): workers on one node, shared buffers in /dev/shm, sparse
  reads and sparse replies, futex wake-ups; the default when every worker is on one machine.
- ``torch`` (``afore.transport.connector``): torch.distributed point-to-point, gloo on CPU
  hosts and NCCL across GPUs and nodes (the two-node layout); its FFN side gathers every token.

Attention end (one per attention worker)::

    sent = end.send(target, seq, hidden [n, H], topk_ids int32 [n, k], topk_weights fp32 [n, k])
    out = end.recv(sent)          # [n, H]: the sum over experts of weight x expert(hidden), in send order
    end.close()

FFN end (one per FFN worker)::

    mb = end.recv(timeout_s)      # Microbatch of the next target (None on timeout)
    nxt = end.peek()              # the target after it, if already published (to read its plan early)
    ok = end.agree(flag, digest)  # every FFN worker's flag ANDed, and all the same plan digest
    end.send(mb, ReplyRows(tokens, rows))   # partial sums of the tokens this worker computed
    end.close()

Another transport (NIXL, DeepEP-style kernels) is one new module with these two classes.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from afore.plan import Target


@dataclasses.dataclass
class Microbatch:
    """One target's inputs at the FFN side, in attention-rank order (N = sum of splits).

    ``hidden`` [N, H] when the transport delivered every row (torch); None when rows stay with
    the transport until ``rows_for`` asks for the ones this worker computes (shm)."""

    target: Target
    seq: int
    hidden: torch.Tensor | None  # [N, H]
    topk_ids: torch.Tensor       # int32 [N, k]: on the worker's device (torch), on the host (shm)
    topk_weights: torch.Tensor   # fp32 [N, k]: with topk_ids
    splits: list[int]            # rows per attention worker
    arrived: float = 0.0         # time.perf_counter() when the last part arrived
    ready: object = None         # CUDA event on the receive stream (None on CPU)
    source: object = None        # lazy rows (``gather(tokens)``, ``dense()``), when hidden is None
    counter: int = 0             # transport message number

    @property
    def num_tokens(self) -> int:
        return int(sum(self.splits))

    def rows_for(self, tokens: torch.Tensor) -> torch.Tensor:
        """A hidden tensor [N, H] whose rows ``tokens`` (int64, ascending) hold the inputs; other
        rows are unspecified. One sender: a view of the transport's buffer (no copy)."""
        if self.hidden is not None:
            return self.hidden
        if len(self.splits) == 1 and self.source.zero_copy:
            return self.source.view_for(tokens)
        rows = self.source.gather(tokens)
        out = torch.empty(self.num_tokens, rows.shape[1], dtype=rows.dtype, device=rows.device)
        out[tokens.to(rows.device)] = rows
        return out

    def dense_hidden(self) -> torch.Tensor:
        """Every row [N, H] (reference path)."""
        return self.hidden if self.hidden is not None else self.source.dense()


@dataclasses.dataclass
class ReplyRows:
    """An FFN worker's partial output for one target: ``rows [U, H]`` for gathered token indices
    ``tokens`` (int64 [U], ascending); tokens it computed no pair of are left out."""

    tokens: torch.Tensor
    rows: torch.Tensor

    @classmethod
    def dense(cls, partial: torch.Tensor) -> "ReplyRows":
        return cls(torch.arange(partial.shape[0], device=partial.device), partial)


class AttentionEnd(Protocol):
    def send(self, target: Target, seq: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
             topk_weights: torch.Tensor) -> object: ...
    def recv(self, sent: object) -> torch.Tensor: ...
    def close(self) -> None: ...


class FFNEnd(Protocol):
    queued: int

    def recv(self, timeout_s: float | None = None) -> Microbatch | None: ...
    def peek(self) -> Microbatch | None: ...
    def agree(self, flag: bool, digest: int = 0) -> bool: ...
    def send(self, mb: Microbatch, partial: ReplyRows) -> None: ...
    def close(self) -> None: ...
