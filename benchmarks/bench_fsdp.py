"""The optimizer step of a model sharded by torch's FSDP2 (`fully_shard`): canzona's FSDP optimizer
against `muon_fsdp2.Muon` (PyPI `muon_fsdp2`, the Muon that FSDP2 users reach for), side by side in
one run on the SAME model.

On spawned gloo ranks (CPU, one torch thread per rank; 2 and 4 ranks by default), a Qwen3-style
decoder (`reference.tiny_model.TinyQwen3`, untied embedding and head; hidden 384, four layers,
ffn 3 x hidden by default: every matrix's rows divisible by 4, which muon_fsdp2's equal-size
gather / scatter needs) is sharded as torchtitan does (`fully_shard` per decoder layer, then at the
root, a 1-D mesh over every rank, fp32) twice from the same weights, and each copy gets its
optimizer:

- `muon_fsdp2`: `muon_fsdp2.Muon` (0.3.0): per matrix, a `gather` of the row shards to the matrix's
  owner (matrix i of its group: rank i % ranks, up to 8 in flight), Newton-Schulz there, a
  `scatter` of the rows back; Adam on the `use_muon=False` group, elementwise on the DTensors.
  Its Newton-Schulz loop is `@torch.compile(fullgraph=True)`: it runs EAGER here (dynamo disabled in
  every rank before the step; the ranks report how many frames dynamo compiled: must be 0);
- `canzona`: `canzona.runtime.DistributedOptimizer` on the FSDP2 parameters (its FSDP step: the
  matrices' row shards to their owners by variable-size all-to-alls in micro-groups, Newton-Schulz
  there, the update rows back; AdamW on the local shards of the rest), built in ONE place,
  `make_canzona`.

Same math on both sides: Muon with Nesterov momentum 0.95, 5 Newton-Schulz steps with (3.4445,
-4.7750, 2.0315) in bf16, the Moonlight scaling 0.2 sqrt(max(rows, cols)) (canzona's
adjust_lr_fn="match_rms_adamw", muon_fsdp2's rms_scale=True), the same lr, no weight decay; Adam
(betas 0.9 / 0.95, eps 1e-8) on the embedding, the head and the norms. The two partitions are built
independently (canzona's from the spec's roles, muon_fsdp2's by the usual name rule) and printed;
a mismatch is reported in red. The only differences left: Newton-Schulz's normalisation (muon_fsdp2
divides by ||X|| + 1e-7, canzona by max(||X||, 1e-7)), its bf16 operations (muon_fsdp2: mm, mul and
add apart; canzona: addmm) and where the lr and scale are multiplied in. On one matrix (384 x 384,
1152 x 384) the two updates agree to 3e-6 relative with Newton-Schulz in fp32, and to 4-6 % of the
largest element in bf16: bf16 rounding, amplified by the iteration, is all that separates them.

Measured: each round, the two sides in alternating order (A B, B A, ...), so load from other
processes on this shared 2-core machine hits both alike: a forward / backward on the muon_fsdp2 copy
(the round's batch), the round's gradients (those of its first backward, same DTensor layout) put
into the side's `.grad`, then its `step()` alone timed between two barriers (the slowest rank's
time). Every step thus runs straight after a backward: a step run straight after the other side's
measured 20-30 % faster than one after a backward, which favoured whichever side went second. Reported per rank count: the median step of each side and the ratio
canzona / muon_fsdp2 (below 1: canzona is faster), and, after the same steps from the same weights
on the same gradients, the largest absolute difference between the two sides' parameters (reported,
not checked). `--profile`: one more step per side under torch.profiler on rank 0, its top operators, and 3 more
muon_fsdp2 steps with its module functions timed on every rank (where its step goes).
No timing is asserted anywhere: the machine is shared and noisy; only ratios from one run mean much.

Run: python3 benchmarks/bench_fsdp.py [--ranks 2 4] [--rounds 12] [--warmup 2] [--hidden 384]
     [--layers 4] [--head-dim 64] [--vocab 1024] [--lr 0.002] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# muon_fsdp2 compiles its Newton-Schulz loop with torch.compile: this benchmark runs it eager. Set
# before torch is imported (the spawned ranks inherit the environment), and again in every rank.
os.environ["TORCHDYNAMO_DISABLE"] = "1"

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmark this checkout (spawned ranks inherit sys.path)
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from canzona.harness.launch import run_ranks  # noqa: E402
from reference.tiny_model import TinyQwen3Config  # noqa: E402

SEQ_LEN = 32
BATCH_PER_RANK = 4
SIDES = ("muon_fsdp2", "canzona")
BETAS = (0.9, 0.95)  # muon_fsdp2's Adam defaults (canzona's AdamW is torch's: 0.999), set on both
ADAM_EPS = 1e-8  # muon_fsdp2's default is 1e-10; canzona's (torch's) 1e-8


def model_config(hidden: int, layers: int, head_dim: int, vocab: int) -> TinyQwen3Config:
    """A Qwen3-style decoder: hidden / head_dim query heads, 2 KV heads where they divide (else 1),
    ffn 3 x hidden, untied head (a separate lm_head matrix, on Adam)."""
    if hidden % head_dim or head_dim % 4 or hidden % 4 or vocab % 4:
        raise SystemExit(f"hidden ({hidden}), head_dim ({head_dim}) and vocab ({vocab}) must be multiples of 4 "
                         "and head_dim must divide hidden")
    heads = hidden // head_dim
    kv = 2 if heads % 2 == 0 else 1
    return TinyQwen3Config(vocab=vocab, hidden=hidden, layers=layers, q_heads=heads, kv_heads=kv, head_dim=head_dim,
                           ffn=3 * hidden, tied_embeddings=False, max_seq_len=SEQ_LEN,
                           name=f"fsdp-bench-{hidden}x{layers}")


def configs(lr: float) -> tuple[dict, dict]:
    """canzona's matrix (MuonConfig) and AdamW configs, as dicts; muon_fsdp2's groups are built from
    the same values (`muon_groups`)."""
    matrix = {"lr": lr, "weight_decay": 0.0, "momentum": 0.95, "nesterov": True, "ns_steps": 5,
              "ns_coefficients": (3.4445, -4.7750, 2.0315), "eps": 1e-7, "adjust_lr_fn": "match_rms_adamw",
              "ns_dtype": "bf16"}
    adamw = {"lr": lr, "betas": BETAS, "eps": ADAM_EPS, "weight_decay": 0.0}
    return matrix, adamw


def make_canzona(model: torch.nn.Module, spec, cfg: tuple[dict, dict]):
    """canzona's optimizer for the fully_shard model: THE one place it is built. `DistributedOptimizer`
    given FSDP2 DTensor parameters runs the FSDP step (canzona.runtime.fsdp.FsdpOptimizer). (Until it
    took them, this built the prototype FsdpOptimizer of branch wip-fsdp-runtime, a temporary copy.)"""
    from canzona.runtime import DistributedOptimizer

    return DistributedOptimizer(model.named_parameters(), spec, "muon", matrix_config=cfg[0], adamw_config=cfg[1])


def canzona_matrices(spec) -> list[str]:
    """The parameters canzona puts on Muon: the spec's routing rule, by role."""
    return [p.name for p in spec.params if p.uses_matrix_optimizer]


