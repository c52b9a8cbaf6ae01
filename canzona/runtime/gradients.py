"""Gradient buffers and their synchronisation over DP, and the per-step soundness check
(docs/design.md §8.2, §8.3).

Per plan bucket a flat buffer (and one for the AdamW parameters, sliced evenly as ZeRO-1 does);
every parameter's `.grad` is a view into it. During backward each bucket's reduce-scatter (or
all-reduce, by the step policy) starts as soon as its last gradient is accumulated, in bucket
order on every rank. `prepare()` finishes the synchronisation and checks, on every rank alike,
that the step is sound before anything is updated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor

from canzona.dp.layout import ceil_to, even_cuts
from canzona.errors import CanzonaError
from canzona.plan import Plan
from canzona.runtime.buffers import FlatBuffer, packed_offsets
from canzona.runtime.comm import Comm, PendingWork
from canzona.spec import ModelSpec
from canzona.step_policies import StepPolicy


class GradientSync:
    """Owns the flat buffers of a DP (x TP) rank and everything that happens to gradients before
    the optimizer reads them."""

    def __init__(self, params: Mapping[str, Tensor], spec: ModelSpec, plan: Plan, policy: StepPolicy,
                 dp: Comm, tp: Comm | None, align: int, reduce_dtype: torch.dtype | None) -> None:
        self.params = params
        self.plan = plan
        self.policy = policy
        self.dp = dp
        self.tp = tp
        self.buckets = [FlatBuffer([p.name for p in b.params], {p.name: (p.offset, p.end) for p in b.params},
                                   b.size, params, reduce_dtype) for b in plan.dp_plan.buckets]
        adamw_names = [p.name for p in spec.adamw_params()]
        offsets, used = packed_offsets(adamw_names, params)
        self.adamw = FlatBuffer(adamw_names, offsets, ceil_to(max(used, 1), align * dp.size), params, reduce_dtype)
        self.adamw_cuts = even_cuts(self.adamw.size, dp.size)
        self.buffer_of = {n: buf for buf in self.all_buffers() for n in buf.names}
        self.index = {n: i for i, n in enumerate(params)}
        self._bucket_of = {n: k for k, b in enumerate(self.buckets) for n in b.names}
        # TP-replicated parameters: every TP rank must hold (and be given) the same gradient
        self._replicated = [p.name for p in spec.params if p.tp_dim is None] if tp is not None else []
        self._sync = True
        self._stale: set[str] = set()  # reduced in the last step and not zeroed since
        self.reset()
        for name, p in params.items():
            p.register_post_accumulate_grad_hook(self._hook(name))

    def all_buffers(self) -> tuple[FlatBuffer, ...]:
        return (*self.buckets, self.adamw)

    def reset(self) -> None:
        """Forget this step's progress (after `step()` and `zero_grad()`)."""
        self._ready = [0] * len(self.buckets)
        self._launched: list[PendingWork | None] = [None] * len(self.buckets)
        self._next = 0
        self._got_grad = torch.zeros(len(self.params), dtype=torch.int64)
        self.grads_ready = False  # reduced and checked (by clip_grad_norm_ or step)
        self.got_anywhere = torch.zeros(0, dtype=torch.int64)

    def zero_grad(self) -> None:
        for buf in self.all_buffers():
            buf.zero_grads()
        self._stale.clear()
        self.reset()

    def stepped(self) -> None:
        """The step consumed the gradients: the buffers hold reduced values, not this rank's sums,
        so a backward must not accumulate onto them before a zero_grad."""
        self._stale = set(self.params)
        self.reset()

    def reduced(self, name: str) -> Tensor:
        """The synchronised gradient of `name`'s local tensor (valid where this rank reads it)."""
        return self.buffer_of[name].reduced_view(name)

    def grad_cuts(self, k: int) -> tuple[int, ...]:
        b = self.plan.dp_plan.buckets[k]
        return b.cuts if self.policy.grad_sync == "reduce-scatter" else even_cuts(b.size, self.dp.size)

    def segments(self) -> list[Tensor]:
        """This rank's share of every reduced gradient element: its segment of each bucket, its
        slice of the AdamW buffer."""
        r = self.dp.rank
        out = [b.reduced[c[r]:c[r + 1]] for k, b in enumerate(self.buckets) for c in (self.grad_cuts(k),)]
        out.append(self.adamw.reduced[self.adamw_cuts[r]:self.adamw_cuts[r + 1]])
        return out

    # --- during backward ---------------------------------------------------------------------

    def _hook(self, name: str) -> Callable[[Tensor], None]:
        buffer = self.buffer_of[name]

        def on_grad_ready(_: Tensor) -> None:
            if not buffer.is_linked(name):
                raise CanzonaError(unlinked_message(name))
            if name in self._stale:
                if self.params[name].grad is buffer.grad_holders[name]:
                    raise CanzonaError(STALE_GRADIENTS.format(name=name))
                self._stale.discard(name)  # model.zero_grad() dropped it: a fresh gradient
            buffer.claim(name)  # after model.zero_grad(): the fresh gradient goes into the buffer
            self._got_grad[self.index[name]] = 1
            k = self._bucket_of.get(name)
            if k is None or not self._sync:
                return  # accumulation micro-batch: nothing is synchronised yet
            if self._launched[k] is not None:
                raise CanzonaError(SYNCED_TWICE)
            self._ready[k] += 1
            self._launch_ready_buckets()
        return on_grad_ready

    def _launch_ready_buckets(self) -> None:
        """Launch in bucket order only, so every rank issues the same collectives in the same order."""
        while self._next < len(self.buckets) and self._ready[self._next] >= len(self.buckets[self._next].names):
            self._launch(self._next)
            self._next += 1

    def _launch(self, k: int) -> None:
        if self._launched[k] is not None:
            raise CanzonaError(SYNCED_TWICE)
        b = self.buckets[k]
        # stage() claims first: a gradient dropped by set_to_none and not recomputed counts as zero
        self._launched[k] = self.dp.reduce_scatter_v(b.stage(), self.grad_cuts(k),
                                                     f"bucket {self.plan.dp_plan.buckets[k].index}")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # --- before the step ---------------------------------------------------------------------

    def _finish(self) -> None:
        while self._next < len(self.buckets):  # buckets whose gradients did not all arrive
            self._launch(self._next)
            self._next += 1
        adamw = self.dp.reduce_scatter_v(self.adamw.stage(), self.adamw_cuts, "adamw")
        for pending in self._launched:
            pending.wait()
        adamw.wait()
        if self.policy.grad_sync == "all-reduce" or self.policy.gather_split:
            gathers = [self.dp.all_gather_v(b.reduced, self.grad_cuts(k),
                                            f"gradients of bucket {self.plan.dp_plan.buckets[k].index}")
                       for k, b in enumerate(self.buckets)]
            for g in gathers:
                g.wait()
        if self.policy.replicated:
            self.dp.all_gather_v(self.adamw.reduced, self.adamw_cuts, "adamw gradients").wait()

    def prepare(self, hyper_parameters: int) -> Tensor:
        """Reduce the gradients and check, on every rank alike, that the step is sound; return
        which parameters got a gradient on any rank. Once per step (clip_grad_norm_, then step).
        `hyper_parameters`: this rank's digest of its param_groups (ranks must agree)."""
        if self.grads_ready:
            return self.got_anywhere
        self._finish()
        unlinked = next((n for buf in self.all_buffers() for n in buf.unlinked()), None)
        header = torch.cat([self._got_grad, torch.tensor(
            [int(self._got_grad.sum()), int(unlinked is not None), hyper_parameters], dtype=torch.int64)])
        table = self.dp.all_gather_values(header, "step check")
        flags, fired, broken, digests = table[:, :-3], table[:, -3], table[:, -2], table[:, -1]
        error = None
        if broken.any():
            error = unlinked_message(unlinked) if unlinked is not None else \
                f"rank(s) {ranks_of(broken != 0)}: {unlinked_message(None)}"
        elif not torch.all(digests == digests[0]):
            error = (f"ranks disagree on the hyper-parameters in param_groups: rank(s) "
                     f"{ranks_of(digests != digests[self.dp.rank])} differ from rank {self.dp.rank}")
        elif not fired.any():
            error = ("step() found no gradient on any rank: call backward() before step(), on the "
                     "parameters given to the optimizer")
        elif not fired.all():
            error = (f"rank(s) {ranks_of(fired == 0)} ran no backward in this step while others did: their "
                     "zero gradients would be averaged in")
        got = flags.amax(dim=0)
        if self.tp is not None:
            error = self._check_tp(error, got, hyper_parameters)
            # a TP group's failure reaches the other DP ranks too, so that every rank in the
            # cluster stops here instead of waiting in the step's collectives
            error = self.dp.spread_failure(error, "tp verdict",
                                           "the TP group of DP rank(s) {ranks} failed this step's check")
        if error is not None:
            raise CanzonaError(error)
        self.got_anywhere = got
        self.grads_ready = True
        return got

    def _check_tp(self, error: str | None, got: Tensor, hyper_parameters: int) -> str | None:
        """The TP ranks of one DP index must all pass, agree on the hyper-parameters and on which
        parameters got a gradient, and hold the same gradient of every TP-replicated parameter: a
        model that forgets to reduce one (say, a QK norm's weight over the heads it was split by),
        or a scheduler stepped on one TP rank only, would otherwise train the replicas apart without
        a word. Returns this rank's error, the same on the TP group."""
        digests = self._replicated_digests()
        row = torch.cat([torch.tensor([int(error is not None), hyper_parameters], dtype=torch.int64), got,
                         digests.view(torch.int64)])
        table = self.tp.all_gather_values(row, "tp step check")
        if error is not None:
            return error
        failed = table[:, 0] != 0
        if failed.any():
            return f"the data-parallel group of TP rank(s) {ranks_of(failed)} failed this step's check (see their error)"
        hyper = table[:, 1]
        if not torch.all(hyper == hyper[0]):
            return (f"TP ranks disagree on the hyper-parameters in param_groups: TP rank(s) "
                    f"{ranks_of(hyper != hyper[self.tp.rank])} differ from TP rank {self.tp.rank} (a scheduler "
                    "or an edit that ran on some ranks only?)")
        table = torch.cat([table[:, :1], table[:, 2:]], dim=1)  # drop the digest column
        got_table = table[:, 1:1 + got.numel()]
        if not torch.all(got_table == got_table[0]):
            differs = int(torch.nonzero((got_table != got_table[0]).any(dim=0))[0])
            return (f"TP ranks disagree on whether {list(self.params)[differs]!r} got a gradient this step: "
                    "every TP rank must run the same backward")
        reps = table[:, 1 + got.numel():].view(self.tp.size, -1, 2)
        bad = torch.nonzero((reps != reps[0]).any(dim=2).any(dim=0)).flatten()
        if bad.numel():
            name = self._replicated[int(bad[0])]
            return (f"the gradient of TP-replicated parameter {name!r} differs between TP ranks: the model "
                    "must reduce it over the TP group (as Megatron's finalize_model_grads or a Replicate "
                    "DTensor does), and nothing may edit one rank's gradients (clip with "
                    "optimizer.clip_grad_norm_, not torch.nn.utils.clip_grad_norm_), or the replicas drift apart")
        return None

    def _replicated_digests(self) -> Tensor:
        """Per TP-replicated parameter, (sum, position-weighted sum) in fp64 of this rank's reduced
        share of its gradient: equal on every TP rank when the gradients are equal."""
        out = torch.zeros(len(self._replicated), 2, dtype=torch.float64)
        r = self.dp.rank
        for i, name in enumerate(self._replicated):
            buf = self.buffer_of[name]
            c = self.adamw_cuts if buf is self.adamw else self.grad_cuts(self._bucket_of[name])
            lo, hi = c[r], c[r + 1]
            a, b = buf.offsets[name]
            s, e = max(a, lo), min(b, hi)
            if s < e:
                part = buf.reduced[s:e].double()
                weights = torch.arange(s - a + 1, e - a + 1, dtype=torch.float64, device=part.device)
                out[i, 0], out[i, 1] = part.sum().cpu(), (part * weights).sum().cpu()
        return out.flatten()


STALE_GRADIENTS = ("backward accumulated the gradient of {name!r} onto the last step's: call "
                   "optimizer.zero_grad() or model.zero_grad() between steps (after a step the buffers hold "
                   "reduced gradients, which a backward must not add to)")
SYNCED_TWICE = ("gradients were synchronised twice in one step: wrap the backward of accumulation "
                "micro-batches in `with optimizer.no_sync():`")


def unlinked_message(name: str | None) -> str:
    which = f"parameter {name!r} no longer lives" if name else "parameters no longer live"
    return (f"{which} in the optimizer's buffers: the model was moved, cast or had parameters replaced "
            "after the optimizer was built (model.to(...), load_state_dict(assign=True), ...); build the "
            "optimizer after those, and load weights with load_state_dict() without assign")


def ranks_of(mask: Tensor) -> list[int]:
    return [int(r) for r in torch.nonzero(mask).flatten()]
