"""How long a small GPU round trip (H2D copy, one kernel, D2H copy: what an attention or FFN
process does per target) takes on one GPU while 0, 1 or 2 other processes keep that GPU busy with
short kernels (as FFN workers do), i.e. the cost of the driver's time-slicing between CUDA
contexts. Run on the GPU host: python3 bench/device/timeslice.py > $OUT/timeslice.json"""
import json
import multiprocessing as mp
import statistics
import sys
import time

import torch


def busy(stop, kernel_us: float) -> None:
    torch.cuda.set_device(0)
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    reps = max(1, int(kernel_us / 25))  # ~25 us per 2048^3 bf16 matmul on an H200 (about 0.7 PFLOP/s)
    while not stop.is_set():
        for _ in range(reps):
            a @ b
        torch.cuda.synchronize()


def probe(n: int = 400) -> dict:
    x = torch.randn(8, 2048)
    times = []
    for i in range(n + 20):
        t0 = time.perf_counter()
        y = (x.to("cuda", non_blocking=False) * 2.0).to("cpu")
        if i >= 20:
            times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return {"p50_us": statistics.median(times), "p90_us": times[int(0.9 * len(times))], "p99_us": times[int(0.99 * len(times))]}


if __name__ == "__main__":
    torch.cuda.init()
    ctx = mp.get_context("spawn")
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": []}
    for others, kernel_us in [(0, 0), (1, 50), (1, 500), (2, 50), (2, 500)]:
        stop = ctx.Event()
        procs = [ctx.Process(target=busy, args=(stop, kernel_us)) for _ in range(others)]
        for p in procs:
            p.start()
        time.sleep(3.0 if others else 0.0)
        r = probe()
        stop.set()
        for p in procs:
            p.join(20)
        out["cases"].append({"other_processes": others, "their_burst_us": kernel_us, **r})
        print(out["cases"][-1], file=sys.stderr)
    # the same busy work on a thread of this process (its own stream, the same context: no switch)
    import threading

    for kernel_us in (50, 500):
        stop = threading.Event()

        def spin():
            with torch.cuda.stream(torch.cuda.Stream()):
                busy(stop, kernel_us)

        t = threading.Thread(target=spin)
        t.start()
        time.sleep(1.0)
        r = probe()
        stop.set()
        t.join(20)
        out["cases"].append({"other_processes": 0, "same_process_thread_burst_us": kernel_us, **r})
        print(out["cases"][-1], file=sys.stderr)
    print(json.dumps(out, indent=1))
