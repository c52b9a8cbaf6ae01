"""Data-parallel partitioning: ZeRO-1 buffer geometry and the policies that place whole matrices."""

from canzona.dp.layout import BucketPlan, DPItem, DPMetrics, DPPlan, Placement
from canzona.dp.policies import ALPHA_POLICIES, DEFAULT_ALIGN, DP_POLICIES, check_dp_policy, plan_dp

__all__ = [
    "ALPHA_POLICIES",
    "DEFAULT_ALIGN",
    "DP_POLICIES",
    "BucketPlan",
    "DPItem",
    "DPMetrics",
    "DPPlan",
    "Placement",
    "check_dp_policy",
    "plan_dp",
]
