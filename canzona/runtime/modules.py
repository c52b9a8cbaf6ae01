"""`ModelSpec`s from live `torch.nn.Module`s: Hugging Face, torchtitan and Megatron-style models.

`ModelSpec.from_module(model, ...)` (canzona/spec.py) delegates here, so the policy core stays
torch-free (docs/architecture.md §4.1). What is read from the module, and how:

- names: `named_parameters()` with wrapper components (`module.`, `_orig_mod.`,
  `_fsdp_wrapped_module.`, `_checkpoint_wrapped_module.`) removed anywhere in the path
  (`canonical_name`). The optimizer must be given the *same* names, so pass it
  `named_parameters(model)` from this module, not `model.named_parameters()`;
- trainable parameters only (`requires_grad`); a Parameter reachable under two names (tied
  embeddings) appears once, under the first name `named_parameters()` gives;
- roles (docs/design.md §2.1): 1-D parameters are `vector`; weights of an `nn.Embedding` or of a
  module named like an embedding are `embedding`; the output head (`get_output_embeddings()` on
  Hugging Face models, else a module named `lm_head`, `output_layer` or a top-level `output`) is
  `head`, unless its weight is also an embedding (tied); a mixture-of-experts layer's parameters
  are `expert` and `router` (below); every other parameter is `matrix`. That includes other
  parameters of 3 or more dimensions (convolutions): the routing rule
  (`canzona.spec.routes_to_matrix_optimizer`) sends only *2-D* matrices and stacks of them to the
  matrix optimizer, so they go to AdamW while still saying what they are, a weight rather than a
  vector;
- parametrized modules (`register_parametrization`: weight_norm, spectral_norm, ...) own their
  originals (`parametrizations.weight.original`, or `original0`, ...): an embedding's or a head's keep
  its role; weight_norm's magnitude (`original0`, the old hook's `weight_g`, `(out, 1)`) is a vector;
- experts (docs/design.md §2.6): a parameter inside a module named `experts` is an expert's. One
  of 3 or more dimensions is a stack of matrices over its first dimension (transformers 5's fused
  experts, torchtitan's grouped-GEMM weights), each `shape[-2] x shape[-1]`, except a fused
  gate/up (`gate_up_proj`), which `split_fc1` (default) makes two matrices per expert where it is
  `[experts, 2 x ffn, hidden]` beside a `down_proj` `[experts, hidden, ffn]` (any other layout is
  one error: give `split_fc1=False`); a 2-D one inside a submodule (`experts.3.w1.weight`, one
  `nn.Linear` per expert) is one expert matrix, and a 2-D one on the experts module itself (stacked
  biases, `*bias`) is a vector; any other 2-D parameter on the experts module is one error. The
  2-D weight of a module named `gate` or `router` beside an `experts` module is a router: AdamW,
  unless `router_optimizer="matrix"`; a `shared_expert_gate` (one row) is a vector;
- layer index: the integer right after a `layers` / `layer` / `h` / `blocks` component;
- dtype: the parameter's, which must be fp64, fp32, bf16 or fp16;
- TP: the module holds local shards. The split dimension of a parameter comes from, in this
  order: its DTensor placement (`parallelize_module`: `Shard(d)`, or `Replicate()`; the global
  shape is the DTensor's and `tp_size` its mesh's), Megatron's annotations (`tensor_model_parallel`
  and `partition_dim`), or `tp_plan` (fnmatch patterns over canonical names); for the last two the
  global shape multiplies the local one by `tp_size`. A `tp_plan` entry that contradicts a
  parameter's own placement or annotation is an error. An expert's DTensor split over TP (transformers'
  own TP plan for Qwen3-MoE and Mixtral splits each expert) is an error naming the plan override
  that keeps experts whole, as canzona runs them (expert TP 1);
- order: registration order unless `order` is given; `backward_order(model, loss_fn)` measures
  the forward order from one backward pass.
"""

from __future__ import annotations

import fnmatch
import importlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from canzona.errors import PlanError, SpecError
from canzona.runtime.kernels import TORCH_DTYPES
from canzona.runtime.shards import dtensor_tp_dim, is_dtensor, megatron_tp_dim
from canzona.runtime.wrappers import module_wrapper, wrapper_message
from canzona.spec import ROUTER_OPTIMIZERS, ModelSpec, ParamSpec, Role

