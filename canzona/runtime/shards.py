"""TP-sharded parameters as users build them, and their local storage (docs/design.md §8.5).

The optimizer works on each rank's *local* tensors: the whole parameter at TP = 1, this rank's
shard under tensor parallelism. Three ways users hand those over, all checked against the spec
(global shape, `tp_dim`) before anything is laid out:

- plain tensors holding the local shard, as in explicit column / row parallel layers; Megatron
  annotates such parameters with `tensor_model_parallel` and `partition_dim`, and where those
  attributes are present they must agree with the spec's `tp_dim`;
- DTensors, as `torch.distributed.tensor.parallel.parallelize_module` makes them: the global shape
  is the DTensor's, the split dimension is its `Shard(d)` placement (`Replicate()`: none), and the
  local tensor is the shard. Their gradients may arrive as `Partial` (a replicated weight used on
  sharded activations, e.g. per-head QK norms): they are reduced over the TP mesh to the
  parameter's own placement before the optimizer reads them, as a torch optimizer's DTensor
  arithmetic would do.

Linking a DTensor's storage to the optimizer's flat buffer goes through its `_local_tensor`, the
one place DTensor keeps it (no public setter exists); everything else uses public API.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

from canzona.errors import PlanError, SpecError
from canzona.spec import ParamSpec

try:  # torch >= 2.4; the import fails only on builds without distributed support
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

MEGATRON_PARALLEL = "tensor_model_parallel"  # Megatron's attribute: the parameter is a TP shard
MEGATRON_DIM = "partition_dim"  # ... split along this dimension


def is_dtensor(p: Tensor) -> bool:
    return DTensor is not None and isinstance(p, DTensor)


def local_tensor(p: Tensor) -> Tensor:
    """The tensor that holds this rank's values of `p`."""
    return p._local_tensor if is_dtensor(p) else p  # type: ignore[attr-defined]


_DLPACK_DEVICES = ("cpu", "cuda")  # where torch's DLPack export runs (elsewhere the plain view is linked)


def link_data(p: Tensor, view: Tensor) -> None:
    """Make `p`'s local values live in `view` (which already holds them).

    A DTensor's local tensor gets an alias of `view` that is its own storage (offset 0, its own
    length, the same memory; DLPack's view of it keeps the buffer alive): torch 2.13's DTensor
    copies its local tensor's storage offset into the wrapper, and pickling a wrapper at a nonzero
    offset reads the wrapper's storage (an error), so `torch.save(model.state_dict())` and
    `copy.deepcopy(model)` failed for every DTensor parameter past the start of a buffer; and the
    one at its start carried the whole buffer into a save or a copy. A plain parameter stays a view
    sharing its buffer's storage, which `model.share_memory()` then moves whole, in place (its own
    storage would be copied out of the buffer); a save writes that storage once, whole: the
    buffer's DTensors' bytes again where a buffer mixes both (a TP model's norms beside its
    DTensors), a larger file holding the same values. DLPack exports a CUDA tensor from the current
    device only: the export runs on the view's."""
    if is_dtensor(p) and view.device.type in _DLPACK_DEVICES:
        with torch.cuda.device(view.device) if view.device.type == "cuda" else contextlib.nullcontext():
            view = torch.from_dlpack(view.detach())
    local_tensor(p).data = view


def local_grad(p: Tensor) -> Tensor | None:
    """The local part of `p.grad` in the parameter's own placement (None if there is none)."""
    g = p.grad
    if g is None or not is_dtensor(g):
        return g
    if tuple(g.placements) != tuple(p.placements):
        # collective over the TP mesh: every TP rank runs the same backward, so all arrive here
        g = g.redistribute(p.device_mesh, p.placements)
    return g.to_local()


def megatron_tp_dim(name: str, p: Tensor) -> int | None:
    """The split dimension Megatron's annotations give `p` (None: not annotated as parallel)."""
    if not getattr(p, MEGATRON_PARALLEL, False):
        return None
    dim = getattr(p, MEGATRON_DIM, None)
    if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < p.dim():
        raise PlanError(f"parameter {name!r} is annotated tensor_model_parallel with partition_dim {dim!r}, "
                        f"not a dimension of its {p.dim()}-D shape")
    return dim