def muon_fsdp2_matrices(model: torch.nn.Module) -> list[str]:
    """The parameters put on muon_fsdp2's `use_muon=True` group, by the rule its users write (2-D, not
    the embedding or the head), independently of canzona's spec."""
    return [n for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n]


def make_muon_fsdp2(model: torch.nn.Module, cfg: tuple[dict, dict]):
    import muon_fsdp2

    matrix, adamw = cfg
    on_muon = set(muon_fsdp2_matrices(model))
    named = list(model.named_parameters())
    return muon_fsdp2.Muon([
        dict(params=[p for n, p in named if n in on_muon], use_muon=True, lr=matrix["lr"],
             momentum=matrix["momentum"], weight_decay=matrix["weight_decay"], nesterov=matrix["nesterov"],
             ns_steps=matrix["ns_steps"], rms_scale=matrix["adjust_lr_fn"] == "match_rms_adamw"),
        dict(params=[p for n, p in named if n not in on_muon], use_muon=False, lr=adamw["lr"],
             betas=adamw["betas"], eps=adamw["eps"], weight_decay=adamw["weight_decay"]),
    ])


def sharded_model(cfg: TinyQwen3Config, mesh):
    from torch.distributed.fsdp import fully_shard

    from reference.tiny_model import TinyQwen3

    model = TinyQwen3(cfg, seed=0)
    spec = model.spec()
    for layer in model.model.layers:  # as torchtitan: each decoder layer, then the root
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, spec


