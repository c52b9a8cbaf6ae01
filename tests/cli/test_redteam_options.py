"""Red-team regressions of the options `canzona simulate` and `canzona compare` share
(`cli.main.SimOptions`): an option that changes nothing where it is given is an error line, as its
siblings are."""

from __future__ import annotations

import json

from tests.cli_helpers import error_line, invoke

DENSE = ["--model", "qwen3-0.6b", "--gpus", "16", "--tp", "2", "--seq-len", "256", "--global-batch", "16"]


def test_fsdp_impl_needs_fsdp():
    """`--fsdp-impl megatron-fsdp` without --fsdp was accepted and ignored (the same run as without
    it) by simulate and, since it gained the option, compare; its sibling --no-reshard-after-forward
    is refused there, and so is a published row's fsdp_impl off an fsdp row."""
    for command in ("simulate", "compare"):
        error_line(invoke(command, *DENSE, "--fsdp-impl", "megatron-fsdp"), "--fsdp-impl megatron-fsdp",
                   "needs --fsdp")
        result = invoke(command, *DENSE, "--fsdp", "--fsdp-impl", "megatron-fsdp", "--json")
        assert result.exit_code == 0, result.stderr
        rows = json.loads(result.stdout)
        assert rows  # under --fsdp it runs
    plain = invoke("simulate", *DENSE, "--fsdp-impl", "fsdp2", "--json")  # the default, named: nothing to refuse
    assert plain.exit_code == 0, plain.stderr


MOE = ["--model", "qwen3-30b-a3b", "--gpus", "16", "--tp", "1", "--global-batch", "16", "--optimizer", "adamw"]
FSDP = [*DENSE, "--fsdp"]
BOTH = ("simulate", "compare")


def _help(option: str) -> str:
    """simulate's help of one option (its parameter name), as click holds it: unwrapped."""
    from typer.main import get_command

    from cli.main import app

    return {p.name: p for p in get_command(app).commands["simulate"].params}[option].help


def _simulated(*args: str) -> dict:
    """What simulate computed (not the options it echoes back): the times, breakdowns and memory."""
    result = invoke("simulate", *args, "--json")
    assert result.exit_code == 0, result.stderr
    row = json.loads(result.stdout)
    return {k: row[k] for k in ("iteration_time_s", "optimizer_step_s", "forward_backward_s", "breakdown",
                                "optimizer_breakdown", "rank_optimizer_s", "memory")}


def test_pipeline_split_accounting_at_pp_1_is_a_documented_no_op():
    """--account-for-embedding/loss-in-pipeline-split at --pp 1: Megatron accepts them there
    (TransformerConfig.__post_init__ only asks layers + 1 [+ 1] divisible by pp, which 1 divides, and
    get_num_layers_to_build takes the counted layers back off the one stage), so they stay accepted,
    but the help says they change nothing there (it did not), and they do not."""
    for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        assert "at --pp 1 a no-op, as in Megatron" in _help(name), name
    both = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")
    assert _simulated(*DENSE, *both) == _simulated(*DENSE)


def test_routing_needs_expert_parallelism():
    """--routing balanced at --ep 1 was accepted and changed nothing (every GPU computes every expert
    on its own tokens); its sibling --router-imbalance is refused there."""
    for command in BOTH:
        error_line(invoke(command, *MOE, "--routing", "balanced"), "--routing balanced", "needs --ep > 1")
    error_line(invoke("simulate", *MOE, "--router-imbalance", "1.5"), "needs expert parallelism")
    assert invoke("simulate", *MOE, "--routing", "random", "--json").exit_code == 0  # the default, named


def test_fp8_recipe_needs_fp8():
    """--fp8-recipe current under --precision bf16 was accepted and changed nothing (no FP8 cast to
    scale); a published row's fp8_recipe off an fp8 row is refused too. The default, named, stays."""
    for command in BOTH:
        error_line(invoke(command, *DENSE, "--fp8-recipe", "current"), "--fp8-recipe current", "--precision fp8")
    error_line(invoke("search", "--model", "qwen3-0.6b", "--gpus", "8", "--fp8-recipe", "current"),
               "--fp8-recipe current", "--precision fp8")
    assert invoke("simulate", *DENSE, "--fp8-recipe", "delayed", "--json").exit_code == 0
    fp8 = [*DENSE, "--precision", "fp8", "--hardware", "h100-sxm"]
    assert _simulated(*fp8, "--fp8-recipe", "current") != _simulated(*fp8)


