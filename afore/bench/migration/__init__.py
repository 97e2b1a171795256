"""``afore bench migration``: expert copy cost, copy/compute overlap and grouped-GEMM time.

Parts (all on the GPU when one is present; ``--device cpu`` runs the same code at small
sizes with the CPU engines, as a smoke test of the pipeline):

  kernels  Triton grouped GEMM vs the torch backend (bf16 error), grouped GEMM vs a loop of
           per-expert ``torch.matmul`` at decode-size loads, and beta_tile: the slope of the
           grouped GEMM's time over the number of M tiles (the scheduler's cost model).
  copies   one-sided pulls of expert weights from a peer process's slot pool (CUDA IPC on
           the second GPU: NVLink P2P), single and batched, per model expert shape, against
           the 450 GB/s NVLink peak and the measured large-copy rate (1 GiB pull).
  overlap  slowdown of the grouped GEMM while copies run on the side stream.
  replay   two FFN worker processes (one per GPU) replay a routing trace: plans from
           Algorithm 1 (``afore.scheduler.algorithm``), copies by the migrator into reserved
           slots while the previous target computes; per target raw copy time, exposed wait
           and lookahead window.
With one GPU, copies/overlap use a second pool on the same GPU and the replay is skipped.

Writes ``<name>.json`` (with the top-level ``cost_model`` that ``afore.scheduler.cost``
reads), ``<name>.md`` and ``<name>.png`` under ``--out-dir`` (default bench/results/).

Modules: ``cli`` (options, the part sequence), ``gemm``, ``copies``, ``overlap``, ``replay``,
``worker`` (one per part), ``peer`` (the peer process), ``report`` (cost model, targets, markdown,
figure), ``shapes`` and ``timing`` (what the parts share).
"""

from afore.bench.migration.cli import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