def worker(rank: int, world: int, cfg: TinyQwen3Config, opt_cfg: tuple[dict, dict], rounds: int, warmup: int,
           profile: bool) -> dict:
    import torch._dynamo
    import torch._dynamo.utils
    from torch.distributed.device_mesh import init_device_mesh

    from reference.data import shard_batch, synthetic_batches

    # torch.compile returns the function as is when TORCHDYNAMO_DISABLE=1 at decoration time (the
    # ranks inherit it from main's process); dynamo's config too, for any other compiled frame.
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    torch._dynamo.config.disable = True
    torch._dynamo.utils.counters.clear()
    import importlib

    import muon_fsdp2

    # Imported before with dynamo on, nsloop_torch would be a wrapper that refuses to run
    # (fullgraph=True with dynamo off): import it afresh.
    if hasattr(muon_fsdp2.nsloop_torch, "_torchdynamo_orig_callable"):
        importlib.reload(muon_fsdp2)
    eager = not hasattr(muon_fsdp2.nsloop_torch, "_torchdynamo_orig_callable")
    mesh = init_device_mesh("cpu", (world,))
    models, opts = {}, {}
    models["muon_fsdp2"], spec = sharded_model(cfg, mesh)
    models["canzona"], _ = sharded_model(cfg, mesh)
    opts["muon_fsdp2"] = make_muon_fsdp2(models["muon_fsdp2"], opt_cfg)
    opts["canzona"] = make_canzona(models["canzona"], spec, opt_cfg)
    init = {n: p.to_local().clone() for n, p in models["canzona"].named_parameters()}
    src, dst = models["muon_fsdp2"], dict(models["canzona"].named_parameters())
    times: dict[str, list[float]] = {s: [] for s in SIDES}
    losses = []
    batches = synthetic_batches(cfg.vocab, BATCH_PER_RANK * world, SEQ_LEN, warmup + rounds, seed=1)
    for i, tokens in enumerate(batches):
        batch = shard_batch(tokens, rank, world)
        grads = None
        for s in (SIDES if i % 2 == 0 else SIDES[::-1]):
            # every step right after a forward / backward (a step run second, straight after the
            # first, measured 20-30 % faster here), then the round's gradients, the first backward's
            for o in opts.values():
                o.zero_grad()
            loss = src.loss(batch)
            loss.backward()
            if grads is None:
                grads = {n: p.grad.detach().clone() for n, p in src.named_parameters()}
                losses.append(float(loss.detach()))
            for n, p in models[s].named_parameters():  # a copy: muon_fsdp2 writes into its .grad
                p.grad = grads[n].clone()
            dist.barrier()
            t0 = time.perf_counter()
            opts[s].step()
            dist.barrier()
            if i >= warmup:
                times[s].append(time.perf_counter() - t0)
    a = dict(models["muon_fsdp2"].named_parameters())
    diff = max(largest(a[n].to_local() - p.to_local()) for n, p in dst.items())
    moved = min(largest(p.to_local() - init[n]) for n, p in dst.items() if p.to_local().numel())
    top, phases = {}, {}
    if profile:
        top = profiled(rank, opts, src, dst, shard_batch(tokens, rank, world))
        phases = muon_fsdp2_phases(opts["muon_fsdp2"], src, shard_batch(tokens, rank, world))
    compiled = sum(torch._dynamo.utils.counters["frames"].values()) + sum(
        torch._dynamo.utils.counters["stats"].values())
    return {"times": times, "diff": diff, "moved": moved, "loss": losses, "compiled": compiled,
            "dynamo_disabled": bool(torch._dynamo.config.disable) and eager,
            "matrices": {"muon_fsdp2": muon_fsdp2_matrices(src), "canzona": canzona_matrices(spec)}, "top": top,
            "phases": phases,
            "canzona_class": f"{type(opts['canzona']).__module__}.{type(opts['canzona']).__name__}"}


def largest(t: torch.Tensor) -> float:
    return float(t.detach().abs().max()) if t.numel() else 0.0


