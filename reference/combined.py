"""One optimizer for a whole model: the matrix optimizer for the parameters the routing rule sends
to it (`canzona.spec.routes_to_matrix_optimizer`), AdamW for the rest.

A stack of matrices (a mixture-of-experts layer's stacked experts, `ParamSpec.matrix_shape`) is
that many matrices here too: the matrix optimizer is given one view per matrix of the stack's
storage, and each step hands each view its slice of the stack's gradient (docs/design.md §2.6).
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any

import torch

from canzona.optimizers import AdamWConfig, config_from_dict
from canzona.optimizers import matrix_optimizer as registry_entry
from canzona.spec import ModelSpec, routes_to_matrix_optimizer
from reference.adamw import AdamW


def _config(name: str, cls: type, config: Any) -> Any:
    """A config dataclass of type `cls` from None (defaults), an instance, or a dict of overrides."""
    if config is None:
        return cls()
    if isinstance(config, Mapping):
        return config_from_dict(name, dict(config))
    if type(config) is not cls:  # exactly: one optimizer's config class may extend another's
        raise ValueError(f"{name} needs a {cls.__name__} (or a dict of its fields), got {type(config).__name__}")
    return config


class CombinedOptimizer(torch.optim.Optimizer):
    """A matrix optimizer (any of `canzona.optimizers.MATRIX_REGISTRY`) + AdamW, routed by the model spec
    (`adamw`, the elementwise entry: AdamW with `adamw_config` on every parameter).

    `param_groups` lists the matrix optimizer's groups, then AdamW's (the same dicts, so LR
    schedulers drive both); `state` is a live view of both optimizers' states (for reading);
    `state_dict()` is {"matrix_optimizer": name, "matrix": ..., "adamw": ...}. Parameters of the
    spec that are not passed are simply not optimised; a name the spec does not know, a repeated
    name, or a shape differing from the spec's is a ValueError.
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]],
        spec: ModelSpec,
        matrix_optimizer: str = "muon",
        matrix_config: Any = None,
        adamw_config: AdamWConfig | Mapping | None = None,
    ) -> None:
        entry = registry_entry(matrix_optimizer)
        self.matrix_optimizer = entry.name
        matrix_cls, config_cls = entry.part("reference"), entry.config
        if entry.elementwise and matrix_config is not None:
            raise ValueError(f"{entry.name} runs every parameter with adamw_config; matrix_config is for a "
                             "matrix optimizer")
        matrix_cfg = _config(self.matrix_optimizer, config_cls, matrix_config)
        adamw_cfg = _config("adamw", AdamWConfig, adamw_config)

        self.names: dict[str, torch.Tensor] = {}
        self.stacks: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (stack, a view per matrix)
        matrix_params, adamw_params = [], []
        for name, p in named_params:
            if name in self.names:
                raise ValueError(f"parameter {name!r} is given twice")
            pspec = spec.param(name)  # SpecError (a ValueError) for unknown names
            if tuple(p.shape) != tuple(pspec.shape):
                raise ValueError(f"parameter {name!r} has shape {tuple(p.shape)}, the spec says {pspec.shape}")
            self.names[name] = p
            # an elementwise optimizer (AdamW) takes every parameter: all of them are AdamW's
            routed = routes_to_matrix_optimizer(pspec) and not entry.elementwise
            if routed and pspec.matrix_shape is not None:
                views = _matrix_views(name, p, pspec.matrix_shape)
                self.stacks.append((p, views))
                matrix_params += views
                continue
            (matrix_params if routed else adamw_params).append(p)
        if not self.names:
            raise ValueError("CombinedOptimizer got no parameters")

        self.matrix = matrix_cls(matrix_params, **asdict(matrix_cfg)) if matrix_params else None
        self.adamw = AdamW(adamw_params, **asdict(adamw_cfg)) if adamw_params else None
        super().__init__(list(self.names.values()), {})
        self._link()

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.matrix, self.adamw) if o is not None]

    def _link(self) -> None:
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]
        self.state = ChainMap(*(o.state for o in self.optimizers))
        self._linked = True

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_linked", False):  # torch.optim.Optimizer.__init__ calls this first
            raise NotImplementedError("CombinedOptimizer routes parameters by the spec; build a new one")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for stack, views in self.stacks:  # each matrix of a stack sees its slice of the gradient
            flat = None if stack.grad is None else stack.grad.reshape(-1)
            for view in views:
                view.grad = None if flat is None else flat[_span(stack, view)].view(view.shape)
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)
        for stack, views in self.stacks:
            for view in views:
                view.grad = None
            if stack.grad is not None:
                if set_to_none:
                    stack.grad = None
                else:
                    stack.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {
            "matrix_optimizer": self.matrix_optimizer,
            "matrix": None if self.matrix is None else self.matrix.state_dict(),
            "adamw": None if self.adamw is None else self.adamw.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("matrix_optimizer") != self.matrix_optimizer:
            raise ValueError(
                f"state dict is for matrix optimizer {state_dict.get('matrix_optimizer')!r}, "
                f"this optimizer uses {self.matrix_optimizer!r}"
            )
        for key, o in (("matrix", self.matrix), ("adamw", self.adamw)):
            if (state_dict[key] is None) != (o is None):
                raise ValueError(f"state dict and optimizer disagree on whether there are {key} parameters")
            if o is not None:
                o.load_state_dict(state_dict[key])
        self._link()  # loading replaces the sub-optimizers' group dicts


def _matrix_views(name: str, stack: torch.Tensor, matrix_shape: tuple[int, int]) -> list[torch.Tensor]:
    """One `m x n` view per matrix of a stack, in memory order: leaves sharing the stack's storage,
    so updating a view updates the stack."""
    if not stack.is_contiguous():
        raise ValueError(f"parameter {name!r} stacks matrices but is not contiguous")
    m, n = matrix_shape
    flat = stack.detach().view(-1)
    return [flat[k * m * n:(k + 1) * m * n].view(m, n) for k in range(stack.numel() // (m * n))]


def _span(stack: torch.Tensor, view: torch.Tensor) -> slice:
    """Where `view` lies in the flattened `stack` (a view made by `_matrix_views`)."""
    start = view.storage_offset() - stack.storage_offset()
    return slice(start, start + view.numel())
