"""Batched kernels (issue 18, part 4; `canzona.runtime.batched`): same-shape matrices of one host run
as one batched kernel, bit-identical on CPU to one per-matrix call each; the executor batches them
(`batch_kernels`, on by default) without changing a bit of the step; `compile_kernels` compiles the
Newton-Schulz iterations and stays within a stated tolerance of eager.

bf16 matmuls are slow on a CPU without native bf16: the bf16 cases keep to small matrices.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from canzona.errors import CanzonaError, SpecError
from canzona.optimizers import (
    MuonConfig,
    ShampooConfig,
    SOAPConfig,
    default_config,
    matrix_optimizer,
)
from canzona.plan import make_plan
from canzona.runtime import batched as B
from canzona.runtime.executor import MatrixStep
from canzona.runtime.kernels import matrix_kernel, muon_apply_scalars, newton_schulz
from canzona.step_policies import get_step_policy
from canzona.step_schedule import PIPELINED, SERIAL, tp_schedule
from reference.tiny_model import get_preset, model_spec

COEFFICIENTS = MuonConfig().ns_coefficients
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def _equal_ns(shape: tuple[int, int], k: int, dtype: torch.dtype, seed: int = 0) -> bool:
    gen = torch.Generator().manual_seed(seed)
    us = [torch.randn(shape, generator=gen) for _ in range(k)]
    one = [newton_schulz(u, COEFFICIENTS, 5, 1e-7, dtype) for u in us]
    many = B.newton_schulz_batched(us, COEFFICIENTS, 5, 1e-7, dtype)
    return many.shape == (k, *shape) and all(torch.equal(a, b) for a, b in zip(one, many))


# --- (a) batched Newton-Schulz == per-matrix Newton-Schulz, bit for bit ------------------------

# wide, tall, square; under and over the 400 multiply-adds below which CPU bmm loops on its own;
# sizes whose matrices, packed back to back, would start misaligned (7 x 300: MKL rounds A A^T
# of a misaligned operand otherwise); vectors and scalars as matrices
SHAPES = [(16, 24), (24, 16), (20, 20), (4, 4), (5, 12), (12, 5), (7, 300), (300, 7), (65, 33), (33, 65),
          (1, 9), (9, 1), (1, 1), (128, 96)]


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_batched_newton_schulz_is_per_matrix_newton_schulz_fp32(shape, k):
    assert _equal_ns(shape, k, torch.float32)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("shape", [(4, 4), (6, 10), (10, 6), (16, 24), (24, 16), (7, 40), (40, 7)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_batched_newton_schulz_is_per_matrix_newton_schulz_bf16(shape, k):
    assert _equal_ns(shape, k, torch.bfloat16)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 48), cols=st.integers(1, 48), k=st.integers(2, 4),
       dtype=st.sampled_from(["fp32", "fp64"]), seed=st.integers(0, 2**16))
def test_batched_newton_schulz_property(rows, cols, k, dtype, seed):
    assert _equal_ns((rows, cols), k, DTYPES[dtype], seed)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 20), cols=st.integers(1, 20), k=st.integers(2, 3), seed=st.integers(0, 2**16))
def test_batched_newton_schulz_property_bf16(rows, cols, k, seed):
    assert _equal_ns((rows, cols), k, torch.bfloat16, seed)


def test_bf16_products_over_stacks_are_the_per_matrix_products_one_thread_too():
    """oneDNN's batched bf16 GEMM rounds otherwise than its single GEMM in rare cases even on one
    thread (about 1 in 500 products of 16 x 16 x 16 matrices on an AVX-512 / AMX Xeon: Newton-Schulz
    of a 16 x 32 expert's A @ A, what made `canzona verify --dp 4 --ep 2` differ after 7 steps):
    many small products, each equal."""
    from canzona.runtime.batched import baddbmm, bmm, stack

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        for _ in range(1000):
            a = stack([torch.randn(16, 16, generator=gen).bfloat16() for _ in range(4)])
            b = stack([torch.randn(16, 16, generator=gen).bfloat16() for _ in range(4)])
            c = stack([torch.randn(16, 16, generator=gen).bfloat16() for _ in range(4)])
            prod, fused = bmm(a, b), baddbmm(c, a, b, beta=-4.775, alpha=2.0315)
            for i in range(4):
                assert torch.equal(prod[i], torch.mm(a[i], b[i]))
                assert torch.equal(fused[i], torch.addmm(c[i], a[i], b[i], beta=-4.775, alpha=2.0315))
    finally:
        torch.set_num_threads(previous)


def test_batched_newton_schulz_with_two_threads():
    """BLAS and torch's reductions split work across threads: still the per-matrix result."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert all(_equal_ns(shape, 3, torch.float32) for shape in [(96, 200), (7, 300), (129, 65)])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(7, 13), (16, 16), (3, 5), (1, 1)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_matrix_of_a_stack_starts_aligned_in_its_layout(shape, dtype):
    for layout in ("row", "col"):
        ts = [torch.randn(shape).to(dtype) for _ in range(3)]
        if layout == "col":
            ts = [t.T.contiguous().T for t in ts]
        s = B.stack(ts)
        for t, m in zip(ts, s):
            assert m.data_ptr() % B.ALIGN_BYTES == 0 and m.stride() == t.stride() and torch.equal(m, t)


# --- batched optimizer kernels == per-matrix kernels, several steps ----------------------------

CONFIGS = {
    "muon": [replace(MuonConfig(), ns_dtype="fp32", weight_decay=0.1),
             replace(MuonConfig(), ns_dtype="fp32", nesterov=False, adjust_lr_fn="match_rms_adamw"),
             MuonConfig()],  # bf16 Newton-Schulz (small shapes only)
    "soap": [replace(SOAPConfig(), precondition_frequency=2, weight_decay=0.05),
             replace(SOAPConfig(), precondition_frequency=3, max_precond_dim=20, correct_bias=False),
             replace(SOAPConfig(), max_precond_dim=0)],
    "shampoo": [replace(ShampooConfig(), precondition_frequency=2, weight_decay=0.05),
                replace(ShampooConfig(), precondition_frequency=3, max_preconditioner_dim=20),
                replace(ShampooConfig(), grafting=False, betas=(0.9, 1.0), precondition_frequency=2)],
}
KERNEL_SHAPES = [(24, 16), (16, 24), (20, 20), (7, 13), (33, 5)]


def _assert_same_update(one, many) -> None:
    if one is None:
        assert many is None
        return
    assert torch.equal(one.direction, many.direction)
    assert (one.scale, one.decay, one.decay_first) == (many.scale, many.decay, many.decay_first)


def _assert_same_state(one: dict, many: dict) -> None:
    assert one.keys() == many.keys()
    for key, value in one.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, many[key]), key
        else:
            assert value == many[key], key


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name,index", [(n, i) for n, cs in CONFIGS.items() for i in range(len(cs))])
def test_batched_kernel_is_the_per_matrix_kernel(name, index, shape):
    cfg, k, steps = CONFIGS[name][index], 3, 5  # SOAP: initialise, update, refresh (2 and 3), update
    gen = torch.Generator().manual_seed(index)
    alone, together = [{} for _ in range(k)], [{} for _ in range(k)]
    for _ in range(steps):
        grads = [torch.randn(shape, generator=gen) for _ in range(k)]
        want = [matrix_kernel(name)(g.clone(), s, cfg, 0.01) for g, s in zip(grads, alone)]
        got = matrix_optimizer(name).part("batched")([g.clone() for g in grads], together, cfg, 0.01)
        for one, many in zip(want, got):
            _assert_same_update(one, many)
        for one, many in zip(alone, together):
            _assert_same_state(one, many)


