"""When Megatron-LM issues the distributed optimizer's parameter all-gathers under
`overlap_param_gather` (docs/design.md §9.3, "Parameter all-gather"), for the simulator
(`sim.iteration._Stage`): the gathers of the last step's updated parameters run under this
iteration's forward, each waited for by the forward pre-hook of the first module that needs it.

megatron/core/distributed (distributed_data_parallel.py, param_and_grad_buffer.py):
- Without `align_param_gather` (Megatron-LM's arguments turn it off without an interleaved
  pipeline; NeMo and Megatron-Bridge set it only with one), nothing issues a gather ahead of the
  forward: the pre-hook's `finish_param_sync` dispatches its bucket group's gather if none has
  been (the first one), waits for it, then dispatches the next
  (`next_param_gather_bucket_group`, the bucket groups in reverse, so forward, order). So each
  gather after the first is issued a bucket ahead, when the forward reaches the bucket before it,
  on the NCCL stream after what the compute stream was given so far (ProcessGroupNCCL's
  `syncStream`): it can start only once the forward is there. The expert buckets (their own
  buffers over the expert data-parallel group) chain apart, the first dispatched where first needed.
- With it (an interleaved pipeline), the schedule dispatches a model chunk's gathers at once
  (`param_sync_func`, DDP's `start_param_sync`: every bucket group of the chunk in bucket order,
  the last layers' first, then the expert groups), chunks 0 and 1 before the warm-up and chunk
  c > 1 before the forward of virtual micro-batch `(c - 1) * pp - stage` of the rank
  (`forward_step_helper_preprocess`: the rank's virtual micro-batch id plus its pipeline rank is
  micro-batch 0 of chunk c - 1, so every stage issues it at once); the pre-hooks only wait.
"""

from __future__ import annotations


def aligned(pp: int, vp: int) -> bool:
    """Whether the schedule dispatches the gathers a model chunk at a time (`align_param_gather`,
    set with an interleaved pipeline)."""
    return pp > 1 and vp > 1


def chunk_issued_before(k: int, stage: int, pp: int, vp: int) -> int | None:
    """Under `aligned`: the model chunk whose gathers rank `stage` issues before its forward `k`
    (0-based, in its order), if any; chunks 0 and 1 go before the warm-up."""
    kk = k + stage
    if kk % pp or kk >= pp * vp:
        return None
    c = kk // pp + 1
    return c if 1 < c < vp else None
