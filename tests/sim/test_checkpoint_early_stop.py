"""torch's non-reentrant checkpoint stops its re-run early (canzona.recompute, "Where the re-run
stops"; sim.model_work `early_stop`; sim.fsdp): a checkpointed dense layer's down projection GEMM
and the residual add after it do not run again, because the re-run ends on entering the last op
that saves a tensor, which saves its inputs before its kernel runs. torch itself is asked here
(on the CPU), then the simulator's pricing of it, under --fsdp (torch's wrappers) and not on
Megatron's layouts (its CheckpointFunction re-runs the whole forward)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from canzona.cost import DeviceRate
from canzona.hardware import load_profile
from canzona.models import resolve_model
from canzona.recompute import (
    FULL,
    MEGATRON_CHECKPOINT,
    SELECTIVE_LAYER,
    SELECTIVE_OP,
    TORCH_CHECKPOINT,
    rerun_stops_early,
    selective_layers,
)
from sim import layer_kernels as lk
from sim.fsdp import fsdp_checkpoint, fsdp_micro_batch_work
from sim.model_work import micro_batch_work
from sim.options import RunOptions
from sim.simulate import SimConfig, layer_dims, simulate
from sim.topology import Cluster
from sim.workload import Workload

A100 = load_profile("a100-sxm")
RATE = DeviceRate.from_profile(A100)
MODEL = "canzona/data/models/llama3-8b.json"
TOKENS = 2048
FSDP = SimConfig(model=MODEL, gpus=8, tp=1, optimizer="adamw", fsdp=True, hardware="a100-sxm",
                 workload=Workload(seq_len=TOKENS, global_batch=8, micro_batch=1))


def _work(recompute: str, early_stop: bool, checkpointed=None):
    spec, arch = resolve_model(MODEL)
    return micro_batch_work(spec, 1, TOKENS, TOKENS, arch.q_dim, arch.hidden, arch.vocab, RATE, recompute=recompute,
                            checkpointed=checkpointed, kv_dim=arch.kv_dim, kernels="eager", early_stop=early_stop)


def _add_s(arch, name: str) -> float:
    shape = lk.LayerShape(tokens=TOKENS, tp=1, hidden=arch.hidden, act_bytes=2, sms=RATE.sms or 132)
    return RATE.kernel_seconds(lk.residual_add(shape, name))


def test_torch_reruns_up_to_the_down_projection_only():
    """torch's own checkpoint wrapper (the one torchtitan applies) on a small Llama block: the
    re-run in the backward runs the forward's first six GEMMs (wq, wk, wv, wo, w1, w3) and the
    SwiGLU product, and no seventh (w2's forward), nor the residual add after it; without early
    stop it runs all seven."""
    torch = pytest.importorskip("torch")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import set_checkpoint_early_stop

    d, f, heads = 32, 48, 4

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
            self.w1, self.w3 = torch.nn.Linear(d, f, bias=False), torch.nn.Linear(d, f, bias=False)
            self.w2 = torch.nn.Linear(f, d, bias=False)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (w(x).view(b, t, heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = x + self.wo(a.transpose(1, 2).reshape(b, t, d))
            return h + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[tuple[str, tuple]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append((func.overloadpacket.__name__,
                             tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))))
            return func(*args, **(kwargs or {}))

    def rerun_forward_mms(early: bool) -> list[tuple]:
        torch.manual_seed(0)
        block = checkpoint_wrapper(Block(), checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False)
        x = torch.randn(2, 8, d, requires_grad=True)
        with set_checkpoint_early_stop(early):
            out = block(x)
        with Ops() as log:
            out.sum().backward()
        # the backward's first GEMM with w2's gradient shape ends the re-run: (d, tokens) x (tokens, f)
        mms = [shapes for op, shapes in log.ops if op == "mm"]
        end = mms.index(((d, 16), (16, f)))
        return mms[:end]

    assert rerun_forward_mms(True) == [((16, d), (d, d))] * 4 + [((16, d), (d, f))] * 2
    assert rerun_forward_mms(False)[-1] == ((16, f), (f, d))  # w2's forward, run again without the stop


@pytest.mark.parametrize("mode", [SELECTIVE_LAYER, FULL])
def test_a_rerun_layer_skips_its_down_projection_and_add(mode):
    """Each checkpointed layer's backward is the whole re-run's less the MLP block's row GEMM
    (w2's forward) and one residual add; the forwards and the other layers are unchanged."""
    _, arch = resolve_model(MODEL)
    inside = selective_layers(2, [range(arch.layers)]) if mode == SELECTIVE_LAYER else None
    whole, early = _work(mode, False, inside), _work(mode, True, inside)
    assert early.forward == whole.forward
    for k in range(arch.layers):
        mlp = whole.forward[k][-1]
        saved = mlp.last_s + _add_s(arch, mlp.name) if inside is None or k in inside else 0.0
        assert mlp.last_s > 0
        assert sum(b.seconds for b in early.backward[k]) == pytest.approx(
            sum(b.seconds for b in whole.backward[k]) - saved, rel=1e-12)


def test_selective_op_skips_only_the_last_add_and_none_nothing():
    """Under selective-op w2's output is saved (its GEMM never re-ran): the stop skips the
    layer's last residual add. Without recompute nothing re-runs."""
    _, arch = resolve_model(MODEL)
    whole, early = _work(SELECTIVE_OP, False), _work(SELECTIVE_OP, True)
    for k in range(arch.layers):
        mlp = whole.forward[k][-1]
        assert sum(b.seconds for b in early.backward[k]) == pytest.approx(
            sum(b.seconds for b in whole.backward[k]) - _add_s(arch, mlp.name), rel=1e-12)
    assert _work("none", True) == _work("none", False)


def test_fsdp_runs_torchs_wrapper_and_megatron_its_own():
    """--fsdp layouts' work is the early-stopping one (torch's non-reentrant wrappers); Megatron's
    CheckpointFunction re-runs the whole forward, so its layouts are unchanged."""
    assert rerun_stops_early(TORCH_CHECKPOINT) and not rerun_stops_early(MEGATRON_CHECKPOINT)
    assert fsdp_checkpoint("fsdp2") == TORCH_CHECKPOINT
    cfg = replace(FSDP, options=RunOptions(recompute=SELECTIVE_LAYER))
    model = resolve_model(MODEL)
    spec, arch = model
    cluster = Cluster(cfg.gpus, cfg.tp, A100.node.gpus, cfg.pp, cp=cfg.cp)
    work = fsdp_micro_batch_work(cfg, model, cluster, A100, RATE, layer_dims(arch, spec).head_dim)
    inside = selective_layers(None, [range(arch.layers)])
    expected = micro_batch_work(spec, 1, TOKENS, TOKENS, arch.q_dim, arch.hidden, arch.vocab, RATE,
                                recompute=SELECTIVE_LAYER, checkpointed=inside, kv_dim=arch.kv_dim,
                                head_dim=layer_dims(arch, spec).head_dim, early_stop=True)
    assert work.backward == expected.backward
    # and the iteration: re-running every other layer costs less than every layer's whole forward
    times = {m: simulate(replace(FSDP, options=RunOptions(recompute=m))).iteration_time_s
             for m in ("none", SELECTIVE_LAYER, FULL)}
    assert times["none"] < times[SELECTIVE_LAYER] < times[FULL]


@pytest.mark.parametrize("overlap", [True, False])
def test_under_tp_the_stopped_rerun_skips_its_reduce_scatter(overlap):
    """At TP 2 (sequence parallel) the down projection's output is reduce-scattered after its
    GEMM; the re-run stops before that GEMM, so it issues no reduce-scatter, while the attention
    block's re-run still does. The search's time floor stays below the simulation."""
    from canzona.cost import DeviceRate
    from sim.search import time_floor

    cfg = replace(FSDP, tp=2, options=RunOptions(recompute=FULL, tp_comm_overlap=overlap))
    r = simulate(cfg)
    rerun_rs = [s.name for s in r.spans if "recompute tp reduce-scatter" in s.name]
    _, arch = resolve_model(MODEL)
    micro_batches = cfg.workload.micro_batches(cfg.gpus // cfg.tp)
    assert len(rerun_rs) == arch.layers * micro_batches  # one a layer a micro-batch: attention's
    assert all(".0 recompute" in name for name in rerun_rs)
    assert any(".1 recompute tp all-gather" in s.name for s in r.spans)  # the MLP's input is gathered again
    assert time_floor(cfg, resolve_model(MODEL), DeviceRate.from_profile(A100), A100) <= r.iteration_time_s


def test_under_deepep_the_stopped_moe_rerun_skips_its_combine():
    """A MoE layer under DeepEP (NeMo AutoModel's): its re-run stops at the unpermute before the
    combine (whose autograd function saves no tensor), so no re-run combine is issued and the
    layer's residual add is not run again; under the `alltoall` dispatcher every re-run layer
    combines again. The search's time floor stays below the simulation."""
    from canzona.cost import DeviceRate
    from sim.ep_dispatch import EpDispatcher
    from sim.search import time_floor

    h100 = load_profile("h100-sxm")
    deepep = EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    cfgs = {name: SimConfig(model="qwen3-30b-a3b", gpus=8, tp=1, ep=8, optimizer="adamw", fsdp=True,
                            workload=Workload(seq_len=4096, global_batch=8, micro_batch=1),
                            options=RunOptions(recompute=FULL, ep_dispatcher=d))
            for name, d in (("deepep", deepep), ("alltoall", EpDispatcher()))}
    model = resolve_model("qwen3-30b-a3b")
    rerun_combines = {}
    for name, cfg in cfgs.items():
        r = simulate(cfg)
        rerun_combines[name] = sum("recompute combine" in s.name for s in r.spans)
        assert any("recompute dispatch" in s.name for s in r.spans)  # the dispatch re-runs either way
        assert time_floor(cfg, model, DeviceRate.from_profile(h100), h100) <= r.iteration_time_s
    assert rerun_combines == {"deepep": 0, "alltoall": model[1].layers}
    # the work: the DeepEP re-run is the forward block less one residual add, sending nothing back
    spec, arch = model
    cluster = Cluster(8, 1, h100.node.gpus, 1)
    rate = DeviceRate.from_profile(h100)
    work = fsdp_micro_batch_work(cfgs["deepep"], model, cluster, h100, rate, layer_dims(arch, spec).head_dim)
    fwd, again = work.forward[0][-1], work.backward[0][0].recompute
    shape = lk.LayerShape(tokens=4096, tp=1, hidden=arch.hidden, act_bytes=2, sms=rate.sms or 132)
    assert not again.sends_output and fwd.sends_output
    assert again.seconds == pytest.approx(fwd.seconds - rate.kernel_seconds(lk.residual_add(shape, fwd.name)))


def test_megatron_fsdp_reruns_with_megatrons_checkpoint():
    """Megatron-FSDP's layouts recompute as Megatron-LM runs them (`CheckpointFunction`, the whole
    forward again): the same layout under FSDP2 re-runs less, and its work is the early-stopping
    one while Megatron-FSDP's is the whole re-run's."""
    assert fsdp_checkpoint("megatron-fsdp") == MEGATRON_CHECKPOINT
    model = resolve_model(MODEL)
    spec, arch = model
    cluster = Cluster(FSDP.gpus, 1, A100.node.gpus, 1)
    head_dim = layer_dims(arch, spec).head_dim
    works = {impl: fsdp_micro_batch_work(replace(FSDP, fsdp_impl=impl, options=RunOptions(recompute=FULL)), model,
                                         cluster, A100, RATE, head_dim)
             for impl in ("fsdp2", "megatron-fsdp")}
    whole = micro_batch_work(spec, 1, TOKENS, TOKENS, arch.q_dim, arch.hidden, arch.vocab, RATE, recompute=FULL,
                             kv_dim=arch.kv_dim, head_dim=head_dim, early_stop=False)
    assert works["megatron-fsdp"].backward == whole.backward
    assert works["fsdp2"].backward != whole.backward


@pytest.mark.parametrize("impl", ["megatron-fsdp", "fsdp2"])
def test_megatron_fsdp_gathers_before_its_no_grad_forward(impl):
    """Megatron's checkpoint runs a layer's first forward under torch.no_grad(), where TE's
    LayerNormLinear turns its userbuffers all-gather off and gathers with NCCL before its GEMM
    (as `sim.iteration._Stage.block` prices the ZeRO-1 layouts): under Megatron-FSDP with full
    recompute at TP 2 with the TP overlap, each forward block's first GEMMs start after its
    input's all-gather; under FSDP2 (torch's wrapper, grad on) they run beside it. The time floor
    stays below the simulation either way."""
    from canzona.cost import DeviceRate
    from sim.search import time_floor

    cfg = replace(FSDP, tp=2, fsdp_impl=impl, options=RunOptions(recompute=FULL, tp_comm_overlap=True))
    r = simulate(cfg)
    spans = {s.name: s for s in r.spans if s.rank == 0 and s.name.startswith("mb0 fwd layer 3.")}
    for block in ("0", "1"):
        gather, first = spans[f"mb0 fwd layer 3.{block} tp all-gather"], spans[f"mb0 fwd layer 3.{block} first"]
        if impl == "megatron-fsdp":
            assert first.start >= gather.end
        else:
            assert first.start < gather.end
    assert time_floor(cfg, resolve_model(MODEL), DeviceRate.from_profile(A100), A100) <= r.iteration_time_s


def test_a_layer_with_a_shared_expert_reruns_through_its_combine():
    """A shared expert beside the routed ones may run after the combine and save its inputs there
    (DeepSeek's layout): the re-run is priced whole, the combine included."""
    from canzona.decoder import DecoderConfig, build_decoder
    from sim.ep_dispatch import EpDispatcher

    cfg = DecoderConfig("tiny-deepseek", 3, 64, 4, 4, 16, 128, 256, False, experts=8, experts_per_token=2,
                        moe_ffn=32, shared_ffn=32, dense_layers=(0,))
    model = (build_decoder(cfg), cfg.architecture())
    h100 = load_profile("h100-sxm")
    deepep = EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    sim_cfg = SimConfig(model="tiny-deepseek", gpus=8, tp=1, ep=8, optimizer="adamw", fsdp=True,
                        workload=Workload(seq_len=256, global_batch=8, micro_batch=1),
                        options=RunOptions(recompute=FULL, ep_dispatcher=deepep))
    work = fsdp_micro_batch_work(sim_cfg, model, Cluster(8, 1, h100.node.gpus, 1), h100, DeviceRate.from_profile(h100),
                                 layer_dims(model[1], model[0]).head_dim)
    experts = [layer[0] for layer in work.backward if layer[0].recompute is not None and layer[0].ep_bytes]
    assert len(experts) == 2  # the two MoE layers, each re-running its expert block with its combine
    assert all(b.recompute.sends_output for b in experts)
