"""Measure the distributed runtime's training step on spawned gloo ranks, for `canzona validate`.

Every step policy trains its own copy of one model on the same batches. Rounds are interleaved (in
each round every policy runs one iteration, in an order rotated each round, after a barrier), so
load from other processes hits all policies alike. A policy's time for a round is its slowest
rank's; reported are medians over the rounds after warm-up, split at the end of backward:
`fwd+bwd` (zero_grad, forward, waiting there for the last step's parameter all-gathers, backward
with the hooks' reduce-scatters in flight) and `step` (`optimizer.step()`: waiting for the
gradients, the update, launching the parameter all-gathers). The
collective log of one step is returned too, for the structure check.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from canzona.harness.launch import report_progress, run_ranks
from canzona.spec import ModelSpec
from reference.tiny_model import TinyQwen3, TinyQwen3Config, model_spec

# A Qwen3-style decoder scaled up from the tiny preset so its matrices have a few hundred rows:
# CPU steps take tens of milliseconds, long enough to time and short enough for a CI-sized run.
VALIDATION_MODEL = TinyQwen3Config(vocab=1024, hidden=384, layers=4, q_heads=6, kv_heads=2, head_dim=64,
                                   ffn=1024, tied_embeddings=True, max_seq_len=64, name="validate-384")
SEQ_LEN = 32
BATCH_PER_RANK = 4


@dataclass(frozen=True)
class Measured:
    policy: str
    forward_backward_s: float  # medians over rounds of the slowest rank
    step_s: float
    iteration_s: float
    rounds: int
    log: tuple[dict, ...]  # the DP collectives of one step, as rank 0's runtime recorded them


def validation_spec(cfg: TinyQwen3Config | None = None) -> ModelSpec:
    return model_spec(cfg or VALIDATION_MODEL)


def _worker(rank: int, world: int, policies: Sequence[str], optimizer: str, cfg: TinyQwen3Config,
            rounds: int, warmup: int) -> dict:
    from canzona.runtime.optimizer import DistributedOptimizer

    runs = []
    for policy in policies:
        model = TinyQwen3(cfg, seed=0)
        opt = DistributedOptimizer(model.named_parameters(), model.spec(), optimizer, policy=policy)
        runs.append((policy, model, opt))
    gen = torch.Generator().manual_seed(1 + rank)
    times: dict[str, list[tuple[float, float]]] = {p: [] for p in policies}
    logs: dict[str, list[dict]] = {}
    total = warmup + rounds
    for k in range(total):
        tokens = torch.randint(0, cfg.vocab, (BATCH_PER_RANK, SEQ_LEN), generator=gen)
        order = runs[k % len(runs):] + runs[:k % len(runs)]
        for policy, model, opt in order:
            before = len(opt.comm.log.records)
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            model.loss(tokens).backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            slowest = torch.tensor([t1 - t0, t2 - t1], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if k >= warmup:
                times[policy].append((float(slowest[0]), float(slowest[1])))
            if k == total - 1:
                logs[policy] = opt.comm.log.to_dicts()[before:]
        report_progress(k + 1, total, f"round {k + 1} of {total}")
    return {"times": times, "logs": logs}


def measure(policies: Sequence[str], optimizer: str = "muon", dp: int = 2, rounds: int = 10, warmup: int = 3,
            cfg: TinyQwen3Config | None = None,
            progress: Callable[[int, int, str], None] | None = None) -> dict[str, Measured]:
    """Median times of every policy's training step on `dp` spawned gloo ranks (one torch thread
    each, as calibration measures with `--threads 1`)."""
    cfg = cfg or VALIDATION_MODEL
    results = run_ranks(_worker, dp, tuple(policies), optimizer, cfg, rounds, warmup, threads=1,
                        deadline_s=60.0 + 30.0 * (rounds + warmup) * len(policies), progress=progress)
    out = {}
    for policy in policies:
        rows = results[0]["times"][policy]
        fb = statistics.median(r[0] for r in rows)
        step = statistics.median(r[1] for r in rows)
        it = statistics.median(r[0] + r[1] for r in rows)
        out[policy] = Measured(policy, fb, step, it, len(rows), tuple(results[0]["logs"][policy]))
    return out
