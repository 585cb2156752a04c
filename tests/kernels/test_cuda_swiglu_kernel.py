"""The cuda backend's SwiGLU (``kernels/backends/cuda_swiglu.py``), checked on a host without a GPU."""

import logging

import pytest
import torch


def test_triton_kernels_in_the_interpreter():
    """Forward and backward against float64 in Triton's interpreter on CPU tensors (a fresh
    process: the interpreter must be chosen before triton is imported), non-finite inputs where
    the compiled op puts them, and ``swiglu()`` taking them under the cuda backend.
    Script: ``cuda_swiglu_interpreted.py``."""
    import os
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = pathlib.Path(__file__).with_name("cuda_swiglu_interpreted.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("interpreted SwiGLU kernels: float64 bounds, non-finite placement, dispatch")


def test_a_failing_kernel_is_said_once_and_the_portable_op_serves(monkeypatch, caplog):
    """Where the once-per-device check fails (here: Triton cannot launch on a CPU tensor outside
    the interpreter, or no triton at all), ``swiglu()`` under the cuda backend says why once and
    runs the portable op: a user's run never depends on an unverified kernel."""
    from mindspeed_like.kernels import compiled, swiglu
    from mindspeed_like.kernels.backend import force_backend
    from mindspeed_like.kernels.backends import cuda_swiglu

    monkeypatch.setattr(cuda_swiglu, "_checked", {})
    monkeypatch.setattr(cuda_swiglu, "unavailable", lambda: None)  # with or without triton installed
    monkeypatch.setattr(cuda_swiglu, "_check", lambda device: "a planted failure")
    monkeypatch.setitem(compiled._state, "said", set())
    x = torch.randn(3, 8, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"), force_backend("cuda"):
        first, second = swiglu.swiglu(x), swiglu.swiglu(x)
    assert caplog.text.count("a planted failure") == 1
    assert "TritonSwiGLU" not in type(first.grad_fn).__name__
    torch.testing.assert_close(second, swiglu.swiglu_reference(x))


def test_without_triton_the_portable_op_serves_and_says_why_once(monkeypatch, caplog):
    """A CUDA host without triton (megatron-core 0.13-0.17 venvs install none): the shape check
    needs no triton, the once-per-device check says "triton is not installed" and the portable op
    runs (it raised AttributeError on ``triton.cdiv`` of None before)."""
    from mindspeed_like.kernels import compiled, swiglu
    from mindspeed_like.kernels.backend import force_backend
    from mindspeed_like.kernels.backends import cuda_swiglu

    monkeypatch.setattr(cuda_swiglu, "triton", None)
    monkeypatch.setattr(cuda_swiglu, "_checked", {})
    monkeypatch.setitem(compiled._state, "said", set())
    x = torch.randn(2, 3, 2 * 1030, requires_grad=True)
    assert cuda_swiglu.fits(x) and not cuda_swiglu.fits(torch.randn(3, 0))
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"), force_backend("cuda"):
        first, second = swiglu.swiglu(x), swiglu.swiglu(x)
    assert caplog.text.count("triton is not installed") == 1
    assert "TritonSwiGLU" not in type(first.grad_fn).__name__
    torch.testing.assert_close(second, swiglu.swiglu_reference(x))
