"""Data-parallel partitioning: ZeRO-1 buffer geometry and the policies that place whole matrices."""

from canzona.dp.layout import BucketPlan, DPItem, DPMetrics, DPPlan, Placement
from canzona.dp.policies import (
    ALPHA_POLICIES,
    DEFAULT_ALIGN,
    DEFAULT_DP_POLICY,
    DP_POLICIES,
    DP_REGISTRY,
    KEEPS_GEOMETRY,
    DPPolicy,
    check_dp_policy,
    dp_policy,
    plan_dp,
)

__all__ = [
    "ALPHA_POLICIES",
    "DEFAULT_ALIGN",
    "DEFAULT_DP_POLICY",
    "DP_POLICIES",
    "DP_REGISTRY",
    "KEEPS_GEOMETRY",
    "BucketPlan",
    "DPItem",
    "DPMetrics",
    "DPPlan",
    "DPPolicy",
    "Placement",
    "check_dp_policy",
    "dp_policy",
    "plan_dp",
]
