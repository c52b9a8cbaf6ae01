"""transformers' `Trainer` and accelerate driving canzona's optimizer (`canzona.integrations`).

One torchrun run (2 gloo ranks, `tests/runtime/integrations_driver.py`) trains the examples'
`CanzonaTrainer` and `CanzonaAccelerator` code in several scenarios; every check here reads its
outputs. Each scenario equals, bit for bit, the same kernels in one process fed the same global
gradients: each step, the ranks' local gradients (recorded by hooks of the driver's own, after
accumulation over micro-batches) summed in rank order and halved, clipped by their global norm
taken as the runtime takes it, then Muon / AdamW at the step's learning rates. The logged
gradient norms are that global norm. The plain `Trainer` and `Accelerator` must fail loudly. The
same launch runs the optimizer folders' scenarios (`integrations_checkpoint_driver.py`; the checks
at the end of this file).
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from canzona.errors import CanzonaError  # noqa: E402
from canzona.harness.training import _entries, _flat_state, compare, runtime_norm  # noqa: E402
from canzona.integrations.accelerate import check_on_device, own_storage, same_device  # noqa: E402
from canzona.integrations.hf import CanzonaTrainer, check_optimizer_kwargs, check_trainer  # noqa: E402
from canzona.optimizers import AdamWConfig, MuonConfig  # noqa: E402
from canzona.plan import make_plan  # noqa: E402
from canzona.runtime.kernels import adamw_step_, apply_update_, matrix_kernel  # noqa: E402
from canzona.runtime.modules import named_parameters  # noqa: E402
from tests.launchers import driver_results, scenario  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import accelerate_loop as loop_example  # noqa: E402
import hf_trainer as example  # noqa: E402

from tests.runtime import integrations_driver as driver  # noqa: E402

DP = 2
SETUP = driver.SETUP


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return driver_results(DP, driver.__file__, tmp_path_factory.mktemp("integrations"), timeout=600)


# --- the emulation -----------------------------------------------------------------------------


def learning_rates(make_scheduler: Callable[[torch.optim.Optimizer], object], steps: int,
                   per_step: int = 1) -> list[tuple[float, float]]:
    """(matrix, AdamW) learning rate of each step, from the run's scheduler class and schedule
    stepped `per_step` times per optimizer step (accelerate steps it once per process)."""
    dummy = torch.optim.SGD([{"params": [torch.zeros(1)], "lr": SETUP.matrix_lr},
                             {"params": [torch.zeros(1)], "lr": SETUP.adamw_lr}])
    scheduler = make_scheduler(dummy)
    out = []
    for _ in range(steps):
        out.append((dummy.param_groups[0]["lr"], dummy.param_groups[1]["lr"]))
        dummy.step()
        for _ in range(per_step):
            scheduler.step()
    return out


def trainer_schedule(steps: int) -> list[tuple[float, float]]:
    from transformers import get_scheduler

    return learning_rates(lambda o: get_scheduler("linear", o, num_warmup_steps=0, num_training_steps=steps), steps)


def emulate(results: list[dict], lrs: list[tuple[float, float]],
            max_norm: float | None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Final parameters and each step's gradient norm (as the optimizer returns it, fp32) of the
    run in one process, fed the ranks' recorded gradients."""
    model = example.build_model(SETUP)
    spec = example.model_spec(model, example.MarkovTokens(SETUP))
    plan = make_plan(spec, DP, 1, "muon", "alpha-balanced")
    params = dict(named_parameters(model))
    matrices = {p.name for p in spec.matrix_params()}
    adamw_names = [p.name for p in spec.adamw_params()]
    steps = [r["grads"] for r in results]
    assert len({len(s) for s in steps}) == 1 and len(steps[0]) == len(lrs), "a step more or less than scheduled"
    states: dict[str, dict] = {}
    norms = []
    for step, (matrix_lr, adamw_lr) in enumerate(lrs):
        grads = {}
        for n in params:
            acc = steps[0][step][n].clone()
            for r in range(1, DP):
                acc += steps[r][step][n]
            grads[n] = acc.div_(DP)
        norm = torch.tensor(runtime_norm(grads, plan, adamw_names), dtype=torch.float64)
        norms.append(float(norm.to(torch.float32)))
        coefficient = 1.0 if max_norm is None else min(1.0, max_norm / (float(norm) + 1e-6))
        with torch.no_grad():
            for n, p in params.items():
                g = grads[n] * coefficient if coefficient < 1.0 else grads[n]
                decay = SETUP.weight_decay if p.dim() >= 2 else 0.0
                state = states.setdefault(n, {})
                if n in matrices:
                    update = matrix_kernel("muon")(g, state, MuonConfig(lr=matrix_lr, weight_decay=decay), matrix_lr)
                    apply_update_(p, update.direction, update)
                else:
                    adamw_step_(p.view(-1), g.view(-1), _flat_state(state),
                                AdamWConfig(lr=adamw_lr, weight_decay=decay), adamw_lr)
    return {n: p.detach().clone() for n, p in params.items()}, norms


def assert_trained_as_emulated(results: list[dict], lrs: list[tuple[float, float]], max_norm: float | None) -> list[float]:
    want, norms = emulate(results, lrs, max_norm)
    for r in results:  # every rank ends with the same parameters, those of one process
        verdict = compare(r["params"], want)
        assert verdict["bit_identical"], verdict
    return norms


def logged_norms(logs: list[dict], after: int = 0) -> list[float]:
    """The grad_norm the Trainer logged at each step after step `after`."""
    return [entry["grad_norm"] for entry in logs if "grad_norm" in entry and entry["step"] > after]


def logged_rates(logs: list[dict]) -> list[tuple[float, float]]:
    """The (learning_rate, learning_rate_adamw) the Trainer logged at each step: transformers' own
    key (the first group's rate, here the matrices') and the AdamW groups' beside it. Before, the
    AdamW rate was not logged at all."""
    return [(e["learning_rate"], e.get("learning_rate_adamw")) for e in logs if "learning_rate" in e]


# --- transformers' own TP plan ----------------------------------------------------------------------

REL_TOL = 1e-5  # the reference optimizers' own arithmetic against the runtime's kernels (test_runtime_tp.py)


def one_process_step(result: dict, grads: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """The step on the unsharded parameters fed the global gradients: the runtime's kernels in one
    process (each matrix of a stack its own, `_entries`), and the reference optimizers."""
    from reference import CombinedOptimizer

    spec, matrix, adamw = result["spec"], result["matrix"], result["adamw"]
    kernels = {n: t.clone() for n, t in result["before"].items()}
    with torch.no_grad():
        for n, w in kernels.items():
            for _, view, g, is_matrix in _entries(spec.param(n), w, grads[n]):
                if is_matrix:
                    update = matrix_kernel("muon")(g.clone(), {}, matrix, matrix.lr)
                    apply_update_(view, update.direction, update)
                else:
                    adamw_step_(view.view(-1), g.reshape(-1), _flat_state({}), adamw, adamw.lr)
    params = {n: nn.Parameter(t.clone()) for n, t in result["before"].items()}
    reference = CombinedOptimizer(params.items(), spec, "muon", matrix, adamw)
    for n, p in params.items():
        p.grad = grads[n].clone()
    reference.step()
    return kernels, {n: p.detach() for n, p in params.items()}


@pytest.mark.distributed
@pytest.mark.parametrize("config", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_a_cli_tp_plan_steps_the_model_transformers_sharded_as_one_process(ranks, config):
    """A model sharded by transformers' TP plan (with the overrides canzona trains under) and a
    plan from `canzona plan --model <config> --dp 1 --tp 2`: every rank's parameters after the step
    are the runtime's kernels' in one process on the unsharded parameters fed the global
    gradients (the ranks' local ones joined along the spec's TP dim), bit for bit, and the
    reference optimizers' within REL_TOL; the sharded forward is the unsharded one's."""
    results = scenario(ranks, f"hf tp {config}")
    spec = results[0]["spec"]
    grads = {}
    for n in results[0]["grads"]:
        parts = [r["grads"][n] for r in results]
        dim = spec.param(n).tp_dim
        if dim is None:
            assert torch.equal(parts[0], parts[1]), f"{n}: a replicated gradient differs between the TP ranks"
        grads[n] = parts[0] if dim is None else torch.cat(parts, dim)
    kernels, reference = one_process_step(results[0], grads)
    for r in results:
        assert compare(r["after"], kernels)["bit_identical"], compare(r["after"], kernels)
        assert compare(r["after"], reference)["max_rel_diff"] <= REL_TOL, compare(r["after"], reference)
        assert r["loss"] == pytest.approx(r["plain_loss"], rel=REL_TOL)
        assert any(not torch.equal(r["after"][n], r["before"][n]) for n in r["after"])


@pytest.mark.distributed
def test_transformers_grad_allreduce_norms_are_one_error_on_every_rank(ranks):
    """Without the overrides, Qwen3's q_norm / k_norm ('replicated_with_grad_allreduce'): one
    PlanError at construction on every rank (it was a StopIteration traceback in backward)."""
    for r in [r["hf tp without overrides"] for r in ranks]:
        assert r["error"].startswith("PlanError: parameter 'model.layers.0.self_attn.q_norm.weight' is sharded by "
                                     "transformers' TP style 'replicated_with_grad_allreduce'"), r["error"]
        assert "\n" not in r["error"]


@pytest.mark.distributed
def test_the_trainer_refuses_a_transformers_tp_model_naming_the_optimizers_own_way(ranks):
    """CanzonaTrainer(model=<sharded by tp_plan "auto">, optimizer_kwargs={"group": mesh, "plan": ...}):
    one CanzonaError at construction on every rank. Before: accelerate's ValueError from inside the
    Trainer's constructor on CPU ("ParallelismConfig is only compatible DistributedType.FSDP (version
    2) or DistributedType.Multi{Device} or DistributedType.DEEPSPEED, but got DistributedType.MULTI_CPU"),
    and where accelerate allows it, canzona's accelerator refusing the parallelism_config the
    Trainer builds itself, advising group=mesh, which the user had given."""
    for r in [r["trainer hf tp"] for r in ranks]:
        assert r["error"].startswith("CanzonaError: CanzonaTrainer does not train a model sharded by transformers' "
                                     "TP plan (tp_size 2)"), r["error"]
        assert "\n" not in r["error"]


@pytest.mark.distributed
def test_the_trainer_refuses_a_transformers_tp_model_built_by_model_init(ranks):
    """CanzonaTrainer(model_init=<a function returning a model sharded by tp_plan "auto">): the same
    one CanzonaError on every rank, before any training step (the Trainer calls model_init in its
    constructor and again in train(); CanzonaTrainer checks what each call returns). Before: the
    check ran on `model=` only, and the model_init model went on into the Trainer."""
    for r in [r["trainer hf tp model_init"] for r in ranks]:
        assert "steps" not in r, r
        assert r["error"].startswith("CanzonaError: CanzonaTrainer does not train a model sharded by transformers' "
                                     "TP plan (tp_size 2)"), r["error"]
        assert "\n" not in r["error"]


# --- transformers' Trainer ---------------------------------------------------------------------


@pytest.mark.distributed
def test_the_trainer_trains_as_one_process_with_accumulation_and_clipping(ranks):
    results = scenario(ranks, "trainer")
    assert results[0]["accelerator"] == "CanzonaAccelerator"
    lrs = trainer_schedule(driver.TRAINER_STEPS)
    norms = assert_trained_as_emulated(results, lrs, SETUP.max_grad_norm)
    for r in results:  # the grad_norm the Trainer logs is the global norm of the averaged gradients
        assert logged_norms(r["logs"]) == norms
        assert logged_rates(r["logs"]) == lrs
    assert max(norms) > SETUP.max_grad_norm  # the clip was active


@pytest.mark.distributed
def test_the_trainer_resumes_from_its_checkpoint_exactly(ranks):
    straight, resumed = scenario(ranks, "trainer"), scenario(ranks, "trainer resumed")
    for a, b in zip(straight, resumed):
        assert compare(b["params"], a["params"])["bit_identical"]
    half = driver.TRAINER_STEPS // 2  # the resumed log starts with the checkpoint's entries
    assert logged_norms(resumed[0]["logs"], after=half) == logged_norms(straight[0]["logs"], after=half)
    assert len(logged_norms(resumed[0]["logs"], after=half)) == driver.TRAINER_STEPS - half


@pytest.mark.distributed
def test_the_trainer_trains_a_given_optimizer_and_scheduler(ranks):
    results = scenario(ranks, "trainer given optimizer")
    steps = driver.GIVEN_STEPS
    lrs = learning_rates(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: example.lr_factor(SETUP, steps, s)),
                         steps)
    norms = assert_trained_as_emulated(results, lrs, SETUP.max_grad_norm)
    assert logged_norms(results[0]["logs"]) == norms
    assert logged_rates(results[0]["logs"]) == lrs


@pytest.mark.distributed
def test_the_trainer_accumulating_an_epochs_last_partial_group_trains_as_one_process(ranks):
    """gradient_accumulation_steps=2 over epochs of 3 batches per rank (the last of 2 samples): each
    epoch's second update accumulates one micro-batch, which the Trainer syncs as its last; with
    max_grad_norm, as one process (found so; no change needed)."""
    results = scenario(ranks, "trainer partial accumulation")
    lrs = trainer_schedule(4)
    norms = assert_trained_as_emulated(results, lrs, SETUP.max_grad_norm)
    epochs = [entry["epoch"] for entry in results[0]["logs"] if "loss" in entry]
    assert epochs == pytest.approx([2 / 3, 1.0, 5 / 3, 2.0])  # groups of 2 and 1 micro-batches, twice
    for r in results:
        assert logged_norms(r["logs"]) == norms and logged_rates(r["logs"]) == lrs


@pytest.mark.distributed
def test_the_trainer_trains_a_given_optimizer_without_a_scheduler_on_its_own_schedule(ranks):
    """`optimizers=(DistributedOptimizer, None)` with accumulation and clipping: the Trainer builds
    its linear schedule over the given optimizer's groups, each at its own rate, and trains as one
    process (found so; no change needed)."""
    results = scenario(ranks, "trainer given optimizer alone")
    lrs = trainer_schedule(driver.GIVEN_STEPS)
    norms = assert_trained_as_emulated(results, lrs, SETUP.max_grad_norm)
    for r in results:
        assert logged_norms(r["logs"]) == norms and logged_rates(r["logs"]) == lrs
    assert max(norms) > SETUP.max_grad_norm  # the clip was active


@pytest.mark.distributed
def test_the_trainer_accumulates_under_sync_each_batch_as_without_it(ranks):
    """`accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True}}`: the
    Trainer runs every micro-batch outside `no_sync` (DDP then reduces each one, for the same
    sum); the optimizer reduces the accumulated gradient once, the same numbers as without it.
    Before: the second micro-batch's backward failed ('gradients were synchronised twice in one
    step: wrap ... in `with optimizer.no_sync():`'), which the user's loop never called."""
    for plain, synced in zip(scenario(ranks, "trainer"), scenario(ranks, "trainer sync_each_batch")):
        assert compare(synced["params"], plain["params"])["bit_identical"]
        assert logged_norms(synced["logs"]) == logged_norms(plain["logs"])


@pytest.mark.distributed
def test_the_trainer_with_adamw_everywhere_trains_as_transformers_own_trainer(ranks):
    """`CanzonaTrainer(matrix_optimizer="adamw")` against `transformers.Trainer` with torch's
    AdamW (DDP) on the same TrainingArguments (accumulation 2, warm-up + cosine, weight decay
    on the Trainer's decay set): the same weights bit for bit and the same losses; the logged
    norm the same up to its summation order."""
    for stock, ours in zip(scenario(ranks, "stock trainer adamw"), scenario(ranks, "trainer adamw")):
        assert compare(ours["params"], stock["params"])["bit_identical"]
        losses = [[e["loss"] for e in r["logs"] if "loss" in e] for r in (stock, ours)]
        assert losses[0] == losses[1] and len(losses[0]) == 3
        assert logged_norms(ours["logs"]) == pytest.approx(logged_norms(stock["logs"]), rel=1e-6)


@pytest.mark.distributed
def test_the_trainer_without_clipping_logs_the_global_norm(ranks):
    results = scenario(ranks, "trainer unclipped")  # max_grad_norm=0: the Trainer asks for the norm with inf
    norms = assert_trained_as_emulated(results, trainer_schedule(2), None)
    assert logged_norms(results[0]["logs"]) == norms


@pytest.mark.distributed
def test_the_trainer_runs_the_overlapped_step_bit_for_bit(ranks):
    """`optimizer_kwargs={"overlap_step": True}`: every step's updates computed under backward's
    reductions and committed after the check, the same numbers as the plain step."""
    results = scenario(ranks, "trainer overlapped")
    norms = assert_trained_as_emulated(results, trainer_schedule(2), None)
    assert logged_norms(results[0]["logs"]) == norms
    assert [r["overlapped_steps"] for r in results] == [2] * DP
    for plain, overlapped in zip(scenario(ranks, "trainer unclipped"), results):
        assert plain["overlapped_steps"] == 0
        assert compare(overlapped["params"], plain["params"])["bit_identical"]


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["", " reentrant"])
def test_the_trainer_with_gradient_checkpointing_trains_bit_for_bit(ranks, how):
    """`TrainingArguments(gradient_checkpointing=True)`: each layer's forward runs again inside
    backward (the gradient hooks fire once per parameter all the same), the same numbers as
    without it."""
    results = scenario(ranks, f"trainer gradient checkpointing{how}")
    for plain, checkpointed in zip(scenario(ranks, "trainer unclipped"), results):
        assert checkpointed["checkpointing"] and not plain["checkpointing"]
        assert checkpointed["forwards"] == 2 * plain["forwards"] > 0  # recomputed in backward
        assert compare(checkpointed["params"], plain["params"])["bit_identical"]
        assert logged_norms(checkpointed["logs"]) == logged_norms(plain["logs"])


