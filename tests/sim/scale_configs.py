"""The configurations whose `simulate(...).to_dict()` (and a digest of the spans) were recorded
before the simulator learned to simulate one representative rank per class of identical ranks
(docs/design.md §9.8): `tests/sim/test_sim_scale.py` checks them bit for bit.

Regenerate (only when a result is meant to change): PYTHONPATH=. python tests/sim/scale_configs.py
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from sim.options import RunOptions
from sim.simulate import SimConfig, SimResult, simulate
from sim.workload import Workload

DATA = Path(__file__).with_name("data") / "scale_golden.json"

WL = Workload(seq_len=1024, global_batch=128)
CONFIGS: dict[str, SimConfig] = {
    "8-tp2-one-node": SimConfig(model="qwen3-1.7b", gpus=8, tp=2, workload=Workload(seq_len=512, global_batch=16)),
    "8-tp1-one-node-overlap": SimConfig(model="qwen3-0.6b", gpus=8, tp=1, workload=Workload(seq_len=512, global_batch=16),
                                        options=RunOptions(overlap_step=True, overlap_param_gather=False)),
    "64-tp8": SimConfig(model="qwen3-32b", gpus=64, tp=8, workload=WL),
    "256-tp8": SimConfig(model="qwen3-32b", gpus=256, tp=8, workload=WL),
    "1024-tp8": SimConfig(model="qwen3-32b", gpus=1024, tp=8, workload=Workload(seq_len=1024, global_batch=256)),
    "64-tp1": SimConfig(model="qwen3-8b", gpus=64, tp=1, workload=WL),
    "256-tp1": SimConfig(model="qwen3-1.7b", gpus=256, tp=1, workload=Workload(seq_len=512, global_batch=256)),
    "256-tp8-pp2": SimConfig(model="qwen3-32b", gpus=256, tp=8, pp=2, workload=WL),
    "128-tp4-pp2-vp2": SimConfig(model="qwen3-8b", gpus=128, tp=4, pp=2, vp=2, workload=WL),
    "256-sc": SimConfig(model="qwen3-32b", gpus=256, tp=8, policy="sc", workload=WL),
    "256-zero1-gather": SimConfig(model="qwen3-32b", gpus=256, tp=8, policy="zero1-gather", workload=WL),
    "256-layerwise": SimConfig(model="qwen3-32b", gpus=256, tp=8, policy="layerwise", workload=WL),
    "256-adamw": SimConfig(model="qwen3-32b", gpus=256, tp=8, optimizer="adamw", workload=WL),
    "256-soap-tp2": SimConfig(model="qwen3-8b", gpus=256, tp=2, optimizer="soap", workload=Workload(1024, 256)),
    "256-overlap-step": SimConfig(model="qwen3-32b", gpus=256, tp=8, workload=WL,
                                  options=RunOptions(overlap_step=True)),
    "256-gather-in-step": SimConfig(model="qwen3-32b", gpus=256, tp=8, workload=WL,
                                    options=RunOptions(overlap_param_gather=False)),
    "256-runtime": SimConfig(model="qwen3-32b", gpus=256, tp=8, workload=WL,
                             options=RunOptions(collectives="runtime")),
    "128-tp1-runtime-overlap": SimConfig(model="qwen3-4b", gpus=128, tp=1, workload=WL,
                                         options=RunOptions(collectives="runtime", overlap_step=True)),
    "256-unbatched-serial": SimConfig(model="qwen3-32b", gpus=256, tp=8, workload=WL, tp_mode="serial",
                                      options=RunOptions(batch_kernels=False)),
    "moe-64-ep8": SimConfig(model="qwen3-30b-a3b", gpus=64, tp=1, ep=8, workload=WL),
    "moe-256-tp4-ep8": SimConfig(model="qwen3-30b-a3b", gpus=256, tp=4, ep=8, workload=WL),
    "moe-128-tp4-ep4-etp2": SimConfig(model="qwen3-30b-a3b", gpus=128, tp=4, ep=4, etp=2, workload=WL),
    "moe-64-ep8-runtime": SimConfig(model="qwen3-30b-a3b", gpus=64, tp=2, ep=8, workload=WL,
                                    options=RunOptions(collectives="runtime")),
    "fsdp-64": SimConfig(model="qwen3-8b", gpus=64, tp=1, fsdp=True, workload=WL),
    "fsdp-256-hsdp": SimConfig(model="qwen3-8b", gpus=256, tp=8, fsdp=True, hsdp_replicate=4, workload=WL),
}


def spans_digest(result: SimResult) -> str:
    """The spans as a set (their order in the engine's list is not a result): sha256 of the sorted reprs."""
    rows = sorted(repr((s.rank, s.stream, s.name, s.kind, float(s.start).hex(), float(s.end).hex(), s.phase))
                  for s in result.spans)
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


def record(result: SimResult) -> dict:
    return {"result": json.loads(json.dumps(result.to_dict())), "spans": spans_digest(result),
            "records": hashlib.sha256(repr(result.collective_records).encode()).hexdigest()}


if __name__ == "__main__":
    import time
    out = {}
    for name, cfg in CONFIGS.items():
        t0 = time.perf_counter()
        out[name] = record(simulate(cfg))
        print(f"{name}: {time.perf_counter() - t0:.2f} s", flush=True)
    DATA.write_text("{\n" + ",\n".join(json.dumps({k: out[k]}, sort_keys=True, separators=(",", ":"))[1:-1]
                                       for k in sorted(out)) + "\n}\n")
