"""collective-streams (issue 54 item 7): the environment each host's process groups get so that a
freed collective buffer is not held until the collective's stream catches up. The decision only: no
GPU or NPU here."""

from __future__ import annotations

import pytest

from mindspeed_like.adapters import collective_streams as streams


def test_torch_28_and_later_need_nothing_on_cuda():
    for version in ("2.8.0", "2.13.0+cu130", "2.13.0"):
        decision = streams.decide("cuda", version, {})
        assert decision.sets == {}
        assert "stashes tensors instead of recordStream" in decision.line


def test_torch_before_28_gets_the_variable_unless_the_user_set_it():
    decision = streams.decide("cuda", "2.7.1+cu126", {})
    assert decision.sets == {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}
    mine = streams.decide("cuda", "2.6.0", {"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"})
    assert mine.sets == {} and "set by you: kept" in mine.line


def test_apply_never_overwrites_the_users_value(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "2.7.0")
    environ = {"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"}
    streams.apply("cuda", environ)
    assert environ == {"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"}
    environ = {}
    streams.apply("cuda", environ)
    assert environ == {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}


@pytest.mark.parametrize("environ", [{}, {"MULTI_STREAM_MEMORY_REUSE": "2"}])
def test_npu_keeps_torch_npus_default_or_the_users_value(environ):
    decision = streams.decide("npu", "2.13.0", environ)
    assert decision.sets == {}
    assert ("set by you" in decision.line) == bool(environ)


def test_cpu_sets_nothing():
    assert streams.decide("cpu", "2.13.0", {}).sets == {}


def test_only_accelerators_switch_it_on():
    from mindspeed_like.config import Config
    from mindspeed_like.toolkit.declaration import Context

    ctx = Config({}, {})
    assert not streams.FEATURE.is_enabled(Context(ctx, device="cpu"))
    assert streams.FEATURE.is_enabled(Context(ctx, device="cuda"))