# --- accelerate --------------------------------------------------------------------------------


@pytest.mark.distributed
def test_the_accelerate_loop_trains_as_one_process_with_accumulation_and_clipping(ranks):
    results = scenario(ranks, "accelerate")
    assert results[0]["prepared"] == "Qwen3ForCausalLM"  # not wrapped in DDP
    lrs = learning_rates(lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, loop_example.schedule(SETUP, driver.LOOP_STEPS, DP)), driver.LOOP_STEPS, per_step=DP)
    norms = assert_trained_as_emulated(results, lrs, SETUP.max_grad_norm)
    for r in results:
        assert r["norms"] == norms
    assert max(norms) > SETUP.max_grad_norm


@pytest.mark.distributed
def test_the_accelerate_loop_accumulating_a_last_partial_group_trains_as_one_process(ranks):
    """`accelerator.accumulate(model)` and `clip_grad_norm_` over 3 batches per rank accumulated by
    2: the last step accumulates the one batch left, synced at the loader's end; as one process
    (found so; no change needed)."""
    results = scenario(ranks, "accelerate partial accumulation")
    lrs = learning_rates(lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, loop_example.schedule(SETUP, driver.LOOP_STEPS, DP)), 2, per_step=DP)
    norms = assert_trained_as_emulated(results, lrs, SETUP.max_grad_norm)
    for r in results:
        assert r["norms"] == norms


@pytest.mark.distributed
def test_the_accelerate_loop_runs_the_overlapped_step_bit_for_bit(ranks):
    """`overlap_step=True` under accelerate's loop: steps whose gradients clipping scales drop
    their early updates and run the plain step, the others commit them; the same numbers as the
    plain loop either way."""
    for plain_name, max_norm in (("accelerate", SETUP.max_grad_norm), ("accelerate unclipped", driver.LOOSE_NORM)):
        plain, overlapped = scenario(ranks, plain_name), scenario(ranks, f"{plain_name} overlapped")
        for a, b in zip(plain, overlapped):
            assert b["norms"] == a["norms"]
            assert compare(b["params"], a["params"])["bit_identical"], plain_name
            committed = sum(n <= max_norm for n in a["norms"])
            assert b["overlapped_steps"] == committed and a["overlapped_steps"] == 0, plain_name
        assert committed == (0 if plain_name == "accelerate" else driver.LOOP_STEPS), (plain_name, committed)


@pytest.mark.distributed
def test_the_model_prepared_before_its_optimizer_trains_the_same(ranks):
    """`accelerator.prepare(model)` in a call of its own, before `prepare(opt, ...)`: the live
    optimizer holding the model's parameters keeps accelerate from wrapping it in DDP (which
    failed at the first backward) and from moving it, and the loop trains as in one call."""
    one_call, separately = scenario(ranks, "accelerate"), scenario(ranks, "accelerate prepared separately")
    for a, b in zip(one_call, separately):
        assert "error" not in b, b.get("error")
        assert b["prepared"] == "Qwen3ForCausalLM" and b["norms"] == a["norms"]
        assert compare(b["params"], a["params"])["bit_identical"]


@pytest.mark.distributed
def test_the_accelerate_loop_accumulates_under_sync_each_batch_as_without_it(ranks):
    """`GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)`: `accelerator.accumulate`
    enters no `no_sync` (DDP then reduces each micro-batch, for the same sum); the optimizer still
    reduces the accumulated gradient once, the same numbers as the plain loop. Before: the second
    micro-batch's backward failed ('gradients were synchronised twice in one step')."""
    for plain, synced in zip(scenario(ranks, "accelerate"), scenario(ranks, "accelerate sync_each_batch")):
        assert synced["norms"] == plain["norms"]
        assert compare(synced["params"], plain["params"])["bit_identical"]


@pytest.mark.distributed
def test_clipping_an_accumulation_micro_batch_is_one_error_line_at_the_clip(ranks):
    """`accelerator.clip_grad_norm_` on a micro-batch before the last (no `if
    accelerator.sync_gradients:`) reduced its gradients early, and the next backward failed with
    'synchronised twice ... wrap ... in no_sync()' although it was: now one error at the clip,
    nothing changed, and the sync step's clip returns the global norm as usual."""
    results = scenario(ranks, "accelerate clip every micro-batch")
    for r in results:
        assert "error" not in r, r.get("error")
        refused, norm = r["clips"]
        assert refused.startswith("CanzonaError: clip_grad_norm_ inside no_sync() (an accumulation micro-batch")
        assert "accelerator.sync_gradients" in refused and "\n" not in refused
        assert isinstance(norm, float) and norm > 0
    assert results[0]["clips"][1] == results[1]["clips"][1]


@pytest.mark.distributed
def test_the_accelerate_loop_resumes_from_save_state_exactly(ranks):
    straight, resumed = scenario(ranks, "accelerate"), scenario(ranks, "accelerate resumed")
    for a, b in zip(straight, resumed):
        assert b["start"] == driver.LOOP_SAVE_AT
        assert compare(b["params"], a["params"])["bit_identical"]


@pytest.mark.distributed
def test_the_accelerator_refuses_what_it_cannot_do_right(ranks):
    refused = scenario(ranks, "accelerate")[0]["refusals"]
    assert refused["clip a subset"].startswith("CanzonaError: clip_grad_norm_ got a subset")
    assert refused["clip_grad_value_ a subset"].startswith("CanzonaError: clip_grad_value_ got a subset")
    assert refused["a DDP model"].startswith("CanzonaError: the model is wrapped in DistributedDataParallel")
    assert refused["a loose parameter"].startswith("CanzonaError: parameter 'extra' requires gradients but no "
                                                   "canzona optimizer holds it")
    assert all("\n" not in message for message in refused.values())


# --- the plain frameworks ----------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["plain trainer", "plain accelerate"])
def test_the_plain_frameworks_fail_with_one_canzona_error(ranks, name):
    for r in ranks:
        error = r[name].get("error", "trained without an error")
        assert error.startswith("CanzonaError: ") and "\n" not in error, error


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["plain trainer", "plain accelerate"])
def test_the_plain_frameworks_name_the_integration(ranks, name):
    error = ranks[0][name].get("error", "")
    assert "canzona.integrations" in error, error


# --- without processes -------------------------------------------------------------------------


def test_optimizer_folders_are_matched_by_the_models_fingerprint():
    """`load_state`'s choice of each optimizer's folder: by fingerprint, equal ones in order; a
    folder without one (an older canzona's) or a model without a folder: every one by order."""
    from canzona.integrations.accelerate import match_folders

    assert match_folders(["a", "b"], ["b", "a"]) == [1, 0]
    assert match_folders(["a", "b", "a"], ["a", "b", "a"]) == [0, 1, 2]
    assert match_folders(["b", "a", "a"], ["a", "a", "b"]) == [2, 0, 1]
    assert match_folders(["a", "b"], ["b", None]) == [0, 1]  # an older folder: order
    assert match_folders(["a", "c"], ["c", "b"]) == [0, 1]  # another model: order, and the load says so
    assert match_folders([None, "b"], ["b", "a"]) == [0, 1]
    # equal fingerprints: each takes the folder saved for the prepared model it steps, the rest in order
    assert match_folders(["a", "a"], ["a", "a"], [0, 1], [1, 0]) == [1, 0]
    assert match_folders(["a", "a", "b"], ["b", "a", "a"], [None, 0, 2], [2, 1, 0]) == [1, 2, 0]
    assert match_folders(["a", "b"], ["b", "a"], [0, 1], [0, 1]) == [1, 0]  # fingerprints first


def test_each_scheduler_takes_the_file_saved_with_its_optimizers_folder():
    """Which prepared scheduler takes each `scheduler_<k>.bin`: a canzona optimizer's scheduler the
    one recorded in its folder's manifest (several in order), others their own position's; None
    where the record cannot tell (an older save, other schedulers than the save's)."""
    from canzona.integrations.accelerate import scheduler_order

    assert scheduler_order([0, 1], [1, 0], [[0], [1]]) == [1, 0]
    assert scheduler_order([0, 1], [0, 1], [[1], [0]]) == [1, 0]  # schedulers alone prepared swapped
    assert scheduler_order([None, 1, 0], [1, 0], [[1], [2]]) == [0, 1, 2]
    assert scheduler_order([0, 0, None], [0], [[1, 0]]) == [1, 0, 2]
    assert scheduler_order([], [1, 0], [[], []]) == []
    assert scheduler_order([0, 1], [1, 0], [None, None]) is None  # an older save
    # a plain scheduler takes the files no folder recorded, in order (before: its own position's, so
    # swapped with a canzona one each took the other's file)
    assert scheduler_order([None, 0], [0], [[0]]) == [1, 0]
    assert scheduler_order([0, None], [0], [[1]]) == [1, 0]
    assert scheduler_order([None, 1, None, 0], [1, 0], [[3], [1]]) == [0, 3, 2, 1]
    # not those of the save: one error, whether or not the optimizers moved (before: None, and the
    # load went on by position where they had not)
    for wraps, folders, saved in (([0, 1], [1, 0], [[], []]), ([0, 0, 1], [0, 1], [[0], [1]]),
                                  ([0, None], [0], [[0, 1]]), ([0, 1], [0, 1], [[0], [2]])):
        with pytest.raises(CanzonaError, match=r"scheduler\(s\) prepared are not those of the save"):
            scheduler_order(wraps, folders, saved)


def test_a_plain_scheduler_takes_no_dropped_optimizers_file_nor_one_the_save_did_not_write():
    """`saved` holds every folder the save wrote, those of optimizers not prepared now too, and
    `files` how many scheduler files it wrote: a plain scheduler takes only a file no folder
    recorded and the save wrote, among those accelerate reads (the first `len(wraps)`), or the load
    is one error. Before: the load passed the records of the prepared optimizers' folders alone, and
    files past the save's counted as free, so a plain scheduler took a dropped optimizer's file
    silently, or a file that was never written."""
    from canzona.integrations.accelerate import scheduler_order

    for wraps, folders, saved, files in (([0, None], [0], [[0], [1]], 3),  # would need file 2: unread
                                         ([0, None, None], [0], [[0], [1]], 3),
                                         ([0, 1, None, None], [0, 1], [[0], [1]], 3)):  # no file 3
        with pytest.raises(CanzonaError, match=r"prepared are not those of the save"):
            scheduler_order(wraps, folders, saved, files)
    assert scheduler_order([0], [0], [[0], [1]], 3) == [0]  # the files left unread are the last
    assert scheduler_order([0, None], [0], [[0], []], 2) == [0, 1]  # the dropped optimizer had none
    assert scheduler_order([None, 0], [1], [[], [0]], 2) == [1, 0]
    assert scheduler_order([0, None], [0], [[0], [2]], 3) == [0, 1]


def test_devices_are_the_same_memory_however_spelled():
    assert same_device("cpu", "cpu:0") and same_device(torch.device("cpu", 3), "cpu")
    assert not same_device("cpu", "meta")
    assert same_device("cuda:1", torch.device("cuda", 1)) and not same_device("cuda:0", "cuda:1")


def test_a_parameter_on_another_device_is_one_error_line():
    with pytest.raises(CanzonaError, match=r"^parameter 'w' is on meta but training runs on cpu:0: move") as e:
        check_on_device([("w", torch.empty(2, device="meta"))], "cpu:0")
    assert "\n" not in str(e.value)
    check_on_device([("w", torch.empty(2))], "cpu:0")  # the same memory: nothing to say


def test_state_dicts_get_storage_of_their_own_and_keep_tied_weights_tied():
    buffer = torch.arange(10.0)
    state = {"a": buffer[:4].view(2, 2), "b": buffer[4:], "tied": buffer[:4].view(2, 2), "step": 3}
    out = own_storage(state)
    assert type(out).__name__ == "OrderedDict" and list(out) == list(state) and out["step"] == 3
    assert out["a"] is out["tied"]  # one copy, as the tied weights were one tensor
    assert out["a"].untyped_storage().data_ptr() != out["b"].untyped_storage().data_ptr()
    assert out["a"].untyped_storage().nbytes() == 16 and torch.equal(out["b"], buffer[4:])
    assert own_storage(state, keep=False) == {}  # a rank that writes no file keeps nothing


def test_the_trainer_takes_canzona_optimizers_only():
    model = nn.Linear(2, 2)
    with pytest.raises(CanzonaError, match="^CanzonaTrainer trains with a canzona DistributedOptimizer, but optimizers= "
                                           "holds a SGD"):
        CanzonaTrainer(model=model, optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
    with pytest.raises(CanzonaError, match="^CanzonaTrainer does not take optimizer_cls_and_kwargs"):
        CanzonaTrainer(model=model, optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}))
    with pytest.raises(CanzonaError, match="^optimizer_kwargs: DistributedOptimizer has no argument 'polcy'"):
        check_optimizer_kwargs({"polcy": "canzona"})
    assert check_optimizer_kwargs({"policy": "sc", "reduce_scatter": "loops"}) == {"policy": "sc", "reduce_scatter": "loops"}


def test_a_given_scheduler_of_another_optimizer_is_one_error_at_construction(tmp_path, one_rank):
    """`CanzonaTrainer(optimizers=(None, scheduler))`: the scheduler was built over another optimizer
    than the one CanzonaTrainer builds (it cannot be over that one), so it stepped that other
    optimizer's rates while the model trained at constant ones, and the AdamW rate was read from
    its last rates by this optimizer's group index (an IndexError in the first log, or another
    group's rate). Likewise `(opt, scheduler over another optimizer)`. Now one CanzonaError at
    construction; a scheduler of the given optimizer is taken as before."""
    from transformers import TrainingArguments, get_scheduler

    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CanzonaError, match=r"^optimizers=\(None, LambdaLR\): the scheduler steps a SGD, not the "
                                           "DistributedOptimizer CanzonaTrainer trains with"):
        CanzonaTrainer(model=model, args=args, optimizers=(None, get_scheduler("linear", sgd, 0, 10)))
    opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "muon", {"lr": 0.02}, {"lr": 3e-3})
    with pytest.raises(CanzonaError, match=r"^optimizers=\(DistributedOptimizer, LambdaLR\): the scheduler steps "
                                           "another optimizer"):
        CanzonaTrainer(model=model, args=args, optimizers=(opt, get_scheduler("linear", sgd, 0, 10)))
    own = get_scheduler("linear", opt, 0, 10)
    assert CanzonaTrainer(model=model, args=args, optimizers=(opt, own)).lr_scheduler is own


