"""The attention side's exchange figures, recorded by the data plane in vLLM's processes.

Call ``observe_exchange`` once per MoE call (one target's A2F send and F2A receive) on the
attention worker. Families (label ``worker``: the attention worker, vLLM's data-parallel rank):

  afore_attention_f2a_wait_seconds      histogram: time the attention worker blocked waiting
                                        for the combined expert outputs (after its own work
                                        that overlaps the exchange: the exposed part only)
  afore_attention_exchange_bytes_total  counter, label direction = a2f | f2a: payload bytes
                                        sent to / received from the FFN pool
  afore_attention_overlap_seconds       histogram: per target, from its post to the start of its
                                        wait: the attention side's own work while the FFN pool
                                        had the target (ping-pong: the next microbatches'
                                        attention; the part of the FFN stage it hides)
  afore_attention_pingpong_steps_total  counter: decode steps run as ping-pong microbatches

Under ``afore serve`` they land in the pod's multiprocess directory (afore.metrics.multiprocess)
and appear on vLLM's ``/metrics``; in a plain vLLM process they register with
prometheus_client's default registry, which vLLM serves then.
"""

from __future__ import annotations

import functools

# 10 us .. 10 s: an exchange is ~100 us on NVLink, ~ms over a network, seconds when stuck
WAIT_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 10.0)


@functools.cache
def _families():
    from prometheus_client import Counter, Histogram

    wait = Histogram("afore_attention_f2a_wait_seconds",
                     "attention worker blocked waiting for the FFN pool's combined outputs, per MoE call",
                     ["worker"], buckets=WAIT_BUCKETS_S)
    sent = Counter("afore_attention_exchange_bytes", "A2F/F2A payload bytes of the attention worker",
                   ["worker", "direction"])
    overlap = Histogram("afore_attention_overlap_seconds",
                        "attention-side work between a target's post and its wait (hidden FFN time), per target",
                        ["worker"], buckets=WAIT_BUCKETS_S)
    steps = Counter("afore_attention_pingpong_steps", "decode steps run as ping-pong microbatches", ["worker"])
    return wait, sent, overlap, steps


def observe_exchange(worker: int, wait_s: float, a2f_bytes: int, f2a_bytes: int, overlap_s: float = 0.0) -> None:
    """Record one exchange of attention worker ``worker``: ``wait_s`` seconds blocked on F2A,
    ``a2f_bytes`` sent (hidden states, top-k ids and weights), ``f2a_bytes`` received,
    ``overlap_s`` seconds of attention-side work between the post and the wait."""
    if not wait_s >= 0 or not overlap_s >= 0 or a2f_bytes < 0 or f2a_bytes < 0:
        raise ValueError(f"observe_exchange: expected wait_s, overlap_s >= 0 and byte counts >= 0, got "
                         f"wait_s={wait_s}, overlap_s={overlap_s}, a2f_bytes={a2f_bytes}, f2a_bytes={f2a_bytes}")
    wait, sent, overlap, _ = _families()
    w = str(int(worker))
    wait.labels(w).observe(wait_s)
    overlap.labels(w).observe(overlap_s)
    if a2f_bytes:
        sent.labels(w, "a2f").inc(a2f_bytes)
    if f2a_bytes:
        sent.labels(w, "f2a").inc(f2a_bytes)


def count_pingpong_step(worker: int) -> None:
    """One decode step of attention worker ``worker`` ran as ping-pong microbatches."""
    _families()[3].labels(str(int(worker))).inc()
