"""The tiny model under tensor parallelism (reference/tiny_model_tp.py), both ways users build it:
Megatron-style layers (`TinyQwen3TP`) and DTensors from `parallelize_module` (`parallelize_tiny`).
Their forward pass and gradients equal the single-device model's (fp64: to round-off of the sums
over TP), and `ModelSpec.from_module` reads their sharding (Megatron annotations, DTensor
placements) back into the catalog's spec."""

from __future__ import annotations

import functools

import pytest
import torch

from canzona.errors import SpecError
from canzona.harness.launch import run_ranks

pytestmark = pytest.mark.distributed  # spawns gloo process groups

TOL = 1e-12  # fp64


def _full_grad(p, tp_dim, group) -> torch.Tensor:
    """The whole gradient of a (plain or DTensor) parameter, from every TP rank's part."""
    import torch.distributed as dist

    from canzona.runtime.shards import is_dtensor

    g = p.grad
    if is_dtensor(g):
        return g.full_tensor()
    if tp_dim is None:
        return g
    size = dist.get_world_size(group)
    every = torch.empty(size * g.numel(), dtype=g.dtype)
    dist.all_gather_into_tensor(every, g.contiguous().reshape(-1), group=group)
    return torch.cat(list(every.view(size, *g.shape).unbind(0)), dim=tp_dim)


def compare_job(rank: int, world: int, preset: str, styles: tuple[str, ...]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.spec import ModelSpec
    from reference.data import fixed_batch
    from reference.tiny_model import TinyQwen3
    from reference.tiny_model_tp import TinyQwen3TP, parallelize_tiny

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    single = TinyQwen3(preset, seed=0, dtype="fp64")
    tokens = fixed_batch(single.cfg.vocab, 3, 12, seed=5)
    loss = single.loss(tokens)
    loss.backward()
    want = dict(single.named_parameters())
    catalog = single.spec()
    out = {}
    for style in styles:
        if style == "megatron":
            model = TinyQwen3TP(preset, mesh.get_group(), seed=0, dtype="fp64")
            spec = ModelSpec.from_module(model, tp_size=world, name=catalog.name)
        else:
            model = parallelize_tiny(TinyQwen3(preset, seed=0, dtype="fp64"), mesh)
            spec = ModelSpec.from_module(model, name=catalog.name)
        logits = model(tokens[:, :-1])
        tp_loss = model.loss(tokens)
        tp_loss.backward()
        grads = {n: (_full_grad(p, spec.param(n).tp_dim, mesh.get_group()) - want[n].grad).abs().max().item()
                 / want[n].grad.abs().max().item() for n, p in model.named_parameters()}
        out[style] = {
            "logits": (logits - single(tokens[:, :-1])).abs().max().item(),
            "loss": abs(tp_loss.item() - loss.item()),
            "grads": grads,
            "names": [n for n, _ in model.named_parameters()],
            "fingerprint": spec.fingerprint(),
            "catalog": catalog.fingerprint(),
            "difference": spec.describe_difference(catalog),
            "annotated": sorted(n for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)),
        }
    return out


@functools.cache
def compared(preset: str, world: int, styles: tuple[str, ...]) -> list[dict]:
    return run_ranks(compare_job, world, preset, styles, deadline_s=120)


CASES = [("tiny", 2, ("megatron",)), ("tiny-untied", 2, ("megatron", "dtensor")), ("small", 4, ("megatron", "dtensor"))]


@pytest.mark.parametrize("preset, world, styles", CASES, ids=[f"{p}-tp{w}" for p, w, _ in CASES])
def test_tp_model_equals_the_single_device_model(preset, world, styles):
    from reference.tiny_model import TinyQwen3

    names = [n for n, _ in TinyQwen3(preset).named_parameters()]
    for rank, out in enumerate(compared(preset, world, styles)):
        for style in styles:
            got = out[style]
            assert got["names"] == names, (rank, style)  # the single-device model's names and order
            assert got["logits"] <= TOL and got["loss"] <= TOL, (rank, style)
            worst = max(got["grads"], key=got["grads"].get)
            assert got["grads"][worst] <= TOL, (rank, style, worst, got["grads"][worst])


@pytest.mark.parametrize("preset, world, styles", CASES, ids=[f"{p}-tp{w}" for p, w, _ in CASES])
def test_from_module_reads_the_sharding_back(preset, world, styles):
    from reference.tiny_model import get_preset, model_spec

    sharded = {p.name for p in model_spec(get_preset(preset)).params if p.tp_dim is not None}
    for out in compared(preset, world, styles):
        for style in styles:
            got = out[style]
            # Megatron's annotations / DTensor placements give the catalog's TP dims and global shapes
            assert got["fingerprint"] == got["catalog"], (style, got["difference"])
        assert set(out["megatron"]["annotated"]) == sharded


def from_module_errors_job(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.spec import ModelSpec
    from reference.tiny_model import TinyQwen3
    from reference.tiny_model_tp import TinyQwen3TP, parallelize_tiny

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    megatron = TinyQwen3TP("tiny", mesh.get_group())
    dtensor = parallelize_tiny(TinyQwen3("tiny-untied"), mesh)
    for label, fn in {
        "plan contradicts annotation": lambda: ModelSpec.from_module(
            megatron, tp_plan={"*.q_proj.weight": 1}, tp_size=world),
        "plan contradicts placement": lambda: ModelSpec.from_module(dtensor, tp_plan={"*.o_proj.weight": 0}),
        "tp_size contradicts the mesh": lambda: ModelSpec.from_module(dtensor, tp_size=world * 2),
    }.items():
        try:
            fn()
            out[label] = ""
        except SpecError as e:
            out[label] = str(e)
    return out


def test_from_module_refuses_contradictions():
    out = run_ranks(from_module_errors_job, 2, deadline_s=120)[0]
    assert "splits 'model.layers.0.self_attn.q_proj.weight' along dimension 1, but the parameter itself says " \
           "dimension 0" in out["plan contradicts annotation"]
    assert "o_proj.weight' along dimension 0, but the parameter itself says dimension 1" in out["plan contradicts placement"]
    assert "tp_size=4, but the model's DTensors are split over 2 ranks" in out["tp_size contradicts the mesh"]
