"""`afore scheduler`: run the scheduler service on the demand mailbox and the plan ring."""

from __future__ import annotations

import argparse
import logging

import msgspec

from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.scheduler.service import SchedulerService, ServiceConfig

_SHAPE_KEYS = {"E": "num_experts", "F": "num_workers", "L": "num_layers", "R": "redundant_slots",
               "M": "m_tile", "K": "top_k"}


def parse_shape(text: str) -> ClusterShape:
    """``E=128,F=8,L=48,R=2,M=16,K=8`` (or the full ClusterShape field names)."""
    fields = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        key = _SHAPE_KEYS.get(key.strip(), key.strip())
        if not sep or key not in ClusterShape.__struct_fields__:
            raise ValueError(f"shape: expected comma-separated KEY=INT with KEY in {sorted(_SHAPE_KEYS)} "
                             f"or a ClusterShape field, got {part!r}")
        try:
            fields[key] = int(value)
        except ValueError:
            raise ValueError(f"shape.{key}: expected an integer, got {value!r}") from None
    if "num_experts" not in fields or "num_workers" not in fields:
        raise ValueError("shape: expected at least E=<experts> and F=<ffn workers>")
    return ClusterShape(**fields)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", help="pool shape, e.g. E=128,F=8,L=48,R=2,M=16,K=8")
    parser.add_argument("--policy", default="afore", help="placement policy (afore.scheduler.policies)")
    parser.add_argument("--mailbox", default="afore-mailbox", help="demand mailbox segment name (/dev/shm)")
    parser.add_argument("--ring", default="afore-plans", help="plan ring segment name (/dev/shm)")
    parser.add_argument("--attn-workers", type=int, default=1, help="attention workers reporting demand (A)")
    parser.add_argument("--microbatches", type=int, default=2, help="microbatches per layer and step")
    parser.add_argument("--deadline-ms", type=float, default=50.0, help="incomplete demand older than this gets no plan")
    parser.add_argument("--liveness-timeout", type=float, default=1.0, help="seconds before a silent reader is evicted")
    parser.add_argument("--no-pid-check", action="store_true",
                        help="detect dead FFN workers by heartbeat only (readers in another pid namespace)")
    parser.add_argument("--spin-us", type=float, default=0.0, help="busy-poll the mailbox this long before sleeping")
    parser.add_argument("--listen", default="", help="host:port of the demand receiver for remote attention workers")
    parser.add_argument("--token", default="", help="shared token of the demand receiver")
    parser.add_argument("--metrics-port", type=int, default=-1, help="Prometheus /metrics port (-1 off, 0 any)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address the /metrics endpoint binds to")
    parser.add_argument("--writer-timeout", type=float, default=1.0,
                        help="seconds without a scheduler heartbeat before FFN workers run primary-only (0 = pid only)")
    parser.add_argument("--theta", type=int, default=SchedulerParams().theta)
    parser.add_argument("--copy-budget", type=int, default=SchedulerParams().copy_budget)
    parser.add_argument("--no-chains", action="store_true",
                        help="plan with the paper's Algorithm 1 alone (no ejection chains)")
    parser.add_argument("--calibration", default="",
                        help="calibration file of the cost model (afore calibrate); default: looked up by --expert and --device")
    parser.add_argument("--expert", default="", help="expert shape for the calibration lookup: HIDDEN,INTERMEDIATE[,DTYPE]")
    parser.add_argument("--device", default="", help="device name for the calibration lookup, e.g. 'NVIDIA H200' or cpu")
    parser.add_argument("--config-json", help="a whole ServiceConfig as JSON (what afore serve passes)")


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    if args.config_json:
        try:
            return msgspec.json.decode(args.config_json, type=ServiceConfig)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"config_json: {exc}") from None
    if not args.shape:
        raise ValueError("shape: expected --shape E=..,F=.. (or --config-json)")
    shape = parse_shape(args.shape)
    return ServiceConfig(
        shape=shape, policy=args.policy, mailbox=args.mailbox, ring=args.ring,
        num_producers=args.attn_workers, num_microbatches=args.microbatches, deadline_ms=args.deadline_ms,
        liveness_timeout_s=args.liveness_timeout, pid_check=not args.no_pid_check, spin_us=args.spin_us, listen=args.listen, token=args.token,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, writer_timeout_s=args.writer_timeout, params=SchedulerParams(theta=args.theta, copy_budget=args.copy_budget, chains=not args.no_chains),
        cost=cost_from_args(args, shape.m_tile))


def cost_from_args(args: argparse.Namespace, m_tile: int) -> CostModel:
    """The cost model of --calibration, else of the calibration of --expert on --device, else the
    defaults (logged)."""
    from afore.scheduler.calibration import ExpertShape, resolve_cost_model

    expert = None
    if args.expert:
        parts = args.expert.split(",")
        try:
            expert = ExpertShape(int(parts[0]), int(parts[1]), *(parts[2:3] or ["bfloat16"]), m_tile=m_tile)
        except (ValueError, IndexError):
            raise ValueError(f"expert: expected HIDDEN,INTERMEDIATE[,DTYPE], got {args.expert!r}") from None
    return resolve_cost_model(args.calibration or None, args.device or None, expert)[0]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    config = config_from_args(args)
    service = SchedulerService(config)
    log = logging.getLogger("afore.scheduler")
    log.info("mailbox %s (A=%d), plan ring %s (F=%d), policy %s", config.mailbox, config.num_producers,
             config.ring, config.shape.num_workers, config.policy)
    try:
        service.start_endpoints()
        if service.metrics_port is not None:
            log.info("metrics on http://%s:%d/metrics", config.metrics_host, service.metrics_port)
        if service.receiver is not None:
            log.info("demand receiver on %s:%d", service.receiver.host, service.receiver.port)
        service.run()
    finally:
        service.close()
    log.info("stopped: %d plans published, %d targets missed; segments unlinked", service.published, service.missed)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m afore.scheduler.service_cli`` = ``afore scheduler`` without loading every other command."""
    parser = argparse.ArgumentParser(prog="afore scheduler", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
