"""The allocator-history replay (toolkit/allocator_history.py) on a synthetic CUDA snapshot: the peak
is the highest total of live blocks (alloc to free_completed, as the allocator counts), and the
blocks alive there are grouped by the first frames of megatron's or this library's code."""

from __future__ import annotations

import pickle

import pytest

from mindspeed_like.toolkit import allocator_history

MiB = 2**20


def _frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def _event(action: str, addr: int, size: int, *frames: dict) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}


OPT = _frame("/site/megatron/core/optimizer/optimizer.py", 569, "step")
FWD = _frame("/site/megatron/core/tensor_parallel/layers.py", 488, "forward")
TORCH = _frame("/site/torch/nn/modules/module.py", 1779, "_call_impl")
TRACE = [
    _event("alloc", 1, 100 * MiB, TORCH, OPT),  # state: held to the end
    _event("alloc", 2, 30 * MiB, TORCH, FWD),
    _event("alloc", 3, 30 * MiB, TORCH, FWD),
    _event("free_requested", 2, 30 * MiB),  # requested, not completed: still counted
    _event("alloc", 4, 10 * MiB),  # no Python caller (autograd's backward): the peak, 170 MiB
    _event("free_completed", 2, 30 * MiB),
    _event("free_completed", 3, 30 * MiB),
    _event("alloc", 5, 50 * MiB, FWD),  # 160 MiB: below the peak
]


def test_the_peak_and_what_it_held() -> None:
    peak = allocator_history.peak_of({"device_traces": [TRACE]})
    assert (peak.bytes, peak.event, peak.events) == (170 * MiB, 4, len(TRACE))
    assert peak.allocating == ""
    groups = {key: (size, count) for key, size, count in peak.groups()}
    assert groups == {
        "optimizer.py:569:step": (100 * MiB, 1),
        "layers.py:488:forward": (60 * MiB, 2),
        "": (10 * MiB, 1),
    }
    lines = allocator_history.report(peak)
    assert lines[0].startswith("peak 170.0 MiB at event 4 of 8; allocating: (no Python caller)")
    assert "100.0 MiB  x1     optimizer.py:569:step" in lines[1]


def test_the_cli_reads_a_snapshot_and_refuses_other_files(tmp_path, capsys) -> None:
    path = tmp_path / "features-rank0.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [TRACE], "segments": []}))
    assert allocator_history.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "peak 170.0 MiB" in out and out.count(" MiB  x") == 2
    other = tmp_path / "other.pickle"
    other.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(SystemExit):
        allocator_history.main([str(other)])
    assert "not a CUDA allocator snapshot" in capsys.readouterr().err


def test_recording_is_off_without_the_variable_or_off_cuda(monkeypatch) -> None:
    monkeypatch.delenv(allocator_history.ENV, raising=False)
    assert not allocator_history.start("cuda")
    monkeypatch.setenv(allocator_history.ENV, "/tmp/x")
    assert not allocator_history.start("cpu")