def test_zero1_options_are_refused_under_fsdp():
    """--no-overlap-grad-reduce, --no-overlap-param-gather and --no-zero1-fallback were accepted
    under --fsdp and changed nothing: FSDP reduce-scatters each unit on its own stream and gathers
    one unit ahead (torch's fully_shard has no switch for either), and canzona's FSDP owners have
    no ZeRO-1 fallback."""
    for command in BOTH:
        error_line(invoke(command, *FSDP, "--no-overlap-grad-reduce"), "--no-overlap-grad-reduce", "--fsdp")
        error_line(invoke(command, *FSDP, "--no-zero1-fallback"), "--no-zero1-fallback", "--fsdp")
        error_line(invoke(command, *FSDP, "--no-overlap-param-gather"), "--no-overlap-param-gather", "--fsdp")
    # on the ZeRO-1 layout they still act
    assert _simulated(*DENSE, "--no-overlap-grad-reduce") != _simulated(*DENSE)
    assert _simulated(*DENSE, "--no-overlap-param-gather") != _simulated(*DENSE)


def test_zero1_step_options_are_refused_under_fsdp():
    """--reduce-scatter, --geometry, --tp-policy, --tp-mode and --capacity were accepted under
    --fsdp and changed nothing: they are DistributedOptimizer's options of the ZeRO-1 layout, which
    FsdpOptimizer (canzona.runtime.fsdp) takes and does nothing with (FSDP2 reduce-scatters, the
    owners hold whole matrices planned at TP 1, the step's micro-groups are the owners' exchanges).
    Named at their defaults they stay accepted (the same run); on the ZeRO-1 layout they act."""
    refused = (("--reduce-scatter", "padded"), ("--geometry", "whole"), ("--tp-policy", "tp-chunk"),
               ("--tp-mode", "serial"), ("--capacity", "1GiB"))
    for command in BOTH:
        for option, value in refused:
            error_line(invoke(command, *FSDP, option, value), f"{option}", "ZeRO-1", "--fsdp")
    defaults = ("--reduce-scatter", "native", "--geometry", "auto", "--tp-policy", "greedy-rollback",
                "--tp-mode", "pipelined", "--capacity", "auto")
    assert _simulated(*FSDP, *defaults) == _simulated(*FSDP)
    dense = _simulated(*DENSE)
    for option, value in refused:
        if option != "--geometry":  # auto already plans whole matrices on this layout
            assert _simulated(*DENSE, option, value) != dense, option


def test_fsdp_owner_options_act_as_the_runtimes():
    """--no-batch-kernels and --bucket-size are FsdpOptimizer's options too (canzona.runtime.fsdp:
    batch_kernels runs an owner's same-shape matrices of a micro-group as one kernel; bucket_size
    goes into its owners' plan, `fsdp_matrices`), so under --fsdp they stay and move the simulated
    run where the runtime's behaviour moves. On FSDP's 16 GPUs at TP 2 no owner has two matrices
    of one shape in a micro-group: nothing to batch, for the runtime either (the same run); over 4
    GPUs there are. The buckets group the matrices whose owners canzona balances bucket by bucket
    below --alpha 1 (at 1 its reorder balances every bucket's matrices together: the same owners)."""
    from canzona.batching import shape_batches
    from sim.fsdp import _FsdpRun, check_fsdp
    from sim.simulate import SimConfig
    from sim.workload import Workload

    cfg = SimConfig(model="qwen3-0.6b", gpus=16, tp=2, fsdp=True, workload=Workload(seq_len=256, global_batch=16))
    cluster, model, hw = cfg.checked()
    run = _FsdpRun(cfg, model, cluster, hw, check_fsdp(cfg, cluster, model[0]))
    assert max(len(b) for g in run.micro_groups() for r in run.members
               for b in shape_batches([m for m in g if m.owner == r], True)) == 1
    assert _simulated(*FSDP, "--no-batch-kernels") == _simulated(*FSDP)
    four = [*DENSE[:2], "--gpus", "4", "--tp", "1", *DENSE[6:], "--fsdp"]
    on, off = _simulated(*four), _simulated(*four, "--no-batch-kernels")
    assert on["optimizer_step_s"] < off["optimizer_step_s"]
    assert on["memory"]["worst"]["step_buffers"] > off["memory"]["worst"]["step_buffers"]  # the batches' stacks
    half = _simulated(*FSDP, "--alpha", "0.5")
    assert _simulated(*FSDP, "--alpha", "0.5", "--bucket-size", "20000000") != half
    assert _simulated(*FSDP, "--bucket-size", "20000000") == _simulated(*FSDP)


