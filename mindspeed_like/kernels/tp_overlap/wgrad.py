"""The weight gradient exactly as megatron's ``LinearWithGradAccumulationAndAsyncCommunication``
computes it, shared by the tiled and the MC2 kernels.

- deferral: with a ``grad_output_buffer`` (the output layer under
  ``defer_embedding_wgrad_compute``), the full ``grad_output`` is appended and the weight
  gradient skipped while ``wgrad_deferral_limit == 0`` or the buffer is shorter than the limit.
- ``gradient_accumulation_fusion`` with a ``main_grad``: the product is accumulated into
  ``weight.main_grad`` (megatron calls apex's ``wgrad_gemm_accum_fp32/fp16``, which computes
  ``main_grad += grad_output^T @ input`` with fp32 accumulation; here ``addmm_`` in
  ``main_grad``'s dtype does the same on any device), Megatron-FSDP's in-place buffer is
  honoured, and the dummy ``grad_weight`` megatron returns so DDP hooks run on the main thread
  (``grad_added_to_main_grad``, ``zero_out_wgrad``) is reproduced.
- otherwise ``grad_output^T @ input``.
"""

from __future__ import annotations

import torch


def wgrad_is_computed(grad_output: torch.Tensor, buffer: list | None, limit: int | None) -> bool:
    """Megatron's deferral rule; appends ``grad_output`` to ``buffer`` when deferring."""
    if buffer is not None and (limit == 0 or len(buffer) < (limit or 0)):
        buffer.append(grad_output)
        return False
    return True


def weight_gradient(
    weight: torch.Tensor,
    grad_output: torch.Tensor,
    total_input: torch.Tensor | None,
    *,
    accumulation_fusion: bool,
    compute: bool,
    input_dtype: torch.dtype,
    rows: slice = slice(None),
) -> torch.Tensor | None:
    """``grad_output`` ``[M, n]`` and ``total_input`` ``[M, k]`` (rank-major, as megatron's).
    ``rows``: the slice of the weight's rows ``grad_output`` covers (a caller that computes the
    gradient in row blocks, each block complete over all tokens: the fused output loss)."""
    if not accumulation_fusion:
        return grad_output.t().matmul(total_input) if compute else None
    if compute:
        if hasattr(weight, "__fsdp_param__"):
            weight.main_grad = weight.get_main_grad()
            torch.matmul(grad_output.t(), total_input, out=weight.main_grad[rows])
        else:
            main_grad = weight.main_grad[rows]
            if main_grad.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")
            main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    shape = weight.main_grad.shape
    if getattr(weight, "zero_out_wgrad", False):
        grad_weight = torch.zeros(shape, dtype=input_dtype, device=weight.main_grad.device)
    else:
        grad_weight = torch.empty(shape, dtype=input_dtype, device=weight.main_grad.device)
    weight.grad_added_to_main_grad = True
    return grad_weight