def profiled(rank: int, opts: dict, src, dst: dict, batch: torch.Tensor) -> dict[str, list[tuple[str, float, int]]]:
    """One more step per side under torch.profiler: rank 0's operators by self CPU time (ms, calls)."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for s in SIDES:
        for o in opts.values():
            o.zero_grad()
        src.loss(batch).backward()
        for n, p in src.named_parameters():
            dst[n].grad = p.grad.detach().clone()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opts[s].step()
            dist.barrier()
        if rank == 0:
            events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            out[s] = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in events[:10]]
    return out


MUON_FSDP2_PHASES = ("momentum", "gather issue", "gather wait", "newton-schulz", "scatter", "scaling", "adam")


def muon_fsdp2_phases(opt, model, batch: torch.Tensor, steps: int = 3) -> dict[str, float]:
    """Where muon_fsdp2's step goes on this rank (ms per step, mean of `steps` more steps): its module
    functions timed by shadowing them (they are looked up as globals at each call); `other`: the rest
    of the step (the DTensor parameter updates, zeros, the Python around them)."""
    import muon_fsdp2 as m

    spent = dict.fromkeys((*MUON_FSDP2_PHASES, "step"), 0.0)

    def timed(fn, phase):
        def inner(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - t0
        return inner

    class Handle:  # times the wait of an async gather
        def __init__(self, h):
            self.h = h

        def wait(self):
            t0 = time.perf_counter()
            self.h.wait()
            spent["gather wait"] += time.perf_counter() - t0

    names = ("apply_momentum", "gather", "zeropower_via_newtonschulz5", "scatter", "apply_scaling", "adam_update")
    saved = {n: getattr(m, n) for n in names}
    gather = timed(saved["gather"], "gather issue")
    try:
        m.apply_momentum = timed(saved["apply_momentum"], "momentum")
        m.gather = lambda *a, **k: Handle(gather(*a, **k))
        m.zeropower_via_newtonschulz5 = timed(saved["zeropower_via_newtonschulz5"], "newton-schulz")
        m.scatter = timed(saved["scatter"], "scatter")
        m.apply_scaling = timed(saved["apply_scaling"], "scaling")
        m.adam_update = timed(saved["adam_update"], "adam")
        for _ in range(steps):
            opt.zero_grad()
            model.loss(batch).backward()
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            spent["step"] += time.perf_counter() - t0
    finally:
        for n, f in saved.items():
            setattr(m, n, f)
    out = {k: v / steps * 1e3 for k, v in spent.items()}
    out["other"] = out["step"] - sum(out[k] for k in MUON_FSDP2_PHASES)
    return out


def ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def run(world: int, cfg: TinyQwen3Config, opt_cfg: tuple[dict, dict], rounds: int, warmup: int,
        profile: bool) -> dict:
    per_rank = run_ranks(worker, world, cfg, opt_cfg, rounds, warmup, profile, deadline_s=1800)
    slowest = {s: [max(r["times"][s][i] for r in per_rank) for i in range(rounds)] for s in SIDES}
    return {"world": world, "step": {s: ms(slowest[s]) for s in SIDES},
            "spread": {s: (min(slowest[s]) * 1e3, max(slowest[s]) * 1e3) for s in SIDES},
            "ratios": [c / m for c, m in zip(slowest["canzona"], slowest["muon_fsdp2"])],
            "diff": max(r["diff"] for r in per_rank), "moved": min(r["moved"] for r in per_rank),
            "compiled": sum(r["compiled"] for r in per_rank),
            "disabled": all(r["dynamo_disabled"] for r in per_rank),
            "matrices": per_rank[0]["matrices"], "top": per_rank[0]["top"], "loss": per_rank[0]["loss"],
            "phases": [r["phases"] for r in per_rank], "canzona_class": per_rank[0]["canzona_class"]}


def partition_report(console: Console, matrices: dict[str, list[str]]) -> bool:
    a, b = matrices["muon_fsdp2"], matrices["canzona"]
    console.print(f"on Muon, muon_fsdp2 ({len(a)}): {', '.join(a)}")
    console.print(f"on Muon, canzona    ({len(b)}): {', '.join(b)}")
    same = set(a) == set(b)
    console.print("the two sides put the same parameters on Muon (the rest on Adam)" if same else
                  f"[bold red]the partitions differ[/]: muon_fsdp2 only {sorted(set(a) - set(b))}, "
                  f"canzona only {sorted(set(b) - set(a))}")
    return same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes, one spawned run each")
    ap.add_argument("--rounds", type=int, default=12, help="measured rounds (one step per side each)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3, help="Muon's and Adam's (Moonlight scaling: one lr)")
    ap.add_argument("--profile", action="store_true", help="top operators of one more step per side (rank 0)")
    args = ap.parse_args()
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")
    cfg = model_config(args.hidden, args.layers, args.head_dim, args.vocab)
    opt_cfg = configs(args.lr)
    console = Console(width=160)
    import muon_fsdp2

    console.print(f"FSDP2 optimizer step: canzona vs muon_fsdp2 {muon_fsdp2.__version__} (eager), gloo ranks "
                  f"{args.ranks} x 1 thread, {cfg.name} (vocab {cfg.vocab}, {cfg.q_heads}/{cfg.kv_heads} heads of "
                  f"{cfg.head_dim}, ffn {cfg.ffn}), {args.rounds} interleaved rounds after {args.warmup} ...")
    load = os.getloadavg()
    t0 = time.perf_counter()
    results = [run(w, cfg, opt_cfg, args.rounds, args.warmup, args.profile) for w in args.ranks]
    wall = time.perf_counter() - t0
    console.print(f"canzona's optimizer: {results[0]['canzona_class']} (make_canzona)")
    partition_report(console, results[0]["matrices"])
    t = Table(title=f"optimizer.step() alone, median of {args.rounds} rounds, slowest rank per round")
    for col in ("ranks", "muon_fsdp2 ms", "canzona ms", "canzona / muon_fsdp2", "paired ratio: median (min-max)",
                "max |p_a - p_b|", "moved from init", "dynamo frames"):
        t.add_column(col, justify="right")
    for r in results:
        step = r["step"]
        t.add_row(str(r["world"]), f"{step['muon_fsdp2']:.1f}", f"{step['canzona']:.1f}",
                  f"{step['canzona'] / step['muon_fsdp2']:.2f}",
                  f"{statistics.median(r['ratios']):.2f} ({min(r['ratios']):.2f}-{max(r['ratios']):.2f})", f"{r['diff']:.2e}", f"{r['moved']:.2e}",
                  str(r["compiled"]) if r["disabled"] else "[red]dynamo on[/]")
    t.caption = ("paired ratio: canzona's step over muon_fsdp2's in the same round (adjacent steps: less exposed to "
                 f"load that comes and goes); after {args.warmup + args.rounds} steps of each side from the same weights on the same gradients: "
                 "max |p_a - p_b| over every parameter element (not checked; bf16 Newton-Schulz); moved from "
                 "init: the smallest max change of a parameter. dynamo frames: frames torch.compile handled in the "
                 "ranks (0, with dynamo disabled and muon_fsdp2's nsloop_torch the plain function: it ran eager).")
    console.print(t)
    for r in results:
        step = r["step"]
        console.print(f"{r['world']} ranks: canzona / muon_fsdp2 = {step['canzona'] / step['muon_fsdp2']:.2f} "
                      f"(median step {step['canzona']:.1f} / {step['muon_fsdp2']:.1f} ms, max |p_a - p_b| "
                      f"{r['diff']:.2e})")
    for r in results:
        if r["compiled"] or not r["disabled"]:
            console.print(f"[bold red]{r['world']} ranks: torch.compile was used[/]")
        for side, rows in r["top"].items():
            p = Table(title=f"{r['world']} ranks, {side}: one step under torch.profiler, rank 0, top operators")
            for col in ("operator", "self CPU ms", "calls"):
                p.add_column(col, justify="left" if col == "operator" else "right")
            for key, self_ms, calls in rows:
                p.add_row(key, f"{self_ms:.1f}", str(calls))
            console.print(p)
        if r["phases"] and r["phases"][0]:
            cols = (*MUON_FSDP2_PHASES, "other", "step")
            p = Table(title=f"{r['world']} ranks: where muon_fsdp2's step goes, ms per step (3 more steps), per rank")
            p.add_column("rank", justify="right")
            for col in cols:
                p.add_column(col, justify="right")
            for k, ph in enumerate(r["phases"]):
                p.add_row(str(k), *(f"{ph[c]:.1f}" for c in cols))
            p.caption = ("gather issue / wait: the async gather of a matrix's row shards to its owner; scatter: "
                         "synchronous, includes waiting for the owner's Newton-Schulz; momentum, scaling, adam: "
                         "elementwise on DTensors; other: the DTensor parameter updates and the rest")
            console.print(p)
    console.print(f"wall {wall:.1f} s, torch {torch.__version__}, load average before / after "
                  f"{load[0]:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
