"""The planner: how many prefill, decode (or both) instances each pool needs to meet the TTFT and ITL targets
at the least cost, from the fleet's heartbeats and the traffic of the last window. A pure decision (``plan``);
the ``kvmesh plan`` command and its actuators (the local launcher, the Kubernetes API) do the rest."""

from kvmesh.planning.capacity import Need, both_need, decode_need, prefill_need
from kvmesh.planning.planner import (
    POOL_ROLES,
    Observation,
    Plan,
    PlannerConfig,
    PlannerState,
    PoolPlan,
    PoolState,
    plan,
    pools_of,
)
from kvmesh.planning.signals import InstanceLoad, Speed, Targets, Traffic, forecast

__all__ = ["POOL_ROLES", "InstanceLoad", "Need", "Observation", "Plan", "PlannerConfig", "PlannerState",
           "PoolPlan", "PoolState", "Speed", "Targets", "Traffic", "both_need", "decode_need", "forecast", "plan",
           "pools_of", "prefill_need"]