def test_batched_shampoo_refuses_what_the_per_matrix_kernel_refuses():
    with pytest.raises(ValueError, match="grafting"):
        B.shampoo_update_batched([torch.randn(4, 4)] * 2, [{}, {}], replace(ShampooConfig(), betas=(0.9, 1.0)), 0.1)


# --- what batches together --------------------------------------------------------------------


def test_batch_key_separates_steps_layouts_and_shapes():
    g = torch.randn(6, 4)
    fresh, stepped = {}, {}
    matrix_kernel("soap")(g, stepped, SOAPConfig(), 0.1)
    assert B.batch_key(g, fresh) == B.batch_key(torch.randn(6, 4), {})
    assert B.batch_key(g, fresh) != B.batch_key(g, stepped)
    later = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in stepped.items()}
    later["step"] = 3
    assert B.batch_key(g, stepped) != B.batch_key(g, later)  # SOAP's step decides what a call does
    col = dict(stepped, exp_avg=stepped["exp_avg"].T.contiguous().T)
    assert B.batch_key(g, stepped) != B.batch_key(g, col)
    assert B.batch_key(g, {}) != B.batch_key(g.T.contiguous(), {})
    assert B.batch_key(torch.randn(6, 8)[:, :4], {}) is None  # neither row- nor column-major: alone


