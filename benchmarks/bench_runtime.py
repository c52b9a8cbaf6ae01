"""Training-iteration time of the DP runtime against torch's own DDP and ZeRO, side by side in one run
(docs/design.md §10).

On spawned gloo ranks (CPU, one torch thread per rank; DP 2 on a 2-core machine), a Qwen3-style
decoder scaled up from the tiny preset so its matrices have a few hundred rows (hidden 384, four
layers, ffn 1024: 28 matrices from 128 x 384 to 1024 x 384) is trained by these contenders, each
with its own copy of the model, all starting from the same weights and fed the same batches:

- `sc`, `zero1-gather`, `canzona`: `DistributedOptimizer` under that policy (`layerwise` with
  `--policies`); reduce-scatters start from gradient hooks during backward;
- `ddp-muon`: `DistributedDataParallel` (all-reduce overlapped with backward) + `torch.optim.Muon`
  on the matrices and `torch.optim.AdamW` on the rest, every rank updating everything;
- `zero-muon`: the same DDP + `ZeroRedundancyOptimizer(torch.optim.Muon)` on the matrices and a
  second `ZeroRedundancyOptimizer(torch.optim.AdamW)` on the rest (ZeRO-1 as torch users run it:
  each rank updates whole parameters it owns, then broadcasts them).

The torch optimizers get canzona's `MuonConfig` / `AdamWConfig` values (lr, momentum, nesterov,
weight decay, NS coefficients and steps, eps, adjust_lr_fn; NS in bf16 on both sides), and the
parameters are split by the project's routing rule (`ModelSpec.matrix_params()`).

Rounds are interleaved: in each round every contender runs one iteration (in an order rotated each
round) after a barrier, so load from other processes hits all of them alike. An iteration is
`zero_grad` + forward + backward + `step()`; a contender's time for it is the slowest rank's.
Reported: medians over the measured rounds after warm-up, canzona / contender ratios (below 1:
canzona is faster), where each step's time goes, canzona's parameter all-gather alone against two
alternatives, and how far each contender's final parameters are from canzona's after the same
steps on the same data (same math per matrix: like for like).
The bars (issue 18): canzona's iteration and optimizer step at most 0.8x ZeRO(Muon)'s and 0.7x
DDP+Muon's, on either shape (`--model bench-384`, the default, or `bench-768`), at DP 2 and DP 4.

A policy named with `+overlap` (`canzona+overlap`) runs it with `overlap_step=True` (each bucket's
updates computed while the later buckets reduce; give `--bucket-size` so there is more than one).

Run: python3 benchmarks/bench_runtime.py [--quick] [--rounds 20] [--warmup 3]
     [--optimizers muon,soap] [--policies sc,zero1-gather,canzona,layerwise,canzona+overlap] [--bucket-size N]
(about a minute with the defaults on an otherwise idle 2-core machine with native bf16 matrix
multiplies, up to two and a half under load from other processes; --quick: about 40 s. On a CPU
without them, bf16 Newton-Schulz dominates every contender alike: on an AVX2-only EPYC, bf16
matmul ran at 2.3 GFLOP/s against 70 for fp32, and --quick took 5 minutes, each contender's step
13-27 s of the same math, so the ratios show only how the work is split.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmark this checkout (spawned ranks inherit sys.path)
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from canzona.harness.launch import run_ranks  # noqa: E402
from canzona.optimizers import AdamWConfig, MuonConfig  # noqa: E402
from reference.tiny_model import TinyQwen3, TinyQwen3Config  # noqa: E402

# Two shapes (issue 18's bars ask for both): many small matrices, and fewer, wider ones.
MODELS = {
    "bench-384": TinyQwen3Config(vocab=1024, hidden=384, layers=4, q_heads=6, kv_heads=2, head_dim=64, ffn=1024,
                                 tied_embeddings=True, max_seq_len=64, name="bench-384"),
    "bench-768": TinyQwen3Config(vocab=1024, hidden=768, layers=2, q_heads=12, kv_heads=4, head_dim=64, ffn=2048,
                                 tied_embeddings=True, max_seq_len=64, name="bench-768"),
}
MODEL = MODELS["bench-384"]  # the default shape (bench_tp.py runs it too)
# canzona's time over each torch contender's, at most (issue 18): iteration and optimizer step
BARS = {"zero-muon": 0.8, "ddp-muon": 0.7}
SEQ_LEN = 32
BATCH_PER_RANK = 4
POLICIES = ("sc", "zero1-gather", "canzona")
TORCH_CONTENDERS = ("ddp-muon", "zero-muon")  # torch has Muon, not SOAP or Shampoo
MUON = MuonConfig()
ADAMW = AdamWConfig()
# Canzona and torch run the same float32 / bf16 operations per matrix; only the gradient averaging
# differs: DDP sums g_r / world in gloo's order, canzona sums in rank order and divides. At DP 2 both
# give the same bits (halving is exact, a sum of two commutes); beyond that the order can flip a
# bf16 rounding inside Newton-Schulz (2^-8 of one update element, about lr * 4e-3 absolute per step).
REL_TOLERANCE = 1e-5  # max over parameters of ||p - p_canzona||_F / ||p_canzona||_F
PHASES = ("grad sync", "param sync")


@dataclass
class Contender:
    """One model copy and what trains it; times are this rank's, per measured round."""

    optimizer: str
    name: str
    how: str
    model: TinyQwen3
    loss: Callable[[Tensor], Tensor]
    optimizers: list[torch.optim.Optimizer]
    matrices_here: int
    times: dict[str, list[float]] = field(default_factory=dict)
    phase_now: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    last_loss: float = float("nan")

    def clock(self, obj: object, method: str, phase: str) -> None:
        """Shadow a bound method of `obj` by one that adds its wall time to `phase`: the step's
        collectives happen inside `step()`, so this is how they are told apart from the math."""
        inner = getattr(obj, method)

        def timed(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.phase_now[phase] += time.perf_counter() - t0

        setattr(obj, method, timed)


class _LossModule(nn.Module):
    """DDP synchronises gradients only for what runs through its own forward, so the model's loss
    has to be that forward."""

    def __init__(self, model: TinyQwen3) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model.loss(tokens)


def torch_muon_kwargs(cfg: MuonConfig) -> dict:
    if cfg.ns_dtype != "bf16":  # torch.optim.Muon always runs Newton-Schulz in bf16
        raise ValueError(f"torch.optim.Muon cannot match ns_dtype {cfg.ns_dtype!r}")
    return {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "momentum": cfg.momentum,
            "nesterov": cfg.nesterov, "ns_coefficients": cfg.ns_coefficients, "eps": cfg.eps,
            "ns_steps": cfg.ns_steps, "adjust_lr_fn": cfg.adjust_lr_fn}


def torch_adamw_kwargs(cfg: AdamWConfig) -> dict:
    return {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}


def split_by_route(model: TinyQwen3) -> tuple[list[Tensor], list[Tensor]]:
    """(matrix-optimizer parameters, AdamW parameters) by the project's routing rule."""
    matrices = {p.name for p in model.spec().matrix_params()}
    named = list(model.named_parameters())
    return [p for n, p in named if n in matrices], [p for n, p in named if n not in matrices]


OVERLAP = "+overlap"  # a policy name with this suffix: that policy with overlap_step=True


def build_canzona(optimizer: str, name: str, cfg: TinyQwen3Config, bucket_size: int | None) -> Contender:
    from canzona.runtime.optimizer import DistributedOptimizer

    model = TinyQwen3(cfg, seed=0)
    policy = name.removesuffix(OVERLAP)
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), optimizer,
                               MUON if optimizer == "muon" else None, ADAMW, policy=policy,
                               bucket_size=bucket_size, overlap_step=name.endswith(OVERLAP))
    buckets = len(opt.plan.dp_plan.buckets)
    c = Contender(optimizer, name, f"{opt.plan.dp_plan.policy} plan, {buckets} bucket{'s' * (buckets > 1)}",
                  model, model.loss, [opt], len(opt.applies))
    c.clock(opt, "_prepare_step", "grad sync")
    c.clock(opt, "_gather_params", "param sync")
    return c


