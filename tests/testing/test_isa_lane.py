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


def _record_runs(monkeypatch, failing: str = "") -> list[dict]:
    """Run main() with every pytest process recorded (and passing, but for the one whose
    ``TORCHINDUCTOR_CACHE_DIR`` and ``ATEN_CPU_CAPABILITY`` match ``failing``) instead of run."""
    runs: list[dict] = []

    def run(args, env, **_):
        runs.append({"tests": [a for a in args if a.startswith("tests/")], **env})
        held = f"{env['TORCHINDUCTOR_CACHE_DIR'].rsplit('/', 1)[-1]}:{env.get('ATEN_CPU_CAPABILITY', '')}"
        return subprocess.CompletedProcess(args, 1 if held == failing else 0)

    monkeypatch.setattr(isa_lane.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(isa_lane.subprocess, "run", run)
    monkeypatch.setattr(isa_lane, "header", lambda lane, env: {"inductor_vec_isa": lane})
    monkeypatch.setattr(isa_lane, "inductor_vec_isa", lambda env: "avx512")
    return runs


def test_the_cross_isa_check_reads_the_cache_a_native_process_filled(monkeypatch):
    """Issue 56: a cache filled natively, then read held (torch.compile on in both), the way a
    directory shared by two CPU kinds is; the main runs keep their own caches."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # held outside: the native fill must not inherit it
    runs = _record_runs(monkeypatch)
    assert isa_lane.main(["--tests", "tests/kernels"]) == 0
    native, *rest = runs
    assert native["tests"] == isa_lane.CROSS_ISA_TESTS and "ATEN_CPU_CAPABILITY" not in native
    assert native["TORCHDYNAMO_DISABLE"] == "0"
    cross = [r for r in rest if r["tests"] == isa_lane.CROSS_ISA_TESTS]
    main_runs = [r for r in rest if r["tests"] == ["tests/kernels"]]
    assert [r["ATEN_CPU_CAPABILITY"] for r in cross] == ["avx2", "default"]
    assert all(r["TORCHINDUCTOR_CACHE_DIR"] == native["TORCHINDUCTOR_CACHE_DIR"] for r in cross)
    assert all(r["TORCHDYNAMO_DISABLE"] == "0" for r in cross)
    assert native["TORCHINDUCTOR_CACHE_DIR"] not in {r["TORCHINDUCTOR_CACHE_DIR"] for r in main_runs}


def test_a_held_read_of_the_native_cache_that_fails_fails_the_lane(monkeypatch, capsys):
    _record_runs(monkeypatch, failing="inductor-shared:avx2")
    assert isa_lane.main(["--tests", "tests/kernels"]) == 1
    assert "CPU-ISA lane failed at: avx2 (cross-ISA cache)" in capsys.readouterr().out


def test_the_cross_isa_check_can_be_left_out(monkeypatch):
    runs = _record_runs(monkeypatch)
    assert isa_lane.main(["--tests", "tests/kernels", "--cross-isa-tests"]) == 0
    assert all(r["tests"] == ["tests/kernels"] for r in runs) and len(runs) == 2
