"""Parsing of human-friendly quantities given on the command line."""

from __future__ import annotations

import re
from typing import Any

from canzona.errors import SpecError
from canzona.fileio import parse_json
from canzona.optimizers import matrix_config_for, matrix_optimizer
from canzona.tp import Capacity

_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_BYTES = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_capacity(text: str | None) -> Capacity | None:
    """`auto` (None), seconds like `20ms` / `0.02s`, or bytes like `4GiB` / `512MB`."""
    if text is None or text.strip().lower() == "auto":
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]+)\s*", text)
    if not m:
        raise SpecError(f"capacity {text!r} is not a number with a unit (e.g. 20ms, 0.02s, 4GiB) or 'auto'")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit in _TIME:
        return Capacity(value * _TIME[unit], "s")
    if unit in _BYTES:
        return Capacity(value * _BYTES[unit], "bytes")
    raise SpecError(f"capacity unit {m.group(2)!r} is unknown; use s, ms, us, B, KB, MB, GB, KiB, MiB or GiB")


# `--matrix-config`'s help: `canzona plan / simulate / search` and examples/train.py (which deploys
# such a plan) take the same option
MATRIX_CONFIG_HELP = (
    "The matrix optimizer's configuration, as DistributedOptimizer's matrix_config: a JSON object of its "
    "fields, e.g. '{\"ns_steps\": 10}' (Muon), '{\"max_precond_dim\": 4096}' (SOAP). The step is priced and "
    "planned at it (its kernels, optimizer state and workspace); a measured cost table, timed at the "
    "defaults, gives way to the analytic model. Default: the optimizer's defaults; not with --optimizer adamw.")


def parse_matrix_config(text: str | None, optimizer: str) -> Any:
    """`--matrix-config`: a JSON object of the matrix optimizer's fields (`{"ns_steps": 10}`), read as
    DistributedOptimizer reads its `matrix_config` (`canzona.optimizers.matrix_config_for`, torch-free):
    None where not given or the optimizer's defaults, else the validated config. Not JSON, not an
    object, an unknown field, a bad value or an elementwise optimizer (AdamW): one SpecError line."""
    if text is None:
        return None
    if matrix_optimizer(optimizer).elementwise:  # before the text: the option itself is the mistake
        raise SpecError(f"--matrix-config configures a matrix optimizer's step; --optimizer {optimizer} runs "
                        "AdamW on every parameter, with no matrix step to configure")
    given = parse_json(text, "--matrix-config", SpecError)
    if not isinstance(given, dict):
        raise SpecError(f"--matrix-config takes a JSON object of the optimizer's fields (e.g. '{{\"ns_steps\": 10}}'), "
                        f"got {type(given).__name__ if given is not None else 'null'}")
    try:
        return matrix_config_for(optimizer, given)
    except SpecError as e:
        raise SpecError(f"--matrix-config: {e}") from None


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
