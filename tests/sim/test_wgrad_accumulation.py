"""Weight gradients accumulate into Megatron's gradient buffer inside their GEMMs (`sim.model_work`,
`canzona.gemm_model`, docs/design.md §9.3): each weight-gradient GEMM of a micro-batch adds into
`main_grad` (beta = 1), so its epilogue reads and writes the buffer at its dtype; the forward and
the data gradients do not change, and FSDP's fresh gradients pay nothing."""

from __future__ import annotations

import pytest

from canzona.cost import DeviceRate, gemm_kernel
from canzona.errors import SpecError
from canzona.hardware import load_profile
from canzona.models import resolve_model
from sim.model_work import micro_batch_work
from sim.simulate import SimConfig, simulate
from sim.workload import Workload

RATE = DeviceRate.from_profile(load_profile("h100-sxm"))
TOKENS = 4096


def _work(accumulate: int, model: str = "qwen3-1.7b", tp: int = 1):
    spec, arch = resolve_model(model)
    return spec, arch, micro_batch_work(spec, tp, TOKENS, TOKENS, arch.q_dim, arch.hidden, arch.vocab, RATE,
                                        kv_dim=arch.kv_dim, accumulate=accumulate)


def _wgrad_extra(spec, arch, accumulate: int, tp: int = 1) -> float:
    """Seconds the layers' and the head's weight-gradient GEMMs gain by accumulating."""
    total = 0.0
    shapes = [p.local_shape(tp) for p in spec.matrix_params() if p.layer is not None and p.stacked_in is None]
    shapes.append((arch.vocab // tp, arch.hidden))
    for out, inp in shapes:
        total += RATE.kernel_seconds(gemm_kernel("w", out, inp, TOKENS, "bf16", accumulate=accumulate)) \
            - RATE.kernel_seconds(gemm_kernel("w", out, inp, TOKENS, "bf16"))
    return total


@pytest.mark.parametrize("accumulate", [2, 4])
def test_backward_grows_by_the_weight_gradients_epilogues_alone(accumulate):
    spec, arch, plain = _work(0)
    _, _, fused = _work(accumulate)
    assert fused.forward == plain.forward and fused.head_forward_s == plain.head_forward_s
    assert fused.embed_backward_s == plain.embed_backward_s  # the embedding's main_grad add is its own pass

    def backward(w) -> float:
        return sum(b.seconds for layer in w.backward for b in layer) + w.head_backward_s

    assert backward(fused) - backward(plain) == pytest.approx(_wgrad_extra(spec, arch, accumulate), rel=1e-9)
    assert backward(fused) > backward(plain)


def test_fp32_main_grad_costs_more_than_bf16():
    *_, bf16 = _work(2)
    *_, fp32 = _work(4)
    assert sum(b.seconds for layer in fp32.backward for b in layer) > sum(b.seconds for layer in bf16.backward
                                                                         for b in layer)


@pytest.mark.parametrize("bad", [1, 3, 8, -4])
def test_only_bf16_and_fp32_buffers(bad):
    with pytest.raises(SpecError, match="accumulate"):
        _work(bad)


def test_the_simulator_accumulates_at_the_gradient_dtype():
    """`grad_bytes` (grad_reduce_in_fp32) sets the buffer: fp32 is slower than bf16 by more than
    the gradient reductions alone (one DP rank: no reduction at all)."""
    def iteration(grad_bytes: int) -> float:
        wl = Workload(seq_len=1024, global_batch=4, grad_bytes=grad_bytes)
        return simulate(SimConfig(model="qwen3-1.7b", gpus=1, tp=1, optimizer="adamw",
                                  workload=wl)).iteration_time_s

    assert iteration(4) > iteration(2)