def given_schedule_warnings(tmp_path):
    """`told(kind, kwargs)`: the floor warnings of `CanzonaTrainer(optimizers=(opt, get_scheduler(kind,
    opt, ...)))` over a canzona optimizer of matrix rate 0.02 and AdamW rate 3e-3."""
    import warnings

    from transformers import TrainingArguments, get_scheduler

    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "muon", {"lr": 0.02}, {"lr": 3e-3})

    def told(kind: str, kwargs: dict) -> list[str]:
        scheduler = get_scheduler(kind, opt, 1, 6, scheduler_specific_kwargs=kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            CanzonaTrainer(model=model, args=args, optimizers=(opt, scheduler))
        return [str(w.message) for w in caught if "transformers schedule" in str(w.message)]
    return told


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_a_given_schedules_floor_is_warned_of_as_on_the_accelerate_path(tmp_path, one_rank):
    """`CanzonaTrainer(optimizers=(opt, get_scheduler("cosine_with_min_lr", opt, ..., {"min_lr": 1e-4})))`:
    a schedule the user built keeps transformers' reading of the floor (of the matrix rate), as on
    the accelerate path, but the Trainer does not `prepare` a given scheduler, so the warning
    `CanzonaAccelerator.prepare` gives was never given (silently: the AdamW groups end at
    3e-3 * 1e-4 / 0.02). Now the same warning at construction; none for a schedule built by the
    Trainer (its floor is measured against the AdamW rate) or without a floor."""

    told = given_schedule_warnings(tmp_path)
    (message,) = told("cosine_with_min_lr", {"min_lr": 1e-4})
    assert f"the AdamW groups at {3e-3 * 1e-4 / 0.02:g}" in message and "min_lr_rate=F/0.003" in message, message
    assert told("cosine", {}) == []
    # once a job: not on the other ranks (before: every rank warned)
    import canzona.integrations.hf as hf
    original = hf.dist.get_rank
    hf.dist.get_rank = lambda *a, **k: 1
    try:
        assert told("cosine_with_min_lr", {"min_lr": 1e-4}) == []
    finally:
        hf.dist.get_rank = original


def test_an_optim_other_than_adamw_is_one_error_at_construction(tmp_path, one_rank):
    """`TrainingArguments(optim="sgd")` (or adafactor, lion, ...): the plain Trainer trains that
    optimizer, and CanzonaTrainer built AdamW on the non-matrix parameters all the same, silently.
    Now one CanzonaError at construction (the arguments are alike on every rank); torch's AdamW
    under any of its names, the default included, and a given optimizer (whose `optim` the
    Trainer ignores too) are accepted."""
    from transformers import TrainingArguments

    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    def args(**kw) -> TrainingArguments:
        return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)

    for optim in ("sgd", "adafactor"):
        with pytest.raises(CanzonaError, match=rf"^TrainingArguments\(optim='{optim}'\): CanzonaTrainer builds muon on "
                                               r"the matrices and torch's AdamW on the rest") as e:
            CanzonaTrainer(model=model, args=args(optim=optim))
        assert "\n" not in str(e.value)
    for optim in ("adamw_torch", "adamw_torch_fused"):
        CanzonaTrainer(model=model, args=args(optim=optim))
    CanzonaTrainer(model=model)  # the default arguments
    opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model))
    CanzonaTrainer(model=model, args=args(optim="sgd"), optimizers=(opt, None))

    # a create_optimizer of the user's own ignores `optim`, as the plain Trainer's override does:
    # accepted (before: refused at construction); one that builds through CanzonaTrainer's is refused
    class Own(CanzonaTrainer):
        def create_optimizer(self, model=None):
            self.optimizer = DistributedOptimizer(named_parameters(self.model), ModelSpec.from_module(self.model))
            return self.optimizer

    class Through(CanzonaTrainer):
        def create_optimizer(self, model=None):
            return super().create_optimizer(model)

    del opt  # one optimizer per model
    assert isinstance(Own(model=model, args=args(optim="sgd")).create_optimizer(), DistributedOptimizer)
    with pytest.raises(CanzonaError, match=r"^TrainingArguments\(optim='sgd'\): CanzonaTrainer builds muon "):
        Through(model=model, args=args(optim="sgd")).create_optimizer()


def test_a_trainer_run_without_a_process_group_is_one_error_naming_torchrun(tmp_path):
    """`python script.py` (no torchrun): the Trainer sets up no process group; building the
    optimizer says so in one line instead of torch's 'Default process group has not been
    initialized' traceback from deep inside the runtime."""
    import torch.distributed as dist
    from transformers import TrainingArguments

    if dist.is_initialized():
        pytest.skip("this process has a process group")
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    trainer = CanzonaTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))
    with pytest.raises(CanzonaError, match=r"^CanzonaTrainer needs torch\.distributed initialised .* launch with "
                                           r"torchrun --nproc-per-node N \(1 for one process") as e:
        trainer.create_optimizer()
    assert "\n" not in str(e.value)


def test_a_transformers_without_the_overridden_methods_is_named_in_one_line():
    from transformers import Trainer

    class Lost(Trainer):  # a transformers whose Trainer lost a private method CanzonaTrainer overrides
        _load_optimizer_and_scheduler = None

    class Changed(Trainer):  # ... or takes other parameters in it
        def _move_model_to_device(self, model, device, non_blocking):
            pass

    with pytest.raises(CanzonaError, match=r"has no Trainer\._load_optimizer_and_scheduler: .* tested with transformers 5\.23\.0"):
        check_trainer(Lost)
    with pytest.raises(CanzonaError, match=r"changed Trainer\._move_model_to_device\(self, model, device, non_blocking\): "):
        check_trainer(Changed)
    check_trainer()  # the installed one has them


# --- the optimizer folders: complete or invisible, checked before they are read ------------------
# (integrations_checkpoint_driver.py's scenarios, in this file's launch, on a bf16 model with fp32
# master weights) a save killed before its rename leaves the previous optimizer folder as it was
# (and loadable); a model/optimizer mix (the framework's model files written, the optimizer's not)
# is refused, and a save resumed whole is not; a damaged optimizer file is one error line; a folder
# of the older integrations (plain `dcp.save`, no manifest) loads, and saving over it is refused.

MIX = "CheckpointError: the model's weights differ from those the optimizer checkpoint was saved with"


def one_line_on_every_rank(results: list[dict], key: str, start: str) -> None:
    """The same one-line error, starting with `start`, on every rank (after the failing rank's
    number, where the ranks found different things)."""
    texts = {r[key] for r in results}
    assert len(texts) == 1, texts
    text = re.sub(r"^CheckpointError: rank \d+: ", "CheckpointError: ", texts.pop())
    assert text.startswith(start) and "\n" not in text, text


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["accelerate", "trainer"])
def test_a_killed_save_into_a_reused_folder_keeps_the_previous_optimizer_state(ranks, name):
    results = scenario(ranks, f"checkpoint {name}")
    one_line_on_every_rank(results, "killed", "CheckpointError: ")
    assert "killed before the rename" in results[0]["killed"]
    for r in results:
        assert r["same manifest"]  # verified against its manifest: the previous save's files, whole
        assert not [n for n in r["after kill"] if ".tmp-" in n or ".old-" in n], r["after kill"]
    if name == "accelerate":
        assert all(r["previous intact"] for r in results)
    else:  # the Trainer's checkpoint-1 resumes as the straight run went on
        assert all(r["resumed exactly"] for r in results)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["accelerate", "trainer"])
def test_model_files_beside_another_saves_optimizer_state_are_refused(ranks, name):
    results = scenario(ranks, f"checkpoint {name}")
    one_line_on_every_rank(results, "mix", MIX)
    assert "different saves" in results[0]["mix"] and "fp32 master weights" in results[0]["mix"]
    if name == "accelerate":
        assert all(r["mix changed nothing"] for r in results)


@pytest.mark.distributed
def test_a_whole_save_resumes_exactly_and_is_not_refused(ranks):
    for r in scenario(ranks, "checkpoint accelerate"):
        assert r["resume"] == "no error" and r["resumed exactly"]
        assert r["fresh resume"] == "no error" and r["fresh resumed exactly"]


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["accelerate", "trainer"])
def test_a_damaged_optimizer_file_is_one_error_line(ranks, name):
    results = scenario(ranks, f"checkpoint {name}")
    one_line_on_every_rank(results, "damaged", "CheckpointError: ")
    assert "differs from the manifest" in results[0]["damaged"]


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["accelerate", "trainer"])
def test_an_older_folder_without_manifest_loads_and_is_not_saved_over(ranks, name):
    results = scenario(ranks, f"checkpoint {name}")
    for r in results:
        assert r["legacy resumed exactly"] if name == "trainer" else (r["legacy"] == "no error"
                                                                      and r["legacy loaded exactly"])
        assert r["legacy untouched"]
    one_line_on_every_rank(results, "save over legacy", "CheckpointError: ")
    assert "older canzona" in results[0]["save over legacy"] and "move it aside" in results[0]["save over legacy"]
    if name == "trainer":  # the Trainer's own save refuses before it writes the step's model files
        one_line_on_every_rank(results, "trainer save over legacy", "CheckpointError: ")
        assert "now holds this step's model files" not in results[0]["trainer save over legacy"]
        assert all(r["model files untouched"] for r in results)


@pytest.mark.distributed
def test_a_checkpoint_folder_or_file_on_one_ranks_disk_only_is_one_error_on_every_rank(ranks):
    """One disk per node: the folder named (or its canzona_optimizer/) there on rank 0, not on rank 1.
    Before (review): whether a rank joined the check of its own files hung on its own isdir, so
    rank 1 went on while rank 0 waited in all_gather_object (and a rank lacking canzona_optimizer/
    raised alone before the optimizer's load's agreed read). Now every rank joins, the checks inside."""
    results = scenario(ranks, "checkpoint trainer rank files")
    one_line_on_every_rank(results, "folder on rank 0 only", "CheckpointError: ")
    assert results[0]["folder on rank 0 only"].startswith("CheckpointError: rank 1: ")
    assert results[0]["folder on rank 0 only"].endswith("elsewhere/checkpoint-1: no such folder")
    one_line_on_every_rank(results, "optimizer on rank 0 only", "CheckpointError: ")
    assert results[0]["optimizer on rank 0 only"].startswith("CheckpointError: rank 1: ")
    assert "holds no canzona_optimizer/" in results[0]["optimizer on rank 0 only"]
    # (before, review: "scheduler.pt cannot be read (FileNotFoundError ...): a damaged file")
    one_line_on_every_rank(results, "scheduler on rank 0 only", "CheckpointError: ")
    assert results[0]["scheduler on rank 0 only"].startswith("CheckpointError: rank 1: ")
    assert results[0]["scheduler on rank 0 only"].endswith("node-scheduler/checkpoint-1: scheduler.pt missing")


@pytest.mark.distributed
def test_the_latest_whole_checkpoint_is_searched_with_every_ranks_own_files(ranks):
    """`resume_from_checkpoint=True`, rank 1 killed while writing its rng_state_1.pth of the last
    save (transformers writes the RNG files per rank, no barrier). Before (review): rank 0 searched
    alone, checking its own files, so the folder taken held rank 1's damaged file and the whole job
    stopped (a damaged rng_state_0.pth was skipped). Now every rank checks its own files of each
    folder, newest first, and all go on to the same one; rank 0's warning names the rank and file."""
    results = scenario(ranks, "checkpoint trainer rank files")
    for r in results:
        assert r["latest, rank 1's rng damaged"].startswith("resumes from ") and \
            r["latest, rank 1's rng damaged"].endswith("rank_files/checkpoint-1"), r["latest, rank 1's rng damaged"]
    (told,) = results[0]["latest warnings"]
    assert "skipping checkpoint-2 (rank 1: rng_state_1.pth cannot be read (" in told, told
    assert results[1]["latest warnings"] == []  # said once


@pytest.mark.distributed
def test_the_trainer_resumes_from_the_latest_whole_checkpoint(ranks):
    """`resume_from_checkpoint=True` skips the folders of saves killed midway (transformers picks
    the highest step and fails in its model, optimizer or trainer_state.json loading); none whole:
    one error line on every rank, naming them."""
    results = scenario(ranks, "checkpoint trainer")
    for r in results:
        assert r["latest resume"] == "no error" and r["latest resumed exactly"], r["latest resume"]
    one_line_on_every_rank(results, "none whole", "CheckpointError: resume_from_checkpoint=True: no whole checkpoint in ")
    one_line_on_every_rank(results, "named partial", "CheckpointError: ")
    assert "checkpoint-2 is not a whole CanzonaTrainer checkpoint (no trainer_state.json" in results[0]["named partial"]
    assert all(r["legacy latest resumed exactly"] for r in results)  # an older canzona's folder counts
    assert "checkpoint-3 (no canzona_optimizer/manifest.json)" in results[0]["none whole"]


@pytest.mark.distributed
def test_accelerate_load_state_takes_the_latest_whole_automatic_checkpoint(ranks):
    """`load_state()` under automatic checkpoint naming after a save_state killed midway: accelerate
    takes the highest number; the integration the latest folder whose optimizer folders are in."""
    results = scenario(ranks, "checkpoint accelerate automatic")
    for r in results:
        assert "killed before the rename" in r["killed"]
        assert r["folders"] == ["checkpoint_1", "checkpoint_2"], r["folders"]  # total_limit=2 rotated checkpoint_0
        assert r["latest"] == "no error" and r["latest loaded exactly"], r["latest"]
        assert r["legacy latest"] == "no error" and r["legacy latest loaded exactly"], r["legacy latest"]
        # (a CheckpointError, a CanzonaError: the folder check is one round on every rank, so a rank
        # whose disk lacks the folder fails every rank rather than hang the others)
        assert r["named"].startswith("CheckpointError: ") and "holds no canzona_optimizer_0/" in r["named"], r["named"]
        assert r["named changed nothing"]


@pytest.mark.distributed
def test_a_tp_models_save_state_keeps_it_whole_on_the_writer_only_and_load_state_cuts_each_shard(ranks):
    """A TP model over both ranks (ColwiseParallel then RowwiseParallel: Shard(0), Shard(1) and a
    Replicate bias) through CanzonaAccelerator.save_state, every local shard moved, load_state.
    get_state_dict keeps the gathered weights on the CPU of the rank that writes the files only
    (before: every rank kept the whole model, on its device); the load gathers nothing (before: one
    full_tensor per DTensor, for safetensors' look at the names) and puts every rank's own part back
    bit for bit (a cut from another rank's box fails here; on the one-rank mesh below it could not)."""
    results = scenario(ranks, "checkpoint accelerate dtensors")
    assert results[0]["placements"] == {"a.weight": "(Shard(dim=0),)", "a.bias": "(Shard(dim=0),)",
                                        "b.weight": "(Shard(dim=1),)", "b.bias": "(Replicate(),)"}
    assert results[0]["kept"] == {"a.weight": ((32, 16), "cpu", True), "a.bias": ((32,), "cpu", True),
                                  "b.weight": ((8, 32), "cpu", True), "b.bias": ((8,), "cpu", True)}
    assert results[1]["kept"] == {}
    for r in results:
        assert r["load"] == "no error" and r["load gathers"] == 0 and r["differ"] == [], (r["load"], r["differ"])


@pytest.mark.distributed
def test_two_optimizers_prepared_in_another_order_resume_exactly(ranks):
    """Two canzona optimizers (on two models) prepared in one order for save_state and in the other
    for load_state: each optimizer reads its own folder, found by the model's fingerprint saved in
    the folder's manifest, and the state and weights come back bit for bit. Before: the folders
    were taken in order, and each optimizer was refused another model's state ("PlanError:
    checkpoint is of model '_TwoLinears' ..., not 'Sequential'")."""
    for r in scenario(ranks, "checkpoint accelerate two optimizers"):
        assert r["swapped"] == "no error" and r["swapped exactly"] == [True, True], r["swapped"]
        # with their schedulers, which accelerate loads by prepare order: the save records which
        # scheduler file each optimizer's scheduler wrote, and the load hands each its own (before:
        # refused, since each would take the other optimizer's schedule)
        assert r["swapped with schedulers"] == "no error", r["swapped with schedulers"]
        assert r["swapped with schedulers exactly"] == [True, True] and r["schedulers' own rates"] == [True, True]
        # a save without that record (an older canzona's): still refused, before anything is loaded
        assert "prepared in another order than at the save" in r["older swapped with schedulers"], \
            r["older swapped with schedulers"]
        assert r["older swapped with schedulers untouched"]


@pytest.mark.distributed
def test_optimizers_of_one_architecture_prepared_in_another_order_resume_as_the_straight_run(ranks):
    """Two models of one architecture (one fingerprint), each with its optimizer and LambdaLR (other
    rates), their optimizers and schedulers prepared in the other order for load_state: each
    optimizer takes the folder saved for the prepared model it steps (recorded in the manifest) and
    each scheduler the file of its optimizer's scheduler, so two steps after the load give the
    straight run's state, weights and rates bit for bit. Before: the folders were taken by order,
    and the load refused with a CheckpointError blaming the files ("come from different saves")."""
    for r in scenario(ranks, "checkpoint accelerate one architecture"):
        assert r["rates differ"]
        assert r["swapped"] == "no error" and r["swapped exactly"] == [True, True], r["swapped"]
        assert r["resumed"] == "no error" and r["resumed exactly"] == [True, True], r["resumed"]
        # saved with the schedulers built on the prepared optimizers, and a plain torch one (before:
        # accelerate links such a scheduler to every optimizer, and the save recorded both as the
        # first optimizer's): each scheduler its own base rates, step count and last rates, and the
        # straight run's two steps, with the schedulers alone swapped, and a plain scheduler first
        # (before: each took its position's file)
        for case in ("resumed", "resumed on prepared", "resumed plain first"):
            assert r[case] == "no error" and r[f"{case} schedulers"], (case, r[case])
            assert r[f"{case} exactly"] == [True, True], (case, r[f"{case} exactly"])
        # a scheduler the save did not have: one error before anything is loaded (before: by position)
        assert "prepared are not those of the save" in r["another scheduler"], r["another scheduler"]
        assert r["another scheduler untouched"]
        # fewer optimizers than at the save, plain schedulers beside the one left (before: a plain one
        # took the dropped optimizer's scheduler file, its base rates and step count, silently), and
        # a plain scheduler more than the save wrote files for (before: given a file never written,
        # which accelerate failed to find after loading the models): one error before anything is
        # loaded, on every rank
        for case in ("fewer optimizers", "fewer optimizers as many schedulers", "more schedulers"):
            assert "prepared are not those of the save" in r[case], (case, r[case])
            assert r[f"{case} untouched"], case