def test_alpha_and_compile_kernels_under_fsdp():
    """--alpha balances canzona's FSDP owners (it changes the run: kept, and the help says so);
    --compile-kernels is priced as eager everywhere, FSDP's optimizer's option too (kept, as the
    runtime's, with the help saying nothing simulated changes)."""
    assert _simulated(*FSDP, "--alpha", "0") != _simulated(*FSDP)
    assert "under --fsdp the balance of its owners" in _help("alpha")
    assert "no simulated figure changes with it" in _help("compile_kernels")
    assert _simulated(*FSDP, "--compile-kernels") == _simulated(*FSDP)


def test_unknown_tp_policy_is_always_an_error():
    """An unknown --tp-policy was accepted wherever no TP schedule is planned (an elementwise
    optimizer, --fsdp --ep with adamw)."""
    for args in ([*DENSE, "--optimizer", "adamw"], [*MOE, "--fsdp", "--ep", "16"]):
        for command in BOTH:
            error_line(invoke(command, *args, "--tp-policy", "bogus"), "unknown TP policy 'bogus'")


def test_selective_layer_needs_fsdp2():
    """torchtitan's selective-layer (every K-th layer checkpointed) was simulated under
    --fsdp-impl megatron-fsdp, which no framework runs it with: Megatron-LM's recompute is
    full / selective with uniform / block methods, NeMo AutoModel's one switch for every layer."""
    for command in BOTH:
        error_line(invoke(command, *FSDP, "--fsdp-impl", "megatron-fsdp", "--recompute", "selective-layer"),
                   "--recompute selective-layer", "--fsdp-impl megatron-fsdp")
    assert invoke("simulate", *FSDP, "--recompute", "selective-layer", "--json").exit_code == 0
    assert invoke("simulate", *FSDP, "--fsdp-impl", "megatron-fsdp", "--recompute", "full", "--json").exit_code == 0


def test_hybridep_sms_needs_hybridep():
    """--moe-hybridep-num-sms off HybridEP was already refused by simulate (sim.ep_dispatch); compare
    refuses it alike."""
    for command in BOTH:
        error_line(invoke(command, *MOE, "--ep", "16", "--moe-hybridep-num-sms", "32"),
                   "--moe-hybridep-num-sms 32 is HybridEP's")


def test_selective_layer_rows_name_their_k():
    """A published selective-layer row is simulated at torchtitan's default K = 2 (its notes call
    it an assumption): the row's layout text and JSON say so."""
    from sim.published import RowResult, load, select

    runs = select(load()[0], "sel-layer")
    assert runs
    for run in runs:
        assert "selective-layer (every 2)" in run.layout
        row = RowResult(run=run).to_dict()
        assert row["recompute"] == "selective-layer" and row["selective_ac_option"] == 2
    plain = RowResult(run=select(load()[0], "torchtitan-sel-op")[0]).to_dict()
    assert "selective_ac_option" not in plain
    result = invoke("simulate", *FSDP, "--recompute", "selective-layer")
    assert result.exit_code == 0, result.stderr
    assert "selective-layer (every 2)" in " ".join(result.stdout.split())


def test_expert_buckets_are_refused_under_fsdp():
    """--expert-buckets sizes the ZeRO-1 layout's buckets of stacked expert matrices; under --fsdp
    --ep the experts are fully_shard'ed with their units (AdamW on the shards: no expert buckets),
    and `--expert-buckets dp-multiple` was accepted, changed nothing and was echoed back as `size`
    in --json. Refused off its default, as the other ZeRO-1 options are; on ZeRO-1 it acts."""
    moe = ["--model", "qwen3-30b-a3b", "--gpus", "8", "--tp", "1", "--global-batch", "8", "--seq-len", "512",
           "--optimizer", "adamw", "--ep", "8"]
    for command in BOTH:
        for value in ("dp-multiple", "auto"):
            error_line(invoke(command, *moe, "--fsdp", "--expert-buckets", value), "--expert-buckets", "--fsdp")
    named = invoke("simulate", *moe, "--fsdp", "--expert-buckets", "size", "--json")  # the default: accepted
    assert named.exit_code == 0, named.stderr


def test_verify_fsdp_refuses_tp_scheduling_options():
    """`canzona verify --fsdp --tp-mode serial` (or --tp-policy) ran and passed with the defaults:
    the FSDP cases never handed the options to the training spec, whose rule refuses them under
    FSDP (canzona.harness.training.TrainSpec.check; FsdpOptimizer refuses them too). One line, before
    any spawn."""
    for option, value in (("--tp-mode", "serial"), ("--tp-policy", "tp-chunk"), ("--tp-mode", "all")):
        error_line(invoke("verify", "--fsdp", "--dp", "2", "--steps", "1", option, value), option, "--fsdp")