def test_batches_group_equal_keys_in_order_and_cap_their_size():
    items = [("a", 1, 10), ("b", 2, 10), ("c", 1, 10), ("d", None, 10), ("e", 1, 10), ("f", 2, 10), ("g", None, 1)]
    assert B.batches(items, max_numel=100) == [["a", "c", "e"], ["b", "f"], ["d"], ["g"]]
    assert B.batches(items, max_numel=20) == [["a", "c"], ["b", "f"], ["d"], ["e"], ["g"]]
    assert B.batches([("big", 1, 50)], max_numel=20) == [["big"]]


# --- (b) the executor's step: batch_kernels=True equals batch_kernels=False --------------------

MATRIX_SPEC = model_spec(get_preset("tiny"))
STEP_CONFIGS = {"muon": replace(MuonConfig(), ns_dtype="fp32"), "soap": replace(SOAPConfig(), precondition_frequency=2),
                "shampoo": replace(ShampooConfig(), precondition_frequency=2)}


class _Counting:
    """A batched kernel that records the size of every batch it runs."""

    def __init__(self, kernel):
        self.kernel, self.sizes = kernel, []

    def __call__(self, grads, states, cfg, lr):
        self.sizes.append(len(grads))
        return self.kernel(grads, states, cfg, lr)


def _train(optimizer: str, batch: bool, mode: str = PIPELINED, policy: str = "canzona", steps: int = 4,
           max_numel: int | None = None):
    """`steps` steps of the executor at TP = 1 on the tiny model's matrices: random gradients, one
    layer's matrices in a second parameter group (other hyper-parameters), one matrix without a
    gradient at step 2. Returns the parameters, the states and the batch sizes run."""
    plan = make_plan(MATRIX_SPEC, 1, 1, optimizer, "alpha-balanced", "greedy-rollback")
    schedule = tp_schedule(plan, MATRIX_SPEC, get_step_policy(policy), 0, mode, 4, 4)
    names = [t.name for t in schedule.tasks()]
    gen = torch.Generator().manual_seed(3)
    params = {n: torch.randn(MATRIX_SPEC.param(n).shape, generator=gen) for n in names}
    cfg = STEP_CONFIGS[optimizer]
    other = replace(cfg, weight_decay=0.5)
    state: dict[str, dict] = {n: {} for n in names}
    counting = _Counting(matrix_optimizer(optimizer).part("batched")) if batch else None
    ms = MatrixStep(schedule, None, 0, matrix_kernel(optimizer), state, torch.float32, torch.float32,
                    torch.device("cpu"), scalars=matrix_optimizer(optimizer).part("scalars"), batched=counting)
    if max_numel is not None:
        ms.max_batch_numel = max_numel
        ms.windows = ms._compute_windows()
    for step in range(steps):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
        ms.run(grad=grads.__getitem__, target=params.__getitem__, applied=lambda n: None,
               config=lambda n: (other if ".layers.1." in n else cfg, 0.01),
               got=lambda n, s=step: not (s == 2 and n.endswith("layers.0.mlp.up_proj.weight")))
    return params, state, counting.sizes if counting else []


@pytest.mark.parametrize("mode", [PIPELINED, SERIAL])
@pytest.mark.parametrize("optimizer", ["muon", "soap", "shampoo"])
def test_executor_step_with_batching_equals_without(optimizer, mode):
    want, want_state, _ = _train(optimizer, batch=False, mode=mode)
    got, got_state, sizes = _train(optimizer, batch=True, mode=mode)
    assert max(sizes) >= 2  # matrices really ran together
    for name in want:
        assert torch.equal(got[name], want[name]), name
        _assert_same_state(want_state[name], got_state[name])


