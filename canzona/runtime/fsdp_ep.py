"""FSDP2 with expert parallelism as torchtitan lays it out (docs/design.md §2.8): each MoE layer's
expert stacks (dim 0 = experts) `Shard(0)` over the `ep` axis of a 2-D mesh, `fully_shard` of the
experts over its other axis (efsdp, expert data parallel; FSDP2 then holds each stack on the 2-D
mesh, `_StridedShard(0), Shard(0)`), the dense part `fully_shard` over the same ranks flattened.

Every rank then holds its own piece of every tensor (`canzona.runtime.fsdp_layout`: the experts'
boxes tile each stack's global shape over ep x efsdp, the dense part's over dp), so AdamW's step
(`optimizer="adamw"`: each rank its own shards, no owners) runs as without experts: the step check
counts every gradient element once (torchtitan's EP clip: the experts' squared norm over ep x
efsdp plus the dense part's over dp) and checkpoints key each stack by its global name and shape.

What is not run here is refused at construction, every rank alike, before any collective: a
matrix optimizer over the experts (its owners would span two meshes), HSDP or TP beside the
experts, expert tensor parallelism (a stack sharded on more than its experts' dimension).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from canzona.errors import SpecError
from canzona.fsdp_plan import stacked_experts_refusal
from canzona.runtime.fsdp_layout import flattened

EP = "ep"  # the experts' mesh dimension, as torchtitan names it


def _ep_size(mesh: Any) -> int:
    names = tuple(mesh.mesh_dim_names or ())
    return int(mesh.mesh.shape[names.index(EP)]) if EP in names else 1


def _on_experts(placement: Any) -> bool:
    """A shard of dim 0 (FSDP2's `_StridedShard(0)` over efsdp, which is no `Shard` subclass, or EP's
    `Shard(0)`)."""
    return getattr(placement, "dim", None) == 0 and not placement.is_replicate() and not placement.is_partial()


def expert_mesh_of(params: Mapping[str, Tensor], optimizer: str, elementwise: bool,
                   expert_mesh: Any = None) -> Any:
    """The experts' mesh of FSDP2's parameters (None: no expert parallelism), checked: one
    SpecError for what FSDP2 with EP does not run here. Local (no collective)."""
    from torch.distributed.tensor import DTensor

    dtensors = {n: p for n, p in params.items() if isinstance(p, DTensor)}
    experts = {n: p for n, p in dtensors.items() if _ep_size(p.device_mesh) > 1}
    if not experts:
        if expert_mesh is not None:
            raise SpecError("expert_mesh= is given, but no parameter is sharded over an 'ep' mesh dimension: "
                            "under FSDP2 the experts' DTensors carry their mesh (torchtitan's layout: Shard(0) over "
                            "'ep', fully_shard over efsdp); leave expert_mesh out")
        return None
    name, first = next(iter(experts.items()))
    mesh = first.device_mesh
    if not elementwise:
        raise SpecError(stacked_experts_refusal(optimizer, name))
    for n, p in experts.items():
        if p.device_mesh != mesh:
            raise SpecError(f"experts {name!r} and {n!r} live on different meshes ({mesh}, {p.device_mesh}): "
                            "shard every expert stack over one (efsdp, ep) mesh")
        if p.device_mesh.ndim != 2 or not all(_on_experts(pl) for pl in p.placements):
            raise SpecError(f"expert {n!r} is {tuple(p.placements)} on {p.device_mesh}: only its experts' dimension "
                            "(dim 0) sharded over a 2-D (efsdp, ep) mesh is run under FSDP2; expert tensor "
                            "parallelism (ETP > 1) is not")
    if expert_mesh is not None and (tuple(expert_mesh.mesh_dim_names or ()) != tuple(mesh.mesh_dim_names) or
                                    expert_mesh.mesh.tolist() != mesh.mesh.tolist()):
        raise SpecError(f"expert_mesh={expert_mesh} is not the mesh the experts live on ({mesh}): leave it out "
                        "(the experts' DTensors carry it)")
    for n, p in dtensors.items():
        if n in experts or flattened(p.device_mesh, mesh):
            continue
        if p.device_mesh.ndim > 1:
            raise SpecError(f"{n!r} lives on {p.device_mesh} beside experts sharded over 'ep': HSDP (or TP) "
                            "beside expert parallelism is not run under FSDP2; fully_shard the dense part over "
                            f"the experts' ranks flattened ({mesh.mesh.flatten().tolist()})")
        raise SpecError(f"{n!r} lives on {p.device_mesh}, the experts on {mesh}: fully_shard the dense part over "
                        f"the experts' ranks flattened, in their order ({mesh.mesh.flatten().tolist()}), as "
                        "torchtitan's dp mesh")
    return mesh