def test_compare_runs_its_adamw_baseline_under_muon_plan_settings():
    """canzona's plan settings (--alpha, --tp-mode, --no-batch-kernels ...) are refused on a run of
    AdamW, where they change nothing; compare's AdamW baseline row beside a Muon comparison runs at
    their defaults instead of failing the whole comparison, and the Muon rows still take them."""
    small = ["--model", "qwen3-0.6b", "--gpus", "8", "--tp", "2", "--global-batch", "8"]
    base = json.loads(invoke("compare", *small, "--json").stdout)
    for extra in (["--alpha", "0.9"], ["--tp-mode", "serial"], ["--no-batch-kernels"]):
        result = invoke("compare", *small, *extra, "--json")
        assert result.exit_code == 0, (extra, result.stderr)
        rows = {r["policy"]: r for r in json.loads(result.stdout)}
        baseline = {r["policy"]: r for r in base}
        assert rows["zero1"]["iteration_time_s"] == baseline["zero1"]["iteration_time_s"]
    # the setting reaches the matrix optimizer's rows: the unbatched kernels are slower there
    unbatched = {r["policy"]: r for r in json.loads(invoke("compare", *small, "--no-batch-kernels", "--json").stdout)}
    assert unbatched["sc"]["iteration_time_s"] > {r["policy"]: r for r in base}["sc"]["iteration_time_s"]
    # a run of AdamW itself still refuses them
    error_line(invoke("simulate", "--optimizer", "adamw", "--alpha", "0.9"), "--alpha 0.9")


def test_no_zero1_fallback_needs_the_canzona_policy():
    """--no-zero1-fallback turns off canzona's report of its ZeRO-1 fallback; under --policy sc /
    zero1-gather / layerwise, and with --optimizer adamw (simulate's zero1, compare's only row), no
    policy run has that fallback, so it was accepted and changed nothing (the same JSON to the
    byte). One line, as its siblings --dp-policy and --alpha; under canzona it stays accepted."""
    for policy in ("sc", "zero1-gather", "layerwise"):
        error_line(invoke("simulate", *DENSE, "--policy", policy, "--no-zero1-fallback"),
                   "--no-zero1-fallback", "canzona", policy)
    for command in BOTH:
        error_line(invoke(command, *DENSE, "--optimizer", "adamw", "--no-zero1-fallback"),
                   "--no-zero1-fallback", "canzona", "zero1")
    assert invoke("simulate", *DENSE, "--policy", "canzona", "--no-zero1-fallback", "--json").exit_code == 0
    assert invoke("compare", *DENSE, "--no-zero1-fallback", "--json").exit_code == 0  # canzona among the rows
    assert invoke("simulate", *DENSE, "--policy", "sc", "--zero1-fallback", "--json").exit_code == 0  # the default


def test_plan_of_adamw_is_the_plan_its_step_policy_runs(tmp_path):
    """`canzona plan --optimizer adamw --tp 2 --out plan.json` wrote a plan with canzona's TP
    scheduler (greedy-rollback), which AdamW's step policy (zero1, tp-sync) refuses when the
    runtime loads it (`DistributedOptimizer`: "policy zero1 runs TP policy tp-sync, but the plan's
    is greedy-rollback"); and canzona's plan settings were accepted and changed nothing but the
    name echoed back (--alpha, --geometry, --tp-policy, --capacity, --balance-by) or made a plan
    the runtime refuses (--dp-policy whole-start). The plan is now the step policy's, and each of
    those settings is one error line, as simulate refuses them."""
    from canzona.models import resolve_spec
    from canzona.plan import load_plan, plan_for
    from canzona.step_policies import STEP_POLICIES

    small = ["--model", "qwen3-0.6b", "--dp", "4", "--tp", "2", "--optimizer", "adamw"]
    out = tmp_path / "plan.json"
    result = invoke("plan", *small, "--out", out)
    assert result.exit_code == 0, result.stderr
    plan, zero1 = load_plan(out), STEP_POLICIES["zero1"]
    for check in (lambda: zero1.check_dp_plan(plan.dp_plan), lambda: zero1.check_tp_plan(plan.tp_plan.policy, 2)):
        check()  # what DistributedOptimizer(optimizer="adamw", plan=...) checks
    assert plan.hash() == plan_for(resolve_spec("qwen3-0.6b", 2), 4, 2, "adamw", "zero1").hash()
    for option, value in (("--alpha", "0.5"), ("--geometry", "whole"), ("--tp-policy", "tp-chunk"),
                          ("--capacity", "20ms"), ("--balance-by", "elements"), ("--dp-policy", "whole-start")):
        error_line(invoke("plan", *small, option, value, "--out", tmp_path / "bad.json"), option, "zero1")
    assert not (tmp_path / "bad.json").exists()
    # its step policy's own, named (as the plan command `canzona search` prints for an AdamW layout)
    named = invoke("plan", *small, "--dp-policy", "zero1-even", "--tp-policy", "tp-sync", "--out", out)
    assert named.exit_code == 0, named.stderr
    assert load_plan(out).hash() == plan.hash()
    # a matrix optimizer's plan still takes them
    assert invoke("plan", *small[:-1], "muon", "--alpha", "0.5", "--balance-by", "elements", "--json").exit_code == 0


