"""compare's activation probe measures one step's saved bytes without changing that step's memory:
the step's backward must free each saved activation as it goes, as in a run without the probe (it
once held every storage until the backward ended: a saved-tensor hook keeps its meter alive with
the graph, and the meter held the storages, which raised the probed step's measured peak)."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from mindspeed_like.compare.measure import ActivationProbe
from mindspeed_like.testing.memory import SavedBytesMeter


def _freed_before_the_earlier_ops_backward(context) -> bool:
    x = torch.randn(4096, requires_grad=True)
    with context:
        t0 = x.exp()  # saves its result: alive (with any hook it was saved through) until exp's backward
        t1 = t0 * 2
        y1 = t1.sin()
        loss = y1.cos().sum()  # cos saves y1; nothing after cos's backward needs it
    ref = StorageWeakRef(y1.untyped_storage())
    seen = []
    t1.register_hook(lambda grad: seen.append(ref.expired()))  # after sin's backward, before exp's
    del y1, t0
    loss.backward()
    assert len(seen) == 1
    return seen[0]


def test_a_run_without_the_probe_frees_during_backward():
    import contextlib

    assert _freed_before_the_earlier_ops_backward(contextlib.nullcontext())


def test_the_probed_step_frees_during_backward_as_the_others_do():
    probe = ActivationProbe(step=0)
    assert _freed_before_the_earlier_ops_backward(probe(0))
    assert probe.bytes == 3 * 4096 * 4  # exp's result, sin's t1, cos's y1 (a product with a number saves nothing)


def test_a_released_meter_refuses_current_bytes():
    with SavedBytesMeter() as meter:
        (torch.randn(8, requires_grad=True) * 2).sin()
    counted = meter.bytes
    meter.release()
    assert meter.bytes == counted
    with pytest.raises(RuntimeError, match="after release"):
        meter.current_bytes()