@pytest.mark.distributed
def test_get_state_dict_of_a_plain_model_is_whole_on_every_rank(ranks):
    """`accelerator.get_state_dict(model)` of a ZeRO-1 model of plain tensors, called on every rank
    as with DDP: the whole state on each. Before: empty off the main process, as accelerate's FSDP2
    state dict. The writing rank gets CPU copies of their own (safetensors drops tensors that share
    storage); the others the parameters themselves, as accelerate gives under DDP, not one host copy
    of the model per rank (found by the review). Inside save_state, where only the main process
    writes, the other ranks copy nothing; a TP model's (DTensor) state stays on the writer only
    (above)."""
    results = scenario(ranks, "checkpoint accelerate two optimizers")
    for rank, r in enumerate(results):
        assert r["state dict"] == {"a.weight": True, "a.bias": True, "b.weight": True, "b.bias": True}, rank
        assert r["state dict copied"] == [rank == 0] * 4, (rank, r["state dict copied"])
        assert r["save_state keeps"] == [rank == 0] * 2, (rank, r["save_state keeps"])


def test_a_config_objects_default_weight_decay_beside_another_trainer_decay_is_warned_of(tmp_path, one_rank):
    """`MuonConfig(lr=0.02, weight_decay=0.1)` (MuonConfig's default) beside the Trainer's 0.0: the
    default reads as unset, so the matrices decay at 0.0 (above), which a user who set 0.1 on purpose
    was not told. Now one warning names both values; none where they are equal or a mapping gives it."""
    import warnings

    from transformers import TrainingArguments

    def built(matrix_config, weight_decay: float) -> list[str]:
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], weight_decay=weight_decay)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            CanzonaTrainer(model=model, args=args, matrix_config=matrix_config).create_optimizer()
        return [str(w.message) for w in caught if "matrix_config's weight_decay" in str(w.message)]

    (message,) = built(MuonConfig(lr=0.02, weight_decay=0.1), 0.0)
    assert "weight_decay 0.1 is MuonConfig's default" in message and "weight_decay 0.0" in message, message
    # the commonest case, MuonConfig's decay left alone beside TrainingArguments' default 0.0, is told
    # too, on purpose: an object cannot say whether its default was chosen, and a Muon user who built
    # MuonConfig may expect its 0.1 (review: decided, not an accident of the rule)
    assert built(MuonConfig(lr=0.02), 0.0) == [message]
    assert built(MuonConfig(lr=0.02), 0.1) == []
    assert built({"lr": 0.02, "weight_decay": 0.1}, 0.0) == []


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_a_schedules_absolute_floor_is_the_adamw_rates(tmp_path, one_rank):
    """transformers' `cosine_with_min_lr`, `cosine_warmup_with_min_lr` (`min_lr`) and `polynomial`
    (`lr_end`) turn their absolute floor into a ratio of `optimizer.defaults["lr"]`, which for a
    canzona optimizer is the matrix rate (0.02): the AdamW groups bottomed out at 3e-3 * 1e-4 / 0.02
    = 1.5e-5, not at the 1e-4 asked for. Now the ratio is of the AdamW rate (`learning_rate`): the
    AdamW groups' rate at every step is, bit for bit, what the schedule gives torch's AdamW at
    `learning_rate` under transformers' own Trainer (its floor exactly 1e-4), and the matrix groups'
    is the same factor of 0.02 (floor 0.02 * 1e-4 / 3e-3)."""
    from transformers import TrainingArguments, get_scheduler

    lr, matrix_lr, floor, steps = 3e-3, 0.02, 1e-4, 6
    for kind, kwargs in (("cosine_with_min_lr", {"min_lr": floor}), ("cosine_warmup_with_min_lr", {"min_lr": floor}),
                         ("polynomial", {"lr_end": floor})):
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], learning_rate=lr,
                                 lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs, warmup_steps=1)
        trainer = CanzonaTrainer(model=model, args=args, matrix_config={"lr": matrix_lr})
        opt = trainer.create_optimizer()
        kept = dict(opt.defaults)
        scheduler = trainer.create_scheduler(steps, opt)
        assert opt.defaults == kept  # the matrix rate is restored once the schedule is built
        plain = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=lr)  # transformers' own Trainer's
        reference = get_scheduler(kind, plain, num_warmup_steps=1, num_training_steps=steps,
                                  scheduler_specific_kwargs=kwargs)
        kinds = [g["kind"] for g in opt.param_groups]
        seen = []
        for step in range(steps + 1):
            factor = reference.lr_lambdas[0](step)
            for g in opt.param_groups:
                want = plain.param_groups[0]["lr"] if g["kind"] == "adamw" else matrix_lr * factor
                assert g["lr"] == want, (kind, step, g["kind"], g["lr"], want)
            seen.append({k: g["lr"] for k, g in zip(kinds, opt.param_groups)})
            scheduler.step()
            reference.step()
        decay = seen[1:]  # (past the warm-up step, which starts at 0)
        assert min(s["adamw"] for s in decay) == floor, (kind, seen)
        assert min(s["matrix"] for s in decay) == pytest.approx(matrix_lr * floor / lr, rel=1e-15), (kind, seen)
        del trainer, opt, scheduler  # one optimizer per model
    # no AdamW group (bias-free matrices only): the floor is the matrix rate's, as the plain Trainer
    # would take it of the only rate that steps. Before (review): of the unused learning_rate, 5e-5,
    # so polynomial refused lr_end 1e-4 as "must be smaller than initial lr" beside a 0.02 rate
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], learning_rate=5e-5,
                             lr_scheduler_type="polynomial", lr_scheduler_kwargs={"lr_end": floor}, warmup_steps=1)
    opt = CanzonaTrainer(model=model, args=args, matrix_config={"lr": matrix_lr}).create_optimizer()
    assert {g["kind"] for g in opt.param_groups} == {"matrix"}
    scheduler = CanzonaTrainer(model=model, args=args, optimizers=(opt, None)).create_scheduler(steps, opt)
    for _ in range(steps + 1):
        scheduler.step()
    assert {g["lr"] for g in opt.param_groups} == {floor}


@pytest.mark.parametrize("kind", ["reduce_lr_on_plateau", "greedy"])
def test_a_plateau_schedules_floor_is_the_adamw_rates(tmp_path, one_rank, kind):
    """transformers' `reduce_lr_on_plateau` (torch's ReduceLROnPlateau) and `greedy` (GreedyLR)
    take `lr_scheduler_kwargs={"min_lr": x}` as one absolute floor for every group: the matrix
    groups (0.02) and the AdamW groups (3e-3) both ended at x, their ratio lost. Now x is measured
    against the AdamW rate (`learning_rate`), as the cosine / polynomial floors are: each group's
    floor is x times its initial rate over the AdamW rate (a list, which both take), so the AdamW
    groups step, bit for bit, as torch's AdamW at `learning_rate` under the plain Trainer (floor x),
    the matrices by the same factor (floor 0.02 * x / 3e-3); a group with its own rate (1e-3) by
    its own. GreedyLR's ceiling `max_lr` (given or its default 1.0) is scaled alike; a list given
    per group is the user's own and kept."""
    import inspect

    from transformers import TrainingArguments, get_scheduler
    from transformers.optimization import GreedyLR  # (pinned transformers 5.23.0 has it)

    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    lr, matrix_lr, own_lr, floor = 3e-3, 0.02, 1e-3, 1e-4
    kwargs = {"min_lr": floor, "factor": 0.5, "patience": 0}
    if kind == "greedy":
        kwargs.update(threshold_mode="abs", threshold=0.0, max_lr=5e-3)

    def plateau(trainer_kwargs: dict, given: bool):
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], learning_rate=lr,
                                 lr_scheduler_type=kind, lr_scheduler_kwargs=trainer_kwargs, eval_strategy="steps")
        if given:  # the first Linear in a group of its own rate
            pairs = list(named_parameters(model))
            opt = DistributedOptimizer([{"params": pairs[:2], "lr": own_lr}, {"params": pairs[2:]}],
                                       ModelSpec.from_module(model), "muon", {"lr": matrix_lr}, {"lr": lr})
            trainer = CanzonaTrainer(model=model, args=args, optimizers=(opt, None), eval_dataset=[{}])
        else:
            trainer = CanzonaTrainer(model=model, args=args, matrix_config={"lr": matrix_lr}, eval_dataset=[{}])
            opt = trainer.create_optimizer()
        return opt, trainer.create_scheduler(10, opt)

    plain = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=lr)  # transformers' own Trainer's
    reference = get_scheduler(kind, plain, scheduler_specific_kwargs=kwargs)
    for given in (False, True):
        opt, scheduler = plateau(kwargs, given)
        reference.load_state_dict(get_scheduler(kind, plain, scheduler_specific_kwargs=kwargs).state_dict())
        plain.param_groups[0]["lr"] = lr
        initial = [g["lr"] for g in opt.param_groups]
        ratios = [r / lr for r in initial]
        assert ratios.count(1.0) >= 1 and (given or set(ratios) == {1.0, matrix_lr / lr})
        metrics = [1.0] * 12 if kind == "reduce_lr_on_plateau" else [1.0] * 12 + [1.0 - k for k in range(1, 40)]
        for metric in metrics:
            scheduler.step(metric)
            reference.step(metric)
            for g, r in zip(opt.param_groups, ratios):
                want = plain.param_groups[0]["lr"]
                assert g["lr"] == (want if r == 1.0 else pytest.approx(want * r, rel=1e-12)), (given, g["kind"], g["lr"])
            if metric == 1.0:
                lows = [g["lr"] for g in opt.param_groups]
        assert lows == [floor if r == 1.0 else pytest.approx(floor * r, rel=1e-15) for r in ratios], (given, lows)
        if kind == "greedy":  # back up to the ceiling 5e-3, each group by its own rate
            assert [g["lr"] for g in opt.param_groups] == [5e-3 if r == 1.0 else pytest.approx(5e-3 * r, rel=1e-15)
                                                            for r in ratios]
        del opt, scheduler
    # a second train() builds the schedule again (transformers drops the one it built) over rates
    # the first reduced: the bounds stay of the initial rates (before: of the reduced ones, so the
    # AdamW groups' floor fell to x times the reduction)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], learning_rate=lr,
                             lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs, eval_strategy="steps")
    trainer = CanzonaTrainer(model=model, args=args, matrix_config={"lr": matrix_lr}, eval_dataset=[{}])
    opt = trainer.create_optimizer()
    first = trainer.create_scheduler(10, opt).min_lrs
    for metric in [1.0] * 3:
        trainer.lr_scheduler.step(metric)
    assert opt.param_groups[0]["lr"] < matrix_lr
    trainer.lr_scheduler = None
    assert trainer.create_scheduler(10, opt).min_lrs == first
    del trainer, opt
    # a list per group: the user's own floors, kept
    opt, scheduler = plateau({**kwargs, "min_lr": [floor] * 2}, False)
    assert len(opt.param_groups) == 2 and scheduler.min_lrs == [floor] * 2
    if kind == "greedy":  # the default ceiling (1.0) is scaled too: the AdamW groups' stays 1.0
        opt, scheduler = plateau({k: v for k, v in kwargs.items() if k != "max_lr"}, False)
        default = inspect.signature(GreedyLR).parameters["max_lr"].default
        assert [m for m, g in zip(scheduler.max_lrs, opt.param_groups) if g["kind"] == "adamw"] == [default]
        assert {m for m, g in zip(scheduler.max_lrs, opt.param_groups) if g["kind"] == "matrix"} == \
            {default * (matrix_lr / lr)}


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_adamw_groups_of_other_rates_are_logged_each_under_a_key_of_its_own(tmp_path, one_rank):
    """`learning_rate_adamw` is the first AdamW group's rate; an AdamW group at another rate (a
    group of its own `lr`) was not logged at all. Now each AdamW group whose base rate differs from
    the first's is logged as `learning_rate_adamw_<group index>` (canzona's groups carry no names),
    right after `learning_rate_adamw`, at the same moment; groups at the first's rate (the Trainer's
    no-weight-decay group) add no key, and the keys are fixed by the base rates, the same every step
    (a warm-up at 0 does not merge them)."""
    from transformers import TrainingArguments

    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    lr, own_lr, steps = 3e-3, 1e-3, 4
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 2))
    pairs = list(named_parameters(model))  # 0.weight 0.bias | 1.weight 1.bias | 2.* | 3.*
    opt = DistributedOptimizer([{"params": pairs[:2], "lr": own_lr}, {"params": pairs[2:4], "weight_decay": 0.0},
                                {"params": pairs[4:]}], ModelSpec.from_module(model), "muon", {"lr": 0.02}, {"lr": lr})
    adamw = [i for i, g in enumerate(opt.param_groups) if g["kind"] == "adamw"]
    assert [opt.param_groups[i]["lr"] for i in adamw] == [own_lr, lr, lr]
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], learning_rate=lr,
                             lr_scheduler_type="linear", warmup_steps=1)
    trainer = CanzonaTrainer(model=model, args=args, optimizers=(opt, None))
    trainer.create_scheduler(steps, opt)
    for step in range(steps):
        first = trainer._get_learning_rate()
        trainer.log({"loss": 1.0, "learning_rate": first, "grad_norm": 0.5})
        logged = trainer.state.log_history[-1]
        rates = [g["lr"] for g in opt.param_groups]
        assert list(logged)[:5] == ["loss", "learning_rate", "learning_rate_adamw", f"learning_rate_adamw_{adamw[1]}",
                                    "grad_norm"], (step, logged)
        assert logged["learning_rate_adamw"] == rates[adamw[0]] and logged[f"learning_rate_adamw_{adamw[1]}"] == \
            rates[adamw[1]], (step, logged, rates)
        assert step > 0 or rates[adamw[1]] == 0.0  # the warm-up's first step: every rate 0, the keys kept
        trainer.lr_scheduler.step()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_a_transformers_schedules_floor_on_the_accelerate_path_is_warned_of_with_the_floors_it_gives(one_rank):
    """`get_scheduler("cosine_with_min_lr", opt, scheduler_specific_kwargs={"min_lr": 1e-4})` (and
    `cosine_warmup_with_min_lr`, `polynomial`'s `lr_end`) given to `CanzonaAccelerator.prepare`:
    transformers divides the floor by `optimizer.defaults["lr"]`, canzona's matrix rate (0.02), so the
    AdamW groups (3e-3) end at 1.5e-5, not 1e-4. Left as built (see `prepare_scheduler`); before,
    silently. Now one warning at prepare names both floors, which are where the rates end; none for
    a schedule without a floor, or equal matrix and AdamW rates."""
    import warnings

    from transformers import get_scheduler

    from canzona.integrations.accelerate import CanzonaAccelerator
    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    floor, matrix_lr, steps = 1e-4, 0.02, 6

    def prepared(kind: str, kwargs: dict, adamw_lr: float = 3e-3) -> tuple[list[str], dict]:
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "muon", {"lr": matrix_lr},
                                   {"lr": adamw_lr})
        sched = get_scheduler(kind, opt, num_warmup_steps=1, num_training_steps=steps, scheduler_specific_kwargs=kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            CanzonaAccelerator(cpu=True).prepare(model, opt, sched)
        ends = {g["kind"]: float("inf") for g in opt.param_groups}
        for _ in range(steps):  # the lowest rate after the warmup, where the cosine bottoms out
            sched.step()
            ends = {g["kind"]: min(g["lr"], ends[g["kind"]]) for g in opt.param_groups}
        return [str(w.message) for w in caught if "transformers schedule" in str(w.message)], ends

    for kind, kwargs in (("cosine_with_min_lr", {"min_lr": floor}), ("cosine_warmup_with_min_lr", {"min_lr": floor}),
                         ("polynomial", {"lr_end": floor})):
        (message,), ends = prepared(kind, kwargs)
        assert ends["matrix"] == pytest.approx(floor, rel=1e-9), (kind, ends)
        assert ends["adamw"] == pytest.approx(3e-3 * floor / matrix_lr, rel=1e-9), (kind, ends)
        assert f"the matrix groups at {ends['matrix']:g}, the AdamW groups at {ends['adamw']:g}" in message, message
        assert "defaults['lr']" in message and f"min_lr_rate=F/{3e-3:g}" in message, message
    assert prepared("cosine", {})[0] == []
    assert prepared("cosine_with_min_lr", {"min_lr": floor}, adamw_lr=matrix_lr)[0] == []


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_the_floor_warning_is_once_on_the_main_process_at_the_users_line_and_not_for_polynomials_default(
        one_rank, monkeypatch):
    """The floor warning of `CanzonaAccelerator.prepare` (see the test above): `polynomial` without an
    `lr_end` of the user's carries transformers' default 1e-7, which is not warned of (before: every
    polynomial schedule over differing rates warned); a scheduler prepared again is not warned of
    again (before: twice); only the main process warns (before: every rank); the warning points at
    the user's line (before: inside accelerate)."""
    import warnings

    from transformers import get_scheduler

    from canzona.integrations.accelerate import CanzonaAccelerator
    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    def caught(kind: str, kwargs: dict, twice: bool = False) -> list:
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "muon", {"lr": 0.02},
                                   {"lr": 3e-3})
        sched = get_scheduler(kind, opt, num_warmup_steps=1, num_training_steps=6, scheduler_specific_kwargs=kwargs)
        accelerator = CanzonaAccelerator(cpu=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            accelerator.prepare(model, opt, sched)
            if twice:
                accelerator.prepare(sched)
        return [w for w in seen if "transformers schedule" in str(w.message)]

    assert caught("polynomial", {}) == []  # lr_end: transformers' default
    assert len(caught("polynomial", {"lr_end": 1e-4})) == 1
    (once,) = caught("cosine_with_min_lr", {"min_lr": 1e-4}, twice=True)
    assert once.filename == __file__, once.filename  # the user's line, not accelerate's
    monkeypatch.setattr(CanzonaAccelerator, "is_main_process", property(lambda self: False))
    assert caught("cosine_with_min_lr", {"min_lr": 1e-4}) == []


def test_the_floor_warning_reads_every_group_of_a_kind():
    """Every group's rate, not the first of each kind: AdamW groups at the matrix rate and at another
    (before: the first AdamW group's equal to the matrix rate, nothing was said)."""
    from types import SimpleNamespace

    from transformers import get_scheduler

    from canzona.integrations.accelerate import floor_warning

    rates = [("matrix", 0.02), ("adamw", 0.02), ("adamw", 3e-3)]
    sgd = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))], "lr": lr} for _, lr in rates], lr=0.02)
    sched = get_scheduler("cosine_with_min_lr", sgd, num_warmup_steps=1, num_training_steps=6,
                          scheduler_specific_kwargs={"min_lr": 1e-4})
    opt = SimpleNamespace(param_groups=[{"kind": k, "lr": lr} for k, lr in rates], defaults={"lr": 0.02})
    told = floor_warning(sched, opt)
    assert told is not None and f"the AdamW groups at {1e-4:g}, {3e-3 * 1e-4 / 0.02:g}" in told, told


