"""The attention role's configuration, read once from the environment.

The launcher (``afore serve``) starts vLLM with ``AFORE_ROLE=attention`` and
``AFORE_CONFIG`` = the JSON of :class:`AttentionRoleConfig`. Without
``AFORE_ROLE=attention`` the plugin leaves vLLM untouched, so a plain
``vllm`` run in the same environment is unaffected.
"""

from __future__ import annotations

import os

import msgspec

ROLE_ENV = "AFORE_ROLE"
CONFIG_ENV = "AFORE_CONFIG"


class AttentionRoleConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an attention worker needs to reach the FFN pool.

    ffn_endpoints[w]   request socket of FFN worker w (ZeroMQ address)
    attn_endpoints[a]  reply socket of attention worker a (one per data-parallel rank)
    ffn_pids[w]        process id of FFN worker w (same host only; 0 = unknown), used to
                       fail a forward fast when a worker died instead of waiting for the timeout
    moe_layers         model layer indices that hold a routed-expert MoE block, in order;
                       the target's ``layer`` is the position in this list
    """

    num_experts: int
    top_k: int
    attn_workers: int
    ffn_endpoints: list[str]
    attn_endpoints: list[str]
    moe_layers: list[int]
    microbatches: int = 2
    ffn_pids: list[int] = []
    mailbox: str = ""             # DemandMailbox segment name ("" = no demand path)
    exchange_timeout_s: float = 60.0
    # "zmq": afore.serve.ffn_link with afore.serve.ffn_worker; "torch": afore.transport.connector
    # (torch.distributed, gloo/NCCL) with afore.ffn.worker; its store is hosted by attention worker 0
    transport: str = "zmq"
    store_host: str = "127.0.0.1"
    store_port: int = 0
    hidden: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts: expected >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k: expected in [1, {self.num_experts}], got {self.top_k}")
        if self.attn_workers < 1 or len(self.attn_endpoints) != self.attn_workers:
            raise ValueError(f"attn_endpoints: expected {self.attn_workers} addresses (attn_workers), got {len(self.attn_endpoints)}")
        if not self.ffn_endpoints:
            raise ValueError("ffn_endpoints: expected at least one FFN worker address")
        if self.ffn_pids and len(self.ffn_pids) != len(self.ffn_endpoints):
            raise ValueError(f"ffn_pids: expected {len(self.ffn_endpoints)} entries or none, got {len(self.ffn_pids)}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches: expected >= 1, got {self.microbatches}")
        if not self.moe_layers:
            raise ValueError("moe_layers: expected at least one MoE layer index")
        if self.transport not in ("zmq", "torch"):
            raise ValueError(f"transport: expected 'zmq' or 'torch', got {self.transport!r}")
        if self.transport == "torch" and (not 0 < self.store_port < 65536 or self.hidden < 1):
            raise ValueError(f"store_port / hidden: expected a port and the hidden size with transport 'torch', got {self.store_port}, {self.hidden}")
        if self.exchange_timeout_s <= 0:
            raise ValueError(f"exchange_timeout_s: expected > 0, got {self.exchange_timeout_s}")

    @property
    def ffn_workers(self) -> int:
        return len(self.ffn_endpoints)

    def to_env(self) -> dict[str, str]:
        return {ROLE_ENV: "attention", CONFIG_ENV: msgspec.json.encode(self).decode()}


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