# weight_norm's parametrization and its deprecated hook, by their (private) classes: () where a
# torch has neither, and no magnitude is then told apart from a matrix
_WEIGHT_NORMS = tuple(c for c in (getattr(parametrizations, "_WeightNorm", None),) if isinstance(c, type))
_WEIGHT_NORM_HOOKS = tuple(c for c in (getattr(importlib.import_module("torch.nn.utils.weight_norm"), "WeightNorm", None),)
                           if isinstance(c, type))

__all__ = [
    "WRAPPER_COMPONENTS",
    "WRAPPER_INSERTED_BY",
    "backward_order",
    "canonical_name",
    "named_parameters",
    "spec_from_module",
]

# Attribute names that wrappers insert between a model and its parameters, each with who inserts it:
# Megatron's Float16Module (and DDP / DataParallel, whose models the optimizer refuses:
# canzona.runtime.wrappers), torch.compile, FSDP (v1, refused too), activation checkpointing.
WRAPPER_INSERTED_BY = {
    "module": "DDP / DataParallel / Megatron's Float16Module (module)",
    "_orig_mod": "torch.compile (_orig_mod)",
    "_fsdp_wrapped_module": "FSDP1 (_fsdp_wrapped_module)",
    "_checkpoint_wrapped_module": "activation checkpointing (_checkpoint_wrapped_module)",
}
WRAPPER_COMPONENTS = frozenset(WRAPPER_INSERTED_BY)
LAYER_CONTAINERS = frozenset({"layers", "layer", "h", "blocks"})
# HF Llama/Qwen, torchtitan, Megatron, GPT-2 (token and position embeddings)
EMBEDDING_MODULE_NAMES = frozenset({"embed_tokens", "tok_embeddings", "word_embeddings", "wte", "wpe"})
# HF and Megatron; anywhere in the path, as these names are specific
HEAD_MODULE_NAMES = frozenset({"lm_head", "output_layer"})
# torchtitan; only at the top level, as `output` is a common name for inner blocks (BERT)
TOP_LEVEL_HEAD_MODULE_NAMES = frozenset({"output"})

SPEC_DTYPES: dict[torch.dtype, str] = {td: name for name, td in TORCH_DTYPES.items()}


# --- names ------------------------------------------------------------------------------------


def canonical_name(name: str) -> str:
    """`name` without wrapper components: `module._orig_mod.model.x` -> `model.x`."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


def named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(canonical name, parameter) for the trainable parameters: what to give the optimizer. A
    model wrapped in DDP or sharded by FSDP is refused (`canzona.runtime.wrappers`)."""
    _refuse_data_parallel_wrappers(model)
    yield from _trainable_parameters(model)


def _refuse_data_parallel_wrappers(model: nn.Module) -> None:
    kind = module_wrapper(model)
    if kind is not None:
        raise SpecError(wrapper_message(kind))


def _trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """`named_parameters()` deduplicates shared Parameters (tied embeddings): the first name wins."""
    found: list[tuple[str, nn.Parameter]] = []
    raw_name: dict[str, str] = {}
    for raw, p in model.named_parameters():
        if not p.requires_grad:
            continue
        name = canonical_name(raw)
        if name in raw_name:
            raise SpecError(f"parameters {raw_name[name]!r} and {raw!r} have the same canonical name {name!r}")
        raw_name[name] = raw
        found.append((name, p))
    return found


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for container, index in zip(parts, parts[1:]):
        if container in LAYER_CONTAINERS and index.isdigit():
            return int(index)
    return None


# --- roles ------------------------------------------------------------------------------------


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DDP / torch.compile / FSDP / checkpoint wrappers (for HF methods and config)."""
    while not hasattr(model, "get_output_embeddings"):
        inner = next((getattr(model, a) for a in WRAPPER_COMPONENTS
                      if isinstance(getattr(model, a, None), nn.Module)), None)
        if inner is None:
            break
        model = inner
    return model


def _declared_head(model: nn.Module) -> nn.Module | None:
    """Hugging Face's own answer; base models without a head return None or raise."""
    getter = getattr(_unwrapped(model), "get_output_embeddings", None)
    if getter is None:
        return None
    try:
        head = getter()
    except (NotImplementedError, AttributeError):
        return None
    return head if isinstance(head, nn.Module) else None


