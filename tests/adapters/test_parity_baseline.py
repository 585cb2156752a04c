"""The adaptor with default flags changes nothing but what the host needs.

On this CPU-only host plain megatron-core cannot train at all (it calls CUDA), so "adaptor vs
plain megatron" is not measurable here, and "adaptor vs reset()-then-minimal-patching" would
compare a thing with itself. The meaningful baseline is: the adaptor with default flags (what
``import mindspeed_like.megatron_adaptor`` applies: device adapter + always-on fixes + feature
defaults) against the cpu-adapter feature applied alone, directly through the engine. Bitwise
equal per-step losses over 5 steps prove that no default-on feature changes the math; on a
GPU host the same test compares against untouched megatron-core (cpu-adapter is then off).
"""

from __future__ import annotations

import pytest

import mindspeed_like
from mindspeed_like import runtime
from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt, train_steps
from mindspeed_like.testing.declarations import declared_patches


def _run(bf16: bool) -> list[float]:
    init_parallel(seed=21)
    try:
        return train_steps(tiny_gpt(bf16=bf16), 5, seed=22, lr=1e-2)
    finally:
        destroy_parallel()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_default_adaptor_equals_device_adapter_alone_bitwise(bf16):
    mindspeed_like.reset()
    try:
        runtime.apply(code={})  # exactly what `import mindspeed_like.megatron_adaptor` does
        with_defaults = _run(bf16)
        features = {r.feature for r in mindspeed_like.report()}
        assert "cpu-adapter" in features
        mindspeed_like.reset()

        runtime.ENGINE.apply("cpu-adapter", declared_patches("cpu-adapter"))
        adapter_only = _run(bf16)
    finally:
        mindspeed_like.reset()
    assert with_defaults == adapter_only  # bitwise: same floats


def test_adaptor_equals_plain_megatron_core_bitwise(tmp_path):
    """Against megatron-core with NO mindspeed_like in the process (see plain_megatron_run.py for
    the minimal shim the reference needs on this host and why it starts both runs from one set
    of initial weights): 5 AdamW steps, per-step losses bitwise equal."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "plain_megatron_run.py")
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_LIKE_ARGS"}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    runs = {}
    for mode in ("plain", "adaptor"):
        result = subprocess.run(
            [sys.executable, script, mode, str(tmp_path / "init.pt")],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs[mode] = json.loads(result.stdout.strip().splitlines()[-1])
    assert runs["plain"]["mindspeed_like_loaded"] is False and runs["adaptor"]["mindspeed_like_loaded"] is True
    assert runs["adaptor"]["losses"] == runs["plain"]["losses"]
