"""Layout-independent checkpoints of `DistributedOptimizer`: per parameter name, full tensors.

`gather_state` assembles the whole state on every rank (matrix states from the ranks that compute
them, AdamW slices stitched back into full tensors), so a checkpoint taken at one DP size loads at
another. It records which model it belongs to; `load_state` refuses a checkpoint of another model
or optimizer, and one whose tensors do not fit this model, with one line saying what differs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from canzona.errors import PlanError
from canzona.optimizers import check_config

if TYPE_CHECKING:
    from canzona.runtime.optimizer import DistributedOptimizer

STATE_FORMAT = "canzona.optimizer_state"
STATE_VERSION = 2  # 2: records the model (fingerprint and parameter shapes)


def gather_state(opt: DistributedOptimizer) -> dict[str, Any]:
    local_matrix = {n: _to_cpu(_with_master(opt, n, s)) for n, s in opt.matrix_state.items()
                    if s and _first_computer(opt, n)}
    local_adamw = {n: (off, _to_cpu(_with_master(opt, n, opt.adamw_state[n]))) for n, _, _, off in opt._adamw_parts()
                   if n in opt.adamw_state and (not opt.policy.replicated or opt.rank == 0)}
    every = opt.comm.all_gather_object((local_matrix, local_adamw), "optimizer state")
    state: dict[str, dict] = {}
    for matrix, _ in every:
        state.update(matrix)
    for _, adamw in every:
        for name, (offset, part) in adamw.items():
            full = state.setdefault(name, {"step": part["step"]})
            for key in SLICED & set(part):
                if key not in full:
                    full[key] = torch.zeros(opt.params[name].numel(), dtype=part[key].dtype)
                full[key][offset:offset + part[key].numel()] = part[key]
    for name in opt.adamw.names:
        if name in state:
            for key in SLICED & set(state[name]):
                state[name][key] = state[name][key].view(opt.params[name].shape)
    return {**_header(opt), "state": state}


def load_state(opt: DistributedOptimizer, state_dict: Mapping[str, Any]) -> None:
    _check_compatible(opt, state_dict)
    opt.matrix_cfg = check_config(opt.optimizer, replace(opt.matrix_cfg, **_tuples(state_dict["matrix_config"])))
    opt.adamw_cfg = check_config("adamw", replace(opt.adamw_cfg, **_tuples(state_dict["adamw_config"])))
    for group, saved in zip(opt.param_groups, state_dict["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    state = {n: dict(s) for n, s in state_dict["state"].items()}
    masters = {n: s.pop("master") for n, s in state.items() if "master" in s}
    device = next(iter(opt.params.values())).device
    opt.matrix_state = {n: _to_device(state[n], device) if n in state else {} for n in opt._computes}
    opt.adamw_state = {}
    for name, s, e, off in opt._adamw_parts():
        if name in state:
            full = state[name]
            opt.adamw_state[name] = {
                "step": full["step"],
                "exp_avg": full["exp_avg"].reshape(-1)[off:off + e - s].clone().to(device),
                "exp_avg_sq": full["exp_avg_sq"].reshape(-1)[off:off + e - s].clone().to(device),
            }
    if opt.master_weights:
        opt.reset_master_weights()  # from the model's weights, then the saved fp32 masters where kept
        for name, s, e, off in opt._adamw_parts():
            if name in masters:
                opt.master[name] = masters[name].reshape(-1)[off:off + e - s].float().to(device)
        for name in opt._computes:
            if name in masters:
                opt.master[name] = masters[name].float().to(device)


SLICED = {"exp_avg", "exp_avg_sq", "master"}  # AdamW state kept as per-rank slices of the flat buffer


def _with_master(opt: DistributedOptimizer, name: str, state: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer state of `name` plus its fp32 master weights, when it has them."""
    return {**state, "master": opt.master[name]} if name in opt.master else dict(state)


def _check_compatible(opt: DistributedOptimizer, sd: Mapping[str, Any]) -> None:
    """Everything a wrong checkpoint gets wrong, checked before anything is changed."""
    if not isinstance(sd, Mapping) or sd.get("format") != STATE_FORMAT:
        raise PlanError("not a canzona optimizer state (format mismatch)")
    if sd.get("version") != STATE_VERSION:
        raise PlanError(f"optimizer state version {sd.get('version')!r}; this canzona reads version {STATE_VERSION}")
    if sd.get("optimizer") != opt.optimizer:
        raise PlanError(f"checkpoint is for {sd.get('optimizer')}, this optimizer runs {opt.optimizer}")
    model = sd.get("model", {})
    shapes = {n: tuple(s) for n, s in model.get("shapes", {}).items()}
    mine = {n: tuple(p.shape) for n, p in opt.params.items()}
    if model.get("fingerprint") != opt.spec.fingerprint() or shapes != mine:
        raise PlanError(f"checkpoint is of model {model.get('name')!r} ({model.get('fingerprint')}), not "
                        f"{opt.spec.name!r} ({opt.spec.fingerprint()}): {_first_difference(shapes, mine)}")
    unknown = sorted(set(sd["state"]) - set(mine))
    if unknown:
        raise PlanError(f"checkpoint has state for unknown parameter {unknown[0]!r}")
    saved_groups = [(g.get("kind"), g.get("optimizer")) for g in sd["param_groups"]]
    my_groups = [(g["kind"], g["optimizer"]) for g in opt.param_groups]
    if saved_groups != my_groups:
        raise PlanError(f"checkpoint has parameter groups {saved_groups}, this optimizer {my_groups}")