def _is_head_module(module_name: str, module: nn.Module, declared: nn.Module | None) -> bool:
    if declared is not None:
        return module is declared
    parts = module_name.split(".")
    return parts[-1] in HEAD_MODULE_NAMES or (len(parts) == 1 and parts[0] in TOP_LEVEL_HEAD_MODULE_NAMES)


def _is_embedding_module(module_name: str, module: nn.Module) -> bool:
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or \
        module_name.split(".")[-1] in EMBEDDING_MODULE_NAMES


def _owned_parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters `module` owns: its own, and those its parametrizations keep for it
    (`register_parametrization` moves `weight` into the child `parametrizations.weight` as
    `original`, or `original0`, `original1`, ...)."""
    yield from module.parameters(recurse=False)
    if parametrize.is_parametrized(module):
        for originals in module.parametrizations.values():
            yield from _owned_parameters(originals)  # an original parametrized in turn: its own originals


def _weight_norm_magnitudes(model: nn.Module) -> set[int]:
    """The ids of weight_norm's magnitudes (`original0` of `parametrizations.weight_norm`, `*_g` of
    the deprecated `torch.nn.utils.weight_norm` hook): a gain per output row kept `(out, 1)`, a
    vector however it is stored, beside its direction (`original1` / `*_v`, a matrix)."""
    found: set[int] = set()
    for module in model.modules():
        if parametrize.is_parametrized(module):
            for originals in module.parametrizations.values():
                # the first parametrization makes the originals (a second one on the tensor adds none)
                if isinstance(originals[0], _WEIGHT_NORMS) and \
                        isinstance(originals._parameters.get("original0"), nn.Parameter):
                    found.add(id(originals.original0))
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, _WEIGHT_NORM_HOOKS):
                g = module._parameters.get(f"{hook.name}_g")
                if g is not None:
                    found.add(id(g))
    return found


def _owner_roles(model: nn.Module) -> dict[int, Role]:
    """Role by the modules that own each Parameter (by id, a parametrized module's originals
    included); a tied weight is owned by both the embedding and the head, and is an embedding.
    weight_norm's magnitudes are vectors, whatever module holds them."""
    declared = _declared_head(model)
    roles: dict[int, Role] = {}
    for raw, module in model.named_modules():
        name = canonical_name(raw)
        if _is_embedding_module(name, module):
            role = Role.EMBEDDING
        elif _is_head_module(name, module, declared):
            role = Role.HEAD
        else:
            continue
        for p in _owned_parameters(module):
            if roles.get(id(p)) is not Role.EMBEDDING:
                roles[id(p)] = role
    roles.update(dict.fromkeys(_weight_norm_magnitudes(model), Role.VECTOR))
    return roles


def _role(p: nn.Parameter, owner_role: Role | None) -> Role:
    if p.dim() <= 1 or owner_role is Role.VECTOR:
        return Role.VECTOR  # a head's or an embedding's bias is a vector like any other; a 0-d scalar one element of one
    return owner_role or Role.MATRIX


EXPERTS_MODULE = "experts"
ROUTER_MODULES = frozenset({"gate", "router"})  # beside an `experts` module
# Qwen2-MoE's gate of its shared expert: one row (1 x hidden), a vector however it is stored
SHARED_EXPERT_GATE = "shared_expert_gate"
FUSED_FC1, FC2 = "gate_up_proj", "down_proj"


def _moe_parts(model: nn.Module) -> tuple[set[str], set[str]]:
    """Canonical names of the modules named `experts` and of the routers (a `gate` / `router`
    module beside one)."""
    experts, routers = set(), set()
    for raw, module in model.named_modules():
        name = canonical_name(raw)
        children = {n for n, _ in module.named_children()}
        if EXPERTS_MODULE in children:
            experts.add(f"{name}.{EXPERTS_MODULE}" if name else EXPERTS_MODULE)
            routers.update(f"{name}.{r}" if name else r for r in children & (ROUTER_MODULES | {SHARED_EXPERT_GATE}))
    return experts, routers