def dtensor_tp_dim(name: str, p: Tensor) -> int | None:
    """The split dimension of a DTensor parameter on a 1-D mesh (None: replicated)."""
    if p.device_mesh.ndim != 1 or len(p.placements) != 1:
        raise PlanError(f"parameter {name!r} is a DTensor on a {p.device_mesh.ndim}-D mesh; canzona "
                        "reads tensor-parallel DTensors on a 1-D TP mesh (parallelize_module(model, "
                        "mesh['tp'], ...))")
    placement = p.placements[0]
    if isinstance(placement, Shard):
        return placement.dim
    if isinstance(placement, Replicate):
        return None
    raise PlanError(f"parameter {name!r} has placement {placement}; a parameter is Shard(d) or Replicate()")


def check_not_meta(name: str, p: Tensor) -> None:
    """A parameter on the meta device (torchtitan's meta-device init, out of order) is refused:
    masters, layout and state would be of tensors with no values, and `to_empty()` moves the
    parameters after them."""
    if p.is_meta:
        raise SpecError(f"parameter {name!r} is on the meta device (the model was built under "
                        "torch.device('meta') and not materialized yet): build the optimizer after "
                        "model.to_empty(device=...) and the weights' init")


def check_local_param(name: str, p: Tensor, spec: ParamSpec, tp: int, tp_ranks: Sequence[int] | None) -> None:
    """`p` is what this rank must hold of `spec` under TP size `tp` (one-line PlanError otherwise).

    `tp_ranks`: the global ranks of this rank's TP group, in TP order (None: no TP group)."""
    want_local = spec.local_shape(tp)
    if is_dtensor(p):
        if tuple(p.shape) != spec.shape:
            raise PlanError(f"parameter {name!r} is a DTensor of global shape {tuple(p.shape)}, the model "
                            f"spec says {spec.shape}")
        mesh_ranks = [int(r) for r in p.device_mesh.mesh.flatten().tolist()]
        if tp_ranks is None and len(mesh_ranks) > 1:
            dims = p.device_mesh.mesh_dim_names or ()
            raise PlanError(f"parameter {name!r} is a DTensor split over ranks {mesh_ranks} (mesh dimensions "
                            f"{dims or 'unnamed'}), but the optimizer has no TP group: a tensor-parallel model "
                            "needs the device mesh with its 'tp' dimension (or tp_group=); a model sharded by "
                            "FSDP2 (fully_shard) takes the FSDP step when its mesh holds every rank of the "
                            "data-parallel group (give no group, or the mesh)")
        if tp_ranks is not None and mesh_ranks != list(tp_ranks):
            raise PlanError(f"parameter {name!r} is a DTensor on ranks {mesh_ranks}, but this rank's TP "
                            f"group is {list(tp_ranks)}")
        dim = dtensor_tp_dim(name, p)
        if tp > 1 and dim != spec.tp_dim:
            raise PlanError(f"parameter {name!r} is placed {p.placements[0]}, but the model spec splits "
                            f"{'no dimension' if spec.tp_dim is None else f'dimension {spec.tp_dim}'}")
    else:
        annotated = megatron_tp_dim(name, p)
        if annotated is not None and tp > 1 and annotated != spec.tp_dim:
            raise PlanError(f"parameter {name!r} is annotated partition_dim={annotated}, but the model spec "
                            f"splits {'no dimension' if spec.tp_dim is None else f'dimension {spec.tp_dim}'}")
    local = tuple(local_tensor(p).shape)
    if local != want_local:
        what = "its local shard" if tp > 1 else "it"
        hint = ""
        if tp > 1 and local == spec.shape:
            hint = ("; the spec must describe the global model: ModelSpec.from_module(model, tp_size=tp) for "
                    "Megatron-style shards, or give each rank its shard")
        raise PlanError(f"parameter {name!r}: {what} has shape {local}, but the model spec at tp={tp} needs "
                        f"{want_local}{hint}")


def same_storage(p: Tensor, view: Tensor) -> bool:
    """`p`'s local values still live in `view` (not moved, cast or replaced)."""
    t = local_tensor(p)
    return t.data_ptr() == view.data_ptr() and t.dtype == view.dtype and t.device == view.device \
        and t.shape == view.shape


def shard_of(full: Tensor, tp_dim: int | None, tp: int, tp_rank: int) -> Tensor:
    """TP rank `tp_rank`'s shard of a full tensor (the whole tensor when it is not split)."""
    if tp_dim is None or tp == 1:
        return full
    return full.chunk(tp, dim=tp_dim)[tp_rank]


def unshard(shards: Sequence[Tensor], tp_dim: int | None) -> Tensor:
    """The full tensor from every TP rank's shard, in TP-rank order."""
    if tp_dim is None or len(shards) == 1:
        return shards[0]
    return torch.cat(list(shards), dim=tp_dim)