def test_a_plateau_schedules_one_absolute_bound_on_the_accelerate_path_is_warned_of(one_rank, monkeypatch):
    """`ReduceLROnPlateau(opt, min_lr=x)` and transformers' `GreedyLR(opt)` built by the user over a
    canzona optimizer of matrix rate 0.02 and AdamW rate 3e-4, given to `CanzonaAccelerator.prepare`:
    torch and transformers floor every group at the one absolute `min_lr` (GreedyLR: its default
    1e-3 too, and caps at `max_lr`), so the matrices may fall to 5e-4 of their rate while the AdamW
    groups fall to 1/30 of theirs, or (`min_lr` above their rate) are never reduced. Before,
    silently. Now one warning on the main process naming where each kind of group stops and the
    per-group lists to pass; none for per-group lists, `min_lr=0` (ReduceLROnPlateau's default) or
    equal rates. `eps` (1e-8, absolute too) stops a reduction only below about eps / (1 - factor), far
    under 3e-4: not mentioned here; it is where a group starts that low (checked below)."""
    import warnings

    from torch.optim.lr_scheduler import ReduceLROnPlateau
    from transformers.optimization import GreedyLR

    from canzona.integrations.accelerate import CanzonaAccelerator
    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    built: dict[float, tuple] = {}  # one optimizer per AdamW rate, its rates set back for each case

    def told(make, adamw_lr: float = 3e-4) -> tuple[list[str], dict]:
        if adamw_lr not in built:
            model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
            opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "muon", {"lr": 0.02},
                                       {"lr": adamw_lr})
            built[adamw_lr] = (model, opt, [g["lr"] for g in opt.param_groups])
        model, opt, initial = built[adamw_lr]
        for g, lr in zip(opt.param_groups, initial):
            g["lr"] = lr
        sched = make(opt)
        accelerator = CanzonaAccelerator(cpu=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            accelerator.prepare(model, opt, sched)
            accelerator.prepare(sched)  # prepared again: told once
        rates = [g["lr"] for g in opt.param_groups]
        for _ in range(20):  # a plateau all along (factor 0.5, patience 0): where the rates stop
            (sched.scheduler if hasattr(sched, "scheduler") else sched).step(1.0)
        ends = {g["kind"]: g["lr"] for g in opt.param_groups}
        return [str(w.message) for w in caught if "bound" in str(w.message)], ends | {"rates": rates}

    (message,), ends = told(lambda o: ReduceLROnPlateau(o, factor=0.5, patience=0, min_lr=1e-4))
    assert (ends["matrix"], ends["adamw"]) == (1e-4, 1e-4), ends  # what is warned of: one floor for both
    assert "ReduceLROnPlateau" in message and "min_lr 0.0001" in message, message
    assert "the matrix groups (rate 0.02) stop at 0.0001 (0.005 of their rate)" in message, message
    assert "the AdamW groups (rate 0.0003) at 0.0001 (0.333 of theirs)" in message, message
    against_adamw = ", ".join(f"{1e-4 * r / 3e-4:g}" for r in ends["rates"])
    assert f"measured against the AdamW rate (0.0003), min_lr=[{against_adamw}]" in message, message
    assert "eps" not in message, message
    (message,), ends = told(lambda o: ReduceLROnPlateau(o, factor=0.5, patience=0, min_lr=1e-3))
    assert (ends["matrix"], ends["adamw"]) == (1e-3, 3e-4), ends
    assert "the AdamW groups (rate 0.0003) are never reduced (min_lr is not below their rate)" in message, message
    (message,), _ = told(lambda o: GreedyLR(o, patience=0))  # its defaults: min_lr 1e-3, max_lr 1.0 (not told of:
    assert "GreedyLR" in message and "min_lr 0.001" in message and "max_lr" not in message, message  # above every rate)
    # a group starting where eps stops every reduction: said (beside a floor that can bind: above
    # eps / (1 - factor), 5.6e-4; a lower one is negligible and not told of, eps with it)
    (message,), _ = told(lambda o: ReduceLROnPlateau(o, min_lr=1e-3, eps=5e-4))
    assert "eps 0.0005" in message and "AdamW groups at 0.0003 never reduced" in message, message
    # nothing to tell: per-group bounds, no floor, equal rates; and not off the main process
    assert told(lambda o: ReduceLROnPlateau(o, min_lr=[1e-4 * g["lr"] / 3e-4 for g in o.param_groups]))[0] == []
    assert told(lambda o: ReduceLROnPlateau(o))[0] == []
    assert told(lambda o: ReduceLROnPlateau(o, min_lr=1e-4), adamw_lr=0.02)[0] == []
    monkeypatch.setattr(CanzonaAccelerator, "is_main_process", property(lambda self: False))
    assert told(lambda o: ReduceLROnPlateau(o, min_lr=1e-4))[0] == []


def _kinds(rates: list[tuple[str, float]]) -> tuple:
    """An SGD of one group per `(kind, rate)` for a scheduler to step, and a stand-in for the canzona
    optimizer `floor_warning` reads (its groups' kinds and rates; the matrix rate its defaults')."""
    from types import SimpleNamespace

    sgd = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))], "lr": lr} for _, lr in rates], lr=0.02)
    return sgd, SimpleNamespace(param_groups=[{"kind": k, "lr": lr} for k, lr in rates], defaults={"lr": 0.02})


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_a_bound_beside_a_frozen_rate_of_0_is_told_of_the_other_groups(tmp_path, one_rank):
    """A canzona optimizer whose AdamW (or matrix) rate is 0 (frozen) under a plateau scheduler with
    one absolute bound, or a transformers schedule with a floor. Before (review): a
    ZeroDivisionError out of `prepare` and `CanzonaTrainer(optimizers=...)` (the warning divided by
    each rate). A group at 0 stays there whatever the bound (0 times any factor; GreedyLR's raise
    too): now it is left out of what is told, so one kind of group moving is nothing to tell, and
    beside another AdamW group the warning is that group's, with a bound of 0 for the frozen one
    in the per-group lists."""
    import warnings

    from torch.optim.lr_scheduler import ReduceLROnPlateau
    from transformers import TrainingArguments, get_scheduler
    from transformers.optimization import GreedyLR

    from canzona.integrations.accelerate import CanzonaAccelerator, floor_warning
    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    makers = (lambda o: ReduceLROnPlateau(o, min_lr=1e-5), GreedyLR,
              lambda o: get_scheduler("cosine_with_min_lr", o, 1, 6, scheduler_specific_kwargs={"min_lr": 1e-5}))
    for rates in ([("matrix", 0.02), ("adamw", 0.0)], [("matrix", 0.0), ("adamw", 3e-4)]):
        for make in makers:
            sgd, opt = _kinds(rates)
            assert floor_warning(make(sgd), opt) is None, rates
    sgd, opt = _kinds([("matrix", 0.02), ("adamw", 0.0), ("adamw", 3e-4)])
    told = floor_warning(ReduceLROnPlateau(sgd, min_lr=1e-5), opt)
    assert "the AdamW groups (rate 0.0003) at 1e-05 (0.0333 of theirs)" in told and "rate 0)" not in told, told
    assert f"measured against the AdamW rate (0.0003), min_lr=[{0.02 * 1e-5 / 3e-4:g}, 0, 1e-05]" in told, told
    # through prepare and the Trainer: no error, nothing told
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "muon", {"lr": 0.02}, {"lr": 0.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CanzonaAccelerator(cpu=True).prepare(model, opt, GreedyLR(opt))
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
        CanzonaTrainer(model=model, args=args, optimizers=(opt, ReduceLROnPlateau(opt, min_lr=1e-5)))
    assert [str(w.message) for w in caught if "bound" in str(w.message)] == []


def test_a_negligible_plateau_floor_is_not_told_of():
    """A plateau scheduler's one absolute `min_lr` far under every rate (`ReduceLROnPlateau(opt,
    min_lr=1e-8)` beside rates of 0.02 and 3e-4). Before: warned of like any floor ("the matrix
    groups stop at 1e-08 (5e-07 of their rate)"), though it cannot bind: a reduction that changes a
    rate by no more than eps is not applied, so the groups stop at about eps / (1 - factor) floor or
    none. Now a floor at or below that (`floor_cannot_bind`) is not told of; just above it, and with
    eps 0, it is; GreedyLR's (its eps / (1 - factor): 2e-7) alike, and its max_lr still told of."""
    from torch.optim.lr_scheduler import ReduceLROnPlateau
    from transformers.optimization import GreedyLR

    from canzona.integrations.accelerate import floor_warning

    sgd, opt = _kinds([("matrix", 0.02), ("adamw", 3e-4)])
    assert floor_warning(ReduceLROnPlateau(sgd, min_lr=1e-8), opt) is None  # under 1e-8 / 0.9
    assert floor_warning(ReduceLROnPlateau(sgd, min_lr=1e-8 / 0.9), opt) is None
    assert floor_warning(ReduceLROnPlateau(sgd, min_lr=1e-8, factor=0.5), opt) is None  # under 2e-8
    for can_bind in (ReduceLROnPlateau(sgd, min_lr=1.2e-8), ReduceLROnPlateau(sgd, min_lr=1e-8, eps=0),
                     ReduceLROnPlateau(sgd, min_lr=1e-8, factor=0.5, eps=1e-9)):
        told = floor_warning(can_bind, opt)
        assert told is not None and "the matrix groups (rate 0.02) stop at " in told, told
    assert floor_warning(GreedyLR(sgd, min_lr=1.9e-7), opt) is None  # under its eps / (1 - factor)
    assert "min_lr 3e-07" in floor_warning(GreedyLR(sgd, min_lr=3e-7), opt)
    told = floor_warning(GreedyLR(sgd, min_lr=1e-8, max_lr=0.01), opt)  # the cap binds, the floor not
    assert told is not None and "max_lr 0.01" in told and "min_lr" not in told.split(". To bound")[0], told
    assert "the matrix groups (rate 0.02) reach no floor that binds" in told, told


def test_a_cyclic_schedules_max_lr_is_no_plateau_bound():
    """torch's `CyclicLR(opt, base_lr=[...per group], max_lr=x)` keeps `max_lrs`, one per group, as
    GreedyLR does. Before (review): read as a plateau scheduler's uniform bound and warned of in
    plateau words ("keep the floors given per group", per-group `max_lr` lists "measured against the
    AdamW rate"). Now only torch's ReduceLROnPlateau and transformers' GreedyLR are read for such
    bounds (by type)."""
    from torch.optim.lr_scheduler import CyclicLR

    from canzona.integrations.accelerate import floor_warning

    sgd, opt = _kinds([("matrix", 0.02), ("adamw", 3e-4)])
    assert floor_warning(CyclicLR(sgd, base_lr=[0.02, 3e-4], max_lr=0.1, cycle_momentum=False), opt) is None


def test_a_list_of_equal_plateau_bounds_is_told_of_alike_by_both_schedulers():
    """`min_lr=[1e-4, 1e-4]` over a matrix group at 0.02 and an AdamW group at 3e-4: every group
    bounded at one absolute rate, as by `min_lr=1e-4`. Before (review): warned of for transformers'
    GreedyLR but not for torch's ReduceLROnPlateau (which records whether `min_lr` was one number;
    GreedyLR keeps no such record, so a list of equal bounds and one number cannot be told apart
    there). Now a list of equal bounds reads as one for both: the same words as for one number."""
    from torch.optim.lr_scheduler import ReduceLROnPlateau
    from transformers.optimization import GreedyLR

    from canzona.integrations.accelerate import floor_warning

    def told(make) -> str | None:
        sgd, opt = _kinds([("matrix", 0.02), ("adamw", 3e-4)])
        return floor_warning(make(sgd), opt)

    one = told(lambda o: ReduceLROnPlateau(o, min_lr=1e-4))
    assert one is not None and told(lambda o: ReduceLROnPlateau(o, min_lr=[1e-4, 1e-4])) == one
    greedy = told(lambda o: GreedyLR(o, min_lr=[1e-4, 1e-4]))
    assert greedy is not None and told(lambda o: GreedyLR(o, min_lr=1e-4)) == greedy
    stops = "the matrix groups (rate 0.02) stop at 0.0001 (0.005 of their rate)"
    assert stops in one and stops in greedy, (one, greedy)


def test_greedy_lrs_default_cap_above_every_rate_is_not_told_of():
    """transformers' GreedyLR caps every group at `max_lr`, by default 1.0: 50 times a matrix rate of
    0.02, far above the rates a group trains at. Before (review): that default counted as a
    uniform bound, so `GreedyLR(opt, min_lr=[one per group])` was still warned of ("keep the floors
    given per group"), and the AdamW groups under the default `min_lr` 1e-3, above their rate 3e-4,
    were said to be "never reduced", where GreedyLR's increases raise them and its reductions then
    bring them back to 1e-3 (checked below). Now the default `max_lr` is named only where it is
    not above every group's rate (a `max_lr` given equal to it cannot be told from it); one of the
    user's is named as before; the AdamW groups' words say what GreedyLR does."""
    from transformers.optimization import GreedyLR

    from canzona.integrations.accelerate import floor_warning

    def told(**kwargs) -> tuple[str | None, torch.optim.Optimizer]:
        sgd, opt = _kinds([("matrix", 0.02), ("adamw", 3e-4)])
        sched = GreedyLR(sgd, patience=0, **kwargs)
        return floor_warning(sched, opt), sched

    assert told(min_lr=[2e-4, 3e-6])[0] is None
    message, _ = told(min_lr=[2e-4, 3e-6], max_lr=0.5)
    assert "one absolute max_lr 0.5" in message and "keep the floors given per group" in message, message
    message, sched = told()
    assert "min_lr 0.001" in message and "max_lr" not in message, message
    assert ("the AdamW groups (rate 0.0003) are never reduced below their rate (min_lr is not below it): GreedyLR's "
            "increases raise them, and its reductions bring them back no lower than 0.001") in message, message
    adamw = sched.optimizer.param_groups[1]
    for loss in [1.0] * 4:  # the first step an improvement (over inf), then a plateau: not reduced
        sched.step(loss)
    assert adamw["lr"] == 3e-4 / 0.95
    for k in range(30):  # improving: raised past min_lr ...
        sched.step(0.5 - k / 100)
    assert adamw["lr"] > 1e-3
    for _ in range(40):  # ... then a plateau: back to min_lr, above their rate
        sched.step(1.0)
    assert adamw["lr"] == 1e-3


@pytest.mark.parametrize(("matrix_config", "weight_decay", "want"), [
    (None, 0.05, (0.05, 0.05, 0.0)),                                # the Trainer's decay on every decay parameter
    ({"lr": 0.02, "weight_decay": 0.1}, 0.0, (0.1, 0.0, 0.0)),       # the matrices' own, given
    ({"lr": 0.02, "weight_decay": 0.1}, 0.05, (0.1, 0.05, 0.0)),
    # a config object states every field: its weight decay counts only off its class's default
    # (review: MuonConfig(lr=0.02) decayed the matrices at MuonConfig's 0.1 beside the Trainer's 0.0)
    (MuonConfig(lr=0.02), 0.0, (0.0, 0.0, 0.0)),
    (MuonConfig(lr=0.02, weight_decay=0.05), 0.0, (0.05, 0.0, 0.0)),
])
def test_a_weight_decay_in_matrix_config_is_the_matrices_own(tmp_path, one_rank, matrix_config, weight_decay, want):
    """`CanzonaTrainer(matrix_config={"weight_decay": 0.1})`: the matrices decay at 0.1, the
    Trainer's other decay parameters (the embedding) at `TrainingArguments.weight_decay`, norms
    and biases not at all (before: the TrainingArguments' 0.0 default replaced the 0.1 given,
    silently, on the matrices too)."""
    from transformers import TrainingArguments

    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], weight_decay=weight_decay)
    opt = CanzonaTrainer(model=model, args=args, matrix_config=matrix_config).create_optimizer()
    groups: dict[tuple, set[int]] = {}
    for g in opt.param_groups:
        groups.setdefault((g["kind"], g["weight_decay"]), set()).update(id(p) for p in g["params"])
    matrices, embedding, norm = want
    assert groups[("matrix", matrices)] == {id(model[1].weight), id(model[3].weight)}
    assert id(model[0].weight) in groups[("adamw", embedding)]
    assert id(model[2].weight) in groups[("adamw", norm)]


