"""Per-target timestamps of an FFN worker (``AFORE_STAGE_TRACE=PATH`` -> ``PATH.ffn<rank>.csv``).

Columns (times: ``time.perf_counter_ns()``, comparable with the attention trace's):
    seq, step, layer, microbatch, tokens (all senders), mine (tokens this worker computed),
    arrived_ns (the transport had the target), start_ns (the worker took it up), plan_ns (its plan
    read and checked), computed_ns (expert compute done), agreed_ns (every worker voted, after
    the compute; a rare second compute when the vote failed comes before it), sent_ns (the reply
    handed to the transport, stamped before it is published), used (1: the scheduler's plan ran, 0: primary-only),
    rows_ns (inside the compute: the hidden rows of this worker's tokens gathered into pinned host
    memory, GPU workers on the shm transport; 0 on paths that read them inside the step or
    received them whole),
    device_ns (CUDA workers: the GPU time of the compute on the worker's stream, from CUDA events
    around it, read after the reply's device-to-host copy completed it; 0 on CPU), published_ns (the
    transport's send returned: on a GPU the reply's device-to-host copy and the publish)
"""

from __future__ import annotations

from afore.metrics.trace import CsvTrace

COLUMNS = ("seq", "step", "layer", "microbatch", "tokens", "mine", "arrived_ns", "start_ns", "plan_ns", "computed_ns",
           "agreed_ns", "sent_ns", "used", "rows_ns", "device_ns", "published_ns")


def ffn_trace(rank: int, path: str | None = None) -> CsvTrace:
    return CsvTrace.from_env(f"ffn{rank}", COLUMNS, path)
