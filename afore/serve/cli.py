"""``afore serve``: vLLM attention workers + afore FFN workers + scheduler, one command."""

from __future__ import annotations

import argparse
import logging
import sys

from afore.config import DEFAULT_COPY_RATE_GBPS
from afore.scheduler.policies import POLICY_NAMES
from afore.serve.launcher import EXCHANGES, PLANNERS, PRIMARY_LAYOUTS, ROLES, TRANSPORTS, ServeOptions, default_microbatches, serve

SPLIT_STORE_PORT = 29600  # --store-port default of the split roles (the manifests expose it)


class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, unless its help already says it or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or action.default in ("", [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _ShowDefaults
    parser.add_argument("--model", default="", help="Hugging Face MoE checkpoint directory (default: the built-in tiny Qwen3-MoE, built once under ~/.cache/afore)")
    parser.add_argument("--attn-workers", type=int, default=1, help="data-parallel vLLM attention workers (A)")
    parser.add_argument("--ffn-workers", type=int, default=2, help="FFN workers holding the routed experts (F; F > A is fine)")
    parser.add_argument("--policy", default="afore", choices=POLICY_NAMES, help="expert placement policy (switchable later: POST /afore/policy on the admin port)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the workers run: cpu (they share the cores) or cuda (one GPU per worker unless --colocate)")
    parser.add_argument("--host", default="127.0.0.1", help="address the API, admin and FFN-node ports listen on")
    parser.add_argument("--port", type=int, default=8000, help="OpenAI-compatible API port")
    parser.add_argument("--admin-port", type=int, default=0,
                        help="admin endpoint port (/afore/status, /afore/policy, OpenAPI at /docs); default 0 = --port + 1, -1 = off")
    # removed: afore's families are on /metrics of the API port (role ffn: the admin port); docs/metrics.md
    parser.add_argument("--metrics-port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--microbatches", type=int, default=None,
                        help="targets per MoE layer and step (default 1); with M >= 2 a step of at least M requests "
                             "runs as M ping-pong microbatches (microbatch b+1's attention while the FFN pool computes b; "
                             "--no-pingpong: all posted, then all awaited)")
    parser.add_argument("--no-pingpong", action="store_true",
                        help="with --microbatches >= 2: post a layer's microbatches together and wait for all (no "
                             "overlap of attention and FFN; the A/B baseline of the ping-pong schedule)")
    parser.add_argument("--spin-us", type=float, default=0.0, metavar="US",
                        help="shm data plane: busy-poll this long before blocking in every wait on the decode path "
                             "(attention replies, FFN targets and plans, scheduler demand); costs a core per waiting "
                             "process (default 0: always block; docs/serving.md says what 2000 measured)")
    parser.add_argument("--ffn-cpus", default="auto", metavar="auto|none|LIST",
                        help="CPU FFN workers' cores: auto (default) pins worker r to its own block of this process's "
                             "cores, round robin; none leaves them to the kernel; a list (0,2-3) pins them round robin "
                             "over those cores (docs/serving.md, 'CPU: where the FFN workers run')")
    parser.add_argument("--ffn-nice", type=int, default=5, metavar="N",
                        help="CPU FFN workers run at this niceness above vLLM's processes, which then preempt their "
                             "after-reply work (0-19, default 5; 0 = the same priority)")
    parser.add_argument("--planner", default="scheduler", choices=PLANNERS,
                        help="who plans each target: the scheduler process (demand mailbox -> policy -> plan ring) or "
                             "every FFN worker itself, replicated (the same "
                             "deterministic policy on the same routed counts: no demand, plan or process hop on the "
                             "decode path; one node, the shm transport on cuda), or the attention worker itself (one "
                             "attention worker: it plans each target in-process from its router output and publishes the "
                             "plan before it posts the tokens; the host exchange)")
    parser.add_argument("--exchange", default="auto", choices=EXCHANGES,
                        help="how a MoE layer call reaches the FFN pool: host (the vLLM worker's Python waits for every "
                             "layer; a splitting op of piecewise CUDA graphs) or stream (enqueued on the CUDA stream as a "
                             "host node: capturable, vLLM's own graph modes, no Python per layer; shm transport, one "
                             "microbatch); default auto: stream on cuda where it applies, else host")
    parser.add_argument("--redundant-slots", type=int, default=2, help="redundant expert slots per FFN worker and layer (R)")
    parser.add_argument("--primaries", default="contiguous", choices=PRIMARY_LAYOUTS,
                        help="primary layout of the experts over the FFN workers: contiguous blocks, or co-clustered by "
                             "expert affinity from --primaries-file (Sem-MoE placement; docs/affinity.md)")
    parser.add_argument("--primaries-file", default="", metavar="PATH",
                        help="--primaries affinity: layout JSON (afore profile affinity --workers F --layout-out) or affinity profile .npz")
    parser.add_argument("--copy-budget", type=int, default=8, help="expert copies per target at most (B)")
    parser.add_argument("--calibration", default="", metavar="PATH",
                        help="cost-model calibration (afore calibrate); default: looked up by expert shape and device")
    parser.add_argument("--role", default="all", choices=ROLES,
                        help="all: everything on this node; ffn / attention: the two halves on two nodes "
                             "(the FFN node first; both need $AFORE_DEMAND_TOKEN, the same checkpoint and the same A, F)")
    parser.add_argument("--ffn-host", default="", help="--role attention: the FFN node's address")
    parser.add_argument("--store-port", type=int, default=None,
                        help=f"transport store port (default: any free port with --role all, {SPLIT_STORE_PORT} with a split role)")
    parser.add_argument("--demand-port", type=int, default=29601, help="split roles: the FFN node's demand receiver port")
    parser.add_argument("--copy-rate-gbps", type=float, default=DEFAULT_COPY_RATE_GBPS,
                        help="GPU FFN workers: expert copy pull rate while experts compute (0 = full rate; see docs/ffn-side.md)")
    parser.add_argument("--colocate", action="store_true",
                        help="--device cuda: allow more workers than GPUs (they share GPUs; check memory headroom). "
                             "On CPU the workers always share the cores")
    parser.add_argument("--transport", default="auto", choices=TRANSPORTS,
                        help="A2F/F2A path: shm (shared buffers on one node, sparse; CUDA tensors staged through the host), "
                             "torch-nccl (one GPU per worker, across nodes), torch-gloo (CPU hosts, or CUDA tensors staged "
                             "through the host); auto = shm on one node where the workers share the device (CPU, or cuda "
                             "with --colocate), else NCCL on CUDA, gloo on CPU across nodes. --role ffn --transport shm: "
                             "attention ends of this node attach to the segment that /afore/status names (data_plane)")
    parser.add_argument("--exact", dest="exact", action="store_const", const=True, default=None,
                        help="bitwise plain vLLM's MoE numerics: FFN workers run vLLM's fused-MoE kernels on their pairs and "
                             "return a row per token-expert pair, summed by the attention worker as vLLM sums them "
                             "(needs --transport shm and one microbatch; F2A carries top_k rows per token; docs/serving.md). "
                             "Default: on with --device cuda, the shm transport and one microbatch; off otherwise")
    parser.add_argument("--no-exact", dest="exact", action="store_const", const=False,
                        help="per-(token, worker) partial sums in afore's own grouped GEMM (fewer F2A bytes; in bf16 the "
                             "experts are summed in another order than vLLM's, so tokens may differ from plain vLLM's)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="vLLM --max-model-len: longest prompt + output, tokens")
    parser.add_argument("--max-num-batched-tokens", type=int, default=0,
                        help="vLLM --max-num-batched-tokens, also the tokens per target the shm transport holds (0 = --max-model-len)")
    parser.add_argument("--dtype", default="auto",
                        help="vLLM --dtype, also the FFN workers' (auto = the checkpoint's, float32 when it declares none)")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM --enforce-eager (faster start, no torch.compile)")
    parser.add_argument("--seed", type=int, default=0, help="vLLM --seed (sampling)")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for each start-up phase")
    parser.add_argument("--vllm-arg", action="append", default=[], metavar="ARG", help="extra argument passed to vLLM's server (repeatable)")
    parser.add_argument("--verbose", action="store_true",
                        help="show vLLM's and the workers' output here (default: in the log file that the ready banner names)")
    parser.add_argument("--log-file", default="", metavar="PATH",
                        help="the children's log (default: ~/.cache/afore/logs/serve-<time>-<pid>.log, under $AFORE_CACHE_DIR if set)")


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """The ServeOptions of parsed ``afore serve`` arguments (ValueError on a bad field)."""
    if args.metrics_port is not None:
        raise ValueError("metrics_port: --metrics-port is gone; afore's metrics are on /metrics of the API port "
                         "(--port), on the FFN node of --role ffn on the admin port (docs/metrics.md)")
    store_port = args.store_port if args.store_port is not None else (0 if args.role == "all" else SPLIT_STORE_PORT)
    return ServeOptions(model=args.model, attn_workers=args.attn_workers, ffn_workers=args.ffn_workers,
                        policy=args.policy, device=args.device, host=args.host, port=args.port,
                        admin_port=args.admin_port, microbatches=(1 if args.exact else default_microbatches(args.device)) if args.microbatches is None else args.microbatches,
                        redundant_slots=args.redundant_slots, copy_budget=args.copy_budget, copy_rate_gbps=args.copy_rate_gbps,
                        role=args.role, ffn_host=args.ffn_host, demand_port=args.demand_port, store_port=store_port,
                        colocate=args.colocate, transport=args.transport, max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
                        enforce_eager=args.enforce_eager, seed=args.seed, start_timeout_s=args.start_timeout,
                        vllm_args=list(args.vllm_arg), verbose=args.verbose, log_file=args.log_file,
                        primaries=args.primaries, primaries_file=args.primaries_file, calibration=args.calibration,
                        exact=args.exact, pingpong=not args.no_pingpong, spin_us=args.spin_us,
                        planner=args.planner, exchange=args.exchange, ffn_cpus=args.ffn_cpus, ffn_nice=args.ffn_nice)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return serve(options_from_args(args))
    except (ValueError, RuntimeError, TimeoutError) as exc:
        print(f"afore serve: {exc}", file=sys.stderr)
        return 2