def build_ddp_muon(cfg: TinyQwen3Config) -> Contender:
    model = TinyQwen3(cfg, seed=0)
    ddp = nn.parallel.DistributedDataParallel(_LossModule(model))
    matrices, rest = split_by_route(model)
    opts = [torch.optim.Muon(matrices, **torch_muon_kwargs(MUON)),
            torch.optim.AdamW(rest, **torch_adamw_kwargs(ADAMW))]
    return Contender("muon", "ddp-muon", "DDP; Muon, AdamW replicated", model, ddp, opts, len(matrices))


def build_zero_muon(cfg: TinyQwen3Config) -> Contender:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = TinyQwen3(cfg, seed=0)
    ddp = nn.parallel.DistributedDataParallel(_LossModule(model))
    matrices, rest = split_by_route(model)
    opts = [ZeroRedundancyOptimizer(matrices, torch.optim.Muon, **torch_muon_kwargs(MUON)),
            ZeroRedundancyOptimizer(rest, torch.optim.AdamW, **torch_adamw_kwargs(ADAMW))]
    here = sum(len(g["params"]) for g in opts[0].optim.param_groups)
    c = Contender("muon", "zero-muon", "DDP; ZeRO(Muon), ZeRO(AdamW)", model, ddp, opts, here)
    for zero in opts:
        c.clock(zero, "_sync_params", "param sync")
    return c


