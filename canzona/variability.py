"""GPU-to-GPU speed variability: why a synchronous job of N GPUs runs at its slowest GPU's pace.

GPUs of one SKU do not run equally fast: power management, clocks under thermal and power limits
and manufacturing differences make one GPU's kernels take longer than another's, persistently
(Sinha et al., "Not All GPUs Are Created Equal", SC22, arXiv 2208.11035). A training iteration
synchronises every GPU with every other (TP collectives inside a layer, PP point-to-point between
stages, the DP gradient reduction between replicas), so each iteration waits for the slowest GPU
of the job, and the expected slowdown grows with the number of GPUs as the expected maximum of N
draws of the per-GPU time.

The model: a GPU's compute time over the median GPU's is normal with mean 1 and standard
deviation `cv` (the profile's `variability.time_cv`); a job of N GPUs pays
`1 + cv * E[max of N standard normals]` on its compute (N = 1: no slowdown, as the kernel
measurements a profile's rates come from are one GPU's). docs/design.md §9.3.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

from canzona.errors import SpecError

# The largest coefficient of variation accepted: the published spreads are a few percent; one of
# 0.3 would put the slowest of a thousand GPUs at twice the median's time (and a normal law's
# lower tail at negative times), beyond any cluster this law describes.
MAX_CV = 0.3


def check_cv(cv: Any, what: str = "gpu variability") -> float:
    """A coefficient of variation of per-GPU compute time: a finite number in [0, MAX_CV]."""
    if isinstance(cv, bool) or not isinstance(cv, int | float) or not math.isfinite(cv) or not 0 <= cv <= MAX_CV:
        raise SpecError(f"{what} must be a number in [0, {MAX_CV:g}] (the per-GPU compute time's standard "
                        f"deviation over its median; 0 prices every GPU alike), got {cv!r}")
    return float(cv)


@lru_cache(maxsize=256)
def expected_max_normal(n: int) -> float:
    """E[max of `n` independent standard normals]: the integral of x * n * phi(x) * Phi(x)^(n-1)
    (0 for n = 1, 1/sqrt(pi) for n = 2, about 3.97 for n = 16384), by scipy's adaptive quadrature."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of draws must be a whole number >= 1, got {n!r}")
    if n == 1:
        return 0.0
    from scipy import integrate, special  # on use: scipy takes most of a second to import

    log_n = math.log(n)

    def density(x: float) -> float:  # x times the density of the maximum, in logs (Phi^(n-1) underflows)
        return x * math.exp(log_n - 0.5 * x * x - LOG_SQRT_2PI + (n - 1) * float(special.log_ndtr(x)))

    # the maximum's density is negligible outside [-9, 10] for any n up to 2^40; its mode, near
    # sqrt(2 ln n), is narrow for large n: name it to the quadrature
    mode = math.sqrt(2 * log_n)
    value, _ = integrate.quad(density, -9.0, 10.0, points=[mode - 1, mode, mode + 1], limit=200, epsabs=1e-12)
    return value


LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def straggler_slowdown(cv: float, gpus: int) -> float:
    """The factor on compute time of a synchronous job of `gpus` GPUs whose per-GPU time has a
    coefficient of variation `cv`: the expected slowest GPU's time over the median GPU's."""
    return 1.0 + check_cv(cv) * expected_max_normal(gpus)


def parse_variability(raw: Any, where: str) -> float:
    """A profile's optional `variability` section, `{"time_cv": x}`: the coefficient of variation."""
    if not isinstance(raw, dict) or set(raw) != {"time_cv"}:
        raise SpecError(f"{where}: variability must be an object with time_cv (the per-GPU compute time's "
                        "standard deviation over its median)")
    return check_cv(raw["time_cv"], f"{where}: variability.time_cv")
