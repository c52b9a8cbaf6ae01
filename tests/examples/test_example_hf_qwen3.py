"""`examples/hf_qwen3.py` as a user runs it (torchrun, 2 gloo ranks, a `transformers` Qwen3): it
trains bit for bit as the same kernels in one process, and a run checkpointed and resumed (at the
same or another DP size) continues where it stopped.

The runs reduce the gradients with the example's default (`--reduce-scatter native`: gloo's own
order, which at DP 2 is any order, a sum of two); the resume at DP 3 with `--reduce-scatter exact`
(rank order, as the emulation sums): with native, gloo sums three ranks in another order than rank
order, the gradients differ in their last bits, and Muon's bf16 Newton-Schulz turns that into
visible differences from the first DP 3 step on (a rounding difference, not a wrong resume)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from canzona.harness.training import _flat_state, compare, runtime_norm  # noqa: E402
from canzona.optimizers import AdamWConfig, MuonConfig  # noqa: E402
from canzona.plan import make_plan  # noqa: E402
from canzona.runtime.kernels import adamw_step_, apply_update_, matrix_kernel  # noqa: E402
from canzona.runtime.modules import backward_order, named_parameters  # noqa: E402
from canzona.spec import ModelSpec  # noqa: E402
from tests.launchers import torchrun_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import hf_qwen3 as example  # noqa: E402

# torchrun spawns gloo ranks; four launches of a transformers model: `make test-all` (the HF
# integration tests check a transformers Qwen3 on canzona bit for bit in `make test`)
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 6


def torchrun(tmp_path: Path, ranks: int, *args: str) -> str:
    cmd = torchrun_command(ranks, ROOT / "examples" / "hf_qwen3.py", *args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    tmp = tmp_path_factory.mktemp("hf")
    logs = {"straight": torchrun(tmp, 2, "--steps", str(STEPS), "--out", "straight.pt")}
    logs["first half"] = torchrun(tmp, 2, "--steps", str(STEPS // 2), "--save", "ckpt")
    logs["resumed"] = torchrun(tmp, 2, "--steps", str(STEPS), "--resume", "ckpt", "--out", "resumed.pt")
    logs["resumed at dp 3"] = torchrun(tmp, 3, "--steps", str(STEPS), "--resume", "ckpt", "--out", "dp3.pt",
                                       "--reduce-scatter", "exact")  # rank order: bit for bit at DP 3
    out = {name: torch.load(tmp / f"{file}.pt") for name, file in
           (("straight", "straight"), ("resumed", "resumed"), ("resumed at dp 3", "dp3"))}
    out["logs"] = logs
    return out


def emulate(setup: example.Setup, dps: list[int]) -> dict[str, torch.Tensor]:
    """The example's run in one process, step s at DP size `dps[s]`: each rank's gradient,
    averaged in rank order (the runtime's `exact` reduce-scatter, and `native`'s at DP 2); the
    global norm taken over that layout's segments in the runtime's order; then the runtime's
    kernels."""
    torch.set_num_threads(1)
    model = example.build_model(setup)
    batches = list(example.batches(setup))
    sample = example.shard(batches[0], 0, dps[0])
    spec = ModelSpec.from_module(model, order=backward_order(model, lambda m: example.loss_of(m, sample)))
    plans = {dp: make_plan(spec, dp, 1, "muon", "alpha-balanced") for dp in set(dps)}
    params = dict(named_parameters(model))
    decay = {n: setup.weight_decay if p.dim() >= 2 else 0.0 for n, p in params.items()}
    adamw_names = [p.name for p in spec.adamw_params()]
    states: dict[str, dict] = {}
    for step, dp in enumerate(dps):
        per_rank = []
        for r in range(dp):
            model.zero_grad()
            example.loss_of(model, example.shard(batches[step], r, dp)).backward()
            per_rank.append({n: p.grad.clone() for n, p in params.items()})
        grads = {}
        for n in params:
            acc = per_rank[0][n].clone()
            for r in range(1, dp):
                acc += per_rank[r][n]
            grads[n] = acc.div_(dp)
        coefficient = _clip_coefficient(grads, plans[dp], adamw_names, setup.clip_norm)
        factor = example.lr_factor(setup, step)
        with torch.no_grad():
            for n, p in params.items():
                g = grads[n] * coefficient if coefficient < 1.0 else grads[n]
                state = states.setdefault(n, {})
                if n in adamw_names:
                    lr = setup.adamw_lr * factor
                    adamw_step_(p.view(-1), g.view(-1), _flat_state(state), AdamWConfig(lr=lr, weight_decay=decay[n]), lr)
                else:
                    lr = setup.matrix_lr * factor
                    update = matrix_kernel("muon")(g, state, MuonConfig(lr=lr, weight_decay=decay[n]), lr)
                    apply_update_(p, update.direction, update)
    return {n: p.detach().clone() for n, p in params.items()}


def _clip_coefficient(grads, plan, adamw_names, max_norm) -> float:
    return min(1.0, max_norm / (runtime_norm(grads, plan, adamw_names) + 1e-6))


def test_the_example_equals_the_same_kernels_in_one_process(runs):
    assert compare(runs["straight"], emulate(example.Setup(), [2] * STEPS))["bit_identical"]


def test_the_example_logs_falling_loss_and_clips(runs):
    lines = [line for line in runs["logs"]["straight"].splitlines() if line.startswith("step")]
    assert len(lines) == STEPS
    losses = [float(line.split("loss")[1].split()[0]) for line in lines]
    norms = [float(line.split("grad norm")[1].split()[0]) for line in lines]
    assert losses[-1] < losses[0]
    assert max(norms) > example.Setup.clip_norm  # the clip was active


def test_a_resumed_run_continues_exactly(runs):
    assert compare(runs["resumed"], runs["straight"])["bit_identical"]
    half = STEPS // 2
    resharded = emulate(example.Setup(), [2] * half + [3] * (STEPS - half))
    assert compare(runs["resumed at dp 3"], resharded)["bit_identical"]
