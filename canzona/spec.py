"""Model description shared by the policy core, the simulator and the runtime (docs/design.md §2).

A `ModelSpec` is an ordered (forward-order) tuple of `ParamSpec`s. The routing rule that decides
whether a parameter goes to the matrix optimizer or to AdamW is defined here, once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Any

from canzona.errors import SpecError

# fp8: Hopper's 8-bit floats (E4M3 / E5M2), the operands of Transformer Engine's FP8 GEMMs (sim.fp8)
DTYPE_BYTES: dict[str, int] = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


class Role(str, Enum):
    MATRIX = "matrix"
    EMBEDDING = "embedding"
    HEAD = "head"
    VECTOR = "vector"
    # a mixture-of-experts layer's expert weights: one expert's 2-D matrix, or a stack of them
    # (`ParamSpec.matrix_shape`); each expert matrix goes to the matrix optimizer and processes
    # only the tokens routed to its expert
    EXPERT = "expert"
    # a mixture-of-experts router (token -> expert logits): AdamW, as the authors' code and
    # Megatron do; a model built with `router_optimizer="matrix"` gives its routers Role.MATRIX
    ROUTER = "router"


# Where a mixture-of-experts model's routers go: AdamW (role router), or the matrix optimizer (role matrix)
ROUTER_OPTIMIZERS = ("adamw", "matrix")

# The separator of a stacked parameter's matrix names: 'model.layers.0.mlp.experts.down_proj[3]'.
# Brackets never occur in torch parameter names, so a matrix name cannot collide with a parameter's.
STACK_OPEN, STACK_CLOSE = "[", "]"


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
    # A stack of matrices of this shape, laid out one after another in the parameter's memory
    # (transformers' fused experts `[experts, 2 x ffn, hidden]`, torchtitan's grouped-GEMM weights):
    # each is one matrix for the matrix optimizer, never the stack as a whole. `(ffn, hidden)` on a
    # fused gate/up stack makes gate and up two matrices per expert (split FC1). A stack's `tp_dim`
    # (expert TP, one EP rank's experts under `canzona.experts.expert_part`; a model's stacks are
    # whole) is one of its matrices' two dimensions and splits every matrix along it, as Megatron
    # shards grouped experts: a shard of `[experts, 2 x ffn, hidden]` split along the rows is
    # `[experts, 2 x ffn / tp, hidden]`, each expert's gate shard then its up shard.
    matrix_shape: tuple[int, int] | None = None
    # Set on the matrices `stacked_matrices` makes of a stack: (the stack's name, the index).
    stacked_in: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        if any(int(d) <= 0 for d in self.shape):  # () is a 0-d scalar: one element
            raise SpecError(f"parameter {self.name!r} has an invalid shape {self.shape}")
        if not self.shape and self.role is not Role.VECTOR:
            # a scalar is AdamW's, as a vector is (a logit scale, a gate); an expert's or a router's
            # count is its first dimension, an embedding's rows, a matrix's two
            raise SpecError(f"parameter {self.name!r}: a 0-d scalar is a vector (stepped by AdamW), not "
                            f"{self.role.value}: give it role 'vector', or its dimensions")
        if self.tp_dim is not None and not 0 <= self.tp_dim < len(self.shape):
            raise SpecError(f"parameter {self.name!r}: tp_dim {self.tp_dim} is outside shape {self.shape}")
        if self.dtype not in DTYPE_BYTES:
            raise SpecError(f"parameter {self.name!r}: unknown dtype {self.dtype!r}")
        if self.matrix_shape is not None:
            self._check_stack()
        elif self.role is Role.EXPERT and len(self.shape) > 2:
            # never guess how a stack is laid out, nor let a whole stack become one AdamW parameter
            raise SpecError(f"parameter {self.name!r}: an expert parameter of shape {self.shape} is a stack of "
                            "matrices and must give matrix_shape (the shape of each)")

    def _check_stack(self) -> None:
        rows, cols = self.matrix_shape if len(self.matrix_shape or ()) == 2 else (0, 0)
        if not (isinstance(rows, int) and isinstance(cols, int) and rows > 0 and cols > 0):
            raise SpecError(f"parameter {self.name!r}: matrix_shape must be two positive whole numbers, got "
                            f"{self.matrix_shape!r}")
        if len(self.shape) < 3 or cols != self.shape[-1] or self.shape[-2] % rows:
            raise SpecError(f"parameter {self.name!r}: a stack of {rows} x {cols} matrices needs a shape of 3 or "
                            f"more dimensions ending in (a multiple of {rows}, {cols}), got {self.shape}")
        if self.role is not Role.EXPERT:
            # what a stack computes is an expert's (a share of the tokens): nothing else stacks
            raise SpecError(f"parameter {self.name!r}: only expert parameters stack matrices, not "
                            f"{self.role.value!r} ones")
        if self.tp_dim is not None and self.tp_dim < len(self.shape) - 2:
            # the dimensions before a stack's matrices number its experts, which EP splits, never TP
            raise SpecError(f"parameter {self.name!r}: tp_dim {self.tp_dim} would split the stack's experts; "
                            "expert TP splits each matrix along its rows or columns (the last two dimensions)")

    @property
    def stack_size(self) -> int:
        """How many matrices the parameter stacks (0: it is not a stack)."""
        if self.matrix_shape is None:
            return 0
        return self.numel // (self.matrix_shape[0] * self.matrix_shape[1])

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
        if self.matrix_shape is not None:  # every matrix of the stack is split, not the stack as a whole
            axis = self.tp_dim - (len(self.shape) - 2)
            split = self.matrix_shape[axis]
            if split % tp:
                raise SpecError(f"tp={tp} does not divide the {split} {('rows', 'columns')[axis]} of each "
                                f"{self.matrix_shape[0]} x {self.matrix_shape[1]} matrix of stack {self.name!r}")
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
    """The one routing rule: 2-D parameters that are neither embeddings, the output head, routers
    nor vectors (a 2-D vector: one bias per expert, stacked), and stacks of matrices (each of
    their matrices: `stacked_matrices`)."""
    if param.matrix_shape is not None:
        return True
    return len(param.shape) == 2 and param.role not in (Role.EMBEDDING, Role.HEAD, Role.ROUTER, Role.VECTOR)


def stacked_matrices(param: ParamSpec) -> tuple[ParamSpec, ...]:
    """The matrices of a stack, in memory order: matrix `k` is the parameter's elements
    `[k * m * n, (k + 1) * m * n)` seen as `m x n`, named `'<param>[k]'`; a parameter that is not a
    stack is itself. A stack split by TP (expert TP) splits each matrix along the same axis."""
    if param.matrix_shape is None:
        return (param,)
    tp_dim = None if param.tp_dim is None else param.tp_dim - (len(param.shape) - 2)
    return tuple(ParamSpec(f"{param.name}{STACK_OPEN}{k}{STACK_CLOSE}", param.matrix_shape, param.role,
                           param.layer, tp_dim, param.dtype, stacked_in=(param.name, k))
                 for k in range(param.stack_size))


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: tuple[ParamSpec, ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for p in self.params:
            if p.name in seen:
                raise SpecError(f"model {self.name!r} has two parameters named {p.name!r}")
            if STACK_OPEN in p.name and p.stacked_in is None:
                raise SpecError(f"model {self.name!r}: parameter name {p.name!r} has a {STACK_OPEN!r}, which "
                                "names the matrices of a stack")
            seen.add(p.name)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def matrix_params(self) -> tuple[ParamSpec, ...]:
        """The matrices of the matrix optimizer, in forward order: a stack of matrices (experts)
        contributes each of its matrices (`stacked_matrices`), never itself."""
        return self._routed[0]

    def own_matrices(self) -> tuple[ParamSpec, ...]:
        """The matrices of `matrix_params` that are parameters of their own, not a stack's
        matrices (`stacked_in` is None), in the same order; without expanding the stacks, which
        a new spec (each pipeline stage's, per layout) would otherwise pay for."""
        return tuple(p for p in self.params
                     if p.matrix_shape is None and p.stacked_in is None and p.uses_matrix_optimizer)

    @property
    def stacks(self) -> tuple[ParamSpec, ...]:
        """The parameters that stack matrices (`ParamSpec.matrix_shape`)."""
        return tuple(p for p in self.params if p.matrix_shape is not None)

    def adamw_params(self) -> tuple[ParamSpec, ...]:
        return self._routed[1]

    def param(self, name: str) -> ParamSpec:
        p = self._by_name.get(name)
        if p is None:
            raise SpecError(f"model {self.name!r} has no parameter named {name!r}")
        return p

    # Computed once per spec (it is frozen): the simulator asks these questions millions of times.
    @cached_property
    def _routed(self) -> tuple[tuple[ParamSpec, ...], tuple[ParamSpec, ...]]:
        return (tuple(m for p in self.params if p.uses_matrix_optimizer for m in stacked_matrices(p)),
                tuple(p for p in self.params if not p.uses_matrix_optimizer))

    @cached_property
    def _by_name(self) -> dict[str, ParamSpec]:
        # a stack's matrices are found by their names too: plans place and own them one by one
        return {p.name: p for p in self.params} | {m.name: m for p in self.stacks for m in stacked_matrices(p)}

    def check_tp(self, tp: int) -> None:
        """Raise a SpecError naming the first parameter that `tp` cannot split evenly."""
        for p in self.params:
            p.local_shape(tp)

    def fingerprint(self, tp: int | None = None) -> str:
        """Hash of the model a plan is for: names, global shapes, roles and TP dims.

        Not of the order: the same model listed in another order (registration order versus a
        measured forward order) is the same model. A plan records its own order in its
        placements, whose names and sizes `check_plan_matches` checks against the model.
        `tp`: a plan's TP size; at TP 1 nothing is split, so the TP dims are left out and a plan
        made from a config (`canzona plan --model`, which marks the splits a TP layout would make)
        is the plan of the unsplit module read from it (`ModelSpec.from_module`, which marks none).
        """
        splits = tp is None or tp > 1
        # a stack's matrix shape only where there is one: a dense model's fingerprint is unchanged
        rows = sorted([p.name, list(p.shape), p.role.value, p.tp_dim if splits else None] +
                      ([list(p.matrix_shape)] if p.matrix_shape is not None else []) for p in self.params)
        blob = json.dumps(rows, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def describe_difference(self, other: ModelSpec) -> str:
        """One line naming the first difference from `other`, for comparing two specs (a plan keeps
        only the fingerprint): a parameter only one of them has, then a parameter whose shape,
        role, TP dim, layer or dtype differs, then the order."""
        mine, theirs = _spec_labels(self, other)
        other_by_name = {p.name: p for p in other.params}
        own_names = {p.name for p in self.params}
        for p in self.params:
            if p.name not in other_by_name:
                return f"parameter {p.name!r} is in {mine} but not in {theirs}"
        for p in other.params:
            if p.name not in own_names:
                return f"parameter {p.name!r} is in {theirs} but not in {mine}"
        for p in self.params:
            q = other_by_name[p.name]
            for field, a, b in (("shape", p.shape, q.shape), ("role", p.role.value, q.role.value),
                                ("tp_dim", p.tp_dim, q.tp_dim), ("layer", p.layer, q.layer),
                                ("dtype", p.dtype, q.dtype), ("matrix_shape", p.matrix_shape, q.matrix_shape)):
                if a != b:
                    return f"parameter {p.name!r} has {field} {a} in {mine} but {b} in {theirs}"
        for i, (p, q) in enumerate(zip(self.params, other.params)):
            if p.name != q.name:
                return (f"same parameters in another order: position {i} is {p.name!r} in {mine}, "
                        f"{q.name!r} in {theirs}")
        return f"no difference between {mine} and {theirs}"

    @classmethod
    def from_module(cls, model: Any, *, tp_plan: Mapping[str, int] | None = None, tp_size: int = 1,
                    name: str | None = None, order: Sequence[str] | None = None, split_fc1: bool = True,
                    router_optimizer: str = "adamw") -> ModelSpec:
        """The spec of a `torch.nn.Module`'s trainable parameters (`canzona.runtime.modules`).

        Names are canonical (wrapper prefixes such as `module.` and `_orig_mod.` removed): give the
        optimizer `canzona.runtime.modules.named_parameters(model)`. `tp_plan` maps fnmatch
        patterns over those names to the split dimension of the local shards the module holds
        (0 column-, 1 row-parallel), `tp_size` the TP size that multiplies it. `order` is the
        forward order, e.g. `backward_order(model, loss_fn)`; registration order otherwise.
        `split_fc1` and `router_optimizer`: how a mixture-of-experts model's fused gate/up experts
        and routers are read (docs/design.md §2.6), as `DecoderConfig` builds them.
        """
        # imported here: it needs torch, and the policy core must import without it
        from canzona.runtime.modules import spec_from_module

        return spec_from_module(model, tp_plan=tp_plan, tp_size=tp_size, name=name, order=order,
                                split_fc1=split_fc1, router_optimizer=router_optimizer)


def _spec_labels(a: ModelSpec, b: ModelSpec) -> tuple[str, str]:
    """How to name the two sides of a comparison; specs often share a name."""
    if a.name != b.name:
        return repr(a.name), repr(b.name)
    return "this spec", "the other spec"


def parametrized_routing(model: ModelSpec, saved: str, remedy: str, fingerprint: object = None,
                         tp: int | None = None) -> str:
    """' (why)' for a fingerprint mismatch of `model` that the routing of parametrized weights'
    originals (2026-12-03: weight_norm's magnitudes, a parametrized embedding's or head's, to
    AdamW) explains: the saved `fingerprint` (of a plan made at TP `tp`, or an optimizer state's) is
    `model`'s with those originals routed as before (every original of two dims or more to the
    matrix optimizer); '' otherwise (a model of another size, other parameters). `saved`: what was
    refused, `remedy`: what to do."""
    import dataclasses

    names = {p.name for p in model.params}
    originals = {n for n in names if ".parametrizations." in n or (n.endswith("_g") and n[:-2] + "_v" in names)}
    if not originals:
        return ""
    try:
        before = dataclasses.replace(model, params=tuple(
            dataclasses.replace(p, role=Role.MATRIX) if p.name in originals and len(p.shape) >= 2 else p
            for p in model.params))
    except SpecError:
        return ""
    if before.fingerprint() == model.fingerprint() or fingerprint not in (before.fingerprint(tp), before.fingerprint()):
        return ""
    return (f" (parametrized weights' originals, weight_norm's magnitudes and a parametrized embedding's or head's, "
            f"are routed as the weight since 2026-12-03, and {saved} saved before for such a model is refused: "
            f"{remedy})")
