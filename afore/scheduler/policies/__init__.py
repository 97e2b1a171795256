"""Placement policies: ``make_policy(name, shape, params, cost, **options)`` -> ``Policy``.

Names: static, eplb, eplb-async, harmoeny, lina, libra, afore, afore-no-prefetch,
afore-no-overlap (see each module's opening paragraph for its source).
"""

from afore.scheduler.policies.base import REGISTRY, LayerState, Observation, Policy, make_policy, register
from afore.scheduler.policies import afore as _afore  # noqa: F401  (registration)
from afore.scheduler.policies import eplb as _eplb  # noqa: F401
from afore.scheduler.policies import harmoeny as _harmoeny  # noqa: F401
from afore.scheduler.policies import libra as _libra  # noqa: F401
from afore.scheduler.policies import lina as _lina  # noqa: F401
from afore.scheduler.policies import static as _static  # noqa: F401

POLICY_NAMES = ("static", "eplb", "eplb-async", "harmoeny", "lina", "libra", "afore", "afore-no-prefetch", "afore-no-overlap")

__all__ = ["REGISTRY", "POLICY_NAMES", "LayerState", "Observation", "Policy", "make_policy", "register"]