@pytest.mark.parametrize("optimizer", ["muon", "soap"])
def test_executor_batches_a_tp_sync_group_and_caps_windows(optimizer):
    want, _, _ = _train(optimizer, batch=False)
    got, _, sizes = _train(optimizer, batch=True, policy="sc")  # one group of everything
    assert max(sizes) >= 2 and all(torch.equal(got[n], want[n]) for n in want)
    capped, _, sizes = _train(optimizer, batch=True, max_numel=2 * 128 * 64)  # two MLP matrices at most
    assert sizes and max(sizes) == 2 and all(torch.equal(capped[n], want[n]) for n in want)


def test_windows_join_groups_only_where_nothing_moves():
    plan = make_plan(MATRIX_SPEC, 1, 1, "muon", "alpha-balanced", "greedy-rollback")
    schedule = tp_schedule(plan, MATRIX_SPEC, get_step_policy("canzona"), 0, PIPELINED, 4, 4)
    kernel, batched, scalars = matrix_kernel("muon"), B.muon_update_batched, muon_apply_scalars
    alone = MatrixStep(schedule, None, 0, kernel, {}, torch.float32, torch.float32, torch.device("cpu"),
                       scalars=scalars)
    assert alone.windows == {i: (i,) for i in range(len(schedule.groups))}
    joined = MatrixStep(schedule, None, 0, kernel, {}, torch.float32, torch.float32, torch.device("cpu"),
                        scalars=scalars, batched=batched)
    assert list(joined.windows) == [0] and joined.windows[0] == tuple(range(len(schedule.groups)))
    plan2 = make_plan(MATRIX_SPEC, 1, 2, "muon", "alpha-balanced", "greedy-rollback")
    schedule2 = tp_schedule(plan2, MATRIX_SPEC, get_step_policy("canzona"), 0, PIPELINED, 4, 4)
    tp2 = MatrixStep(schedule2, None, 0, kernel, {}, torch.float32, torch.float32, torch.device("cpu"),
                     scalars=scalars, batched=batched)
    assert tp2.windows == {i: (i,) for i in range(len(schedule2.groups))}  # collectives between groups


# --- how chunks are applied: the registry's scalars, not the host's --------------------------


@pytest.mark.parametrize("optimizer", ["muon", "soap", "shampoo", "normuon"])
def test_registry_scalars_are_the_kernels_own_at_every_step(optimizer):
    """What a TP rank that receives chunks applies them with (`scalars`, from the step count) is
    what the host's kernel returns: SOAP's first step without an update, its bias-corrected scale
    after; and `steps_taken` reads the count back from a state."""
    entry = matrix_optimizer(optimizer)
    kernel, scalars, taken = entry.part("kernel"), entry.part("scalars"), entry.part("steps_taken")
    cfg = replace(default_config(optimizer), weight_decay=0.1)
    gen = torch.Generator().manual_seed(5)
    state: dict = {}
    for steps in range(4):
        update = kernel(torch.randn(12, 8, generator=gen), state, cfg, 0.02)
        assert (None if update is None else update.scalars) == scalars((12, 8), cfg, 0.02, steps), steps
        if taken is not None:
            assert taken(state) == steps + 1
    assert (optimizer == "soap") == (scalars((12, 8), cfg, 0.02, 0) is None)


def test_executor_refuses_a_state_that_disagrees_with_the_step_count():
    """The host checks its kernel's update against the scalars its TP peers compute from the step
    count they keep: a state out of step with it is one error, before that matrix changes."""
    plan = make_plan(MATRIX_SPEC, 1, 1, "soap", "alpha-balanced", "greedy-rollback")
    schedule = tp_schedule(plan, MATRIX_SPEC, get_step_policy("canzona"), 0, PIPELINED, 4, 4)
    names = [t.name for t in schedule.tasks()]
    params = {n: torch.zeros(MATRIX_SPEC.param(n).shape) for n in names}
    state: dict[str, dict] = {n: {} for n in names}
    ms = MatrixStep(schedule, None, 0, matrix_kernel("soap"), state, torch.float32, torch.float32,
                    torch.device("cpu"), scalars=matrix_optimizer("soap").part("scalars"))
    gen = torch.Generator().manual_seed(3)
    how = dict(target=params.__getitem__, applied=lambda n: None, config=lambda n: (STEP_CONFIGS["soap"], 0.01))
    for _ in range(2):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
        ms.run(grad=grads.__getitem__, got=lambda n: n != names[0], **how)
    assert ms.steps == {n: 2 for n in names[1:]}  # a matrix without a gradient takes no step
    before = {n: p.clone() for n, p in params.items()}
    ms.steps[names[1]] = 0  # as if a state were loaded on the host alone
    with pytest.raises(CanzonaError, match="step count every TP rank keeps disagree"):
        ms.run(grad=grads.__getitem__, got=lambda n: True, **how)
    assert all(torch.equal(params[n], before[n]) for n in names[1:2])