def test_the_fsdp2_layout_is_one_error_naming_its_own_loop():
    """`DistributedOptimizer(...)` on a `fully_shard`ed model is the FSDP2 layout (`FsdpOptimizer`,
    not a `DistributedOptimizer` subclass). Before: `CanzonaTrainer(optimizers=(it, sched))` said it
    wanted "a canzona DistributedOptimizer, but optimizers= holds a FsdpOptimizer" (what the user
    had built), and `CanzonaAccelerator.prepare` took it for a foreign optimizer (accelerate's DDP
    wrapping, accumulation and checkpoints). Now one CanzonaError naming the layout and the loop
    that trains it, whatever wraps it. (The layout's type is all the integrations look at: an
    instance without construction stands for one here; building one takes 2 ranks.)"""
    from accelerate.optimizer import AcceleratedOptimizer

    from canzona.integrations.accelerate import canzona_optimizer
    from canzona.runtime.fsdp import FsdpOptimizer

    fsdp = object.__new__(FsdpOptimizer)
    wrapped = object.__new__(AcceleratedOptimizer)
    wrapped.optimizer = fsdp
    want = r"^the optimizer is canzona's FSDP2 layout \(FsdpOptimizer: .*examples/fsdp2_train\.py"
    for given in (fsdp, wrapped):
        with pytest.raises(CanzonaError, match=want) as e:
            canzona_optimizer(given)
        assert "\n" not in str(e.value)
        # the advice is what the example does (before: opt.no_sync(), which FsdpOptimizer refuses, and
        # sharded_state_dict, which the example does not save with)
        assert "get_state_dict(model, opt)" in str(e.value) and "set_requires_gradient_sync(False)" in str(e.value)
        assert "no_sync" not in str(e.value) and "sharded_state_dict" not in str(e.value)
    with pytest.raises(CanzonaError, match=want):
        CanzonaTrainer(model=nn.Linear(2, 2), optimizers=(fsdp, None))


def test_resuming_from_the_latest_whole_checkpoint_says_which_it_skipped(tmp_path, one_rank):
    """`resume_from_checkpoint=True` (and accelerate's `load_state()` under automatic naming) skips
    the folders of saves killed midway and resumes from an older whole one, steps of training
    behind. Before, silently: a run whose checkpoint-2 lost its optimizer folder resumed from
    checkpoint-1 with not a word. Now one warning (rank 0's: the search runs there) naming the
    folder taken and each skipped, and why; none where the latest is whole."""
    import warnings

    from canzona.integrations.hf import latest_checkpoint
    from canzona.integrations.optimizer_state import save_optimizer
    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    model = nn.Sequential(nn.Linear(4, 4))
    opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "muon")
    for step in (1, 2):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        for name in ("model.safetensors", "trainer_state.json"):
            (folder / name).write_text("{}")
        torch.save({}, folder / "scheduler.pt")  # (read before a resume: a real one)
        save_optimizer(opt, str(folder / "canzona_optimizer"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    assert [w for w in caught if "skipping" in str(w.message)] == []
    shutil.rmtree(tmp_path / "checkpoint-2" / "canzona_optimizer")  # killed before it (and trainer_state.json)
    (tmp_path / "checkpoint-2" / "trainer_state.json").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-1")
    (told,) = [w for w in caught if "skipping" in str(w.message)]
    assert str(told.message).startswith("resume_from_checkpoint=True: resuming from checkpoint-1, skipping "
                                        "checkpoint-2 (no canzona_optimizer/manifest.json)"), str(told.message)
    # at the caller's line (before, review: canzona's own, hf.py's and accelerate.py's), accelerate's too
    assert told.filename == __file__, (told.filename, told.lineno)
    from canzona.integrations.accelerate import latest_state

    for step in (0, 1):
        (tmp_path / "acc" / f"checkpoint_{step}" / "canzona_optimizer_0").mkdir(parents=True)
    (tmp_path / "acc" / "checkpoint_0" / "canzona_optimizer_0" / "manifest.json").write_text("{}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest_state(str(tmp_path / "acc"), 1) == str(tmp_path / "acc" / "checkpoint_0")
    (told,) = [w for w in caught if "skipping" in str(w.message)]
    assert told.filename == __file__, (told.filename, told.lineno)


def test_a_damaged_scheduler_or_rng_file_is_refused_before_anything_is_loaded(tmp_path, one_rank):
    """A whole checkpoint-<step> but for a damaged `scheduler.pt` (or `rng_state*.pth`, which the
    Trainer reads at the first epoch). Before: torch's own error, a traceback, from the Trainer's
    load, after the model's weights and the optimizer state were loaded. Now `train` reads them
    before anything is loaded: one CheckpointError line naming the file (a named folder), or the
    folder skipped with the reason (`resume_from_checkpoint=True`); the optimizer's own load reads
    the scheduler's file before its state too."""
    import warnings

    from safetensors.torch import save_file
    from transformers import TrainerState, TrainingArguments

    from canzona.errors import CheckpointError
    from canzona.integrations.hf import check_whole, latest_checkpoint
    from canzona.integrations.optimizer_state import save_optimizer

    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    args = TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to=[], learning_rate=3e-3)
    trainer = CanzonaTrainer(model=model, args=args, matrix_config={"lr": 0.02}, train_dataset=[{}])
    opt = trainer.create_optimizer()
    scheduler = trainer.create_scheduler(10, opt)
    for step in (1, 2):
        folder = tmp_path / "run" / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        TrainerState(global_step=step, max_steps=10, train_batch_size=8).save_to_json(str(folder / "trainer_state.json"))
        torch.save(scheduler.state_dict(), folder / "scheduler.pt")
        torch.save({"cpu": torch.random.get_rng_state()}, folder / "rng_state.pth")
        save_optimizer(opt, str(folder / "canzona_optimizer"))
        # the model's weights the Trainer loads first (other than the model's: a load would show)
        save_file({k: v.detach() + 1 for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    latest = tmp_path / "run" / "checkpoint-2"
    check_whole(str(latest))  # whole
    data = (latest / "scheduler.pt").read_bytes()
    (latest / "scheduler.pt").write_bytes(data[: len(data) // 2])  # damaged: half of it
    want = rf"^{re.escape(str(latest))}: scheduler\.pt cannot be read \(\w+: [^\n]*\): a damaged file$"
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(latest))} is not a whole CanzonaTrainer "
                                              r"checkpoint \(scheduler\.pt cannot be read \(") as e:
        check_whole(str(latest))
    assert "\n" not in str(e.value) and "killed" not in str(e.value), str(e.value)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match="scheduler.pt cannot be read"):
        trainer.train(resume_from_checkpoint=str(latest))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))  # nothing loaded
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest_checkpoint(str(tmp_path / "run")) == str(tmp_path / "run" / "checkpoint-1")
    (told,) = [w for w in caught if "skipping" in str(w.message)]
    assert "checkpoint-2 (scheduler.pt cannot be read (" in str(told.message), str(told.message)
    assert "killed" not in str(told.message), str(told.message)
    # the optimizer's own load: the scheduler's file read before the optimizer state
    loaded = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("canzona.integrations.hf.load_optimizer", lambda *a: loaded.append(a))
        with pytest.raises(CheckpointError, match=want):
            trainer._load_optimizer_and_scheduler(str(latest))
    assert loaded == []
    # an RNG state file likewise
    (latest / "scheduler.pt").write_bytes(data)
    (latest / "rng_state.pth").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match=r"\(rng_state\.pth cannot be read \(\w+: .*\): a damaged file\)"):
        check_whole(str(latest))


class _Halve:
    """A LambdaLR's callable object holding a numpy scalar: saved in the scheduler's state, which
    torch then does not load weights-only (nor does the Trainer)."""

    def __init__(self) -> None:
        self.factor = __import__("numpy").float64(0.5)

    def __call__(self, step: int) -> float:
        return float(self.factor) ** step


def test_a_scheduler_or_rng_file_torch_does_not_load_weights_only_is_named_as_such_not_damaged(tmp_path):
    """A valid `scheduler.pt` (or `rng_state.pth`) holding objects torch will not load weights-only,
    as the Trainer loads them (transformers 5: `torch.load(weights_only=True)`, the RNG states with
    numpy's types allowed): the resume would fail there too. Before (review): refused as "a damaged
    file", the line carrying torch's ANSI escapes and not naming the global. Now one line saying
    which global torch blocks, and how to allow it."""
    from fractions import Fraction

    from torch.optim.lr_scheduler import LambdaLR

    from canzona.errors import CheckpointError
    from canzona.integrations.hf import read_resumed

    sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.5)
    torch.save(LambdaLR(sgd, _Halve()).state_dict(), tmp_path / "scheduler.pt")
    torch.save({"cpu": torch.random.get_rng_state(), "seed": Fraction(1, 2)}, tmp_path / "rng_state.pth")
    for name, blocked in (("scheduler.pt", "numpy._core.multiarray.scalar"), ("rng_state.pth", "fractions.Fraction")):
        with pytest.raises(CheckpointError) as e:
            read_resumed(str(tmp_path), name)
        assert str(e.value).startswith(f"{name} holds objects torch does not load weights-only ({blocked}"), str(e.value)
        assert "damaged" not in str(e.value) and "\x1b" not in str(e.value) and "\n" not in str(e.value), str(e.value)
    # a damaged one still is, ANSI-free
    (tmp_path / "rng_state.pth").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match=r"^rng_state\.pth cannot be read \(UnpicklingError: .*\): a damaged file$") \
            as e:
        read_resumed(str(tmp_path), "rng_state.pth")
    assert "\x1b" not in str(e.value), str(e.value)


def test_a_file_torch_does_not_load_weights_only_stops_the_search_naming_every_global(tmp_path, one_rank):
    """`resume_from_checkpoint=True`, the latest checkpoint's scheduler.pt holding a numpy scalar
    (a LambdaLR's callable object): a trusted file the Trainer's weights-only load refuses, no
    damage. Before (review): skipped as a damaged file, the resume rolling back silently to an
    older step with a warning only; and the named folder's error said "not a whole checkpoint ...
    resume from another, or resume_from_checkpoint=True", and named one global of two. Now the
    search stops with one CheckpointError naming every global torch blocks and add_safe_globals."""
    from torch.optim.lr_scheduler import LambdaLR

    from canzona.errors import CheckpointError
    from canzona.integrations.hf import check_whole, latest_checkpoint
    from canzona.integrations.optimizer_state import save_optimizer
    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    model = nn.Sequential(nn.Linear(4, 4))
    opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "muon")
    sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.5)
    for step in (1, 2):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text("{}")
        torch.save({} if step == 1 else LambdaLR(sgd, _Halve()).state_dict(), folder / "scheduler.pt")
        save_optimizer(opt, str(folder / "canzona_optimizer"))
    latest = tmp_path / "checkpoint-2"
    for attempt in (lambda: latest_checkpoint(str(tmp_path)), lambda: check_whole(str(latest))):
        with pytest.raises(CheckpointError) as e:
            attempt()
        text = str(e.value)
        assert text.startswith(f"{latest}: scheduler.pt holds objects torch does not load weights-only ("), text
        assert "numpy._core.multiarray.scalar" in text and "numpy.dtype" in text, text  # both globals
        assert "add_safe_globals([" in text and "damaged" not in text and "resume from another" not in text, text


def test_only_the_rng_file_this_run_reads_is_checked_and_a_direct_load_names_its_folder(tmp_path, one_rank):
    """The Trainer reads `rng_state.pth` at world size 1, else its own `rng_state_<process_index>.pth`
    (`_load_rng_state`; a missing one is only logged). Before (review): every `rng_state*.pth` was
    read, so a 4-rank checkpoint resumed on 1 rank was refused for a damaged rng_state_3.pth nobody
    reads; and the optimizer's own load said "scheduler.pt cannot be read" without the folder.
    Now each run checks only the file it reads (`rng_file`), and the direct load names the folder."""
    from types import SimpleNamespace

    from canzona.errors import CheckpointError
    from canzona.integrations.hf import check_whole, latest_checkpoint, rng_file
    from canzona.integrations.optimizer_state import save_optimizer
    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    model = nn.Sequential(nn.Linear(4, 4))
    opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "muon")
    folder = tmp_path / "run" / "checkpoint-1"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    torch.save({}, folder / "scheduler.pt")
    save_optimizer(opt, str(folder / "canzona_optimizer"))
    for r in range(4):
        torch.save({"cpu": torch.random.get_rng_state()}, folder / f"rng_state_{r}.pth")
    (folder / "rng_state_3.pth").write_bytes(b"not a torch file")
    assert rng_file(SimpleNamespace(world_size=1, process_index=0)) == "rng_state.pth"
    assert rng_file(SimpleNamespace(world_size=4, process_index=3)) == "rng_state_3.pth"
    check_whole(str(folder))  # one rank: reads rng_state.pth (none here: the Trainer only logs it)
    assert latest_checkpoint(str(tmp_path / "run")) == str(folder)
    check_whole(str(folder), "rng_state_2.pth")
    with pytest.raises(CheckpointError, match=r"\(rng_state_3\.pth cannot be read \("):
        check_whole(str(folder), "rng_state_3.pth")
    (folder / "scheduler.pt").write_bytes(b"not a torch file")
    args = SimpleNamespace(world_size=1, process_index=0)
    trainer = SimpleNamespace(args=args)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(folder))}: scheduler\.pt cannot be read \("):
        CanzonaTrainer._load_optimizer_and_scheduler(trainer, str(folder))


def test_resuming_from_save_only_model_checkpoints_says_so():
    """`save_only_model=True` checkpoints (model files and trainer_state.json, no optimizer state),
    then `resume_from_checkpoint=True`: one CheckpointError (transformers documents such a
    checkpoint as not resumable). Before, it said only that "a save killed midway leaves such a
    folder" (a killed save writes trainer_state.json last, so this is none); now it names
    save_only_model. (`resume_from_checkpoint=<folder>` named it already.) Then (review) the
    message still ended "a save killed midway leaves such a folder"; now that tail is only for the
    folders no other reason names (beside such a folder: naming those)."""
    import tempfile

    from canzona.errors import CheckpointError
    from canzona.integrations.hf import latest_checkpoint

    only = ("no canzona_optimizer/ beside trainer_state.json: likely saved with save_only_model=True, which keeps "
            "no optimizer state to resume from")
    with tempfile.TemporaryDirectory() as root:
        for step in (1, 2, 3):
            folder = Path(root) / f"checkpoint-{step}"
            folder.mkdir()
            for name in ("model.safetensors", "trainer_state.json", "training_args.bin"):
                (folder / name).write_text("{}")
        (Path(root) / "checkpoint-3" / "trainer_state.json").unlink()  # (a save killed midway)
        with pytest.raises(CheckpointError) as e:
            latest_checkpoint(root)
        assert str(e.value) == (f"resume_from_checkpoint=True: no whole checkpoint in {root}: checkpoint-3 (no "
                                f"canzona_optimizer/manifest.json), checkpoint-2 ({only}), checkpoint-1 ({only}); a save "
                                "killed midway leaves a folder like checkpoint-3"), str(e.value)
        shutil.rmtree(Path(root) / "checkpoint-3")
        with pytest.raises(CheckpointError) as e:
            latest_checkpoint(root)
        assert str(e.value) == (f"resume_from_checkpoint=True: no whole checkpoint in {root}: checkpoint-2 ({only}), "
                                f"checkpoint-1 ({only})"), str(e.value)


def test_another_backends_checkpoint_is_named_as_such_not_save_only_model(tmp_path):
    """A checkpoint-<step> of transformers' Trainer under FSDP (`optimizer_0/`, `pytorch_model_fsdp_0/`;
    or a whole `optimizer.bin`) or DeepSpeed (`global_step<N>/`) beside trainer_state.json. Before
    (review): named "saved with save_only_model=True", definitively, which it was not. Now named as
    saved by another optimizer/backend; a folder with no optimizer files at all stays
    save_only_model's, worded "likely"; `resume_from_checkpoint=<folder>` says it is not a
    CanzonaTrainer checkpoint (not a killed save)."""
    from canzona.errors import CheckpointError
    from canzona.integrations.hf import check_whole, checkpoint_problem

    cases = {"fsdp": (["optimizer_0", "pytorch_model_fsdp_0"], [], "optimizer_0/", "FSDP"),
             "fsdp_full": ([], ["optimizer.bin", "pytorch_model_fsdp.bin"], "optimizer.bin", "FSDP"),
             "deepspeed": (["global_step4"], ["latest"], "global_step4/", "DeepSpeed")}
    for case, (folders, files, marker, backend) in cases.items():
        folder = tmp_path / case
        folder.mkdir()
        for name in folders:
            (folder / name).mkdir()
        for name in [*files, "trainer_state.json"]:
            (folder / name).write_text("{}")
        assert checkpoint_problem(str(folder)) == (f"no canzona_optimizer/ but {marker}: saved by another "
                                                   f"optimizer/backend ({backend})"), case
        with pytest.raises(CheckpointError, match=r"is not a CanzonaTrainer checkpoint \(no canzona_optimizer/ but "
                                                  + re.escape(marker)) as e:
            check_whole(str(folder))
        assert "killed" not in str(e.value) and "save_only_model" not in str(e.value), str(e.value)
    folder = tmp_path / "only"
    folder.mkdir()
    (folder / "trainer_state.json").write_text("{}")
    assert checkpoint_problem(str(folder)) == ("no canzona_optimizer/ beside trainer_state.json: likely saved with "
                                               "save_only_model=True, which keeps no optimizer state to resume from")


def test_resuming_from_transformers_own_checkpoint_says_so(tmp_path, one_rank):
    """`CanzonaTrainer.train(resume_from_checkpoint=<a checkpoint of transformers' own Trainer>)`
    (its optimizer.pt: a torch optimizer's state). Before: "not a whole CanzonaTrainer checkpoint
    (...: a save killed midway, or save_only_model=True)", neither of which it was. Now one
    CheckpointError naming what it is and how to start from its weights; in
    `resume_from_checkpoint=True`'s list of the folders skipped, the same. Beside a whole
    canzona_optimizer/ (a CanzonaTrainer save killed before trainer_state.json, into a folder a plain
    Trainer's run left optimizer.pt in) it is a killed save (before: named transformers' own)."""
    from canzona.errors import CheckpointError
    from canzona.integrations.hf import check_whole, latest_checkpoint

    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        (folder / name).write_text("{}")
    with pytest.raises(CheckpointError, match=r"is not a CanzonaTrainer checkpoint \(no canzona_optimizer/ but "
                                              r"optimizer\.pt: saved by transformers' own Trainer with a torch "
                                              r"optimizer, .* load the model from it \(from_pretrained\)") as e:
        check_whole(str(folder))
    assert "killed" not in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match=r"checkpoint-2 \(no canzona_optimizer/ but optimizer\.pt: saved by "
                                              r"transformers' own Trainer\)"):
        latest_checkpoint(str(tmp_path))
    # a CanzonaTrainer save killed before trainer_state.json into a folder a plain Trainer's run left
    # (its optimizer.pt beside a whole canzona_optimizer/): a killed save, not transformers' own
    (folder / "trainer_state.json").unlink()
    from canzona.integrations.optimizer_state import save_optimizer
    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    model = nn.Sequential(nn.Linear(4, 4))
    save_optimizer(DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "muon"),
                   str(folder / "canzona_optimizer"))
    with pytest.raises(CheckpointError, match=r"is not a whole CanzonaTrainer checkpoint \(no trainer_state\.json: "
                                              r"a save killed midway"):
        check_whole(str(folder))
    shutil.rmtree(folder / "canzona_optimizer")
    (folder / "optimizer.pt").unlink()  # a save killed before its optimizer state: as before
    with pytest.raises(CheckpointError, match=r"\(no canzona_optimizer/manifest\.json: a save killed midway, or "
                                              r"save_only_model=True\)"):
        check_whole(str(folder))