def build(optimizer: str, name: str, cfg: TinyQwen3Config, bucket_size: int | None) -> Contender:
    if name == "ddp-muon":
        return build_ddp_muon(cfg)
    if name == "zero-muon":
        return build_zero_muon(cfg)
    return build_canzona(optimizer, name, cfg, bucket_size)


def iterate(c: Contender, tokens: Tensor, keep: bool) -> None:
    """One training iteration, started together on every rank. No barrier between backward and
    step: DDP waits for its all-reduce inside backward, canzona inside step, and the iteration
    time counts either."""
    c.phase_now = dict.fromkeys(PHASES, 0.0)
    dist.barrier()
    t0 = time.perf_counter()
    for opt in c.optimizers:
        opt.zero_grad()
    loss = c.loss(tokens)
    loss.backward()
    t1 = time.perf_counter()
    for opt in c.optimizers:
        opt.step()
    t2 = time.perf_counter()
    c.last_loss = loss.item()
    if keep:
        math = t2 - t1 - sum(c.phase_now.values())
        for key, value in (("iteration", t2 - t0), ("fwd+bwd", t1 - t0), ("step", t2 - t1), ("math", math),
                           *c.phase_now.items()):
            c.times.setdefault(key, []).append(value)


GATHER_VARIANTS = ("as run: broadcast from each owner, in place", "all-to-all, fresh repeat send buffer",
                   "all-to-all, send buffers built once")


@torch.no_grad()
def all_gather_variants(c: Contender, reps: int = 20) -> dict[str, float] | None:
    """Median seconds, per step, of canzona's parameter all-gather (every bucket and the AdamW
    buffer) alone: as `Comm.all_gather_v` runs it (one in-place broadcast per owner), against the
    all-to-all form it replaced (a send buffer of dp copies, built fresh each call or once).
    Collective: every rank calls it for every contender in the same order. The parameters are
    already identical on all ranks, so nothing changes."""
    opt = c.optimizers[0]
    if not getattr(getattr(opt, "policy", None), "gather_params", False) or opt.plan.dp_plan.policy == "layerwise":
        return None
    rank, dp, group = opt.rank, opt.dp, opt.comm.group
    pieces = [(b.data, bp.cuts) for b, bp in zip(opt.buckets, opt.plan.dp_plan.buckets)]
    pieces.append((opt.adamw.data, opt.adamw_cuts))
    sends = [flat[cuts[rank]:cuts[rank + 1]].repeat(dp) for flat, cuts in pieces]

    def wait_all(works: list) -> None:
        for w in works:
            w.wait()

    def all_to_all(fresh: bool) -> None:
        wait_all([dist.all_to_all_single(flat[:cuts[-1]], flat[cuts[rank]:cuts[rank + 1]].repeat(dp) if fresh else send,
                                         [b - a for a, b in zip(cuts, cuts[1:])],
                                         [cuts[rank + 1] - cuts[rank]] * dp, group=group, async_op=True)
                  for (flat, cuts), send in zip(pieces, sends)])

    variants = {
        GATHER_VARIANTS[0]: lambda: wait_all([opt.comm.all_gather_v(f, cuts, "bench") for f, cuts in pieces]),
        GATHER_VARIANTS[1]: lambda: all_to_all(fresh=True),
        GATHER_VARIANTS[2]: lambda: all_to_all(fresh=False),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():  # interleaved, like the contenders
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in samples.items()}