# --- options ----------------------------------------------------------------------------------


def test_kernel_options_are_checked_before_anything_else():
    from canzona.runtime.optimizer import DistributedOptimizer
    from reference.tiny_model import TinyQwen3

    model = TinyQwen3("tiny")
    with pytest.raises(SpecError, match="batch_kernels"):
        DistributedOptimizer(model.named_parameters(), model.spec(), batch_kernels="yes")
    with pytest.raises(SpecError, match="compile_kernels"):
        DistributedOptimizer(model.named_parameters(), model.spec(), compile_kernels=1)


@pytest.fixture
def no_cpp_compiler():
    """Inductor finds no C++ compiler (its search is cached: cleared before and after)."""
    from torch._inductor import config
    from torch._inductor.cpp_builder import cpp_compiler_search

    cpp_compiler_search.cache_clear()
    with config.patch({"cpp.cxx": ("/nonexistent/c++",)}):  # torch's own patch: restored as it was
        yield
    cpp_compiler_search.cache_clear()


def test_compile_without_a_compiler_is_one_error_at_construction(no_cpp_compiler):
    from canzona.runtime.optimizer import DistributedOptimizer
    from reference.tiny_model import TinyQwen3

    with pytest.raises(CanzonaError, match="C\\+\\+ compiler"):
        B.check_compile(["cpu"])
    model = TinyQwen3("tiny")
    # raised before the optimizer looks for a process group (none here)
    with pytest.raises(CanzonaError, match="compile_kernels=True.*C\\+\\+ compiler"):
        DistributedOptimizer(model.named_parameters(), model.spec(), compile_kernels=True)


def test_matrix_kernels_choose_per_matrix_batched_and_compiled():
    assert B.matrix_kernels("soap", batch=False, compile=False) == (matrix_kernel("soap"), None)
    assert B.matrix_kernels("shampoo", batch=True, compile=True) == (matrix_kernel("shampoo"),
                                                                     B.shampoo_update_batched)
    kernel, batched = B.matrix_kernels("muon", batch=True, compile=True)
    assert isinstance(kernel, functools.partial) and isinstance(batched, functools.partial)


# --- compile_kernels: torch.compile of the Newton-Schulz iterations ----------------------------

# Inductor may fuse and reorder arithmetic, so compiled need not equal eager. Observed on this CPU
# (torch 2.13, 5 steps, the shapes below): equal for most, as inductor calls the same mm / addmm
# there; 1.4e-6 absolute (entries ~1) for the batched 7 x 13 fp32, whose compiled form runs torch's
# own bmm (its CPU loop for tiny matrices sums in another order); 0 in bf16. Asserted, with margin:
# 1e-5 absolute in fp32, one bf16 rounding step at 1 (2^-8 = 3.9e-3) in bf16.
COMPILE_ATOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8}
# inductor's own imports warn about a deprecated torch.jit API: not this project's
QUIET_INDUCTOR = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@QUIET_INDUCTOR
@pytest.mark.parametrize("dtype,shape", [(torch.float32, (16, 24)), (torch.float32, (24, 16)),
                                         (torch.float32, (7, 13)), (torch.bfloat16, (12, 20))], ids=str)
def test_compiled_newton_schulz_matches_eager(dtype, shape):
    B.check_compile(["cpu"])
    gen = torch.Generator().manual_seed(0)
    us = [torch.randn(shape, generator=gen) for _ in range(3)]
    eager = [newton_schulz(u, COEFFICIENTS, 5, 1e-7, dtype) for u in us]
    one = [B.newton_schulz_compiled(u, COEFFICIENTS, 5, 1e-7, dtype) for u in us]
    many = B.newton_schulz_batched_compiled(us, COEFFICIENTS, 5, 1e-7, dtype)
    for e, o, m in zip(eager, one, many):
        assert o.dtype == m.dtype == dtype and o.shape == m.shape == e.shape
        assert (o.float() - e.float()).abs().max().item() <= COMPILE_ATOL[dtype]
        assert (m.float() - e.float()).abs().max().item() <= COMPILE_ATOL[dtype]