def _first_difference(saved: dict[str, tuple], mine: dict[str, tuple]) -> str:
    for name in sorted(set(saved) | set(mine)):
        if name not in mine:
            return f"this model has no parameter {name!r}"
        if name not in saved:
            return f"the checkpoint has no parameter {name!r}"
        if saved[name] != mine[name]:
            return f"{name} is {list(saved[name])} there, {list(mine[name])} here"
    return "same parameter names and shapes, but other roles or tensor-parallel layout"


def _first_computer(opt: DistributedOptimizer, name: str) -> bool:
    """Replicated matrices are saved by the lowest rank that computes them."""
    if opt.policy.replicated:
        return opt.rank == 0
    dpp = opt.plan.dp_plan
    bucket = dpp.buckets[opt._bucket_of[name]]
    p = next(p for p in bucket.params if p.name == name)
    return opt.rank == min(dpp.computing_ranks(bucket, p))


def _to_cpu(state: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v for k, v in state.items()}


def _to_device(state: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.detach().to(device, copy=True) if isinstance(v, Tensor) else v for k, v in state.items()}


def _tuples(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


# --- torch.distributed.checkpoint: every rank writes only what it owns ----------------------------

DCP_PREFIX = "canzona_optimizer"


def sharded_state(opt: DistributedOptimizer, prefix: str = DCP_PREFIX) -> dict[str, Any]:
    """This rank's part of the state as flat `torch.distributed.checkpoint` entries: the matrices it
    is the first to compute, its AdamW slices (keyed by their element offset in the parameter), and
    the small metadata every rank holds alike. Compose with the model's entries in one `dcp.save`."""
    # JSON text: a leaf for dcp (a dict would be flattened into one entry per field)
    out: dict[str, Any] = {f"{prefix}/meta": json.dumps(_header(opt), default=_json_scalar)}
    for name, state in opt.matrix_state.items():
        if state and _first_computer(opt, name):
            for key, value in _with_master(opt, name, state).items():
                out[f"{prefix}/matrix/{name}/{key}"] = value
    if not opt.policy.replicated or opt.rank == 0:
        for name, _, _, off in opt._adamw_parts():
            if name in opt.adamw_state:
                for key, value in _with_master(opt, name, opt.adamw_state[name]).items():
                    out[f"{prefix}/adamw/{name}/{key}@{off}"] = value
    return out


def _header(opt: DistributedOptimizer) -> dict[str, Any]:
    """Everything but the tensors: what `load_state` checks and restores (identical on every rank)."""
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "model": {"name": opt.spec.name, "fingerprint": opt.spec.fingerprint(),
                  "shapes": {n: list(p.shape) for n, p in opt.params.items()}},
        "optimizer": opt.optimizer,
        "matrix_config": asdict(opt.matrix_cfg),
        "adamw_config": asdict(opt.adamw_cfg),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    }


def load_sharded(opt: DistributedOptimizer, checkpoint_id: Any, prefix: str = DCP_PREFIX) -> None:
    """Read what this rank needs under its own layout from a checkpoint written by `sharded_state`
    at any DP size (whole matrices it computes, the saved AdamW pieces overlapping its slices)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(checkpoint_id) if isinstance(checkpoint_id, str) else checkpoint_id
    entries = reader.read_metadata().state_dict_metadata

    def placeholder(key: str) -> Any:
        m = entries[key]
        if isinstance(m, TensorStorageMetadata):
            return torch.empty(tuple(m.size), dtype=m.properties.dtype)
        return None  # a pickled object: dcp.load replaces the entry

    if f"{prefix}/meta" not in entries:
        raise PlanError(f"no canzona optimizer state under {prefix!r} in this checkpoint")
    matrix_keys = {n: [k for k in entries if k.startswith(f"{prefix}/matrix/{n}/")] for n in opt._computes}
    pieces: dict[str, list[tuple[str, int, str]]] = {}  # name -> (state key, offset, entry key)
    for key in entries:
        if key.startswith(f"{prefix}/adamw/"):
            name, rest = key[len(f"{prefix}/adamw/"):].rsplit("/", 1)
            field_name, offset = rest.rsplit("@", 1)
            pieces.setdefault(name, []).append((field_name, int(offset), key))
    wanted: dict[str, Any] = {f"{prefix}/meta": placeholder(f"{prefix}/meta")}
    for keys in matrix_keys.values():
        wanted.update({k: placeholder(k) for k in keys})
    mine = {name: (off, e - s) for name, s, e, off in opt._adamw_parts()}
    for name, (off, length) in mine.items():
        for _, start, key in pieces.get(name, []):
            size = entries[key].size[0] if isinstance(entries[key], TensorStorageMetadata) else None
            if size is None or (start < off + length and start + size > off):
                wanted[key] = placeholder(key)
    dcp.load(wanted, storage_reader=reader)

    # rebuild the layout-independent form for the slices this rank needs, then load it as usual
    state: dict[str, dict[str, Any]] = {}
    for name, keys in matrix_keys.items():
        if keys:
            state[name] = {k.rsplit("/", 1)[1]: wanted[k] for k in keys}
    for name in mine:
        got = [(f, start, wanted[key]) for f, start, key in pieces.get(name, []) if key in wanted]
        if not got:
            continue
        numel = opt.params[name].numel()
        full: dict[str, Any] = {}
        for field_name, start, value in got:
            if isinstance(value, Tensor):
                full.setdefault(field_name, torch.zeros(numel, dtype=value.dtype))[start:start + value.numel()] = value
            else:
                full[field_name] = value
        state[name] = {k: v.view(opt.params[name].shape) if isinstance(v, Tensor) else v for k, v in full.items()}
    load_state(opt, {**json.loads(wanted[f"{prefix}/meta"]), "state": state})


def _json_scalar(value: Any) -> Any:
    if isinstance(value, Tensor) and value.numel() == 1:  # a scheduler's tensor learning rate
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} in the checkpoint's metadata")
