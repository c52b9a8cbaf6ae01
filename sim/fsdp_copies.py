"""The copies an FSDP implementation runs on the compute stream around its collectives, priced by
the bytes they move at the profile's achievable HBM bandwidth (docs/design.md §2.8, §9.3).

- `fsdp2` (torch's `fully_shard`, which torchtitan, NeMo AutoModel and canzona's runtime
  (`canzona.runtime.fsdp`) shard with): read from torch
  `torch/distributed/_composable/fsdp/_fsdp_collectives.py` (since 2.6 under
  `torch/distributed/fsdp/_fully_shard/`):
  - all-gather copy-out (`foreach_all_gather_copy_out`): after every all-gather of a unit's
    parameters the current (compute) stream splits the gathered flat buffer into the parameters'
    own tensors (`split_with_sizes_copy`): read and write the unit's gathered parameters,
    `2 x numel x param_bytes`, before the unit's forward and again before its backward;
  - reduce-scatter copy-in (`foreach_reduce` / `foreach_reduce_scatter_copy_in`): after a unit's
    backward its unsharded gradients (the parameter dtype's, bf16) are copied into the
    reduce-scatter input, cast to the reduce dtype (fp32 under torchtitan's
    `mixed_precision_reduce`): read `numel x param_bytes`, write `numel x grad_bytes`. On the
    current stream from torch 2.4's release (the copy-in, then `reduce_scatter_stream.wait_stream`);
    an earlier 2.4 development version ran it first thing on the reduce-scatter stream, where it
    took the same HBM bytes beside the compute.
  **Assumption**: the all-gather copy-in (`_foreach_copy_` of the rank's shard into the
  all-gather input) runs on its own stream and moves 1 / S of the unit: left out.
- `megatron-fsdp` (Megatron-Core's Megatron-FSDP, `--use-megatron-fsdp`): parameters and
  their `main_grad` are views into per-bucket contiguous buffers that the collectives gather
  into and reduce-scatter from (Megatron-LM
  `megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py`,
  `ParamAndGradBuffer`, as we read it), and Transformer Engine's wgrad GEMMs accumulate into
  `main_grad` (gradient_accumulation_fusion): no copy on either side.
"""

from __future__ import annotations

from canzona.choices import check_choice

FSDP2, MEGATRON_FSDP = "fsdp2", "megatron-fsdp"
FSDP_IMPLS = (FSDP2, MEGATRON_FSDP)


def check_fsdp_impl(impl: str) -> str:
    return check_choice(impl, FSDP_IMPLS, "fsdp implementation")


def copy_out_bytes(impl: str, numel: int, param_bytes: int) -> int:
    """The compute stream's bytes after one all-gather of `numel` parameters."""
    return 2 * numel * param_bytes if check_fsdp_impl(impl) == FSDP2 else 0


def copy_in_bytes(impl: str, numel: int, param_bytes: int, grad_bytes: int) -> int:
    """The compute stream's bytes before one reduce-scatter of `numel` gradients (computed in the
    parameters' dtype, reduced in `grad_bytes`)."""
    return numel * (param_bytes + grad_bytes) if check_fsdp_impl(impl) == FSDP2 else 0


def reshard_options(impl: str) -> tuple[bool, ...]:
    """The `reshard_after_forward` values an implementation runs: FSDP2's `fully_shard` takes either;
    Megatron-FSDP takes no such option (`MegatronFSDP.__init__`, Megatron-LM
    `megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py`): under
    `optim_grads_params` each FSDP unit's parameters are released after its forward and gathered
    again for its backward, and `optim_grads` (ZeRO-2) does not shard them at all, which the
    simulator does not model."""
    return (True, False) if check_fsdp_impl(impl) == FSDP2 else (True,)


__all__ = ["FSDP2", "FSDP_IMPLS", "MEGATRON_FSDP", "check_fsdp_impl", "copy_in_bytes", "copy_out_bytes",
           "reshard_options"]
