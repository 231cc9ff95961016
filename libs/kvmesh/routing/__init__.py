"""Scheduling decisions shared by the router service and the simulator: policies, cost model, admission."""

from kvmesh.routing.cost import CostModel, SpeedEstimator, SpeedFit
from kvmesh.routing.policies import (
                                   POLICIES,
                                   CacheAware,
                                   Candidate,
                                   Decision,
                                   LeastLoaded,
                                   Policy,
                                   RandomChoice,
                                   RoundRobin,
                                   make_policy,
)

__all__ = [
                                   "POLICIES",
                                   "CacheAware",
                                   "Candidate",
                                   "CostModel",
                                   "Decision",
                                   "LeastLoaded",
                                   "Policy",
                                   "RandomChoice",
                                   "RoundRobin",
                                   "SpeedEstimator",
                                   "SpeedFit",
                                   "make_policy",
]
