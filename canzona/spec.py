"""Model description shared by the policy core, the simulator and the runtime (docs/design.md §2).

A `ModelSpec` is an ordered (forward-order) tuple of `ParamSpec`s. The routing rule that decides
whether a parameter goes to the matrix optimizer or to AdamW is defined here, once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import Enum

from canzona.errors import SpecError

DTYPE_BYTES: dict[str, int] = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}


class Role(str, Enum):
    MATRIX = "matrix"
    EMBEDDING = "embedding"
    HEAD = "head"
    VECTOR = "vector"


@dataclass(frozen=True)
class ParamSpec:
    """One parameter with its *global* shape; `tp_dim` says which dimension TP splits (None: replicated).

    For a weight stored `out x in`, tp_dim 0 is column-parallel (rows split) and tp_dim 1 is
    row-parallel (columns split).
    """

    name: str
    shape: tuple[int, ...]
    role: Role
    layer: int | None = None
    tp_dim: int | None = None
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        if not self.shape or any(int(d) <= 0 for d in self.shape):
            raise SpecError(f"parameter {self.name!r} has an invalid shape {self.shape}")
        if self.tp_dim is not None and not 0 <= self.tp_dim < len(self.shape):
            raise SpecError(f"parameter {self.name!r}: tp_dim {self.tp_dim} is outside shape {self.shape}")
        if self.dtype not in DTYPE_BYTES:
            raise SpecError(f"parameter {self.name!r}: unknown dtype {self.dtype!r}")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def uses_matrix_optimizer(self) -> bool:
        return routes_to_matrix_optimizer(self)

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of this parameter's shard on one of `tp` tensor-parallel ranks."""
        if tp < 1:
            raise SpecError(f"tp must be >= 1, got {tp}")
        if self.tp_dim is None or tp == 1:
            return self.shape
        size = self.shape[self.tp_dim]
        if size % tp:
            raise SpecError(
                f"tp={tp} does not divide dimension {self.tp_dim} ({size}) of parameter {self.name!r}"
            )
        shape = list(self.shape)
        shape[self.tp_dim] = size // tp
        return tuple(shape)

    def local_numel(self, tp: int) -> int:
        n = 1
        for d in self.local_shape(tp):
            n *= d
        return n


def routes_to_matrix_optimizer(param: ParamSpec) -> bool:
    """The one routing rule: 2-D parameters that are neither embeddings nor the output head."""
    return len(param.shape) == 2 and param.role not in (Role.EMBEDDING, Role.HEAD)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: tuple[ParamSpec, ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for p in self.params:
            if p.name in seen:
                raise SpecError(f"model {self.name!r} has two parameters named {p.name!r}")
            seen.add(p.name)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def matrix_params(self) -> tuple[ParamSpec, ...]:
        return tuple(p for p in self.params if p.uses_matrix_optimizer)

    def adamw_params(self) -> tuple[ParamSpec, ...]:
        return tuple(p for p in self.params if not p.uses_matrix_optimizer)

    def param(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name:
                return p
        raise SpecError(f"model {self.name!r} has no parameter named {name!r}")

    def check_tp(self, tp: int) -> None:
        """Raise a SpecError naming the first parameter that `tp` cannot split evenly."""
        for p in self.params:
            p.local_shape(tp)

    def fingerprint(self) -> str:
        """Hash of everything a plan depends on: names, order, global shapes, roles, TP dims."""
        rows = [[p.name, list(p.shape), p.role.value, p.tp_dim] for p in self.params]
        blob = json.dumps(rows, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
