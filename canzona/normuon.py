"""NorMuon's cost model (torch-free; its math: `canzona.optimizers.NorMuonConfig`): Muon's
kernels, then the per-neuron normalisation, a few passes over the fp32 update."""

from __future__ import annotations

from canzona.cost import (
    FP32,
    FP32_STEP,
    Kernel,
    StepDtypes,
    elementwise_kernel,
    muon_kernels,
    muon_state_bytes,
)
from canzona.memory import muon_workspace_bytes
from canzona.optimizers import NorMuonConfig


def cost_kernels(m: int, n: int, cfg: NorMuonConfig, dtypes: StepDtypes = FP32_STEP) -> list[Kernel]:
    """Muon's step (its momentum, normalisation and apply at `dtypes`), then: the row means of O²
    and the second moment, the division by its root, the two Frobenius norms and the rescale, on
    the fp32 update whatever the run's dtypes (`canzona.runtime.normuon`: O in the work dtype)."""
    mn = m * n
    return muon_kernels(m, n, cfg, dtypes) + [
        elementwise_kernel("second moment", mn, 2, FP32),
        elementwise_kernel("normalize rows", mn, 2, 2 * FP32),
        elementwise_kernel("norms", 2 * mn, 2, FP32),
        elementwise_kernel("rescale", mn, 1, 2 * FP32),
    ]


def state_bytes(m: int, n: int, cfg: NorMuonConfig) -> int:
    return muon_state_bytes(m, n, cfg) + FP32 * m  # the momentum buffer, one second moment per row


def workspace_bytes(m: int, n: int, grad_bytes: int, cfg: NorMuonConfig) -> int:
    """Muon's temporaries, then the fp32 update, its square and the normalised update."""
    return muon_workspace_bytes(m, n, grad_bytes, cfg) + 3 * FP32 * m * n
