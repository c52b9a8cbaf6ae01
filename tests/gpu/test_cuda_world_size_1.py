"""The CUDA path at world size 1 (issue 18 #8): a one-rank NCCL group, the tiny model on the GPU,
`DistributedOptimizer` with its defaults (CUDA streams, events, the overlapped parameter gather)
against the same training on the CPU. Skipped without a GPU; run on one with
`python -m pytest tests/gpu`.

GPU and CPU kernels round differently (cuBLAS against the CPU's GEMMs, bf16 Newton-Schulz), so the
runs agree within a tolerance, not bit for bit; within one device the ladder's bit-for-bit checks
hold as on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.timeout(300)]

STEPS = 3
REL_TOLERANCE = 1e-2  # bf16 Newton-Schulz on two devices: a few bf16 roundings per step


def _train(device: str, optimizer: str) -> dict[str, torch.Tensor]:
    from canzona.runtime import DistributedOptimizer
    from reference.tiny_model import TinyQwen3

    model = TinyQwen3("tiny", device=device)
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), optimizer, timeout_s=120)
    gen = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        tokens = torch.randint(0, model.cfg.vocab, (2, 16), generator=gen).to(device)
        opt.zero_grad()
        model.loss(tokens).backward()
        opt.step()
    opt.wait_params()
    return {n: p.detach().float().cpu() for n, p in model.named_parameters()}


def _on_one_rank(backend: str, device: str, optimizer: str) -> dict[str, torch.Tensor]:
    """Train in a one-rank group of `backend` (NCCL: the usual GPU setup), then leave it."""
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        params = _train(device, optimizer)
        if device == "cuda":
            torch.cuda.synchronize()
        return params
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("optimizer", ["muon", "soap", "adamw"])
def test_one_rank_on_cuda_trains_as_on_the_cpu(optimizer):
    on_gpu = _on_one_rank("nccl", "cuda", optimizer)
    on_cpu = _on_one_rank("gloo", "cpu", optimizer)
    for name, p in on_cpu.items():
        q = on_gpu[name]
        assert torch.isfinite(q).all(), name
        assert (q - p).norm() <= REL_TOLERANCE * p.norm(), name