@torch.no_grad()
def distances(model: nn.Module, reference: nn.Module) -> tuple[list[float], float]:
    """(per parameter ||p - q||_F / ||q||_F, max absolute difference over all parameters)."""
    rel, absolute = [], 0.0
    model.state_dict(), reference.state_dict()  # wait for canzona's overlapped parameter all-gathers
    for (name, p), (ref_name, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert name == ref_name, (name, ref_name)
        d = p - q
        rel.append(float(d.norm() / q.norm()))
        absolute = max(absolute, float(d.abs().max()))
    return rel, absolute


def worker(rank: int, world: int, cfg: TinyQwen3Config, jobs: list[tuple[str, str]], rounds: int,
           warmup: int, bucket_size: int | None) -> list[dict]:
    from reference.data import shard_batch, synthetic_batches

    contenders = [build(o, n, cfg, bucket_size) for o, n in jobs]
    batches = synthetic_batches(cfg.vocab, BATCH_PER_RANK * world, SEQ_LEN, warmup + rounds, seed=1)
    for i, tokens in enumerate(batches):
        mine = shard_batch(tokens, rank, world)
        for k in range(len(contenders)):
            iterate(contenders[(i + k) % len(contenders)], mine, keep=i >= warmup)
    canzona = {c.optimizer: c.model for c in contenders if c.name == "canzona"}
    start = TinyQwen3(cfg, seed=0)
    out = []
    for c in contenders:
        rel, absolute = distances(c.model, canzona[c.optimizer])
        out.append({"optimizer": c.optimizer, "name": c.name, "how": c.how, "times": c.times,
                    "matrices": c.matrices_here, "loss": c.last_loss, "rel": max(rel), "abs": absolute,
                    "moved": min(distances(c.model, start)[0]), "gather": all_gather_variants(c)})
    return out


# --- in the parent ------------------------------------------------------------------------------


def slowest_rank(per_rank: list[list[dict]]) -> list[dict]:
    """Merge the ranks' rows: per round the slowest rank's time, the worst distance, the ranks'
    matrix counts."""
    merged = []
    for rows in zip(*per_rank):
        first = dict(rows[0])
        first["times"] = {k: [max(vals) for vals in zip(*(r["times"][k] for r in rows))] for k in first["times"]}
        first["matrices"] = "/".join(str(r["matrices"]) for r in rows)
        first["rel"] = max(r["rel"] for r in rows)
        first["abs"] = max(r["abs"] for r in rows)
        first["moved"] = min(r["moved"] for r in rows)
        if first["gather"] is not None:
            first["gather"] = {k: max(r["gather"][k] for r in rows) for k in first["gather"]}
        merged.append(first)
    return merged


def median_ms(row: dict, key: str) -> float:
    return statistics.median(row["times"][key]) * 1e3


def ratio(canzona: float, other: float) -> str:
    return f"{canzona / other:.2f}"


def paired_ratio(canzona: dict, other: dict) -> str:
    """Median over rounds of canzona's iteration / the other's in the same round: a slow spell of
    the machine inflates both sides of a round's ratio, so this resists load better than the ratio
    of medians."""
    pairs = zip(canzona["times"]["iteration"], other["times"]["iteration"], strict=True)
    return f"{statistics.median(a / b for a, b in pairs):.2f}"


def timing_table(rows: list[dict], args: argparse.Namespace, world: int) -> Table:
    model = MODELS[args.model]
    t = Table(title=f"Training iteration on gloo: DP {world} spawned ranks x 1 thread, {model.name} (hidden "
                    f"{model.hidden}, {model.layers} layers, ffn {model.ffn}, {7 * model.layers} matrices), "
                    f"{BATCH_PER_RANK} x {SEQ_LEN} tokens per rank; median of {args.rounds} interleaved "
                    f"rounds after {args.warmup}")
    for col in ("optimizer", "contender", "how", "matrices / rank", "iteration ms", "min-max", "fwd+bwd ms",
                "step ms", "canzona/this iteration", "paired", "canzona/this step"):
        t.add_column(col, justify="left" if col in ("optimizer", "contender", "how") else "right")
    for optimizer in dict.fromkeys(r["optimizer"] for r in rows):
        group = [r for r in rows if r["optimizer"] == optimizer]
        ref = next(r for r in group if r["name"] == "canzona")
        for r in group:
            it = r["times"]["iteration"]
            t.add_row(optimizer, r["name"], r["how"], r["matrices"], f"{median_ms(r, 'iteration'):.1f}",
                      f"{min(it) * 1e3:.0f}-{max(it) * 1e3:.0f}", f"{median_ms(r, 'fwd+bwd'):.1f}",
                      f"{median_ms(r, 'step'):.1f}",
                      ratio(median_ms(ref, "iteration"), median_ms(r, "iteration")), paired_ratio(ref, r),
                      ratio(median_ms(ref, "step"), median_ms(r, "step")),
                      style="bold green" if r is ref else None)
        t.add_section()
    t.caption = ("iteration: zero_grad + forward + backward + step, slowest rank. fwd+bwd includes DDP's "
                 "all-reduce wait; canzona waits for its reduce-scatters in step. Ratios below 1: canzona is faster; "
                 "paired: median over rounds of the iteration ratio within the round.")
    return t


def phase_table(rows: list[dict]) -> Table:
    t = Table(title="Where the step goes (ms, median of the slowest rank per round)")
    for col in ("optimizer", "contender", "step", "grad-sync tail", "math", "param sync"):
        t.add_column(col, justify="left" if col in ("optimizer", "contender") else "right")
    for r in rows:
        sync, gather = median_ms(r, "grad sync"), median_ms(r, "param sync")
        t.add_row(r["optimizer"], r["name"], f"{median_ms(r, 'step'):.1f}",
                  f"{sync:.1f}" if sync else "in backward", f"{median_ms(r, 'math'):.1f}",
                  f"{gather:.1f}" if gather else "none")
    t.caption = ("Each column is its own median of the slowest rank, so they need not add up. grad-sync "
                 "tail: canzona's wait for its reduce-scatters and the step check; math: kernels and AdamW "
                 "(ZeRO: its local step); param sync: launching canzona's all-gathers (overlap_param_gather: "
                 "the next forward waits for them) / ZeRO's broadcasts. Collectives "
                 "include waiting for the slower rank.")
    return t


def gather_table(rows: list[dict]) -> Table:
    t = Table(title="Canzona's parameter all-gather alone, per step (ms, median of 20, slowest rank)")
    for col in ("optimizer", "contender", *GATHER_VARIANTS):
        t.add_column(col, justify="left" if col in ("optimizer", "contender") else "right")
    for r in rows:
        if r["gather"] is not None:
            t.add_row(r["optimizer"], r["name"], *(f"{r['gather'][k] * 1e3:.1f}" for k in GATHER_VARIANTS))
    t.caption = ("as run: Comm.all_gather_v, one in-place broadcast per owner; the other columns are the "
                 "all-to-all form it replaced, measured on the same buffers.")
    return t


def agreement_table(rows: list[dict], steps: int) -> tuple[Table, bool]:
    t = Table(title=f"Final parameters after {steps} identical steps vs canzona's (every rank, worst)")
    for col in ("optimizer", "contender", "max rel. Frobenius distance", "max abs. difference",
                "moved from init (rel.)", "final loss", f"within {REL_TOLERANCE:g}"):
        t.add_column(col, justify="left" if col in ("optimizer", "contender") else "right")
    ok = True
    for r in rows:
        good = r["rel"] <= REL_TOLERANCE
        ok &= good
        t.add_row(r["optimizer"], r["name"], f"{r['rel']:.2e}", f"{r['abs']:.2e}", f"{r['moved']:.2e}",
                  f"{r['loss']:.5f}",
                  "[green]yes[/]" if good else "[red]NO[/]")
    t.caption = ("moved from init: the smallest, over parameters, relative distance from the initial weights; "
                 "it shows the distances to canzona's weights are measured on weights that did train.")
    return t, ok


def verdicts(rows: list[dict], console: Console) -> bool:
    """The bar of this benchmark, and the older one of docs/design.md §10 (canzona's step beats sc's)."""
    ok = True
    for sc in (r for r in rows if r["name"] == "sc"):
        mine = next(r for r in rows if r["optimizer"] == sc["optimizer"] and r["name"] == "canzona")
        beats = median_ms(mine, "step") < median_ms(sc, "step")
        ok &= beats
        console.print(f"{sc['optimizer']}: canzona step {median_ms(sc, 'step') / median_ms(mine, 'step'):.2f}x "
                      f"faster than sc -> {'[bold green]PASS[/]' if beats else '[bold red]FAIL[/]'} "
                      "(bar: canzona's step beats sc's)")
    ref = next(r for r in rows if r["optimizer"] == "muon" and r["name"] == "canzona")
    passed = True
    for r in (r for r in rows if r["optimizer"] == "muon" and r["name"] in TORCH_CONTENDERS):
        for phase in ("iteration", "step"):
            ratio = median_ms(ref, phase) / median_ms(r, phase)
            ok_here = ratio <= BARS[r["name"]]
            passed &= ok_here
            console.print(f"muon: canzona {phase} {median_ms(ref, phase):.1f} ms = {ratio:.2f}x of {r['name']}'s -> "
                          f"{'[bold green]PASS[/]' if ok_here else '[bold red]FAIL[/]'} (bar: at most "
                          f"{BARS[r['name']]:g}x)")
    return ok and passed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizers", default="muon", help="muon (with the torch contenders), soap, shampoo")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--model", choices=tuple(MODELS), default="bench-384", help="the model shape")
    ap.add_argument("--rounds", type=int, default=20, help="measured rounds (one iteration per contender each)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket-size", type=int, default=None,
                    help="canzona's plan bucket size in elements (default: the plan's, one bucket here)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 rounds after 1, timing bars not enforced")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.warmup = 2, 1
    optimizers = args.optimizers.split(",")
    if "muon" not in optimizers:
        ap.error("--optimizers must include muon: the bar compares against torch's Muon")
    policies = list(dict.fromkeys([*args.policies.split(","), "canzona"]))
    jobs = [(o, name) for o in optimizers for name in (*policies, *(TORCH_CONTENDERS if o == "muon" else ()))]

    load = os.getloadavg()
    t0 = time.perf_counter()
    per_rank = run_ranks(worker, args.dp, MODELS[args.model], jobs, args.rounds, args.warmup, args.bucket_size,
                         deadline_s=900.0)
    wall = time.perf_counter() - t0
    rows = slowest_rank(per_rank)

    console = Console(width=200)
    console.print(timing_table(rows, args, args.dp))
    console.print(phase_table(rows))
    if any(r["gather"] is not None for r in rows):
        console.print(gather_table(rows))
    agreement, agree = agreement_table(rows, args.warmup + args.rounds)
    console.print(agreement)
    passed = verdicts(rows, console)
    console.print(f"like for like: {'[bold green]yes[/]' if agree else '[bold red]NO[/]'} (every contender "
                  f"within {REL_TOLERANCE:g} relative of canzona's parameters)")
    console.print(f"wall {wall:.1f} s, torch {torch.__version__}, load average before / after "
                  f"{load[0]:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.quick:  # two rounds cannot settle a timing bar: a smoke run fails only on disagreement
        console.print("--quick: timing bars printed, not enforced")
        return 0 if agree else 1
    return 0 if passed and agree else 1


if __name__ == "__main__":
    sys.exit(main())
