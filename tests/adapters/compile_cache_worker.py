"""One process of the cross-ISA compile-cache test (tests/adapters/test_compile_cache.py).

    python compile_cache_worker.py adaptor|plain

Compiles megatron's GroupedMLP activation with probs (``silu(x[:, :n]) * x[:, n:] * probs``, the
graph issue 56 saw reused across ISAs) with torch.compile on, in the ``TORCHINDUCTOR_CACHE_DIR``
and ``ATEN_CPU_CAPABILITY`` its parent chose; ``adaptor``: with mindspeed_like on the CPU device
first (``plain``: torch alone). Prints one JSON line: the vector ISA Inductor generates for, the
FX graph and AOTAutograd cache hits and misses, the FX graph keys in the cache directory, and
whether the compiled result equals eager's (within fp32 rounding of a vectorized exp).
"""

from __future__ import annotations

import json
import os
import sys

import torch


def activation_with_probs(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    half = torch.chunk(x, 2, dim=-1)
    return torch.nn.functional.silu(half[0]) * half[1] * probs


def main(mode: str) -> None:
    if mode == "adaptor":
        import mindspeed_like

        mindspeed_like.configure(device="cpu")
    elif mode != "plain":
        raise SystemExit(f"mode must be 'adaptor' or 'plain', not {mode!r}")
    from torch._dynamo.utils import counters
    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 256, generator=generator)
    probs = torch.rand(128, 1, generator=generator) + 0.5
    expected = activation_with_probs(x, probs)
    got = torch.compile(activation_with_probs)(x, probs)
    fxgraph = os.path.join(cache_dir(), "fxgraph")
    keys = sorted(k for _, dirs, _ in os.walk(fxgraph) for k in dirs if k.startswith("f") and len(k) > 3)
    print(
        "COMPILE-CACHE "
        + json.dumps(
            {
                "vec_isa": str(cpu_vec_isa.pick_vec_isa()),
                "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
                "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
                "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
                "keys": keys,
                "close": bool(torch.allclose(got, expected, rtol=1e-5, atol=1e-6)),
                "max_error": float((got - expected).abs().max()),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1])
