"""The step's parameter all-gathers, left in flight until something reads the parameters
(Megatron's `overlap_param_gather`): `step()` launches them and returns, and the next forward
waits for each bucket just before the first module that holds one of its parameters runs.

Everything documented that reads parameters waits first:
- a module's forward (training or eval, under `no_grad` too): a forward pre-hook on every module
  that holds one of the optimizer's parameters waits for the buckets of *its own* parameters
  (under `torch.compile` too: construction clears dynamo's caches, so that no forward traced
  before the hooks existed skips them, `_forget_compiled_forwards`; the wait itself runs eagerly,
  a graph break, so `fullgraph=True` is dynamo's error naming `overlap_param_gather=False`; a
  compiled forward waits for every bucket at the first hooked module it enters, the modules
  around the holders included, `_before_forward`);
- `module.state_dict()` (so `torch.save(model.state_dict())`, DCP's `get_model_state_dict`,
  `save_pretrained`) and `module.load_state_dict()` (a gather landing afterwards would overwrite
  what was loaded): pre-hooks on the same modules wait for every bucket;
- the optimizer itself: `step()`, `clip_grad_norm_()`, its state dicts and checkpoints;
- `opt.wait_params()`;
- any other read of a parameter's values (torch's EMA `AveragedModel.update_parameters(model)`,
  `copy.deepcopy(model)`, pickling a parameter or the model (the hooks pickle as no-ops, `Hook`),
  `model.parameters()` iterated by hand, a custom method such as `model.loss()`, a module whose
  forward reads *another* module's weight first):
  while its gathers are in flight a parameter is marked (`pending_params`: its class is swapped to
  a `nn.Parameter` subclass whose `__torch_function__` waits for them; a DTensor's, a TP model's,
  to a DTensor subclass, and its local tensor's too), and the first op that reads it waits; what
  reads no values (`.grad`, shape, dtype: `zero_grad()`) does not.

What remains: parameters of another class than `nn.Parameter` (or a subclass of it: a Parameter
class of the user's own is marked too) or DTensor (a DTensor whose local tensor is a subclass) are not marked: read outside those paths between `step()` and
the next forward, they give a mix of this step's values and the last step's; call
`opt.wait_params()` first, or build with `overlap_param_gather=False`. Where such a read feeds the
loss, backward catches most of it: a gradient arriving for a parameter whose gather nothing waited
for is one `CanzonaError` before anything is updated (`check_read`); what it cannot see is a stale
read of a parameter whose bucket a later module's hook then waited for. A `torch.compile`d forward
that reads another module's marked weight first breaks its graph at that read (the wait runs
eagerly, and `fullgraph=True` is the same error as the hooks'), without recompiling at later steps;
a compiled function that takes marked parameters as arguments (a compiled EMA) waits too, but
recompiles at each step (its guards see the class the wait restored): `opt.wait_params()` first.
A read from another thread waits like the rest (the waits hold a lock); a gather whose wait
failed (the timeout's `CanzonaError`) fails every later wait for it with the same error.
"""

from __future__ import annotations

import functools
import gc
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping
from itertools import compress
from typing import Any

import torch
from torch import Tensor, nn

from canzona.errors import CanzonaError
from canzona.runtime import pending_params
from canzona.runtime.comm import PendingWork
from canzona.runtime.mesh import TP
from canzona.runtime.pending_params import FULLGRAPH

log = logging.getLogger("canzona")


# where a parameter is held: (the module, weakly, the attribute name) of each module holding it
Holders = dict[str, list[tuple["weakref.ref[nn.Module]", str]]]


# id(module) -> the live modules holding it as a direct child (`enclosing_modules`)
Parents = dict[int, list[nn.Module]]


def param_holders(params: Mapping[str, Tensor], parents: Parents | None = None) -> Holders:
    """Each of `params` that some live module holds as its own (not a child's) parameter: every
    such module (a weak reference) and its attribute (two for tied weights), in the order of
    `params` (not gc's, which differs between processes: an error naming the first parameter
    names the same one on every rank). `parents`, when given, gets every live module's parents
    from the same walk (what `enclosing_modules` needs: one walk of gc, not two)."""
    by_id = {id(p): name for name, p in params.items()}
    found: Holders = {}
    for obj in live_modules():  # once, at construction: modules are gc-tracked containers
        add_holder(obj, by_id, found, parents)
    return {n: found[n] for n in params if n in found}


def live_modules(*exact: type) -> list[object]:
    """The live modules (gc's objects whose type subclasses `nn.Module`) and the live objects of
    the types `exact`, in gc's order. Each type is looked at once, not each object: a rank holds
    some 350,000 objects, of which a few hundred are modules (a look at each object cost about
    0.2 s of CPU an FSDP2 optimizer's construction)."""
    objects = gc.get_objects()
    # type(), not isinstance(): that asks some objects for __class__, and deprecated proxies
    # (torch.distributed.reduce_op) warn when asked
    wanted = {t for t in set(map(type, objects)) if t in exact or issubclass(t, nn.Module)}
    return list(compress(objects, map(wanted.__contains__, map(type, objects))))  # in C: no Python per object


def add_holder(obj: object, by_id: Mapping[int, str], found: Holders, parents: Parents | None = None) -> None:
    """`param_holders`' look at one live object: a module holding a parameter of `by_id` (id ->
    name) as its own goes into `found` (for a walk of `gc` that looks for other objects too), and
    into `parents` (when given) as the parent of each of its children."""
    # type(), not isinstance(): that asks some objects for __class__, and deprecated proxies
    # (torch.distributed.reduce_op) warn when asked
    if issubclass(type(obj), nn.Module):
        for attr, p in obj._parameters.items():
            if p is not None and id(p) in by_id:
                found.setdefault(by_id[id(p)], []).append((weakref.ref(obj), attr))
        if parents is not None:
            for child in obj._modules.values():
                if child is not None:
                    parents.setdefault(id(child), []).append(obj)


