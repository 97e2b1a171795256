"""The attention role's configuration, read once from the environment.

The launcher (``afore serve``) starts vLLM with ``AFORE_ROLE=attention`` and
``AFORE_CONFIG`` = the JSON of :class:`AttentionRoleConfig`. Without
``AFORE_ROLE=attention`` the plugin leaves vLLM untouched, so a plain
``vllm`` run in the same environment is unaffected.
"""

from __future__ import annotations

import os

import msgspec

from afore import config

ROLE_ENV = "AFORE_ROLE"
CONFIG_ENV = "AFORE_CONFIG"
DEMAND_TOKEN_ENV = config.DEMAND_TOKEN_ENV  # shared secret of the FFN node's demand receiver


class AttentionRoleConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an attention worker needs to reach the FFN pool.

    The A2F/F2A path is ``afore.transport.connector`` (torch.distributed: gloo on CPU, NCCL on
    GPU): attention workers are ranks 0..A-1, the F FFN workers (``afore ffn-worker``) ranks
    A..A+F-1, all meeting at the TCPStore that attention worker 0 hosts on
    ``store_host:store_port``.

    moe_layers         model layer indices that hold a routed-expert MoE block, in order;
                       the target's ``layer`` is the position in this list
    exchange_timeout_s bound of one exchange: a silent FFN worker fails the forward after it,
                       a dead one at once
    """

    num_experts: int
    top_k: int
    attn_workers: int
    ffn_workers: int
    moe_layers: list[int]
    store_port: int
    hidden: int
    store_host: str = "127.0.0.1"
    dtype: str = "float32"
    device: str = "cpu"           # cpu: gloo; cuda: NCCL (as the FFN workers)
    backend: str = ""             # torch.distributed backend, as the FFN workers': "" = gloo on CPU,
                                  # nccl on CUDA; "gloo" on CUDA stages tensors through the host
                                  # (workers sharing one GPU: NCCL cannot hold them)
    microbatches: int = 2
    mailbox: str = ""             # DemandMailbox segment name (attention on the FFN node)
    demand: str = ""              # "host:port" of the FFN node's demand receiver (attention on
                                  # another node; token in $AFORE_DEMAND_TOKEN); "" = mailbox
    store_master: bool = True     # attention worker 0 hosts the store; False: the FFN node does
    exchange_timeout_s: float = 60.0
    shm_segment: str = ""         # the shm transport's segment (afore.transport.shm); "" = torch.distributed
    max_tokens: int = 0           # shm: tokens per target the segment holds (vLLM's max_num_batched_tokens)
    depth: int = 2                # shm: targets in flight per attention worker (>= microbatches)
    exact: bool = False           # shm: replies per token-expert pair, summed as vLLM sums them (afore.ffn.exact)
    pingpong: bool = True         # microbatches >= 2: split decode steps into ping-pong microbatches
                                  # (afore.attention.pingpong); False: post all of a call's targets, then wait
    spin_us: float = 0.0          # shm: busy-poll this long before blocking on the replies (afore serve --spin-us)
    planner: str = ""             # "" (the scheduler process, or the FFN workers, plan) or the msgspec JSON of the
                                  # ServiceConfig of the in-process planner (afore serve --planner attention,
                                  # afore.attention.planner: this worker plans its targets and publishes the plans)
    policy_board: str = ""        # --planner attention: the policy board's segment (policy switches)
    exchange: str = "host"        # host: each MoE layer call exchanges on the Python host (a splitting op of
                                  # piecewise CUDA graphs); stream: enqueued on the CUDA stream as a host node,
                                  # capturable (afore.attention.stream; shm, one microbatch)

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts: expected >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k: expected in [1, {self.num_experts}], got {self.top_k}")
        if self.attn_workers < 1:
            raise ValueError(f"attn_workers: expected >= 1, got {self.attn_workers}")
        if self.ffn_workers < 1:
            raise ValueError(f"ffn_workers: expected >= 1, got {self.ffn_workers}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches: expected >= 1, got {self.microbatches}")
        if not self.moe_layers:
            raise ValueError("moe_layers: expected at least one MoE layer index")
        if not 0 < self.store_port < 65536:
            raise ValueError(f"store_port: expected in [1, 65535], got {self.store_port}")
        if self.hidden < 1:
            raise ValueError(f"hidden: expected the model's hidden size (>= 1), got {self.hidden}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {self.device!r}")
        if self.backend not in ("", "gloo", "nccl"):
            raise ValueError(f"backend: expected '', 'gloo' or 'nccl', got {self.backend!r}")
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError(f"backend: nccl needs device 'cuda', got {self.device!r}")
        if self.mailbox and self.demand:
            raise ValueError("mailbox, demand: expected one demand path, got both")
        if self.demand:
            split_address(self.demand, "demand")
        if self.shm_segment and self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected >= 1 with shm_segment, got {self.max_tokens}")
        if self.shm_segment and self.depth < self.microbatches:
            raise ValueError(f"depth: expected >= microbatches={self.microbatches} (every microbatch of a layer is in flight), got {self.depth}")
        if self.exchange_timeout_s <= 0:
            raise ValueError(f"exchange_timeout_s: expected > 0, got {self.exchange_timeout_s}")
        if not self.spin_us >= 0:
            raise ValueError(f"spin_us: expected microseconds >= 0, got {self.spin_us}")
        if self.planner and (self.mailbox or self.demand or self.attn_workers != 1 or self.exchange != "host"):
            raise ValueError("planner: the in-process planner needs one attention worker, the host exchange and no other "
                             f"demand path, got attn_workers={self.attn_workers}, exchange={self.exchange!r}, "
                             f"mailbox={self.mailbox!r}, demand={self.demand!r}")
        if self.exchange not in ("host", "stream"):
            raise ValueError(f"exchange: expected 'host' or 'stream', got {self.exchange!r}")
        if self.exchange == "stream" and (not self.shm_segment or self.microbatches != 1 or self.demand):
            raise ValueError("exchange: 'stream' needs the shm transport (shm_segment), one microbatch and the FFN node's "
                             f"mailbox, got shm_segment={self.shm_segment!r}, microbatches={self.microbatches}, "
                             f"demand={self.demand!r}")

    def to_env(self) -> dict[str, str]:
        return {ROLE_ENV: "attention", CONFIG_ENV: msgspec.json.encode(self).decode()}


def split_address(address: str, name: str = "address") -> tuple[str, int]:
    """("host", port) of "host:port"; ValueError naming ``name`` otherwise."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # [IPv6]:port
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}: expected 'host:port' (IPv6: '[addr]:port') with a port in [1, 65535], got {address!r}")
    return host, int(port)


def role() -> str:
    return os.environ.get(ROLE_ENV, "")


def load_from_env() -> AttentionRoleConfig:
    raw = os.environ.get(CONFIG_ENV)
    if not raw:
        raise ValueError(f"{CONFIG_ENV}: expected the attention role's JSON configuration when {ROLE_ENV}=attention, got nothing")
    try:
        return msgspec.json.decode(raw, type=AttentionRoleConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{CONFIG_ENV}: {exc}") from exc