def test_save_state_and_load_state_of_a_model_of_dtensors(tmp_path, one_rank):
    """A model whose parameters are DTensors (a TP model of `parallelize_module`, or `fully_shard`
    over one rank, both trained by the ZeRO-1 layout) through `CanzonaAccelerator.save_state` /
    `load_state`: the model file holds each parameter whole, and loading it puts every weight back
    in place, bit for bit, into the optimizer's parameters. Before: accelerate's safetensors writer
    failed on the DTensors ("RuntimeError: Attempted to access the data pointer on an invalid
    python storage", a traceback from inside accelerate)."""
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from canzona.integrations.accelerate import CanzonaAccelerator
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.shards import local_tensor
    from canzona.spec import ModelSpec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    spec = ModelSpec.from_module(model)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    opt = DistributedOptimizer(named_parameters(model), spec, "muon", {"lr": 0.02}, {"lr": 0.01})
    accelerator = CanzonaAccelerator(cpu=True)
    model, opt = accelerator.prepare(model, opt)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    saved = {n: local_tensor(p).detach().clone() for n, p in named_parameters(model)}
    accelerator.save_state(str(tmp_path / "state"))
    on_disk = load_file(str(tmp_path / "state" / "model.safetensors"))
    assert set(on_disk) == set(saved) and all(torch.equal(on_disk[n], saved[n]) for n in saved)
    with torch.no_grad():
        for p in model.parameters():
            local_tensor(p).zero_()
    gathered = []
    kept = DTensor.full_tensor
    with pytest.MonkeyPatch.context() as patch:  # the load gathers nothing (before: once per DTensor)
        patch.setattr(DTensor, "full_tensor", lambda self, *a, **k: gathered.append(self.shape) or kept(self, *a, **k))
        accelerator.load_state(str(tmp_path / "state"))
    assert gathered == []
    for n, p in named_parameters(model):
        assert torch.equal(local_tensor(p), saved[n]), n


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_schedulers_registered_for_checkpointing_in_another_order_are_one_error(tmp_path, one_rank):
    """`accelerator.register_for_checkpointing(plain_sched, canzona_sched)` at the save and
    `(canzona_sched, plain_sched)` at the load: accelerate loads `custom_checkpoint_<i>.pkl` by
    registration order, so each scheduler took the other's state (before, silently, both optimizers
    of two groups: after the load and one step the canzona groups were at 0.03125 and 0.00625, the
    SGD's base rates on the canzona schedule, instead of 0.00125 and 1.875e-4, and the SGD's at
    0.004 instead of 0.1; of other group counts, a ValueError from torch's zip at the next
    `step()`). Now the save's manifest
    records what each registered object is (type, and the optimizer a scheduler steps: a canzona
    one by its folder), and the load is one `CanzonaError` before anything is loaded when the
    registered objects differ from the save's; the same order loads."""
    from torch.optim.lr_scheduler import LambdaLR

    from canzona.integrations.accelerate import CanzonaAccelerator
    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    def build() -> tuple:
        torch.manual_seed(0)
        model, other = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)), nn.Linear(2, 2)
        opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "muon", {"lr": 0.02},
                                   {"lr": 3e-3})
        sgd = torch.optim.SGD([{"params": [other.weight]}, {"params": [other.bias], "lr": 0.1}], lr=0.5)
        plain, mine = LambdaLR(sgd, lambda s: 1.0 / (s + 1)), LambdaLR(opt, lambda s: 0.5 ** s)
        accelerator = CanzonaAccelerator(cpu=True)
        model, opt = accelerator.prepare(model, opt)
        return accelerator, model, opt, plain, mine

    accelerator, model, opt, plain, mine = build()
    accelerator.register_for_checkpointing(plain, mine)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        plain.step()
        mine.step()
        opt.zero_grad()
    accelerator.save_state(str(tmp_path / "state"))
    want = [g["lr"] for g in opt.param_groups]
    accelerator, model, opt, plain, mine = build()
    accelerator.register_for_checkpointing(mine, plain)  # swapped
    with pytest.raises(CanzonaError, match="register_for_checkpointing are those of the save in another order") as e:
        accelerator.load_state(str(tmp_path / "state"))
    assert "\n" not in str(e.value), str(e.value)
    assert mine.last_epoch == 0 and plain.last_epoch == 0  # nothing loaded
    accelerator, model, opt, plain, mine = build()
    accelerator.register_for_checkpointing(plain, mine)  # the order of the save
    accelerator.load_state(str(tmp_path / "state"))
    assert mine.last_epoch == 3 and [g["lr"] for g in opt.param_groups] == want


OLDER_SAVE_KEYS = ("prepared_model", "schedulers", "optimizer_folders", "scheduler_files", "registered_objects")


def _older_save(tmp_path: Path) -> tuple[Callable[..., dict], list[float]]:
    """A `save_state` of a canzona optimizer (its LambdaLR) and a plain SGD (its StepLR, registered
    for checkpointing too) after 3 steps, as an older canzona wrote it: `state/` with the manifest's
    scheduler and registration records stripped, `between/` with the registration record alone
    stripped. Returns `load(order, register=1, folder="state")`, which builds them afresh, prepares
    the schedulers `order` names, registers the first `register` of (plain, mine), loads, and gives
    them with the error (if any) and the warnings of the older save; and the canzona rates saved."""
    import json
    import warnings

    from torch.optim.lr_scheduler import LambdaLR, StepLR

    from canzona.integrations.accelerate import CanzonaAccelerator
    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    def build(order: str, register: int) -> dict:
        torch.manual_seed(0)
        model, other = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)), nn.Linear(2, 2)
        opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "muon", {"lr": 0.02},
                                   {"lr": 3e-3})
        sgd = torch.optim.SGD(other.parameters(), lr=0.5)
        plain, mine = StepLR(sgd, 2), LambdaLR(opt, lambda s: 0.5 ** s)
        scheds = {"plain mine": (plain, mine), "mine plain": (mine, plain), "plain": (plain,),
                  "plain plain": (plain, LambdaLR(sgd, lambda s: 1.0))}[order]
        accelerator = CanzonaAccelerator(cpu=True)
        accelerator.prepare(model, opt, *scheds)
        for obj in (plain, mine)[:register]:
            accelerator.register_for_checkpointing(obj)
        return {"accelerator": accelerator, "model": model, "opt": opt, "plain": plain, "mine": mine,
                "weights": [p.detach().clone() for p in model.parameters()]}

    saved = build("plain mine", 1)
    for _ in range(3):
        saved["model"](torch.randn(4, 8)).sum().backward()
        saved["opt"].step()
        saved["plain"].step()
        saved["mine"].step()
        saved["opt"].zero_grad()
    saved["accelerator"].save_state(str(tmp_path / "state"))
    shutil.copytree(tmp_path / "state", tmp_path / "between")
    for folder, keys in (("state", OLDER_SAVE_KEYS), ("between", ("registered_objects",))):
        manifest = tmp_path / folder / "canzona_optimizer_0" / "manifest.json"
        raw = json.loads(manifest.read_text())
        assert set(OLDER_SAVE_KEYS) <= set(raw["info"])
        raw["info"] = {k: v for k, v in raw["info"].items() if k not in keys}
        manifest.write_text(json.dumps(raw))

    def load(order: str, register: int = 1, folder: str = "state") -> dict:
        got = build(order, register)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                got["accelerator"].load_state(str(tmp_path / folder))
            except CanzonaError as e:
                got["error"] = str(e)
        got["told"] = [w for w in caught if "older canzona" in str(w.message)]
        return got

    return load, [g["lr"] for g in saved["opt"].param_groups]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_an_older_save_is_refused_where_it_shows_another_setup(tmp_path, one_rank):
    """A save of an older canzona (its manifest without the scheduler and registration records,
    synthesised by stripping them from a fresh save: `_older_save`). Before: not checked at all,
    the scheduler files taken by position: a plain scheduler and a canzona one prepared swapped
    failed in torch's `load_state_dict` (a KeyError traceback) after the model was loaded, and
    another count of registered objects was accelerate's multi-line RuntimeError after loading the
    rest. Now what the save carries is checked before anything is loaded: a scheduler file whose
    state is another class's or group count's, another count of registered objects (fewer scheduler
    files than schedulers alike): one `CanzonaError` line."""
    load, _ = _older_save(tmp_path)

    def refused(got: dict, start: str) -> str:
        assert got.get("error", "").startswith(start) and "\n" not in got["error"], got.get("error")
        assert got["mine"].last_epoch == 0 and got["plain"].last_epoch == 0  # nothing loaded
        assert all(torch.equal(p, w) for p, w in zip(got["model"].parameters(), got["weights"]))
        return got["error"]

    error = refused(load("mine plain"), "load_state(): scheduler.bin of the save in ")  # swapped
    assert "holds another scheduler's state (keys base_lrs, gamma, last_epoch, step_size; 1 group(s)) than the " \
           "LambdaLR prepared as scheduler 0 (keys base_lrs, last_epoch, lr_lambdas; " in error, error
    # a scheduler of another group count in the canzona one's place
    refused(load("plain plain"), "load_state(): scheduler_1.bin of the save in ")
    refused(load("plain mine", register=0), "load_state(): 0 object(s) are given to accelerator.register_for_checkpointing")


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_an_older_save_is_warned_of_where_it_cannot_be_verified(tmp_path, one_rank):
    """The older save of `_older_save` loaded with the schedulers and object of the save: loaded,
    and one warning (at the user's line) of what it could not verify: the object registered (the
    save records not what it was), scheduler files left unread; the schedulers, each of its own
    class and group count, are verified and not named. A save with the scheduler records but not
    the registration record still gives each scheduler its own file (prepared swapped). A load it
    can verify wholly warns of nothing."""
    load, want = _older_save(tmp_path)
    got = load("plain mine")
    assert "error" not in got and got["mine"].last_epoch == 3 and [g["lr"] for g in got["opt"].param_groups] == want
    (told,) = got["told"]
    assert told.filename == __file__, told.filename
    message = str(told.message)
    assert "could not verify that the 1 object(s) registered for checkpointing are the save's" in message, message
    assert "scheduler" not in message.split("could not verify")[1].split("registered")[0], message
    got = load("mine plain", folder="between")
    assert "error" not in got and got["mine"].last_epoch == 3 and got["plain"].last_epoch == 3
    (told,) = got["told"]
    assert "registered for checkpointing" in str(told.message) and "scheduler file" not in str(told.message)
    (Path(tmp_path) / "state" / "custom_checkpoint_0.pkl").unlink()
    got = load("plain", register=0)  # the canzona scheduler's file left unread
    assert "error" not in got and got["plain"].last_epoch == 3
    (told,) = got["told"]
    assert "that the 1 scheduler file(s) left unread are none of these schedulers'" in str(told.message), told.message
    assert "registered" not in str(told.message).split("could not verify")[1], told.message
    (Path(tmp_path) / "state" / "scheduler_1.bin").unlink()  # nothing unverifiable: no warning
    got = load("plain", register=0)
    assert "error" not in got and got["told"] == [] and got["plain"].last_epoch == 3


def _scheduler_files(folder: Path, states: list) -> str:
    """An older save's scheduler files alone (accelerate's names), for `check_older_save`."""
    from canzona.integrations.accelerate import scheduler_file

    folder.mkdir(parents=True, exist_ok=True)
    for k, state in enumerate(states):
        torch.save(state, folder / scheduler_file(k))
    return str(folder)


def test_an_older_save_of_a_scheduler_with_private_state_only_is_warned_of_not_refused(tmp_path):
    """An older save of a `ChainedScheduler` (torch's state holds only `_last_lr` and `_schedulers`),
    or of any scheduler whose state is private keys alone. Before (review): no public key left an
    empty shape, and `check_older_save` probed its first entry: "CheckpointError: tuple index out of
    range" on loading a legitimate save. Now it is loaded, and warned of as not verified."""
    from torch.optim.lr_scheduler import ChainedScheduler, ExponentialLR, StepLR

    from canzona.integrations.accelerate import check_older_save

    sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.5)
    chained = ChainedScheduler([StepLR(sgd, 2), ExponentialLR(sgd, 0.9)], optimizer=sgd)

    class Private:
        def state_dict(self) -> dict:
            return {"_count": 3}

    for scheds in ([chained], [Private()], [chained, Private()]):
        where = _scheduler_files(tmp_path / str(len(scheds)) / type(scheds[-1]).__name__,
                                 [s.state_dict() for s in scheds])
        told = check_older_save(where, scheds, 0, False, True)
        assert told is not None and "could not verify which scheduler file each scheduler takes" in told, told


