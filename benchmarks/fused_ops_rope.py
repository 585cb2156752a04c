"""RoPE fwd+bwd: megatron's ``rope_utils.apply_rotary_pos_emb`` (its eager, non-TE path) vs ours
(portable backend), on megatron's sbhd layout ``[s, b, n, d]`` with ``[s, 1, 1, rot_dim]`` freqs.

Time: median of ``--repeats`` fwd+bwd runs, same inputs, same process, after ``WARMUP`` runs.
``ours_ms`` is the default (``--portable-kernels auto``: the compiled custom op where TorchDynamo
is on), ``ours_eager_ms`` the eager Function (``--portable-kernels eager``). Saved: bytes autograd
keeps for backward per call (saved-tensor hooks, storages counted once). Megatron recomputes
cos/sin on every call and saves them per call; ours saves references to one cached cos/sin
pair shared by every call with the same freqs (q and k of every layer, every step), so the
per-model figure is even smaller than the per-call one shown.

    python benchmarks/fused_ops_rope.py [--quick] [--json out.json]
"""

from __future__ import annotations

import types

import common  # benchmarks/ is the script directory (as in import_overhead.py)
import torch

from mindspeed_like.kernels import compiled
from mindspeed_like.kernels import rope as rope_kernel
from mindspeed_like.testing import SavedBytesMeter

MiB = 2**20
WARMUP = 4  # the process's first compile keeps Inductor's workers busy for a few calls


class _NoCP:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _config(interleaved: bool) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        apply_rope_fusion=False, rotary_interleaved=interleaved, multi_latent_attention=False, mrope_section=None
    )


def megatron(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    from megatron.core.models.common.embeddings import rope_utils

    original = getattr(rope_utils.apply_rotary_pos_emb, "__wrapped__", rope_utils.apply_rotary_pos_emb)
    return original(t, freqs, _config(interleaved), cp_group=_NoCP())


def ours(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    mode = "interleave" if interleaved else "half"
    return rope_kernel.apply_rope(t, freqs, mode=mode, backend="portable")


def _fwd_bwd(fn, t, freqs, interleaved, grad):
    def step():
        t.grad = None
        fn(t, freqs, interleaved).backward(grad)

    return step


def _saved_mib(fn, t, freqs, interleaved) -> float:
    with SavedBytesMeter() as meter:
        out = fn(t, freqs, interleaved)
    del out
    return meter.bytes / MiB


def run(args, results: common.Results) -> None:
    torch.manual_seed(0)
    seq, batch, heads, dim = (1024, 1, 8, 128) if args.quick else (4096, 1, 32, 128)
    cases = [("half", 1.0, False), ("half", 0.5, False), ("interleaved", 1.0, True)]
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(seq, batch, heads, dim, dtype=dtype, requires_grad=True)
        grad = torch.randn(seq, batch, heads, dim, dtype=dtype)
        for label, percent, interleaved in cases:
            rot_dim = int(dim * percent)
            freqs = torch.rand(seq, 1, 1, rot_dim) * 100
            base_s = common.median_seconds(
                _fwd_bwd(megatron, t, freqs, interleaved, grad), args.repeats, WARMUP, label="megatron"
            )
            ours_s = common.median_seconds(
                _fwd_bwd(ours, t, freqs, interleaved, grad), args.repeats, WARMUP, label="ours"
            )
            compiled.set_mode("eager")
            eager_s = common.median_seconds(
                _fwd_bwd(ours, t, freqs, interleaved, grad), args.repeats, WARMUP, label="ours_eager"
            )
            compiled.set_mode(None)
            results.add(
                op=f"rope {label}" + (f" rotary_percent={percent}" if percent < 1 else ""),
                dtype=str(dtype).replace("torch.", ""),
                shape=f"{seq}x{batch}x{heads}x{dim}",
                megatron_ms=base_s * 1e3,
                ours_ms=ours_s * 1e3,
                ours_eager_ms=eager_s * 1e3,
                speedup=base_s / ours_s,
                megatron_saved_MiB=_saved_mib(megatron, t, freqs, interleaved),
                ours_saved_MiB=_saved_mib(ours, t, freqs, interleaved),
            )


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    results = common.Results("fused_ops_rope")
    run(args, results)
    results.print_table()
    results.write_json(args.json)


if __name__ == "__main__":
    main()
