"""The CPU-ISA lane's own logic (mindspeed_like/testing/isa_lane.py), without running a lane: its
environment, the header's check that the ISA really is held, and its refusals. `make test-isa`
runs the lane itself (from .ci/run)."""

from __future__ import annotations

import json
import subprocess

import pytest

from mindspeed_like.testing import isa_lane


def test_each_lane_holds_aten_and_onednn_with_its_own_inductor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDSPEED_LIKE_CPU_GEMM", "native")  # a decision forced outside must not reach a lane
    envs = {lane: isa_lane.lane_env(lane, str(tmp_path)) for lane in isa_lane.LANES}
    assert envs["avx2"]["ATEN_CPU_CAPABILITY"] == "avx2" and envs["avx2"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert envs["default"]["ATEN_CPU_CAPABILITY"] == "default" and envs["default"]["ONEDNN_MAX_CPU_ISA"] == "SSE41"
    assert len({env["TORCHINDUCTOR_CACHE_DIR"] for env in envs.values()}) == 2
    assert all("MINDSPEED_LIKE_CPU_GEMM" not in env for env in envs.values())


def _header_process(capability: str):
    facts = {"aten_cpu_capability": capability, "onednn_isa": "Intel AVX2"}
    return subprocess.CompletedProcess([], 0, stdout="noise\nISA-HEADER " + json.dumps(facts) + "\n", stderr="")


def test_the_header_fails_the_lane_when_the_capability_is_not_held(monkeypatch):
    """torch that ignored ATEN_CPU_CAPABILITY would run the lane at the host's own ISA: refused."""
    monkeypatch.setattr(isa_lane.subprocess, "run", lambda *a, **k: _header_process("AVX512"))
    with pytest.raises(RuntimeError, match="asked ATEN_CPU_CAPABILITY=avx2 but torch runs at AVX512"):
        isa_lane.header("avx2", {})
    monkeypatch.setattr(isa_lane.subprocess, "run", lambda *a, **k: _header_process("AVX2"))
    assert isa_lane.header("avx2", {})["onednn_isa"] == "Intel AVX2"


def test_exec_refuses_an_unknown_lane_or_no_command():
    with pytest.raises(SystemExit, match="unknown lane 'avx512'"):
        isa_lane.main(["--exec", "avx512", "-c", "pass"])
    with pytest.raises(SystemExit, match="needs the Python arguments"):
        isa_lane.main(["--exec", "avx2"])


def test_a_host_that_is_not_x86_skips_with_the_reason(monkeypatch, capsys):
    monkeypatch.setattr(isa_lane.platform, "machine", lambda: "aarch64")
    assert isa_lane.main([]) == 0
    assert "SKIPPED: the CPU-ISA lane holds x86 ISAs; this host is aarch64" in capsys.readouterr().out
