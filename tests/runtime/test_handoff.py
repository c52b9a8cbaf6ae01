"""`canzona.runtime.comm.Handoff`: a collective's `wait()` returns only once nothing but the
handoff holds the tensors it handed to the backend, so that no other thread frees (or hands back
a reference to) a Python object after the main thread may have reached interpreter finalization.
The race itself is exercised by `test_clean_exit.py`; here the rule it waits by."""

from __future__ import annotations

import threading
import time

import torch

from canzona.runtime.comm import Handoff


def test_an_alias_held_elsewhere_is_held_until_it_is_let_go():
    hand = Handoff()
    alias = hand(torch.zeros(3))
    assert hand.held()  # the caller's name
    del alias
    assert not hand.held()
    holder = torch.futures.Future()  # another holder, as a backend's work holds its tensors
    holder.set_result(hand(torch.ones(2)))
    assert hand.held()
    del holder
    assert not hand.held()
    assert hand.release() and hand.aliases == []


def test_release_waits_for_a_holder_on_another_thread_and_frees_on_its_own():
    hand = Handoff()
    box = [hand(torch.zeros(4))]
    let_go = threading.Timer(0.05, box.clear)  # as gloo's worker drops its references after completing
    start = time.monotonic()
    let_go.start()
    assert hand.release(limit_s=10.0)
    assert time.monotonic() - start >= 0.04 and hand.aliases == []


def test_release_gives_up_after_its_limit_and_drops_the_aliases_all_the_same():
    hand = Handoff()
    kept = hand(torch.zeros(1))
    assert not hand.release(limit_s=0.01)
    assert hand.aliases == [] and kept.shape == (1,)


def test_cuda_tensors_are_handed_over_as_they_are():
    meta = torch.empty(2, device="meta")  # any non-CPU device: NCCL's wait only orders streams
    hand = Handoff()
    assert hand(meta) is meta and hand.aliases == []
