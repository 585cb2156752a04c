"""cpu-compile-cache: torch.compile's graph caches keyed by the CPU vector ISA (issue 56).

In process: on the CPU device the FX graph cache key carries the ISA (two ISAs, two keys), it is
torch's own key again once the feature is off, and the user's ``TORCHINDUCTOR_CACHE_DIR`` and
``cache_key_tag`` are left as they are. Across processes (compile_cache_worker.py): a process held
to a lower ISA, reading the cache directory a native process filled, does not read the native
graph and computes the right values; the slow canary shows torch alone does read it, and computes
garbage, which is why the feature exists.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mindspeed_like
from mindspeed_like.adapters import compile_cache

WORKER = Path(__file__).with_name("compile_cache_worker.py")


def _graph_key() -> str:
    from torch._inductor import codecache

    def activation(x):
        return torch.nn.functional.silu(x) * 2

    gm = torch.fx.symbolic_trace(activation)
    return codecache.compiled_fx_graph_hash(gm, [torch.ones(4, 8)], {}, [])[0]


def _init_of_details():
    from torch._inductor import codecache

    return vars(codecache.FxGraphHashDetails)["__init__"]


def test_the_key_carries_the_isa_and_is_torchs_own_again_when_off(monkeypatch):
    mindspeed_like.reset()
    original_init = _init_of_details()
    torch_key = _graph_key()
    try:
        mindspeed_like.configure(device="cpu")
        records = [r for r in mindspeed_like.report() if r.feature == compile_cache.NAME]
        assert [(r.target, r.status, r.global_change) for r in records] == [(compile_cache.TARGET, "applied", True)]
        keys = {}
        for isa in ("avx2", "avx512", "avx2"):
            monkeypatch.setattr(compile_cache, "vec_isa", lambda isa=isa: isa)
            keys.setdefault(isa, set()).add(_graph_key())
        assert len(keys["avx2"]) == 1 and len(keys["avx512"]) == 1  # stable per ISA
        assert keys["avx2"] != keys["avx512"]
        assert torch_key not in keys["avx2"] | keys["avx512"]
    finally:
        mindspeed_like.reset()
    assert _init_of_details() is original_init  # reversible, by identity
    assert _graph_key() == torch_key


def test_off_the_cpu_device_torch_keeps_its_key():
    mindspeed_like.reset()
    original_init = _init_of_details()
    try:
        mindspeed_like.configure(device="cpu")
        assert _init_of_details() is not original_init
        mindspeed_like.configure(device="cuda")
        assert _init_of_details() is original_init
        assert not [r for r in mindspeed_like.report() if r.feature == compile_cache.NAME]
    finally:
        mindspeed_like.reset()


def test_the_users_cache_directory_and_tag_are_kept(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    # config.patch, not monkeypatch: monkeypatch's undo deletes the attribute, and deleting an entry
    # of a torch config module hides it, so every later compile failed ("cache_key_tag does not exist")
    tag = torch.compiler.config.patch(cache_key_tag="theirs")
    tag.__enter__()
    mindspeed_like.reset()
    try:
        mindspeed_like.configure(device="cpu")
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
        assert torch.compiler.config.cache_key_tag == "theirs"
        assert compile_cache.cache_dir_in_use() == (str(tmp_path), "TORCHINDUCTOR_CACHE_DIR, set by you: used as it is")
        monkeypatch.setattr(compile_cache, "vec_isa", lambda: "avx2")
        line = compile_cache.describe()
        assert str(tmp_path) in line and "set by you" in line and "'avx2'" in line
    finally:
        mindspeed_like.reset()
        tag.__exit__(None, None, None)
    assert torch.compiler.config.cache_key_tag == ""
    # unset, or set by torch itself to its default (it writes the variable when first asked)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    default = os.path.abspath(default_cache_dir())
    assert compile_cache.cache_dir_in_use() == (default, "torch's default: TORCHINDUCTOR_CACHE_DIR unset")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default)
    assert compile_cache.cache_dir_in_use()[0] == default and "default" in compile_cache.cache_dir_in_use()[1]


def _run(mode: str, cache: Path, capability: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MINDSPEED_LIKE_ARGS")}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache), TORCHDYNAMO_DISABLE="0", OMP_NUM_THREADS="1")
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run(
        [sys.executable, str(WORKER), mode], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("COMPILE-CACHE ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[0].removeprefix("COMPILE-CACHE "))


def _native_then_held(mode: str, cache: Path) -> tuple[dict, dict]:
    """Fill ``cache`` natively, then read it from a process held below the native ISA."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"ATEN_CPU_CAPABILITY holds x86 ISAs; this host is {platform.machine()}")
    native = _run(mode, cache, None)
    if not native["vec_isa"].startswith(("avx512", "avx2")):
        pytest.skip(f"Inductor generates {native['vec_isa']!r} here: no lower x86 ISA to hold the process to")
    held_to = "avx2" if native["vec_isa"].startswith("avx512") else "default"
    held = _run(mode, cache, held_to)
    assert held["vec_isa"] != native["vec_isa"], (native, held)  # the hold really changed the generated code
    return native, held


@pytest.mark.slow  # two compiling processes, ~50 s; the key test above runs in the default lane
def test_a_held_process_does_not_read_the_graph_a_native_process_wrote(tmp_path):
    native, held = _native_then_held("adaptor", tmp_path / "inductor")
    assert native["fx_miss"] >= 1 and native["close"]
    assert held["fx_hit"] == 0 and held["aot_hit"] == 0 and held["fx_miss"] >= 1, held
    assert set(native["keys"]) < set(held["keys"])  # the native graph is still there, beside the held one
    assert held["close"], held


@pytest.mark.slow
def test_canary_torch_alone_reads_the_native_graph_across_isas(tmp_path):
    """Why the feature exists: without it the held process finds the native graph by its key and
    runs C++ written for the wider vectors. If this fails because torch now keys its cache by the
    ISA, the feature can go (for those torch releases)."""
    native, held = _native_then_held("plain", tmp_path / "inductor")
    assert held["fx_hit"] >= 1 and held["keys"] == native["keys"], held
    if native["vec_isa"].startswith("avx512"):  # 16-float code on 8-float vectors: half the output unwritten
        assert not held["close"], held