def fsdp_params_of(params: Mapping[str, Tensor],
                   parents: Parents | None = None) -> tuple[dict[str, Any], list[Any], Holders]:
    """FSDP2's record (its `FSDPParam`) of each of `params` that it shards, by name (the tensor
    FSDP2 trains in that place is its `sharded_param`), the `FSDPParamGroup`s holding them, and
    the modules holding each of the others (`param_holders`): one walk of `gc`, at construction.
    `parents`, when given, gets every live module's parents from the same walk (`module_links`)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    by_id = {id(p): name for name, p in params.items()}
    found, groups, holders = {}, [], {}
    for obj in live_modules(FSDPParam, FSDPParamGroup):
        if type(obj) is FSDPParam and id(getattr(obj, "sharded_param", None)) in by_id:
            found[by_id[id(obj.sharded_param)]] = obj
        elif type(obj) is FSDPParamGroup:
            groups.append(obj)
        else:
            add_holder(obj, by_id, holders, parents)
    ids = {id(f) for f in found.values()}
    groups = [g for g in groups if any(id(f) in ids for f in g.fsdp_params)]
    # in the parameters' order; a sharded parameter's holders are FSDP2's business (its FSDPParam)
    return ({n: found[n] for n in params if n in found}, groups,
            {n: holders[n] for n in params if n in holders and n not in found})


def fsdp_holders(fsdp_params: Mapping[str, Any]) -> Holders:
    """The modules FSDP2 sets each of its parameters on (its `FSDPParam`'s module, and a tied
    weight's other modules), for `module_links`: FSDP2's record holds the module, so a module
    replaced in the model lives on in it, still holding the parameter, whoever else lets it go."""
    return {n: [(weakref.ref(info.module), info.param_name)
                for info in (fp._module_info, *getattr(fp, "_shared_module_infos", ()))]
            for n, fp in fsdp_params.items()}


RESHARD_FIRST = "a forward ran and the model was not resharded: call model.reshard() before building the optimizer"


def check_not_unsharded(params: Mapping[str, Tensor], holders: Holders, parents: Parents) -> None:
    """None of `params` is FSDP2's unsharded parameter: after a forward that left an FSDP2 model
    unsharded (one rank, no `model.reshard()`), `model.named_parameters()` hands out FSDP2's
    full-size plain parameters, which FSDP2 swaps back for its sharded ones: the optimizer would
    own tensors no later forward reads (and its hooks would meet FSDP2's own reads as a user's).
    `holders` / `parents`: the construction's walk of `gc` (`param_holders`)."""
    if "torch.distributed.fsdp" not in sys.modules:
        return
    from torch.distributed.fsdp import FSDPModule

    for name, refs in holders.items():
        p = params[name]
        if hasattr(p, "_local_tensor"):  # FSDP2's unsharded parameters are plain ones
            continue
        around = [m for m in (ref() for ref, _ in refs) if m is not None]
        seen: set[int] = set()
        while around:  # the holding modules and every module enclosing them
            module = around.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None and any(getattr(f, "_unsharded_param", None) is p for f in group.fsdp_params):
                    raise CanzonaError(f"parameter {name!r} is FSDP2's unsharded one just now ({RESHARD_FIRST})")
            around.extend(parents.get(id(module), []))


def point_fsdp_at(params: Mapping[str, Tensor]) -> dict[str, Any]:
    """Make FSDP2 all-gather each of `params` it holds from the parameter's local tensor as it is now
    (after `shards.link_data` laid it into the optimizer's buffers), and return FSDP2's record of
    each (`fsdp_params_of`): FSDP2 gathers from its own `_sharded_param_data`, which it points at
    the local tensor at `fully_shard` and again at its lazy init (the first forward) only. Built
    after a forward, the optimizer would step memory that no forward reads (the model kept its
    initial weights). Only the ZeRO-1 step relinks an FSDP2 model's parameters: FSDP2 on one rank."""
    # FSDP2's parameters are DTensors on a mesh other than a TP one (`fsdp.is_fsdp_sharded`): a
    # model without any walks no `gc`
    if "torch.distributed.fsdp" not in sys.modules or not any(
            hasattr(p, "_local_tensor") and tuple(p.device_mesh.mesh_dim_names or ()) != (TP,) for p in params.values()):
        return {}
    found, _, _ = fsdp_params_of(params)
    with torch.no_grad():
        for name, record in found.items():
            held = getattr(record._module_info.module, record._module_info.param_name, None)
            if held is not record.sharded_param:
                raise CanzonaError(f"parameter {name!r} is FSDP2's unsharded one just now ({RESHARD_FIRST})")
            record.reset_sharded_param()  # FSDP2's own repointing (load_state_dict, nn.Module._apply use it)
            if not fsdp_reads(record, params[name]):
                raise CanzonaError(f"FSDP2 keeps its own copy of parameter {name!r} (padded or pinned), which "
                                   "canzona's one-rank step cannot update: shard the model over more than one "
                                   "rank (the FSDP step) or train it without fully_shard")
    return found


def held_by_fsdp(records: Mapping[str, Any], groups: Iterable[Any] = ()) -> str | None:
    """A gradient FSDP2 still holds unreduced on this rank, by its records of the optimizer's
    parameters (`fsdp_params_of`) and their param groups: the last backward run under
    `set_requires_gradient_sync(False)` or, under HSDP, `set_requires_all_reduce(False)` (or such a
    backward after a clip). `.grad` does not have it, so the step would run without it (on zeros
    after `zero_grad(set_to_none=False)`), and FSDP2 would add it to the next step's. The FSDP
    step's check and the ZeRO-1 step's over an FSDP2 model on one rank (`point_fsdp_at`)."""
    for name, record in records.items():
        unsharded = getattr(record, "_unsharded_param", None)
        if record.unsharded_accumulated_grad is not None or getattr(unsharded, "grad", None) is not None:
            return (f"{name}: FSDP2 holds a gradient it has not reduced on rank {_rank()} (a backward under "
                    "model.set_requires_gradient_sync(False)): run the last micro-batch's backward with "
                    "model.set_requires_gradient_sync(True) before step(), through every module that held one")
    for group in groups:
        if getattr(group, "_partial_reduce_output", None) is not None:
            # HSDP: reduce-scattered, its all-reduce over the replicas held back
            name = next(n for n, f in records.items() if f in group.fsdp_params)
            return (f"{name}: FSDP2 holds a gradient it has not all-reduced over the replicas on rank {_rank()} (an "
                    "HSDP backward under model.set_requires_all_reduce(False)): run the last micro-batch's backward "
                    "with model.set_requires_all_reduce(True) before step(), through every module that held one (a "
                    "module the last backward does not reach keeps what the earlier ones held back)")
    return None


def _rank() -> int:
    """This process's rank for a message (0 without torch.distributed): read where a message is
    made, not on every step's check."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def fsdp_reads(record: Any, p: Tensor) -> bool:
    """FSDP2's record `record` of parameter `p` gathers from `p`'s local values (their memory)."""
    local = p._local_tensor
    return record._sharded_param_data.data_ptr() == local.data_ptr() and record.sharded_param is p


def modules_holding(params: Mapping[str, Tensor], holders: Holders | None = None) -> dict[nn.Module, list[str]] | None:
    """Every live module that holds one of `params` as its own (not a child's) parameter, with the
    names of those it holds; None when some parameter is held by no module (a bare tensor).
    `holders`: `param_holders(params)`, when already taken."""
    holders = param_holders(params) if holders is None else holders
    if set(holders) != set(params):
        return None
    found: dict[nn.Module, list[str]] = {}
    for name, refs in holders.items():
        for ref, _ in refs:
            module = ref()
            if module is not None:
                found.setdefault(module, []).append(name)
    return found


def enclosing_modules(holding: Iterable[nn.Module], parents: Parents | None = None) -> list[nn.Module]:
    """Every live module that holds one of `holding` as a descendant and is not one of them
    itself (the model, its blocks, a `torch.compile` wrapper), in the order gc gives them (the
    hooks they get do the same thing whatever the order). `parents`: what `param_holders` filled
    in, when already taken (else a walk of gc of its own)."""
    if parents is None:
        parents = {}
        param_holders({}, parents)
    seen = {id(m) for m in holding}
    found: list[nn.Module] = []
    todo = list(holding)
    while todo:
        for parent in parents.get(id(todo.pop()), ()):
            if id(parent) not in seen:
                seen.add(id(parent))
                found.append(parent)
                todo.append(parent)
    return found


# (parent, attribute, child, a parameter below): `parent._modules[attribute]` was `child` at
# construction, and `child` holds the parameter or has a descendant that does (`module_links`)
Links = list[tuple["weakref.ref[nn.Module]", str, "weakref.ref[nn.Module]", str]]

# modules registered in any module (assigned, added, a container's item set) since the first
# `ModuleLinks`: bumped by one process-wide hook (`_watch_registrations`), never one an optimizer
_registrations = [0]
_registration_hook: list[Any] = []


def _count_registration(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    _registrations[0] += 1


def _watch_registrations() -> bool:
    """The process-wide module registration hook in place (registered once, whatever the number
    of optimizers: nothing of theirs lives in it); False on a torch without one (the links are then
    walked every step)."""
    if not _registration_hook:
        register = getattr(nn.modules.module, "register_module_module_registration_hook", None)
        if register is None:
            return False
        _registration_hook.append(register(_count_registration))
    return True


def module_links(holders: Holders, parents: Parents) -> Links:
    """Every link from a live module to its child on the way down to the modules holding the
    parameters (`param_holders`' `parents`), each once, with the first parameter (in `holders`'
    order) below it, for `replaced_parameter` to see a module replaced while the old one lives on."""
    links: Links = []
    seen: set[int] = set()
    attrs_of: dict[int, dict[int, list[str]]] = {}  # a parent's children by id, built once per parent
    for name, refs in holders.items():
        todo = [m for ref, _ in refs if (m := ref()) is not None]
        while todo:
            child = todo.pop()
            if id(child) in seen:
                continue
            seen.add(id(child))
            for parent in parents.get(id(child), ()):
                attrs = attrs_of.get(id(parent))
                if attrs is None:
                    attrs = attrs_of[id(parent)] = {}
                    for attr, m in parent._modules.items():
                        attrs.setdefault(id(m), []).append(attr)
                links.extend((weakref.ref(parent), attr, weakref.ref(child), name) for attr in attrs.get(id(child), ()))
                todo.append(parent)
    return links


# a root the optimizer's names were given from, at construction: (the module, weakly, the prefix to
# drop from an optimizer's name, the prefix to add, its tied names, every name of its parameters):
# `name` is `add + name[len(drop):]` from the root, wrapper components left out (`canonical_name`: a
# `torch.compile` wrapper's `_orig_mod.`); the tied names are the root's other names of the
# optimizer's parameters at construction (a head tied to the embedding: `lm_head.weight` ->
# `embed.weight`); every name, the optimizer's or not, to tell a name that came since (`_fresh`)
Roots = list[tuple["weakref.ref[nn.Module]", str, str, dict[str, str], frozenset[str]]]


class ModuleLinks:
    """`module_links`, walked by `changed` only when a module was registered somewhere since
    the last walk that found nothing (the process-wide hook's count), or when one of the
    optimizer's parameters got no gradient this step (`missed`: a module replaced by writing a
    parent's `_modules` directly, `del layers[i]` and `ModuleList.insert`, `del model.head`,
    registers nothing, but the old module's parameters then get no gradient; a model with a
    parameter that never gets one walks every step): a step of a model whose modules stay put
    and train costs two comparisons, not a walk of every link. Not seen before the next
    registration: a change that registers nothing and leaves every parameter its gradient where
    every parameter gets one (two modules swapped through `_modules`, `ModuleList.insert` of a
    module without submodules, nothing removed). `roots`: where the optimizer's names were
    taken from (`construction_roots`), against which a mismatched link is judged. `moved`: set
    where a walk accepted links that no longer stood (and took them again), for the holders to be
    taken again too (`replaced_parameter`). `frozen`: the frozen tensors a walk accepted where a
    name of a root trains nothing the optimizer holds (`_fresh`: a tied head replaced by a frozen
    one), weakly: one set to require grad since sends the next step to judge the names again."""

    __slots__ = ("links", "roots", "_walked", "moved", "frozen")

    def __init__(self, links: Links, params: Mapping[str, Tensor] | None = None) -> None:
        self.links = links
        self.roots = construction_roots(links, params) if params else []
        self._walked = -1  # the count at the last walk that found nothing
        self.moved = False
        self.frozen: list[weakref.ref[Tensor]] = []
        _watch_registrations()

    def changed(self, params: Mapping[str, Tensor] | Callable[[], Mapping[str, Tensor]],
                missed: Callable[[], Collection[str]] | None = None) -> str | None:
        """`params`: by name, each parameter as the model holds it, or a call that returns them
        (taken only when the links are walked: FSDP2's, whose modules hold the unsharded tensors
        while unsharded). `missed`: the names of the parameters that got no gradient this step."""
        count = _registrations[0]
        thawed = bool(self.frozen) and any(t is not None and t.requires_grad for t in (r() for r in self.frozen))
        if not thawed and count == self._walked and _registration_hook and not (missed is not None and missed()):
            return None
        if callable(params):
            params = params()
        frozen: list[Tensor] = []
        if thawed:  # a frozen tensor accepted in a name's place now requires grad
            fresh = _lost(self.roots, params, frozen)[3]
            self.frozen = []
            if fresh is not None:
                return _fresh_message(fresh, "a frozen tensor in its place requires grad now")
        moved: list[bool] = []
        problem = links_changed(self.links, params, moved, self.roots, frozen)
        if problem is None:
            self.watch(frozen)
            if moved:  # the links follow what moved (or went): from the model's roots down, as now
                self.links = relinked(self.links, params, self.roots)
                self.moved = True
            self._walked = count
        return problem

    def watch(self, frozen: Iterable[Tensor]) -> None:
        """Watch `frozen` too (`ModuleLinks.frozen`), each once."""
        known = {id(t) for r in self.frozen if (t := r()) is not None}
        self.frozen = [r for r in self.frozen if r() is not None]
        self.frozen.extend(weakref.ref(t) for t in frozen if id(t) not in known and not known.add(id(t)))


def _canonical_params(root: nn.Module) -> dict[str, Tensor]:
    """Every parameter under `root` by its canonical name (each name of a tied one)."""
    from canzona.runtime.modules import canonical_name

    return {canonical_name(raw): p for raw, p in root.named_parameters(remove_duplicate=False)}


def _resolves(root: nn.Module, drop: str, add: str, params: Mapping[str, Tensor],
              names: Mapping[str, Tensor] | None = None) -> str | None:
    """The first of `params` whose name (`drop` dropped, `add` added) does not lead from `root` to
    that same Parameter now, or None (`names`: `root`'s, where already taken)."""
    if names is None:
        names = _canonical_params(root)
    return next((n for n, p in params.items() if names.get(add + n[len(drop):]) is not p), None)


def construction_roots(links: Links, params: Mapping[str, Tensor]) -> Roots:
    """The live modules from which every one of `params` is found by its name (the one given to
    the optimizer), up to one prefix dropped or added: the model, a wrapper of it (torch.compile's,
    DDP's `module.`). A module that holds some of them only (a backup `ModuleList` of the layers, a
    teacher sharing a block) is none."""
    if not params:
        return []
    first, p0 = next(iter(params.items()))
    out: Roots = []
    todo = _roots(links)
    seen: set[int] = set()
    mine = {id(p) for p in params.values()}
    while todo:
        root = todo.pop()
        if id(root) in seen:
            continue
        seen.add(id(root))
        names = _canonical_params(root)
        if not mine <= {id(p) for p in names.values()}:
            continue
        for m in (m for m, p in names.items() if p is p0):
            drop, add = ("", m[:len(m) - len(first)]) if m.endswith(first) else \
                (first[:len(first) - len(m)], "") if first.endswith(m) else (None, None)
            if drop is not None and _resolves(root, drop, add, params, names) is None:
                by_id = {id(p): n for n, p in params.items()}
                tied = {t: by_id[id(p)] for t, p in names.items()
                        if id(p) in by_id and t != add + by_id[id(p)][len(drop):]}
                out.append((weakref.ref(root), drop, add, tied, frozenset(names)))
                break
        # a wrapper's one child holding them all (the model under a compile or DDP wrapper), in case
        # the wrapper goes while the model stays
        holding = [c for c in root._modules.values() if c is not None and next(c.parameters(), None) is not None]
        if len(holding) == 1 and not any(id(p) in mine for p in root._parameters.values()):
            todo.append(holding[0])
    return out


# a name of a root that trains a tensor none of the optimizer's (`_fresh`), and the optimizer's
# parameter it stands for (the one tied to it then) or is nearest (by the names' leading components)
Fresh = tuple[str, str]


def _fresh(drop: str, add: str, tied: Mapping[str, str], built: frozenset[str], params: Mapping[str, Tensor],
           names: Mapping[str, Tensor], frozen: list[Tensor] | None = None) -> Fresh | None:
    """The first name of a root (`Roots`) that trains a tensor none of `params` now, or None: a
    tied name holding another tensor (a new head in place of one tied to the embedding), or a
    name not there at construction (`built`) holding one that requires grad (the head put in an
    `nn.Sequential`, `lm_head.0.weight`; a bias on a head tied again; a new Parameter on a layer
    replaced by one holding its Parameters). A tied name gone, or holding another of `params`, trains
    nothing this optimizer does not step; nor does a frozen tensor in such a place (a tied head
    replaced by a frozen one), which goes into `frozen` (to be watched: `ModuleLinks.frozen`)."""
    mine = {id(p) for p in params.values()}
    other = [(t, q) for t in tied if (q := names.get(t)) is not None and id(q) not in mine]
    other += [(n, q) for n, q in names.items() if n not in built and id(q) not in mine]
    if frozen is not None:
        frozen.extend(q for _, q in other if not q.requires_grad)
    new = next((n for n, q in other if q.requires_grad), None)
    if new is None:
        return None
    if new in tied:
        return new, tied[new]
    # the optimizer's parameter whose name (at construction, from this root) shares most leading components
    ours = [(add + n[len(drop):], n) for n in params] + list(tied.items())
    parts = new.split(".")

    def shared(name: str) -> int:
        k = 0
        for a, b in zip(parts, name.split(".")):
            if a != b:
                break
            k += 1
        return k
    return new, max(ours, key=lambda o: shared(o[0]))[1]


def _lost(roots: Roots, params: Mapping[str, Tensor],
          frozen: list[Tensor] | None = None) -> tuple[str | None, bool, bool, Fresh | None]:
    """(the first of `params` not found from a live root of `roots` by its construction name, or
    None; whether all of `params` are still under a live root, by any name (then it moved); whether
    any root lives; a name of a root that trains a tensor none of `params` now, `_fresh`, or None).
    Each root's names are read once. `frozen` gets the frozen tensors in such places (`_fresh`)."""
    live = [(r, *rest) for ref, *rest in roots if (r := ref()) is not None]
    if not live:
        return None, True, False, None
    wrong = fresh = None
    held: set[int] = set()
    for root, drop, add, tied, built in live:
        names = _canonical_params(root)
        held.update(id(p) for p in names.values())
        if wrong is None:
            wrong = _resolves(root, drop, add, params, names)
        if fresh is None:
            fresh = _fresh(drop, add, tied, built, params, names, frozen)
    if wrong is None:
        return None, True, True, fresh
    # a parameter under no root at all first (replaced, dropped), else the first under another name
    gone = next((n for n, p in params.items() if id(p) not in held), None)
    return gone or wrong, gone is None, True, fresh


def _fresh_message(fresh: Fresh, where: str) -> str:
    """The error of a name that trains a tensor none of the optimizer's (`_fresh`): `where`, what shows it."""
    name, ours = fresh
    return replaced_message(ours, f"{where}: {name!r} is a tensor this optimizer does not hold")


def in_place(roots: Roots, params: Mapping[str, Tensor], where: str = "",
             frozen: list[Tensor] | None = None) -> tuple[bool, str | None]:
    """(whether every one of `params` is found from the live construction `roots` by its name; the
    error of a name there that trains a tensor none of `params`, `_fresh`, or None): with both, a
    module holding one of them that left the model (`replaced_parameter`'s holders) leaves the
    model to train as before (`_lost`). `where`: what shows it, for the error; `frozen`, as `_lost`'s."""
    lost, _, rooted, fresh = _lost(roots, params, frozen)
    placed = rooted and lost is None
    return placed, _fresh_message(fresh, where) if placed and fresh is not None else None


def links_changed(links: Links, params: Mapping[str, Tensor], moved: list[bool] | None = None,
                  roots: Roots | None = None, frozen: list[Tensor] | None = None) -> str | None:
    """A message for the links of `links` no longer standing as built (a parent that now holds
    another module, or none, or a child wrapped in place, or a child gone), unless every one of
    `params` is still found from the construction `roots` under its name (`canonical_name`: a
    checkpoint or compile wrapper's component is no rename), as the same Parameter (a ModuleList
    rebuilt with the same modules in the same places; a module replaced by one holding the same
    Parameters at the same path, torchao's `Float8Linear.from_float`; a checkpoint wrapper put
    around a layer). The verdict is the names', whether the old child lives on or was freed. Two
    layers swapped, or a wrapper that renames (`.inner`), is the error: the optimizer's state (and
    its checkpoints) is keyed by the names at construction. Without a live root, the parameters
    below an old child that lives must be in the model (from the links' roots, as the same
    objects). `moved` gets an item where a link no longer stands as built and was accepted;
    `frozen`, the frozen tensors in a name's place there (`_fresh`)."""
    changed: list[tuple[nn.Module | None, str, nn.Module | None, Any]] = []  # (parent, attr, old child, now)
    for parent_ref, attr, child_ref, _ in links:
        parent, child = parent_ref(), child_ref()
        if parent is None and child is None:
            continue
        if parent is None:  # a parent gone (a container that held it for a while)
            changed.append((None, attr, child, None))
            continue
        now = parent._modules.get(attr)
        if now is not child:  # child None: gone, so not what the parent holds
            changed.append((parent, attr, child, now))
    if not changed:
        return None
    lost, kept, rooted, fresh = _lost(roots or [], params, frozen)
    if lost is None and fresh is not None:  # a name trains a new tensor: a new head, untied; a new Parameter
        p = params[fresh[1]]
        named = [c for c in changed if c[0] is not None and c[2] is not None]
        parent, attr, _, now = next((c for c in named if any(q is p for q in c[2]._parameters.values())), None) or \
            next((c for c in named if any(q is p for q in c[2].parameters())),
                 next((c for c in changed if c[0] is not None), changed[0]))
        where = f"{type(parent).__name__}.{attr} now holds another module" if parent is not None else \
            "its module's parent left the model"
        return _fresh_message(fresh, where)
    if not rooted:  # no live root: an old child that lives must have its parameters in the model
        reachable = {id(p) for root in _roots(links) for p in root.parameters()}
        mine = {id(p): n for n, p in params.items()}
        for parent, attr, child, now in changed:
            if parent is None or child is None or (isinstance(now, nn.Module) and any(m is child for m in now.modules())):
                continue
            lost = next((mine[id(p)] for p in child.parameters() if id(p) in mine and id(p) not in reachable), None)
            if lost is not None:
                return _link_message(links, parent, attr, now, lost, False)
        lost = None
    if lost is None:
        if moved is not None:
            moved.append(True)
        return None
    # the link to name: the first whose old child holds the parameter (as its own, else below it), else the
    # first with a parent
    p = params[lost]
    named = [c for c in changed if c[0] is not None]
    parent, attr, _, now = next((c for c in named if c[2] is not None and any(q is p for q in c[2]._parameters.values())),
                                None) or next((c for c in named if c[2] is not None and any(q is p for q in c[2].parameters())),
                                              named[0] if named else changed[0])
    if parent is None:
        return moved_message(lost, "its module's parent left the model") if kept else \
            dropped_message(lost, "its module's parent left the model")
    return _link_message(links, parent, attr, now, lost, kept)


def _link_message(links: Links, parent: nn.Module, attr: str, now: Any, lost: str, kept: bool) -> str:
    """The message of a link `parent._modules[attr]` that holds `now` in place of the child it
    held, for parameter `lost` (`kept`: every parameter still in the model, under other names)."""
    where = f"{type(parent).__name__}.{attr}"
    known = {id(c) for _, _, ref, _ in links if (c := ref()) is not None}
    if now is None:
        return dropped_message(lost, f"{where} holds no module now")
    how = f"{where} now holds another of its modules" if id(now) in known else f"{where} now holds another module"
    if kept:
        return moved_message(lost, how)
    return dropped_message(lost, how) if id(now) in known else replaced_message(lost, how)


def _roots(links: Links) -> list[nn.Module]:
    """The live roots of the links: a live parent that is no live link's child (the model, a
    `torch.compile` wrapper of it)."""
    parents = {id(p): p for ref, _, _, _ in links if (p := ref()) is not None}
    for _, _, ref, _ in links:
        child = ref()
        if child is not None:
            parents.pop(id(child), None)
    return list(parents.values())


def relinked(links: Links, params: Mapping[str, Tensor], roots: Roots | None = None) -> Links:
    """The links as the model stands now: from the live construction `roots` (else the live roots
    of `links`) down to every module with one of `params` below it (the first by module order
    named), each once."""
    mine = {id(p): n for n, p in params.items()}
    first: dict[int, str | None] = {}  # a module's first parameter of `params` below it, by id

    def below(module: nn.Module) -> str | None:
        if id(module) not in first:
            first[id(module)] = None  # a cycle of modules stops here
            name = next((mine[id(p)] for p in module._parameters.values() if p is not None and id(p) in mine), None)
            for child in module._modules.values():
                if child is not None and (found := below(child)) is not None and name is None:
                    name = found
            first[id(module)] = name
        return first[id(module)]

    out: Links = []
    done: set[int] = set()
    todo = [r for ref, *_ in roots or [] if (r := ref()) is not None] or _roots(links)
    while todo:
        module = todo.pop()
        if id(module) in done:
            continue
        done.add(id(module))
        for attr, child in module._modules.items():
            if child is not None and below(child) is not None:
                out.append((weakref.ref(module), attr, weakref.ref(child), first[id(child)]))
                todo.append(child)
    return out


def replaced_parameter(params: Mapping[str, Tensor], holders: Holders, links: ModuleLinks | None = None,
                       missed: Callable[[], bool] | None = None) -> str | None:
    """A message naming a parameter that a module held at construction and holds no longer (a new
    Parameter or module assigned in its place: `load_state_dict(assign=True)`, `tie_weights()`, a
    new head), or None. The model then trains the new tensor, which no hook of the optimizer's
    sees (its gradient is never reduced, it is never stepped), while the optimizer steps the old.
    `links` (`ModuleLinks`) catch a module replaced in a live parent while the old one lives on (a
    reference cycle gc has not collected yet, a reference of the user's), where the old module
    still holds the parameter; a child wrapped in place (an activation checkpoint wrapper holding
    it) or moved with its parameters is no replacement (`links_changed`). A holder that left the
    model (freed, or holding another tensor now) is no error either where the names say so
    (`in_place`: a head tied to the embedding replaced by a new one tied to it again, a module
    replaced by one holding the same Parameters), and no name there trains a tensor the optimizer
    does not hold (`_fresh`: a new Parameter beside them): `holders` are then taken again from the roots,
    so the verdict is the same whether gc freed the old module or not."""
    failed = _failed_holder(params, holders)
    if failed is not None:
        name, module, attr = failed
        where = f"{type(module).__name__}.{attr} now holds another tensor" if module is not None else \
            f"the module that held it ({attr}) is gone"
        frozen: list[Tensor] = []
        placed, fresh = (False, None) if links is None else in_place(links.roots, params, where, frozen)
        if fresh is not None:
            return fresh
        if not placed:
            held = f"{type(module).__name__}.{attr}" if module is not None else f"the module that held it ({attr})"
            return replaced_message(name, f"{held} now holds another tensor, or its module was replaced")
        links.watch(frozen)
        _rehold(holders, links.roots, params)
    if links is None:
        return None
    problem = links.changed(params, missed)
    if problem is None and links.moved:
        # a walk accepted links that no longer stood (a tied head replaced by one tied again, the old
        # head alive): the old module may still hold the parameters, so the holders are taken again
        # too, or a later Parameter assigned to the new one (no walk) would train unseen
        links.moved = False
        _rehold(holders, links.roots, params)
    return problem


def _failed_holder(params: Mapping[str, Tensor],
                   holders: Holders) -> tuple[str, nn.Module | None, str] | None:
    """The first holder (`Holders`) freed or holding another tensor than its parameter now: (the
    parameter's name, the module or None, the attribute), or None (the step's check: a loop)."""
    for name, refs in holders.items():
        p = params[name]
        for ref, attr in refs:
            module = ref()
            if module is None or module._parameters.get(attr) is not p:
                return name, module, attr
    return None


def _rehold(holders: Holders, roots: Roots, params: Mapping[str, Tensor]) -> None:
    """`holders` taken again, in place, from the live `roots` down (`param_holders`' entries); left
    as they are without a live root."""
    by_id = {id(p): n for n, p in params.items()}
    found: Holders = {}
    seen: set[int] = set()
    live = [r for ref, *_ in roots if (r := ref()) is not None]
    if not live:
        return
    for root in live:
        for module in root.modules():
            if id(module) not in seen:
                seen.add(id(module))
                add_holder(module, by_id, found)
    holders.clear()
    holders.update({n: found[n] for n in params if n in found})


def dropped_message(name: str, how: str) -> str:
    """The error of a parameter the model holds no longer, its module moved off (`how`) after the
    optimizer was built (`links_changed`)."""
    return (f"parameter {name!r} is no longer in the model ({how}), after the optimizer was built: the optimizer "
            "would step a tensor the model no longer trains. Put the module back, or build the optimizer after "
            "such changes")


def moved_message(name: str, how: str) -> str:
    """The error of a parameter still in the model but under another name than the optimizer was
    given (two layers swapped) (`links_changed`)."""
    return (f"parameter {name!r} moved in the model after the optimizer was built ({how}): its optimizer state, "
            "and a checkpoint's, is keyed by the name it had then, so a resume would pair other weights with it. "
            "Put the modules back in their places, or build the optimizer after such changes")


def replaced_message(name: str, how: str) -> str:
    """The error of a parameter replaced in the model after the optimizer was built (`how`: what
    shows it), under ZeRO-1 (`replaced_parameter`) and FSDP2 alike."""
    return (f"parameter {name!r} was replaced after the optimizer was built ({how}): the model would train a tensor "
            "this optimizer never steps (load_state_dict(assign=True), tie_weights(), register_parametrization or "
            "weight_norm, a new module or Parameter "
            "assigned). Build the optimizer after such changes, and load weights in place (load_state_dict() "
            "without assign, DCP, set_model_state_dict)")


class ParamsInFlight:
    """The pending all-gathers of one step and the hooks that wait for them."""

    def __init__(self, works_of: Mapping[str, tuple[int, ...]], modules: Mapping[nn.Module, list[str]],
                 params: Mapping[str, Tensor], parents: Parents | None = None) -> None:
        # parameter name -> the gathers that write it (several for a stack spanning buckets)
        self._works_of = dict(works_of)
        self._pending: list[list[PendingWork | None]] = [[]]  # boxed: the finalizer holds the box
        self._handles: list = []
        self._lock = threading.RLock()
        me = weakref.ref(self)
        # the parameters marked pending while their gathers are in flight (`pending_params`), and
        # those each gather writes (to unmark them as it lands)
        self._marked = {n: p for n, p in params.items() if n in self._works_of and pending_params.markable(p)}
        self._marked_of: dict[int, list[str]] = {}
        for name, p in self._marked.items():
            for k in self._works_of[name]:
                self._marked_of.setdefault(k, []).append(name)
            pending_params.watch(p, functools.partial(_wait_param, me, self._works_of[name]))
        wait_all = _wait_all_hook(me)
        for module, names in modules.items():
            works = sorted({k for n in names for k in self._works_of[n]})
            self._handles.append(module.register_forward_pre_hook(Hook(_before_forward(me, works))))
            self._handles.append(module.register_state_dict_pre_hook(Hook(wait_all)))
            self._handles.append(module.register_load_state_dict_pre_hook(Hook(wait_all)))
        # the modules around them (the model itself, its blocks): a compiled forward lands every
        # gather at the first of these it enters (`_before_forward`), a module waiting for none
        for module in enclosing_modules(modules, parents):
            self._handles.append(module.register_forward_pre_hook(Hook(_before_forward(me, []))))
        # When the optimizer is dropped, or at interpreter exit with it alive: its hooks go (the
        # modules may live on, under another optimizer) and gathers still in flight land first,
        # so that gloo lets go of their tensors before the interpreter finalizes
        # (`canzona.runtime.comm.Handoff`; a script that returns right after its last step).
        weakref.finalize(self, _close, self._pending, self._handles, list(self._marked.values()))
        _forget_compiled_forwards()

    @property
    def in_flight(self) -> bool:
        return any(w is not None for w in self._pending[0])

    def launch(self, gathers: Callable[[], list[PendingWork]]) -> None:
        """Start the gathers (after anything still pending has landed)."""
        self.wait_all()
        self._pending[0] = list(gathers())
        pending_params.mark(self._marked.values())

    def wait(self, works: Iterable[int]) -> None:
        # one thread at a time: another thread's read of a parameter whose gather this one is
        # waiting for must wait too, not find the gather taken and read last step's values
        with self._lock:
            self._wait(works)

    def _wait(self, works: Iterable[int]) -> None:
        pending = self._pending[0]
        landed = []
        for k in works:
            work = pending[k] if k < len(pending) else None
            if work is not None:
                pending[k] = None  # first: a wait within this one (same thread) does not wait again
                try:
                    work.wait()
                except Exception as e:
                    # its parameters were not written: every later wait for it is this error
                    # again (a read, a forward, step()), never a read of last step's values
                    pending[k] = _Failed(e)
                    raise
                except BaseException:  # Ctrl-C within the wait: still in flight, the next read waits
                    pending[k] = work
                    raise
                landed.append(k)
        if not self.in_flight:
            self._pending[0] = []
            pending_params.unmark(self._marked.values())
            return
        names = {n for k in landed for n in self._marked_of.get(k, ())}
        pending_params.unmark(self._marked[n] for n in names
                              if all(k >= len(pending) or pending[k] is None for k in self._works_of[n]))

    def wait_all(self) -> None:
        self.wait(range(len(self._pending[0])))

    def check_read(self, name: str) -> None:
        """Called as `name`'s gradient arrives: the forward that produced it used the parameter, so
        its gather must have landed; if no hook waited for it, the forward read last step's values
        (or half-written ones). One error, in backward, before anything is updated."""
        pending = self._pending[0]
        if any(k < len(pending) and pending[k] is not None for k in self._works_of[name]):
            raise CanzonaError(
                f"parameter {name!r} was read before the last step's all-gather of it landed: its values "
                "were read outside the forward of a module holding it (a custom method such as loss(), or "
                "another module's forward reading it first). Run the model through module forwards, call "
                "opt.wait_params() before such reads, or build the optimizer with overlap_param_gather=False")


class _Failed:
    """A gather whose wait raised, in its place among the pending ones: waiting for it raises again."""

    def __init__(self, error: Exception) -> None:
        self.message = str(error) if isinstance(error, CanzonaError) else (
            f"the step's parameter all-gather failed: {type(error).__name__}: {error}")

    def wait(self) -> None:
        raise CanzonaError(self.message)


def _close(pending: list[list[PendingWork | None]], handles: list, marked: list[Tensor]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
    pending_params.unwatch(marked)
    pending_params.unmark(marked)
    works, pending[0] = pending[0], []
    for work in works:
        if work is not None:
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - the group may be gone: nothing reads these weights now
                pass


def _before_forward(me: weakref.ref[ParamsInFlight], works: list[int]) -> Callable[..., None]:
    """A module's forward pre-hook: eagerly, wait for the gathers of its own parameters (`works`);
    traced by torch.compile, wait for every gather, once, at the first hooked module the compiled
    code enters. A graph cannot wait mid-way, so the per-module waits would break it at every
    module (and dynamo then runs a loop of layers eagerly), and the parameters it reads would be
    marked (`pending_params`) where dynamo checks its guards and traces: a recompilation at each
    step, and dynamo's SpeculationLogDivergence tracing a marked parameter's `.dtype` before a
    break. Landed first, the compiled forward sees plain parameters, each step alike."""
    def hook(module: nn.Module, args) -> None:
        gathers = me()
        if gathers is not None and gathers._pending[0]:
            if _compiled():
                _wait_all(gathers)
            elif works:
                _wait(gathers, works)
    return hook


def _compiled() -> bool:
    """Whether torch.compile traces this code or runs it within a compiled region: a hook that
    dynamo traced with nothing in flight is a frame without graph, which it runs eagerly from
    then on, with its callback still set for the frames it calls."""
    if torch.compiler.is_compiling():
        return True
    return torch._C._dynamo.eval_frame.get_eval_frame_callback() not in (None, False)


@torch.compiler.disable(reason=FULLGRAPH)
def _wait(gathers: ParamsInFlight, works: list[int]) -> None:
    """A forward's wait for its modules' gathers: always eager (torch.compile breaks its graph here)."""
    gathers.wait(works)


@torch.compiler.disable(reason=FULLGRAPH)
def _wait_all(gathers: ParamsInFlight) -> None:
    """A compiled forward's wait for every gather: eager, a break before its graph."""
    gathers.wait_all()


class Hook:
    """One of these hooks, as the module holds it. A model pickled (`torch.save(model)`) or deep-copied
    with it holds `_NoHook` in its place: a closure cannot be pickled, and the copy's parameters are
    not the ones this optimizer gathers into."""

    def __init__(self, hook: Callable[..., None]) -> None:
        self._hook = hook

    def __call__(self, *args, **kwargs) -> None:
        return self._hook(*args, **kwargs)

    def __reduce__(self):
        return (_NoHook, ())


class _NoHook:
    """What a pickled or copied model holds in place of a `Hook`."""

    def __call__(self, *args, **kwargs) -> None:
        return None


def _wait_param(me: weakref.ref[ParamsInFlight], works: tuple[int, ...]) -> None:
    """A read of a parameter marked pending (`pending_params`): wait for the gathers writing it."""
    gathers = me()
    if gathers is not None:
        gathers.wait(works)


def _wait_all_hook(me: weakref.ref[ParamsInFlight]) -> Callable[..., None]:
    def hook(*_args, **_kwargs) -> None:
        gathers = me()
        if gathers is not None:
            gathers.wait_all()
    return hook


def _forget_compiled_forwards() -> None:
    """Code that torch.compile traced before these hooks existed (a compiled model's warm-up or
    evaluation forward before the optimizer was built, or a compiled model an earlier optimizer's
    hooks were traced into) does not call them: dynamo installs no guard on a module's hooks
    (`torch._dynamo.config.skip_nnmodule_hook_guards`), and such a forward would read parameters
    whose gather is still in flight. Its caches are cleared here, so that the next compiled
    forward is traced again, with the hooks (a recompilation, once)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:  # nothing was ever compiled in this process
        return
    frames = getattr(getattr(dynamo, "convert_frame", None), "FRAME_COUNTER", 1)
    if frames:
        log.warning("canzona: overlap_param_gather's forward hooks are new to code torch.compile traced "
                    "before them: cleared torch.compile's caches (torch.compiler.reset()), so that the next "
                    "compiled forward waits for the step's parameter gathers (it recompiles once)")
        torch.compiler.reset()
