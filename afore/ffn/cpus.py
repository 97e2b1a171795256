"""Where CPU FFN workers run: their cores and their scheduling priority.

On one CPU node the FFN workers share the cores with vLLM's processes (the API server, the engine
core and the model runner, which vLLM binds to its own cores). Left to the kernel's placement,
two FFN workers woken by the same post often land on one core and take turns, and a worker's
after-reply bookkeeping keeps a core that the woken model runner needs. ``afore serve`` therefore
(``--ffn-cpus auto``, the default on ``--device cpu``) pins FFN worker r to its own block of
cores, round robin over the cores this process may use, and runs it at a niceness above vLLM's
(``--ffn-nice``, default 5): while the attention side waits for the FFN pool nothing else is
runnable, and while the attention side computes it comes first. Measured on the 2-core CPU
(docs/serving.md, "CPU: where the FFN workers run").

Both calls act on the calling thread and the threads it starts later (Linux), so a worker calls
``apply`` first, before its intra-op pool or any other thread exists.
"""

from __future__ import annotations

import os

#: --ffn-cpus: auto = pinned on a CPU device, not on cuda; none = the kernel places them
CPU_MODES = ("auto", "none")


def parse_cpu_list(text: str) -> list[int]:
    """Core ids of ``"0,2-3"`` (ascending, no duplicates); ValueError naming the bad part."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"ffn_cpus: expected 'auto', 'none' or core ids like 0,2-3, got {text!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"ffn_cpus: expected core ids >= 0 and ranges lo-hi with lo <= hi, got {part!r} in {text!r}")
        cores.update(range(first, last + 1))
    return sorted(cores)


def check_cpu_option(text: str, allowed: set[int]) -> None:
    """ValueError unless ``text`` is a CPU_MODES entry or a list of cores within ``allowed``."""
    if text in CPU_MODES:
        return
    outside = sorted(set(parse_cpu_list(text)) - allowed)
    if outside:
        raise ValueError(f"ffn_cpus: cores {outside} are not among this process's cores {sorted(allowed)}")


def threads_per_worker(num_cores: int, num_ffn: int, num_attention: int) -> int:
    """Intra-op threads of one CPU FFN worker: the cores shared by every worker of the node, at least 1."""
    return max(1, num_cores // (num_ffn + num_attention))


def worker_cpus(cores: list[int], rank: int, num_ffn: int, num_attention: int) -> list[int]:
    """The cores of FFN worker ``rank``: a block of ``threads_per_worker`` consecutive entries of
    ``cores``, worker r's block starting at entry r x threads, wrapping around (more workers than
    cores: several per core, as evenly as round robin gives)."""
    if not cores:
        raise ValueError("cores: expected at least one core")
    if not 0 <= rank < num_ffn:
        raise ValueError(f"rank: expected in [0, {num_ffn}), got {rank}")
    n = len(cores)
    threads = threads_per_worker(n, num_ffn, num_attention)
    return sorted({cores[(rank * threads + j) % n] for j in range(threads)})


def placement(option: str, device: str, rank: int, num_ffn: int, num_attention: int,
              allowed: set[int] | None = None) -> list[int]:
    """The cores FFN worker ``rank`` is pinned to under ``--ffn-cpus option`` ([] = not pinned):
    ``auto`` pins on a CPU device over ``allowed`` (default: this process's cores), ``none``
    never; a list pins over its cores."""
    if option == "none" or (option == "auto" and device != "cpu"):
        return []
    cores = sorted(allowed if allowed is not None else os.sched_getaffinity(0)) if option == "auto" else parse_cpu_list(option)
    return worker_cpus(cores, rank, num_ffn, num_attention)


def apply(cpus: list[int], nice: int) -> None:
    """Pin the calling thread (and those it starts later) to ``cpus`` ([] = leave it) and raise
    its niceness by ``nice`` (0 = leave it)."""
    if cpus:
        os.sched_setaffinity(0, set(cpus))
    if nice:
        os.nice(nice)
