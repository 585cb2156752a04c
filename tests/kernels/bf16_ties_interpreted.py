"""The cuda backend's Triton kernels (``kernels/backends/cuda_bf16_residual.py``) in Triton's
interpreter, run by ``test_reuse_fp32_param_kernel.py`` as a script with ``TRITON_INTERPRET=1``
(set before triton is imported: its own jitted library functions are built for the mode in
force at import). Exits non-zero with the first difference."""

from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(__file__))

from test_reuse_fp32_param_kernel import _bits  # noqa: E402

from mindspeed_like.kernels import bf16_residual as K  # noqa: E402
from mindspeed_like.kernels import bf16_ties  # noqa: E402
from mindspeed_like.kernels.backends import cuda_bf16_residual as cuda  # noqa: E402
from mindspeed_like.testing.bf16_patterns import hard_masters  # noqa: E402


def main() -> None:
    sample = bf16_ties.crafted(torch.device("cpu"))
    sample = sample[torch.randperm(sample.numel(), generator=torch.Generator().manual_seed(0))[:20_003]]
    assert bf16_ties._differs(cuda, sample) is None, "kernels differ from the eager ops on crafted patterns"
    n = 4099
    master = hard_masters(n, seed=5)
    w, r = torch.empty(n, dtype=torch.int16), torch.empty(n, dtype=torch.int16)
    bits = torch.zeros((n + 7) // 8, dtype=torch.uint8)
    cuda.encode(master, w, r, bits, 0)
    b, ref_r, ref_side = K.split_reference(master)
    nan = torch.isnan(master)
    assert torch.equal(w[~nan], _bits(b)[~nan]), "weights are not torch's cast"
    assert torch.isnan(w[nan].view(torch.bfloat16).float()).all(), "a NaN master's weight is not NaN"
    assert torch.equal(r, ref_r), "residuals differ from the reference"
    assert torch.equal(bf16_ties.unpack(bits, 0, n).nonzero().flatten(), ref_side), "ties differ"
    out = torch.empty(n)
    cuda.decode(w, r, bits, 0, out)
    assert torch.equal(_bits(out)[~nan], _bits(master)[~nan]) and torch.isnan(out[nan]).all(), "decode not exact"
    print("interpreted kernels: bitwise the eager ops and the reference")


if __name__ == "__main__":
    main()
