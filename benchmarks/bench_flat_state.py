"""Size and time of torch's nested and flattened optimizer state dicts (docs/design.md §8.4):
canzona's optimizer (ZeRO-1, or FSDP2 with `--fsdp`) against torch's AdamW built from
`model.parameters()`, as torchtitan builds it, in one process (a one-rank gloo group).

The models have tiny widths (8) but realistic parameter counts: `llama80` (80 Llama-like blocks of
nine parameters: 723), `qwen3moe48` (48 Qwen3-MoE-like blocks with stacked experts: 531),
`llama444` (3999). For each form (`get_optimizer_state_dict`, nested or
`flatten_optimizer_state_dict=True`, torchtitan's default) after one step: the bytes of the group
entries (each flattened `param_groups.<name>.<key>` value, or each nested group, pickled on its
own, as dcp writes each), `dcp.save`'s `.metadata` and total file bytes, and the seconds of
`get_optimizer_state_dict`, `dcp.save`, and `dcp.load` + `set_optimizer_state_dict`.

    python3 benchmarks/bench_flat_state.py [--fsdp] [llama80 qwen3moe48 llama444]
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

WIDTH = 8


def _linears(module: nn.Module, names: tuple[str, ...]) -> None:
    for name in names:
        setattr(module, name, nn.Linear(WIDTH, WIDTH, bias=False))


class Llama(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, WIDTH)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            block = nn.Module()
            block.attention_norm, block.ffn_norm = nn.RMSNorm(WIDTH), nn.RMSNorm(WIDTH)
            _linears(block, ("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
            self.layers.append(block)
        self.norm, self.output = nn.RMSNorm(WIDTH), nn.Linear(WIDTH, 32, bias=False)


class Experts(nn.Module):
    """Stacked experts (transformers' Qwen3-MoE layout): `[experts, 2 x ffn, hidden]` and `[experts, hidden, ffn]`."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * WIDTH, WIDTH) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(experts, WIDTH, WIDTH) * 0.1)


class Qwen3Moe(nn.Module):
    def __init__(self, layers: int, experts: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, WIDTH)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            block = nn.Module()
            block.input_layernorm, block.post_attention_layernorm = nn.RMSNorm(WIDTH), nn.RMSNorm(WIDTH)
            block.q_norm, block.k_norm = nn.RMSNorm(WIDTH), nn.RMSNorm(WIDTH)
            _linears(block, ("q_proj", "k_proj", "v_proj", "o_proj"))
            block.mlp = nn.Module()
            block.mlp.gate, block.mlp.experts = nn.Linear(WIDTH, experts, bias=False), Experts(experts)
            self.layers.append(block)
        self.norm, self.lm_head = nn.RMSNorm(WIDTH), nn.Linear(WIDTH, 32, bias=False)


MODELS = {"llama80": lambda: Llama(80), "qwen3moe48": lambda: Qwen3Moe(48), "llama444": lambda: Llama(444)}


def _optimizer(model: nn.Module, kind: str, fsdp: bool) -> torch.optim.Optimizer:
    if kind == "torch":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    spec = ModelSpec.from_module(model)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return DistributedOptimizer(model.named_parameters(), spec)
    from canzona.runtime.modules import named_parameters

    return DistributedOptimizer(list(named_parameters(model)), spec)


def _group_bytes(sd: dict, flat: bool) -> int:
    if flat:
        return sum(len(pickle.dumps((k, v))) for k, v in sd.items() if k.startswith("param_groups."))
    return sum(len(pickle.dumps(g)) for g in sd["param_groups"])


def measure(name: str, kind: str, fsdp: bool, folder: str) -> dict[str, dict]:
    model = MODELS[name]()
    opt = _optimizer(model, kind, fsdp)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad()
    rows = {"params": sum(1 for _ in model.parameters())}
    for form, flat in (("nested", False), ("flat", True)):
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        start = time.perf_counter()
        sd = get_optimizer_state_dict(model, opt, options=options)
        got = time.perf_counter() - start
        path = tempfile.mkdtemp(dir=folder)
        start = time.perf_counter()
        dcp.save({"optim": sd}, checkpoint_id=path)
        saved = time.perf_counter() - start
        files = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        template = {"optim": get_optimizer_state_dict(model, opt, options=options)}
        start = time.perf_counter()
        dcp.load(template, checkpoint_id=path)
        set_optimizer_state_dict(model, opt, template["optim"], options=options)
        loaded = time.perf_counter() - start
        rows[form] = {"groups": _group_bytes(sd, flat), "metadata": os.path.getsize(os.path.join(path, ".metadata")),
                      "files": files, "get": got, "save": saved, "load": loaded}
        shutil.rmtree(path)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["llama80", "qwen3moe48"], choices=list(MODELS))
    parser.add_argument("--fsdp", action="store_true", help="canzona's optimizer under FSDP2 (fully_shard per block)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    canzona = "canzona (FSDP2)" if args.fsdp else "canzona (ZeRO-1)"
    print("| model | params | optimizer | form | group entries B | .metadata B | files B | get s | save s | load s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            for kind, label in (("torch", "torch AdamW"), ("canzona", canzona)):
                rows = measure(name, kind, args.fsdp, folder)
                for form in ("nested", "flat"):
                    r = rows[form]
                    print(f"| {name} | {rows['params']} | {label} | {form} | {r['groups']} | {r['metadata']} | "
                          f"{r['files']} | {r['get']:.2f} | {r['save']:.2f} | {r['load']:.2f} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