def test_expert_buckets_needs_expert_matrices():
    """`--expert-buckets dp-multiple` on a dense model (no stacked expert matrices to size) was
    accepted by simulate, compare and plan and changed nothing but the name echoed back. One line;
    on a mixture-of-experts model it still sizes the expert buckets, and named at its default (or
    the simulator's auto) it is accepted."""
    for command in BOTH:
        error_line(invoke(command, *DENSE, "--expert-buckets", "dp-multiple"), "--expert-buckets dp-multiple",
                   "qwen3-0.6b", "no stacked expert matrices")
        for value in ("size", "auto"):
            assert invoke(command, *DENSE, "--expert-buckets", value, "--json").exit_code == 0
    plan = ["plan", "--model", "qwen3-0.6b", "--dp", "8", "--tp", "2"]
    error_line(invoke(*plan, "--expert-buckets", "dp-multiple"), "--expert-buckets dp-multiple", "qwen3-0.6b")
    assert invoke(*plan, "--expert-buckets", "size", "--json").exit_code == 0
    moe = invoke("plan", "--model", "qwen3-30b-a3b", "--dp", "8", "--tp", "1", "--expert-buckets", "dp-multiple",
                 "--json")
    assert moe.exit_code == 0, moe.stderr


def test_plan_out_is_a_plan_some_step_policy_runs(tmp_path):
    """`canzona plan --dp-policy layerwise --tp 2 --out plan.json` wrote a plan that no step policy
    executes: canzona needs whole matrices in their owners' segments (layerwise's are not) and the
    layerwise baseline runs tp-sync, not the plan's greedy-rollback; the runtime refused it at
    load. The plan file is refused before it is written, naming why; the same plan with the
    baseline's TP scheduler (or at TP 1) runs under the layerwise policy and is written, and the
    tables alone still show any DP policy."""
    from canzona.plan import load_plan
    from canzona.step_policies import STEP_POLICIES

    small = ["--model", "qwen3-0.6b", "--dp", "4", "--tp", "2", "--dp-policy", "layerwise"]
    out = tmp_path / "plan.json"
    error_line(invoke("plan", *small, "--out", out), "no step policy runs", "layerwise", "greedy-rollback")
    assert not out.exists()
    assert invoke("plan", *small).exit_code == 0  # the tables: a comparison, no plan file
    for extra in (["--tp-policy", "tp-sync"], ["--tp", "1"]):
        result = invoke("plan", *small, *extra, "--out", out)
        assert result.exit_code == 0, (extra, result.stderr)
        plan = load_plan(out)
        STEP_POLICIES["layerwise"].check_dp_plan(plan.dp_plan)
        STEP_POLICIES["layerwise"].check_tp_plan(plan.tp_plan.policy, plan.tp)


def test_inspect_against_a_job_refuses_a_plan_no_step_policy_runs(tmp_path):
    """`canzona inspect plan.json --model M --dp D --tp T` said "valid plan" of a plan file the
    runtime refuses at that layout (written by an older `canzona plan --optimizer adamw --tp 2`:
    greedy-rollback, which AdamW's zero1 does not run). Checked against a job, it is one line."""
    import json as _json

    good = tmp_path / "good.json"
    assert invoke("plan", "--model", "qwen3-0.6b", "--dp", "4", "--tp", "2", "--optimizer", "adamw",
                  "--out", good).exit_code == 0
    bad = tmp_path / "bad.json"
    body = _json.loads(good.read_text())
    body["tp_plan"]["policy"] = "greedy-rollback"
    bad.write_text(_json.dumps(body))
    job = ["--model", "qwen3-0.6b", "--dp", "4", "--tp", "2"]
    error_line(invoke("inspect", bad, *job), "no step policy runs", "tp-sync")
    assert invoke("inspect", good, *job).exit_code == 0
    assert invoke("inspect", bad).exit_code == 0  # the file alone is well formed