def _in_experts(module: str, experts: set[str]) -> bool:
    """Whether the module named `module` is an `experts` module or inside one."""
    return any(module == e or module.startswith(e + ".") for e in experts)


def _check_whole_expert(pname: str, p: nn.Parameter, experts: set[str]) -> None:
    """An expert's DTensor must be whole on every TP rank (expert TP 1, as `canzona plan --model`
    reads a config): transformers' own TP plan for Qwen3-MoE and Mixtral splits each expert
    (`packed_colwise` gate/up halves, `rowwise` down), which canzona does not run."""
    if not (is_dtensor(p) and _in_experts(pname.rpartition(".")[0], experts)):
        return
    if all(placement.is_replicate() for placement in p.placements):
        return
    module = re.sub(r"\.\d+\.", ".*.", next(e for e in experts if pname.startswith(e + ".")))
    raise SpecError(f"parameter {pname!r} of an experts module is split over TP ({', '.join(map(str, p.placements))}): "
                    "canzona runs every expert whole on each TP rank (expert TP 1); under transformers' TP plan keep "
                    f"them whole with DistributedConfig(tp_plan={{'{module}': 'replicate', '{module}.gate_up_proj': "
                    f"'replicate', '{module}.down_proj': 'replicate'}}) (docs/design.md §2.5)")


