"""``sem-moe``: Sem-MoE's model placement, static: every pair on its expert's co-clustered primary.

Source: Semantic Parallelism / Sem-MoE (arXiv 2503.04398; seeds/000, 003, 004): offline, experts
that tokens activate together are clustered onto the same device under a load-balance term, and
the placement then stays fixed while serving (re-placed periodically offline, not per batch).
In afore the placement is the primary layout itself (``ClusterShape.primaries``, computed by
``afore.affinity.cocluster.co_cluster`` from an affinity profile; ``afore serve --primaries
affinity``), so this policy runs every token-expert pair on its primary and never copies. Under
the default contiguous primaries it plans exactly as ``static``; the difference between the two
is the layout, which is why it is a property of the shape and not of the policy. ``afore``
under co-clustered primaries is the combination: Sem-MoE's placement plus online replicas.
"""

from __future__ import annotations

from afore.scheduler.policies.base import register
from afore.scheduler.policies.static import StaticPolicy


@register("sem-moe")
class SemMoEPolicy(StaticPolicy):
    pass
