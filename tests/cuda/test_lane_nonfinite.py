"""Issue 37 item 3 on the lane's device: the fused kernels a user's model gets there (the backend the
device picks: on CUDA torch's fused RMSNorm, the Triton SwiGLU, SDPA's kernels) propagate NaN and
inf as megatron's own ops do on the same device. The CPU lane's tests/kernels/test_nonfinite_propagation.py
states the contract per kernel and why; here the same injections (NaN, +-inf, a huge finite value
into one input or the incoming gradient) on the device: RMSNorm, SwiGLU and RoPE give megatron's
NaN/inf positions exactly, flash attention its output's positions exactly and a non-finite value in
each gradient exactly when megatron's has one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from cuda_lane import DTYPES, as_on_cuda

pytestmark = pytest.mark.cuda
SPECIALS = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}


def _placement(t: torch.Tensor) -> torch.Tensor:
    code = torch.zeros(t.shape, dtype=torch.int8, device=t.device)
    code[t.isnan()] = 1
    code[t.isposinf()] = 2
    code[t.isneginf()] = 3
    return code.cpu()


def _run(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach(), *[t.grad for t in leaves]]


def _cases(shapes: dict, dtype: torch.dtype, where: dict, device: torch.device):
    gen = torch.Generator().manual_seed(1234)
    base = {n: torch.randn(s, generator=gen).to(dtype) for n, s in shapes.items()}
    yield "clean", {n: t.to(device) for n, t in base.items()}
    huge = torch.finfo(dtype).max / 4
    for name in shapes:
        for label, value in {**SPECIALS, "huge": huge}.items():
            changed = base[name].clone()
            changed[where[name]] = value
            yield f"{name}={label}", {n: (changed if n == name else t).to(device) for n, t in base.items()}


def _compare(ours, megatron, shapes, where, dtype, device, exact=True):
    for case, t in _cases(shapes, dtype, where, device):
        names = [n for n in shapes if n != "grad"]
        with as_on_cuda(device):
            got = _run(ours, [t[n] for n in names], t["grad"])
        expected = _run(megatron, [t[n] for n in names], t["grad"])
        for i, (a, b) in enumerate(zip(got, expected)):
            if exact or i == 0:
                assert torch.equal(_placement(a), _placement(b)), f"{dtype} {case}: tensor {i} NaN/inf positions"
            else:
                assert bool(_placement(a).any()) == bool(_placement(b).any()), f"{dtype} {case}: gradient {i}"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rmsnorm_swiglu_rope_nonfinite_as_megatrons_on_the_device(lane_device, dtype):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from mindspeed_like.kernels.rmsnorm import rms_norm
    from mindspeed_like.kernels.rope import apply_rope
    from mindspeed_like.kernels.swiglu import swiglu

    dt, dev = DTYPES[dtype], lane_device
    _compare(
        lambda x, w: rms_norm(x, w, 1e-5),
        lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-5),
        {"x": (3, 4, 64), "w": (64,), "grad": (3, 4, 64)},
        {"x": (1, 2), "w": (5,), "grad": (1, 2)},
        dt,
        dev,
    )
    _compare(
        swiglu,
        lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1],
        {"x": (8, 128), "grad": (8, 64)},
        {"x": (1, 3), "grad": (1, 3)},
        dt,
        dev,
    )
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    angles = torch.outer(torch.arange(6, dtype=torch.float32), inv)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :].to(dev)
    _compare(
        lambda t: apply_rope(t, freqs),
        lambda t: _apply_rotary_pos_emb_bshd(t, freqs),
        {"t": (6, 2, 2, 16), "grad": (6, 2, 2, 16)},
        {"t": (0, 1, 1, 3), "grad": (2, 1, 0, 4)},
        dt,
        dev,
    )


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_flash_attention_nonfinite_as_megatrons_on_the_device(lane_device, dtype):
    from mindspeed_like.kernels.flash_attention import CAUSAL, _reference_sbhd, flash_attention

    _compare(
        lambda q, k, v: flash_attention(q, k, v, scale=0.25, band=CAUSAL),
        lambda q, k, v: _reference_sbhd(q, k, v, 0.25, None, CAUSAL, 0.0),  # megatron's eager math
        {"q": (6, 2, 4, 16), "k": (6, 2, 4, 16), "v": (6, 2, 4, 16), "grad": (6, 2, 64)},
        {"q": (2, 0, 1, 3), "k": (2, 0, 1, 3), "v": (2, 0, 1, 3), "grad": (3, 0, 20)},
        DTYPES[dtype],
        lane_device,
        exact=False,
    )
