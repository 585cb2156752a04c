"""Emulator of ``torch_npu.npu_rotary_mul`` enforcing its documented contract.

``npu_rotary_mul(input, r1, r2, rotary_mode='half') -> Tensor``; out = x * r1 + rotate(x) * r2
(r1 = cos, r2 = sin), rotating the FULL last dim. 4-D input (BNSD / BSND / SBND), r1 and r2
broadcast as 11SD, 1S1D or S11D; D even and < 896; B, N < 1000 ('interleave': B * N < 1000);
same dtype everywhere (fp16 / bf16 / fp32); output has the input's shape and dtype.
"""

from __future__ import annotations

import torch

from mindspeed_like.testing.npu_emulator import ContractError, register

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_broadcast(x: torch.Tensor, r: torch.Tensor, name: str) -> tuple[int, int]:
    """The (B, N) of x implied by r's broadcast pattern (11SD -> BNSD, 1S1D -> BSND, S11D -> SBND)."""
    if r.dim() != 4:
        raise ContractError(f"npu_rotary_mul: {name} must be 4-D, got shape {tuple(r.shape)}")
    if r.shape[-1] != x.shape[-1]:
        raise ContractError(f"npu_rotary_mul: {name} last dim {r.shape[-1]} != input's {x.shape[-1]}")
    lead = tuple(r.shape[:3])
    non_one = [i for i, size in enumerate(lead) if size != 1]
    if len(non_one) > 1:
        raise ContractError(
            f"npu_rotary_mul: {name} shape {tuple(r.shape)} is not a broadcast shape 11SD, 1S1D or S11D"
        )
    seq_axis = non_one[0] if non_one else 0  # all ones: any layout; take SBND
    if lead[seq_axis] not in (1, x.shape[seq_axis]):
        raise ContractError(f"npu_rotary_mul: {name} shape {tuple(r.shape)} does not match input {tuple(x.shape)}")
    b, n = (x.shape[i] for i in range(3) if i != seq_axis)  # B before N in all three layouts
    return b, n


@register("npu_rotary_mul")
def npu_rotary_mul(input, r1, r2, rotary_mode: str = "half"):  # noqa: A002 - torch_npu's argument name
    for name, tensor in (("input", input), ("r1", r1), ("r2", r2)):
        if not isinstance(tensor, torch.Tensor):
            raise ContractError(f"npu_rotary_mul: {name} must be a Tensor, got {type(tensor).__name__}")
    if rotary_mode not in ("half", "interleave"):
        raise ContractError(f"npu_rotary_mul: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    if input.dim() != 4:
        raise ContractError(f"npu_rotary_mul: input must be 4-D (BNSD/BSND/SBND), got shape {tuple(input.shape)}")
    if input.dtype not in _DTYPES or r1.dtype != input.dtype or r2.dtype != input.dtype:
        raise ContractError(
            f"npu_rotary_mul: dtypes must be one of fp16/bf16/fp32 and equal, got {input.dtype}, {r1.dtype}, {r2.dtype}"
        )
    d = input.shape[-1]
    if d % 2 or d >= 896:
        raise ContractError(f"npu_rotary_mul: D must be even and < 896, got {d}")
    if tuple(r1.shape) != tuple(r2.shape):
        raise ContractError(f"npu_rotary_mul: r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} differ")
    b, n = _check_broadcast(input, r1, "r1")
    if b >= 1000 or n >= 1000:
        raise ContractError(f"npu_rotary_mul: B and N must be < 1000, got B={b}, N={n}")
    if rotary_mode == "interleave" and b * n >= 1000:
        raise ContractError(f"npu_rotary_mul: 'interleave' needs B*N < 1000, got {b * n}")
    if rotary_mode == "half":
        x1, x2 = torch.chunk(input, 2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        rotated = torch.stack((-input[..., 1::2], input[..., ::2]), dim=-1).flatten(-2)
    return input * r1 + rotated * r2
