"""afore.ffn.cpus: which cores a CPU FFN worker is pinned to, and that a worker process really
runs there at the niceness asked for."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from afore.ffn import cpus


def test_parse_cpu_list_ranges_and_errors():
    assert cpus.parse_cpu_list("3,0-1, 1") == [0, 1, 3]
    assert cpus.parse_cpu_list("2-2") == [2]
    for bad, match in (("a", "core ids like"), ("1-", "core ids like"), ("3-1", "lo <= hi"), ("-1", "core ids like")):
        with pytest.raises(ValueError, match=match):
            cpus.parse_cpu_list(bad)


def test_worker_cpus_blocks_round_robin():
    # 2 cores, A=1, F=2 (the default on the 2-core CPU): a core each
    assert [cpus.worker_cpus([0, 1], r, 2, 1) for r in range(2)] == [[0], [1]]
    # 16 cores, A=1, F=2: 5 threads each, disjoint blocks
    assert [cpus.worker_cpus(list(range(16)), r, 2, 1) for r in range(2)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    # more workers than cores: round robin, every core used
    got = [cpus.worker_cpus([4, 7], r, 5, 1) for r in range(5)]
    assert got == [[4], [7], [4], [7], [4]]
    # the block wraps around the list
    assert cpus.worker_cpus([0, 1, 2], 2, 3, 0) == [2]
    with pytest.raises(ValueError, match="rank"):
        cpus.worker_cpus([0, 1], 2, 2, 1)
    with pytest.raises(ValueError, match="at least one core"):
        cpus.worker_cpus([], 0, 1, 1)


def test_placement_modes():
    allowed = {0, 1, 2, 3}
    assert cpus.placement("auto", "cpu", 1, 2, 1, allowed) == [1]
    assert cpus.placement("auto", "cuda", 1, 2, 1, allowed) == []  # GPU workers: left to the kernel
    assert cpus.placement("none", "cpu", 0, 2, 1, allowed) == []
    assert cpus.placement("2-3", "cpu", 1, 2, 1, allowed) == [3]
    with pytest.raises(ValueError, match="ffn_cpus: cores"):
        cpus.check_cpu_option("0,99", allowed)
    cpus.check_cpu_option("auto", allowed)
    cpus.check_cpu_option("1-2", allowed)


def _child(core: int, nice: int, queue) -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    cpus.apply([core], nice)
    import threading

    seen = {}
    # a thread started after apply inherits both
    t = threading.Thread(target=lambda: seen.update(cpus=os.sched_getaffinity(0), nice=os.getpriority(os.PRIO_PROCESS, 0)))
    t.start()
    t.join()
    queue.put((sorted(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0) - before, sorted(seen["cpus"]),
               seen["nice"] - before))


def test_apply_pins_and_renices_the_process_and_its_later_threads():
    core = max(os.sched_getaffinity(0))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(core, 3, queue))
    proc.start()
    got = queue.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 0
    assert got == ([core], 3, [core], 3)