def _moe_role(pname: str, p: nn.Parameter, experts: set[str], routers: set[str], split_fc1: bool,
              router_optimizer: str, params: Mapping[str, nn.Parameter]) -> tuple[Role, tuple[int, int] | None] | None:
    """The role (and stack shape) of an expert's or router's parameter; None for any other."""
    module, _, leaf = pname.rpartition(".")
    if module in routers and p.dim() == 2:
        if module.rpartition(".")[2] == SHARED_EXPERT_GATE:
            return Role.VECTOR, None
        return (Role.ROUTER if router_optimizer == "adamw" else Role.MATRIX), None
    if p.dim() < 2 or not _in_experts(module, experts):
        return None
    if p.dim() == 2:
        if module not in experts:
            return Role.EXPERT, None  # one expert's linear: `experts.3.w1.weight`
        if leaf.endswith("bias"):
            return Role.VECTOR, None  # one bias per expert, stacked (GPT-OSS): AdamW's, as any bias
        # e.g. Megatron's legacy GroupedMLP `weight1` [hidden, experts x ffn]: never guess
        raise SpecError(f"parameter {pname!r} of shape {tuple(p.shape)} on an experts module is neither one "
                        "expert's linear, a stack [experts, m, n] nor a stacked bias: canzona does not know "
                        "how its experts' matrices lie in it")
    rows, cols = p.shape[-2], p.shape[-1]
    if split_fc1 and leaf == FUSED_FC1:
        down = params.get(f"{module}.{FC2}")
        # gate and up can be split only where they are row blocks of [experts, 2 x ffn, hidden]
        # (transformers' Qwen3-MoE and Mixtral); Llama 4 and GPT-OSS store [experts, hidden, 2 x ffn]
        if down is None or down.dim() != p.dim() or tuple(down.shape[-2:]) != (cols, rows // 2) or rows % 2:
            raise SpecError(f"parameter {pname!r} of shape {tuple(p.shape)} is not laid out as [experts, 2 x ffn, "
                            f"hidden] beside a {FC2} of [experts, hidden, ffn], so its gate and up cannot be split: "
                            "give split_fc1=False to optimize each expert's block as one matrix")
        rows //= 2
    return Role.EXPERT, (rows, cols)


def _dtype(name: str, p: nn.Parameter) -> str:
    try:
        return SPEC_DTYPES[p.dtype]
    except KeyError:
        raise SpecError(f"parameter {name!r} has dtype {p.dtype}; canzona specs support "
                        f"{', '.join(map(str, SPEC_DTYPES))}") from None


# --- tensor parallelism -----------------------------------------------------------------------


def _check_tp_size(tp_size: int) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise SpecError(f"tp_size must be an integer >= 1, got {tp_size!r}")


def _tp_dims(names: Sequence[str], tp_plan: Mapping[str, int] | None) -> dict[str, int]:
    """tp_dim per matched name. A pattern matching nothing is an error: a typo would otherwise
    silently replicate what it meant to split."""
    if not tp_plan:
        return {}
    dims: dict[str, int] = {}
    for pattern, dim in tp_plan.items():
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise SpecError(f"tp_plan[{pattern!r}] must be a dimension index (0 or 1), got {dim!r}")
        matched = fnmatch.filter(names, pattern)
        if not matched:
            raise SpecError(f"tp_plan pattern {pattern!r} matches no trainable parameter")
        for name in matched:
            if dims.setdefault(name, dim) != dim:
                raise SpecError(f"tp_plan gives parameter {name!r} two tp dims ({dims[name]} and {dim})")
    return dims


def _own_tp_dim(name: str, p: nn.Parameter, fsdp: bool = False) -> tuple[bool, int | None]:
    """(whether the parameter says how it is split, the split dimension) from a DTensor placement
    or Megatron's annotations. Under FSDP2 (`fsdp`) only the placement on a mesh dimension named
    `tp` is tensor parallelism; FSDP's own Shard(0) is not."""
    if is_dtensor(p) and fsdp:
        names = p.device_mesh.mesh_dim_names or ()
        if "tp" not in names:
            return True, None
        placement = p.placements[names.index("tp")]
        return True, placement.dim if hasattr(placement, "dim") else None
    if is_dtensor(p):
        return True, dtensor_tp_dim(name, p)
    dim = megatron_tp_dim(name, p)
    return dim is not None, dim


def _dtensor_tp_size(params: Mapping[str, nn.Parameter], tp_size: int, fsdp: bool = False) -> int:
    """The TP size of the model's DTensors (their 1-D mesh; under FSDP2 their mesh's `tp`
    dimension, if any), checked against `tp_size`."""
    if fsdp:
        sizes = {p.device_mesh.size(p.device_mesh.mesh_dim_names.index("tp")) for p in params.values()
                 if is_dtensor(p) and "tp" in (p.device_mesh.mesh_dim_names or ())}
        return sizes.pop() if len(sizes) == 1 else tp_size
    sizes = {p.device_mesh.size() for p in params.values() if is_dtensor(p)}
    if not sizes:
        return tp_size
    if len(sizes) > 1:
        raise SpecError(f"the model's DTensor parameters live on meshes of different sizes {sorted(sizes)}")
    (size,) = sizes
    if tp_size not in (1, size):
        raise SpecError(f"tp_size={tp_size}, but the model's DTensors are split over {size} ranks")
    return size


def _sharded_by_fsdp2(model: nn.Module) -> bool:
    """Whether FSDP2's `fully_shard` sharded any of `model` (its parameters are DTensors of global
    shape, split by FSDP over data-parallel ranks)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - builds without distributed support
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _global_shape(local: tuple[int, ...], tp_dim: int | None, tp_size: int) -> tuple[int, ...]:
    if tp_dim is None or tp_dim >= len(local):
        return local  # an out-of-range tp_dim is reported by ParamSpec, with the parameter's name
    shape = list(local)
    shape[tp_dim] *= tp_size
    return tuple(shape)


# --- order ------------------------------------------------------------------------------------


def _ordered(names: list[str], order: Sequence[str] | None) -> list[str]:
    """`order` must list every trainable parameter once and nothing else."""
    if order is None:
        return names
    if isinstance(order, str):
        raise SpecError("order must be a list of parameter names, not a string")
    order = list(order)
    known = set(names)
    seen: set[str] = set()
    for name in order:
        if name not in known:
            raise SpecError(f"order names {name!r}, which is not a trainable parameter of the model")
        if name in seen:
            raise SpecError(f"order lists {name!r} twice")
        seen.add(name)
    missing = [n for n in names if n not in seen]
    if missing:
        raise SpecError(f"order is missing {len(missing)} trainable parameter(s), the first {missing[0]!r}")
    return order


def backward_order(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]) -> list[str]:
    """Canonical names in forward order, measured: the reverse of the order in which gradients
    become ready in one `loss_fn(model).backward()`.

    Registration order is only a guess at forward order (HF Qwen3 registers o_proj before the
    norms it runs after). Parameters that get no gradient follow, in registration order. Hooks are
    removed and every `.grad` is left as it was (the same tensor, or None). Call it on the plain
    module, before wrapping it in DDP or FSDP, whose hooks would communicate.
    """
    params = _trainable_parameters(model)
    ready: list[str] = []
    saved = {name: p.grad for name, p in params}
    handles = []
    try:
        for name, p in params:
            p.grad = None  # so this backward cannot add into the caller's gradients
            handles.append(p.register_post_accumulate_grad_hook(lambda _p, n=name: ready.append(n)))
        with torch.enable_grad():
            loss = loss_fn(model)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise SpecError("backward_order: loss_fn(model) must return a scalar tensor")
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        for name, p in params:
            p.grad = saved[name]
    # A weight used twice (tied) is ready after its last use in backward: its first in forward.
    forward = list(dict.fromkeys(reversed(ready)))
    got_grad = set(forward)
    return forward + [name for name, _ in params if name not in got_grad]


# --- the spec ---------------------------------------------------------------------------------


def _default_name(model: nn.Module) -> str:
    inner = _unwrapped(model)
    config = getattr(inner, "config", None)
    for attr in ("_name_or_path", "model_type"):
        value = getattr(config, attr, None)
        if isinstance(value, str) and value:
            return value
    cls = type(inner)
    if _sharded_by_fsdp2(inner) and cls.__name__.startswith("FSDP"):
        # fully_shard swaps the class for FSDP<Name>(FSDPModule, Name): the model's name is Name's
        cls = next((c for c in cls.__mro__[1:] if c.__name__ == cls.__name__[len("FSDP"):]), cls)
    return cls.__name__


def spec_from_module(model: nn.Module, tp_plan: Mapping[str, int] | None = None, tp_size: int = 1,
                     name: str | None = None, order: Sequence[str] | None = None, *, split_fc1: bool = True,
                     router_optimizer: str = "adamw") -> ModelSpec:
    """The `ModelSpec` of `model`'s trainable parameters (see the module docstring)."""
    if not isinstance(model, nn.Module):
        raise SpecError(f"from_module needs a torch.nn.Module, got {type(model).__name__}")
    if router_optimizer not in ROUTER_OPTIMIZERS:
        raise SpecError(f"router_optimizer must be one of {', '.join(ROUTER_OPTIMIZERS)}, got {router_optimizer!r}")
    experts, routers = _moe_parts(model)
    every = {canonical_name(n): p for n, p in model.named_parameters()}  # frozen ones too: layouts are checked on them
    _refuse_data_parallel_wrappers(model)
    _check_tp_size(tp_size)
    params = dict(_trainable_parameters(model))
    if not params:
        raise SpecError(f"model {type(model).__name__} has no trainable parameters")
    tp_dims = _tp_dims(list(params), tp_plan)
    fsdp = _sharded_by_fsdp2(model)
    tp_size = _dtensor_tp_size(params, tp_size, fsdp)
    owner_roles = _owner_roles(model)
    specs = []
    for pname in _ordered(list(params), order):
        p = params[pname]
        if not fsdp:
            _check_whole_expert(pname, p, experts)
        try:
            says, own = _own_tp_dim(pname, p, fsdp)
        except PlanError as e:
            raise SpecError(str(e)) from None
        if says and pname in tp_dims and tp_dims[pname] != own:
            raise SpecError(f"tp_plan splits {pname!r} along dimension {tp_dims[pname]}, but the parameter "
                            f"itself says {'no dimension' if own is None else f'dimension {own}'}")
        tp_dim = own if says else tp_dims.get(pname)
        shape = tuple(p.shape) if is_dtensor(p) else _global_shape(tuple(p.shape), tp_dim, tp_size)
        moe = _moe_role(pname, p, experts, routers, split_fc1, router_optimizer, every)
        role, matrix_shape = moe if moe is not None else (_role(p, owner_roles.get(id(p))), None)
        specs.append(ParamSpec(pname, shape, role, _layer_index(pname), tp_dim, _dtype(pname, p), matrix_shape))
    return ModelSpec(name or _default_name(model), tuple(specs))
