"""``afore ffn-worker``: run one FFN worker until SIGTERM (``afore serve`` starts F of them)."""

from __future__ import annotations

import argparse
import logging
import sys

import msgspec

from afore.ffn.worker import DTYPES, FFNWorkerConfig, run_and_exit
from afore.config import DEFAULT_COPY_RATE_GBPS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config-json", default=None,
                        help="a whole FFNWorkerConfig as JSON (what afore serve passes; the other options are then unused)")
    parser.add_argument("--rank", type=int, default=None, help="this worker's index in [0, num-ffn) (required without --config-json)")
    parser.add_argument("--num-ffn", type=int, default=None, help="F, FFN workers in the pool (required without --config-json)")
    parser.add_argument("--num-attention", type=int, default=None, help="A, attention workers sending targets (required without --config-json)")
    parser.add_argument("--model", default=None, help="Hugging Face checkpoint directory (required without --config-json)")
    parser.add_argument("--host", default="127.0.0.1", help="transport store host (attention rank 0)")
    parser.add_argument("--port", type=int, default=29600, help="transport store port")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:<index> (one GPU per worker)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--backend", choices=("", "gloo", "nccl"), default="", help="default: gloo on CPU, nccl on CUDA")
    parser.add_argument("--redundant-slots", type=int, default=2, help="R, redundant slots per layer")
    parser.add_argument("--m-tile", type=int, default=16)
    parser.add_argument("--copy-rate-gbps", type=float, default=DEFAULT_COPY_RATE_GBPS,
                        help="GPU: pace expert copies to this pull rate while experts compute, faster only when the "
                             "lookahead window needs it (0 = always full rate)")
    parser.add_argument("--plan-ring", default="", help="the scheduler's PlanRing name (none: primary-only plans)")
    parser.add_argument("--plan-timeout-ms", type=float, default=5.0)
    parser.add_argument("--metrics-port", type=int, default=0, help="serve /metrics on this port + rank (0: off)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="transport timeout")
    parser.add_argument("--shm-segment", default="", help="the shm transport's segment in /dev/shm (none: torch.distributed)")
    parser.add_argument("--max-tokens", type=int, default=0, help="shm: tokens per target and attention worker the segment holds")
    parser.add_argument("--depth", type=int, default=2, help="targets in flight per attention worker (>= 2)")


def config_from_args(args: argparse.Namespace) -> FFNWorkerConfig:
    """The worker's config: ``--config-json`` decoded (msgspec, errors name the field), else
    built from the options (ValueError naming a missing one)."""
    if args.config_json is not None:
        try:
            return msgspec.json.decode(args.config_json, type=FFNWorkerConfig)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"config_json: {exc}") from None
    missing = [f"--{n.replace('_', '-')}" for n in ("rank", "num_ffn", "num_attention", "model") if getattr(args, n) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)}: required without --config-json")
    return FFNWorkerConfig(rank=args.rank, num_ffn=args.num_ffn, num_attention=args.num_attention, model=args.model,
                          host=args.host, port=args.port, device=args.device, dtype=args.dtype, backend=args.backend,
                          redundant_slots=args.redundant_slots, m_tile=args.m_tile, plan_ring=args.plan_ring,
                          plan_timeout_ms=args.plan_timeout_ms, copy_rate_gbps=args.copy_rate_gbps, metrics_port=args.metrics_port, timeout_s=args.timeout_s,
                          shm_segment=args.shm_segment, max_tokens=args.max_tokens, depth=args.depth)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"afore ffn-worker: {exc}", file=sys.stderr)
        return 2
    run_and_exit(cfg)
    return 0  # not reached
