"""Placement policies: ``make_policy(name, shape, params, cost, **options)`` -> ``Policy``.

``REGISTRY`` maps each name to its class (``@register(name)`` in the policy's module); every list
of policy names in afore (the CLIs' choices, ``afore serve``'s check, the benchmarks) is
``POLICY_NAMES``, derived from it. See each module's opening paragraph for its source.
"""

from afore.scheduler.policies.base import REGISTRY, LayerState, Observation, Policy, make_policy, register

# isort: off
# Registration order is the order of POLICY_NAMES: the baselines first, then afore and its ablations.
from afore.scheduler.policies import static as _static  # noqa: F401  (registration)
from afore.scheduler.policies import eplb as _eplb  # noqa: F401
from afore.scheduler.policies import harmoeny as _harmoeny  # noqa: F401
from afore.scheduler.policies import lina as _lina  # noqa: F401
from afore.scheduler.policies import libra as _libra  # noqa: F401
from afore.scheduler.policies import afore as _afore  # noqa: F401
from afore.scheduler.policies import sem_moe as _sem_moe  # noqa: F401
# isort: on

POLICY_NAMES: tuple[str, ...] = tuple(REGISTRY)

__all__ = ["REGISTRY", "POLICY_NAMES", "LayerState", "Observation", "Policy", "make_policy", "register"]
