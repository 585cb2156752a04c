"""Liger-Kernel's Triton kernels as the anchor of the fused-op benchmarks on a GPU (not a script).

The same op, on the same shapes and dtype, forward + backward, through Liger's autograd Functions
(package ``liger-kernel``, read from its 0.8.5 sources), each given the layout it is written for:

- RMSNorm: ``LigerRMSNormFunction.apply(X, W, eps, offset=0.0, casting_mode="llama",
  in_place=False)``; X ``[tokens, hidden]``. ``in_place=False`` because its default writes dX into
  the incoming gradient, which the timing loop reuses (ours allocates dX too).
- RoPE: ``LigerRopeFunction.apply(q, k, cos, sin)`` rotates q and k in one launch; q/k as
  ``[batch, heads, seq, dim]`` (here a view of megatron's ``[seq, batch, heads, dim]``, which Liger
  transposes back to that physical layout), cos/sin ``[1, seq, dim]``. HF's rotate-half = megatron's
  non-interleaved RoPE; Liger has no interleaved mode.
- SwiGLU: ``LigerSiLUMulFunction.apply(a, b)`` = ``silu(a) * b`` on two tensors ``[tokens, ffn]``
  (HF's separate gate and up projections; megatron's fused fc1 output is ``[tokens, 2 * ffn]``).
- Fused linear cross-entropy: ``LigerFusedLinearCrossEntropyFunction.apply(input [tokens, hidden],
  weight [vocab, hidden], target [tokens])``, mean over tokens (it computes the gradients in the
  forward).

Where Liger cannot run, :func:`unavailable` says why in a few words (``not installed``; ``needs a
GPU``: its kernels are Triton GPU kernels); the benchmarks print that in Liger's column and run
the rest.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

DISTRIBUTION = "liger-kernel"


def unavailable(device: torch.device) -> str | None:
    """Why Liger's kernels cannot run on ``device`` here, or None when they can (``TRITON_INTERPRET=1``
    lets them run on CPU tensors, slowly: a check of the calls, not a timing)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"needs a GPU (Triton kernels), not {device.type}"
    try:
        for module in ("rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"):
            importlib.import_module(f"liger_kernel.ops.{module}")
    except Exception as error:  # a broken install is a column that says so, not a crashed benchmark
        return f"import failed: {type(error).__name__}: {error}"[:120]
    return None


def version() -> str | None:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(DISTRIBUTION)
    except PackageNotFoundError:
        return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)


def rope_sbhd(q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[s, b, nq, d]`` and k ``[s, b, nk, d]`` rotated by megatron's ``freqs`` ``[s, 1, 1, d]``
    (full rotary, rotate-half), returned as ``[b, n, s, d]`` views. Liger rotates its inputs' storage
    in place: callers pass tensors they do not need unrotated (the timing reuses them; a rotation
    keeps their magnitude)."""
    from liger_kernel.ops.rope import LigerRopeFunction

    seq, dim = freqs.shape[0], freqs.shape[-1]
    cos = torch.cos(freqs).reshape(1, seq, dim).to(q.dtype)
    sin = torch.sin(freqs).reshape(1, seq, dim).to(q.dtype)
    return LigerRopeFunction.apply(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), cos, sin)


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply(a, b)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean loss over ``hidden`` ``[tokens, h]`` against ``weight`` ``[vocab, h]``."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    out = LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, target)
    return out[0] if isinstance(out, tuple) else out