def test_an_older_save_is_refused_only_where_its_scheduler_state_contradicts_the_prepared_one(tmp_path):
    """`check_older_save` against legitimate older scheduler files whose public keys differ from a
    fresh scheduler's: torch <= 2.6 wrote `verbose` in every LRScheduler's state, 2.6 added
    ReduceLROnPlateau's `default_min_lr`, a scheduler may set a key lazily or keep a growing metric
    history. Before (review): the key sets had to be equal, so each was refused; torch's own
    load_state_dict (__dict__.update) loads them. Now refused only where the states contradict (no
    key of a class's own in common; a list of the prepared optimizer's group count against the
    file's of another length at the same key), still one CanzonaError line."""
    from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau, StepLR

    from canzona.integrations.accelerate import check_older_save

    sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.5)
    two = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(2))]}, {"params": [nn.Parameter(torch.zeros(2))]}],
                          lr=0.5)

    class History:
        """A scheduler of the user's keeping its metrics, its best one set at the first."""

        def __init__(self, metrics: list[float]) -> None:
            self.metrics, self.optimizer = metrics, sgd

        def state_dict(self) -> dict:
            state = {"base_lrs": [0.5], "last_epoch": len(self.metrics), "metrics": list(self.metrics), "patience": 2}
            return state | ({"best": min(self.metrics)} if self.metrics else {})

    lam = LambdaLR(sgd, lambda s: 0.5 ** s)
    plateau = ReduceLROnPlateau(sgd)
    older = {k: v for k, v in plateau.state_dict().items() if k != "default_min_lr"}
    for name, sched, state in (("verbose", lam, lam.state_dict() | {"verbose": False}),
                               ("plateau", plateau, older)):
        assert check_older_save(_scheduler_files(tmp_path / name, [state]), [sched], 0, False, True) is None, name
    # a key set lazily reads as a class whose keys are a part of another's: loaded, warned of as not verified
    told = check_older_save(_scheduler_files(tmp_path / "history", [History([0.3, 0.2, 0.1]).state_dict()]),
                            [History([])], 0, False, True)
    assert told is not None and "scheduler.bin holds best of its class's own, which scheduler 0's state lacks" in told
    for name, sched, state, why in (
            ("class", lam, StepLR(sgd, 2).state_dict(), "another class's: no key of its class's own in common"),
            ("groups", lam, LambdaLR(two, lambda s: 1.0).state_dict(), "2 group(s) in its base_lrs, not 1")):
        with pytest.raises(CanzonaError, match=r"^load_state\(\): scheduler\.bin of the save in .* holds another "
                                               rf"scheduler's state .*: {re.escape(why)}\), and accelerate") as e:
            check_older_save(_scheduler_files(tmp_path / name, [state]), [sched], 0, False, True)
        assert "\n" not in str(e.value)


def test_an_older_saves_scheduler_file_of_another_class_sharing_a_generic_key_is_refused(tmp_path):
    """Schedulers of two classes whose states share a generic key name (gamma: StepLR and
    MultiStepLR, CyclicLR; mode: CyclicLR and ReduceLROnPlateau; cycle_momentum, use_beta1:
    OneCycleLR and CyclicLR). Before (review): refused only where the states shared no key of
    their class's own, so each loaded the other class's state silently. Now refused where each side
    has keys of its class's own the other lacks (beyond keys of a torch version's); where one
    side's are a part of the other's (an ExponentialLR's gamma beside a StepLR's), warned of."""
    from torch.optim import lr_scheduler as L

    from canzona.integrations.accelerate import check_older_save

    sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.5, momentum=0.9)
    make = {"step": lambda: L.StepLR(sgd, 2), "multistep": lambda: L.MultiStepLR(sgd, [2, 4]),
            "cyclic": lambda: L.CyclicLR(sgd, 0.01, 0.1), "plateau": lambda: L.ReduceLROnPlateau(sgd),
            "onecycle": lambda: L.OneCycleLR(sgd, 0.1, total_steps=20), "exp": lambda: L.ExponentialLR(sgd, 0.9)}
    for saved, prepared in (("step", "multistep"), ("multistep", "step"), ("cyclic", "plateau"),
                            ("plateau", "cyclic"), ("onecycle", "cyclic"), ("cyclic", "onecycle"), ("cyclic", "step")):
        where = _scheduler_files(tmp_path / f"{saved}-{prepared}", [make[saved]().state_dict()])
        with pytest.raises(CanzonaError, match=r"^load_state\(\): scheduler\.bin of the save in .* holds another "
                                               r"scheduler's state .*another class's: .*\), and accelerate") as e:
            check_older_save(where, [make[prepared]()], 0, False, True)
        assert "\n" not in str(e.value)
    for saved, prepared in (("exp", "step"), ("step", "exp")):
        where = _scheduler_files(tmp_path / f"{saved}-{prepared}", [make[saved]().state_dict()])
        told = check_older_save(where, [make[prepared]()], 0, False, True)
        assert told is not None and "could not verify which scheduler file each scheduler takes" in told, told
        assert "step_size" in told, told
    for name in make:  # its own class's: neither
        where = _scheduler_files(tmp_path / f"same-{name}", [make[name]().state_dict()])
        assert check_older_save(where, [make[name]()], 0, False, True) is None, name


def test_a_prepared_scheduler_whose_state_is_no_mapping_is_warned_of_in_words_of_its_own(tmp_path):
    """A prepared scheduler whose state_dict() is no mapping, beside an older save's file. Before
    (review): its file was listed as one that "could not be read weights-only", which it was."""
    from canzona.integrations.accelerate import check_older_save

    class Listed:
        def state_dict(self) -> list:
            return [1, 2]

    told = check_older_save(_scheduler_files(tmp_path, [{"base_lrs": [0.5], "last_epoch": 3}]), [Listed()], 0,
                            False, True)
    assert told is not None and "weights-only" not in told, told
    assert "scheduler 0's state_dict() is a list, no mapping to compare scheduler.bin with" in told, told


def test_the_older_saves_warning_says_why_each_scheduler_file_is_not_verified(tmp_path):
    """What `check_older_save` could not verify, in words of its own for each case. Before
    (review): one wording for all, "(schedulers of one class and group count read alike)", also
    where a file could not be read weights-only or a state (a ChainedScheduler's) shows no key of a
    class's own; and the docs said a file of another class's state is refused, while a LambdaLR's
    and a MultiplicativeLR's read alike."""
    import numpy as np
    from torch.optim import lr_scheduler

    from canzona.integrations.accelerate import check_older_save

    sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.5)

    class Halve:
        def __init__(self) -> None:
            self.factor = np.float64(0.5)  # saved in the state (a callable object's __dict__): not weights-only

        def __call__(self, step: int) -> float:
            return float(self.factor) ** step

    LambdaLR, MultiplicativeLR = lr_scheduler.LambdaLR, lr_scheduler.MultiplicativeLR
    unread = LambdaLR(sgd, Halve())
    told = check_older_save(_scheduler_files(tmp_path / "unread", [unread.state_dict()]), [unread], 0, False, True)
    assert "could not verify what scheduler.bin holds (it could not be read weights-only" in told, told
    lam, mul = LambdaLR(sgd, lambda s: 1.0), MultiplicativeLR(sgd, lambda s: 1.0)
    told = check_older_save(_scheduler_files(tmp_path / "alike", [lam.state_dict(), mul.state_dict()]), [lam, mul], 0,
                            False, True)
    assert "which scheduler file each scheduler takes (scheduler.bin could be scheduler 1's too; scheduler_1.bin " \
           "could be scheduler 0's too)" in told, told
    chained = lr_scheduler.ChainedScheduler([lr_scheduler.StepLR(sgd, 2), lr_scheduler.ExponentialLR(sgd, 0.9)],
                                            optimizer=sgd)
    told = check_older_save(_scheduler_files(tmp_path / "chained", [chained.state_dict()]), [chained], 0, False, True)
    assert "which scheduler file each scheduler takes (scheduler.bin shows no key of a scheduler class's own)" in told
    assert "read alike" not in told, told


def test_fewer_or_more_objects_registered_for_checkpointing_than_saved_is_a_count_error():
    """`register_for_checkpointing` given fewer (or more) objects at the load than at the save. Before
    (review): the error said "each would take another's state", which is the words for another
    order; now it names the counts (accelerate reads `custom_checkpoint_<i>.pkl` by position, and
    would leave the save's last unread, or find none for the last registered)."""
    from canzona.integrations.accelerate import CanzonaAccelerator

    class Counter:
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    accelerator = CanzonaAccelerator(cpu=True)
    accelerator.register_for_checkpointing(Counter())
    with pytest.raises(CanzonaError, match=r"^load_state\(\): 1 object is given to accelerator\."
                                           r"register_for_checkpointing, the save registered 2 \(saved: Counter; "
                                           r"Counter; registered now: Counter\)") as e:
        accelerator._check_registered(["Counter", "Counter"], [], [])
    assert "another's state" not in str(e.value), str(e.value)
    with pytest.raises(CanzonaError, match=r"1 object is given .* the save registered none \(saved: none;"):
        accelerator._check_registered([], [], [])


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_an_optimizer_the_trainer_dropped_is_freed(tmp_path, one_rank):
    """`hyperparameter_search` (and a second `train()` of a new model) sets `self.optimizer` and
    `self.lr_scheduler` to None and builds them again: the optimizer dropped must be freed (its
    state, buffers and the previous model's parameters). Before (review): the base rates of the
    plateau bounds and the logged AdamW keys were cached as `(optimizer, ...)` on the trainer,
    keeping the dropped optimizer alive until the next one replaced the cache."""
    import gc
    import weakref

    from transformers import TrainingArguments

    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], learning_rate=3e-3,
                             lr_scheduler_type="reduce_lr_on_plateau", lr_scheduler_kwargs={"min_lr": 1e-4},
                             eval_strategy="steps")
    trainer = CanzonaTrainer(model=model, args=args, matrix_config={"lr": 0.02}, eval_dataset=[{}])
    opt = trainer.create_optimizer()
    trainer.create_scheduler(10, opt)
    trainer._get_learning_rate()  # (the logged AdamW keys)
    dropped = weakref.ref(opt)
    del opt
    trainer.optimizer = trainer.lr_scheduler = None  # as transformers drops them for the next trial
    gc.collect()
    assert dropped() is None, [type(r).__name__ for r in gc.get_referrers(dropped())]
    # the next optimizer gets bounds and keys of its own
    opt = trainer.create_optimizer()
    assert trainer.create_scheduler(10, opt).min_lrs[0] == pytest.approx(1e-4 * 0.02 / 3e-3, rel=1e-15)
    trainer._get_learning_rate()
    assert [k for k, _ in trainer._adamw_rates] == ["learning_rate_adamw"]


def test_a_bad_plateau_bound_leaves_the_optimizers_defaults_as_they_were(tmp_path, one_rank):
    """`create_scheduler` reads the AdamW rate into `optimizer.defaults["lr"]` while transformers
    builds the schedule. Before (review): the plateau bounds were computed after that swap and
    outside its `try`, so a bound that is not a number (`{"min_lr": "1e-5"}`: a TypeError) left
    `defaults["lr"]` at the AdamW rate for good. Now the error leaves the matrix rate there."""
    from transformers import TrainingArguments

    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], learning_rate=3e-3,
                             lr_scheduler_type="reduce_lr_on_plateau", lr_scheduler_kwargs={"min_lr": "1e-5"},
                             eval_strategy="steps")
    trainer = CanzonaTrainer(model=model, args=args, matrix_config={"lr": 0.02}, eval_dataset=[{}])
    opt = trainer.create_optimizer()
    kept = dict(opt.defaults)
    with pytest.raises(TypeError):
        trainer.create_scheduler(10, opt)
    assert opt.defaults == kept and trainer.args.lr_scheduler_kwargs == {"min_lr": "1e-5"}


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_a_given_schedules_floor_warning_is_not_noise(tmp_path, one_rank):
    """The warning of a given schedule's floor (`test_a_given_schedules_floor_is_warned_of_as_on_the_accelerate_path`):
    none for `polynomial` without an `lr_end` of the user's (transformers' default 1e-7, which every
    polynomial schedule carries); and, since a schedule built as the warning advises
    (`min_lr_rate=F/adamw_lr`) cannot be told from one of an absolute `min_lr`, the warning says
    the divided floor conditionally (before, review: it said transformers had divided an absolute
    floor, also of a schedule built with the advised `min_lr_rate`)."""

    told = given_schedule_warnings(tmp_path)
    assert told("polynomial", {}) == []  # lr_end: transformers' default
    (message,) = told("cosine_with_min_lr", {"min_lr_rate": 1e-4 / 3e-3})  # as advised
    assert f"the AdamW groups at {3e-3 * (1e-4 / 3e-3):g}" in message, message
    assert "If that ratio was made of an absolute floor (min_lr, lr_end)" in message, message
    assert "a min_lr_rate given as advised" in message, message


@pytest.mark.parametrize("kind", ["reduce_lr_on_plateau", "greedy"])
def test_the_logged_adamw_keys_are_those_of_the_initial_rates_after_a_resume(tmp_path, one_rank, kind):
    """A resume builds the schedule over the new optimizer, then loads the rates the run had
    reached. A plateau schedule sets no `initial_lr`, so the logged AdamW keys (`_adamw_keys`,
    fixed at the first log) were read of the loaded rates: two AdamW groups of their own rates
    (1e-3, 3e-3) both at a floor of the user's (`min_lr=[1e-4, ...]`) merged into one key, and the
    resumed run logged other keys than the run it continues. Now the keys are of the rates the
    schedule was built over (GreedyLR's `_init_lrs` for a given one)."""
    from transformers import TrainingArguments, get_scheduler

    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    lr, own_lr = 3e-3, 1e-3
    for given in (False, True):
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        pairs = list(named_parameters(model))
        opt = DistributedOptimizer([{"params": pairs[:2], "lr": own_lr}, {"params": pairs[2:]}],
                                   ModelSpec.from_module(model), "muon", {"lr": 0.02}, {"lr": lr})
        kwargs = {"min_lr": [1e-4] * len(opt.param_groups)}
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], learning_rate=lr,
                                 lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs, eval_strategy="steps")
        if given and kind == "reduce_lr_on_plateau":
            continue  # (a given ReduceLROnPlateau keeps no initial rates: nothing to read them from)
        scheduler = get_scheduler(kind, opt, scheduler_specific_kwargs=kwargs) if given else None
        trainer = CanzonaTrainer(model=model, args=args, optimizers=(opt, scheduler), eval_dataset=[{}])
        if not given:
            trainer.create_scheduler(10, opt)
        straight = [k for k, _ in trainer._adamw_keys()]
        assert len(straight) == 2, straight
        trainer._adamw_keys_of = None  # a resumed run's trainer: keys not read yet ...
        for g in opt.param_groups:  # ... over the rates load_optimizer restored (every group at the floor)
            g["lr"] = 1e-4
        assert [k for k, _ in trainer._adamw_keys()] == straight, (given, kind)


@pytest.mark.parametrize("call", ["clip_grad_norm_", "clip_grad_value_"])
def test_accelerate_clip_given_no_number_is_the_optimizers_one_spec_error(one_rank, call):
    """`accelerator.clip_grad_norm_(params, None)` (a config value left unset on one rank): the
    optimizer's step check refuses it, on every rank alike, as a SpecError naming the threshold;
    nothing updated. Before: `float(None)` raised a TypeError on that rank alone, before the check
    its peers waited in. A 0-dim tensor threshold is taken as its number, as torch's clips take it."""
    from canzona.errors import SpecError
    from canzona.integrations.accelerate import CanzonaAccelerator
    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "adamw")
    accelerator = CanzonaAccelerator(cpu=True)
    model, opt = accelerator.prepare(model, opt)
    accelerator.backward(model(torch.ones(2, 8)).sum())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(SpecError, match="must be a positive number"):
        getattr(accelerator, call)(model.parameters(), None)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    getattr(accelerator, call)(model.parameters(), torch.tensor(1.0))
    opt.step()


def test_accelerate_clip_grad_value_is_the_optimizers_and_steps_as_torch(one_rank):
    """`CanzonaAccelerator.clip_grad_value_(model.parameters(), v)` is `opt.clip_grad_value_(v)`: the
    weights bit for bit torch's AdamW after torch.nn.utils.clip_grad_value_ (one rank: the gradient
    DDP averages is the rank's own); a subset of the optimizer's parameters is refused, as for
    clip_grad_norm_. Before: refused ('clip_grad_value_ is not supported')."""
    from canzona.integrations.accelerate import CanzonaAccelerator
    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    model, reference = build(), build()
    opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "adamw",
                               adamw_config={"weight_decay": 0.1})
    accelerator = CanzonaAccelerator(cpu=True)
    model, opt = accelerator.prepare(model, opt)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1)
    clamped = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        opt.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        accelerator.clip_grad_value_(model.parameters(), 0.01)
        opt.step()
        torch_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        clamped.append(any(bool((p.grad.abs() > 0.01).any()) for p in reference.parameters()))
        torch.nn.utils.clip_grad_value_(reference.parameters(), 0.01)
        torch_opt.step()
    assert all(clamped)  # the clamp was active in every step
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(model.parameters(), reference.parameters()))
    with pytest.raises(CanzonaError, match="^clip_grad_value_ got a subset"):
        accelerator.clip_grad_value_(list(model.parameters())[:2], 0.01)