@QUIET_INDUCTOR
def test_compiled_muon_kernels_match_eager():
    """One step of the compiled Muon kernels, per matrix and batched, as the executor runs them."""
    kernel, batched = B.matrix_kernels("muon", batch=True, compile=True)
    cfg = replace(MuonConfig(), ns_dtype="fp32")
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(16, 24, generator=gen) for _ in range(2)]
    eager = [matrix_kernel("muon")(g, {}, cfg, 0.01) for g in grads]
    for got in ([kernel(g, {}, cfg, 0.01) for g in grads], batched(grads, [{}, {}], cfg, 0.01)):
        for e, u in zip(eager, got):
            assert (u.direction - e.direction).abs().max().item() <= COMPILE_ATOL[torch.float32]
            assert (u.scale, u.decay) == (e.scale, e.decay)


# --- (b) whole optimizer steps on gloo: batch_kernels=True equals batch_kernels=False ------------

DIST_CONFIGS = {"muon": {"ns_dtype": "fp32"}, "soap": {"precondition_frequency": 2},
                "shampoo": {"precondition_frequency": 2}}


def _dist_cases(tp: int) -> dict[tuple, tuple]:
    """(optimizer, variant, batch) -> (TrainSpec, extra). At TP 1 the plan's own layout (consecutive
    groups join); at TP 2 one micro-group of every matrix (hosts batch their same-shape ones) and
    `sc` (tp-sync: every rank computes every matrix in one group)."""
    from canzona.harness.training import TrainSpec
    from canzona.tp import Capacity

    out = {}
    for optimizer, cfg in DIST_CONFIGS.items():
        base = TrainSpec(optimizer=optimizer, steps=4, global_batch=4, seq_len=16, tp=tp, matrix_config=dict(cfg))
        variants = {"plan": (base, {})}
        if tp > 1:
            one_group = make_plan(MATRIX_SPEC, 1, tp, optimizer, "alpha-balanced", "greedy-rollback",
                                  capacity=Capacity(1e9))
            variants = {"one group": (base, {"plan": one_group}), "sc": (replace(base, policy="sc"), {})}
        for variant, (spec, extra) in variants.items():
            for batch in (True, False):
                out[(optimizer, variant, batch)] = (replace(spec, batch_kernels=batch), {**extra, "state_dict": False})
    return out


@functools.cache
def _spawned(tp: int) -> dict:
    from canzona.harness.launch import run_ranks
    from canzona.harness.training import many_specs_worker

    jobs = _dist_cases(tp)
    results = run_ranks(many_specs_worker, tp, [s for s, _ in jobs.values()], [e for _, e in jobs.values()],
                        deadline_s=300.0)
    return {key: [r[i] for r in results] for i, key in enumerate(jobs)}


def _hosts_batch(result: dict, spec) -> bool:
    """Some rank's schedule gives it two same-shape matrices in one compute window."""
    policy = get_step_policy(spec.policy)
    schedule = tp_schedule(result["plan"], MATRIX_SPEC, policy, 0, spec.tp_mode, 4, 4)
    for group in schedule.groups:
        shapes = [t.shape for t in group.hosted(result["tp_rank"])]
        if len(shapes) != len(set(shapes)):
            return True
    return schedule.tp == 1 and len({t.shape for t in schedule.tasks()}) < len(schedule.tasks())


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_optimizer_steps_with_batching_equal_steps_without(tp):
    runs = _spawned(tp)
    for (optimizer, variant, batch), results in runs.items():
        if not batch:
            continue
        spec = _dist_cases(tp)[(optimizer, variant, batch)][0]
        assert any(_hosts_batch(r, spec) for r in results), (optimizer, variant)
        for on, off in zip(results, runs[(optimizer, variant, False)]):
            assert on["tp_rank"] == off["tp_rank"]
            for name, p in off["params"].items():
                assert torch.equal(on["params"][name], p), (optimizer, variant, on["tp_rank"], name)
