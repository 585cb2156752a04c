"""RoPE fwd+bwd: megatron's ``rope_utils.apply_rotary_pos_emb`` (its eager, non-TE path) vs ours
(portable backend), on megatron's sbhd layout ``[s, b, n, d]`` with ``[s, 1, 1, rot_dim]`` freqs.

Time: median of ``--repeats`` fwd+bwd runs, same inputs, same process, after ``WARMUP`` runs.
``ours_ms`` is the default (``--portable-kernels auto``: the compiled custom op where TorchDynamo
is on), ``ours_eager_ms`` the eager Function (``--portable-kernels eager``). Saved: bytes autograd
keeps for backward per call (saved-tensor hooks, storages counted once). Megatron recomputes
cos/sin on every call and saves them per call; ours saves references to one cached cos/sin
pair shared by every call with the same freqs (q and k of every layer, every step), so the
per-model figure is even smaller than the per-call one shown.

The ``rope q+k`` rows rotate a query and a key/value tensor of Llama-8B's attention (32 query heads,
8 KV groups, head dim 128; bf16): megatron and ours once per tensor, as megatron's attention calls
them, and on a GPU Liger-Kernel's Triton RoPE on the same tensors in its one call for both (the
anchor: ``liger_ms``, ``vs_liger`` = Liger's time / ours; its column says why where it cannot run,
benchmarks/liger_anchor.py). Liger has no interleaved mode and no partial rotation of this layout.

    python benchmarks/fused_ops_rope.py [--quick] [--device cuda] [--json out.json]
"""

from __future__ import annotations

import types

import common  # benchmarks/ is the script directory (as in import_overhead.py)
import liger_anchor
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
    # the backend a user's run gets on this device (the portable one on a CPU, as always measured)
    backend = "portable" if t.device.type == "cpu" else None
    return rope_kernel.apply_rope(t, freqs, mode=mode, backend=backend)


def _fwd_bwd(fn, t, freqs, interleaved, grad):
    def step():
        t.grad = None
        fn(t, freqs, interleaved).backward(grad)

    return step


def _q_and_k(fn, q, k, freqs, grads):
    """megatron's attention: the same rotation applied to q and to k, one call each."""

    def step():
        q.grad = k.grad = None
        torch.autograd.backward([fn(q, freqs, False), fn(k, freqs, False)], list(grads))

    return step


def _liger_q_and_k(q, k, freqs, grads):
    """Liger's one call for both (its outputs are [b, n, s, d] views; the gradients likewise)."""
    grads_bnsd = [g.permute(1, 2, 0, 3) for g in grads]

    def step():
        q.grad = k.grad = None
        torch.autograd.backward(list(liger_anchor.rope_sbhd(q, k, freqs)), grads_bnsd)

    return step


def _seconds(step, repeats: int, label: str) -> float:
    return common.median_seconds(step, repeats, WARMUP, label=label, inner=common.calls_per_sample())


def _saved_mib(fn, t, freqs, interleaved) -> float:
    with SavedBytesMeter() as meter:
        out = fn(t, freqs, interleaved)
    del out
    return meter.bytes / MiB


def run(args, results: common.Results) -> None:
    torch.manual_seed(0)
    device = common.device()
    seq, batch, heads, dim = (1024, 1, 8, 128) if args.quick else (4096, 1, 32, 128)
    cases = [("half", 1.0, False), ("half", 0.5, False), ("interleaved", 1.0, True)]
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(seq, batch, heads, dim, dtype=dtype, device=device, requires_grad=True)
        grad = torch.randn(seq, batch, heads, dim, dtype=dtype, device=device)
        for label, percent, interleaved in cases:
            rot_dim = int(dim * percent)
            freqs = torch.rand(seq, 1, 1, rot_dim, device=device) * 100
            base_s = _seconds(_fwd_bwd(megatron, t, freqs, interleaved, grad), args.repeats, "megatron")
            ours_s = _seconds(_fwd_bwd(ours, t, freqs, interleaved, grad), args.repeats, "ours")
            compiled.set_mode("eager")
            eager_s = _seconds(_fwd_bwd(ours, t, freqs, interleaved, grad), args.repeats, "ours_eager")
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
    _q_and_k_case(args, results, seq, dim)


def _q_and_k_case(args, results: common.Results, seq: int, dim: int) -> None:
    """Llama-8B's q (32 heads) and k (8 KV groups), bf16, full rotary: megatron, ours, Liger."""
    device, dtype = common.device(), torch.bfloat16
    q_heads, kv_heads = (8, 2) if args.quick else (32, 8)
    q = torch.randn(seq, 1, q_heads, dim, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(seq, 1, kv_heads, dim, dtype=dtype, device=device, requires_grad=True)
    grads = (torch.randn_like(q), torch.randn_like(k))
    half = torch.rand(seq, 1, 1, dim // 2, device=device) * 100
    freqs = torch.cat([half, half], dim=-1)  # megatron's RotaryEmbedding: the angles twice (rotate-half)
    base_s = _seconds(_q_and_k(megatron, q, k, freqs, grads), args.repeats, "megatron")
    ours_s = _seconds(_q_and_k(ours, q, k, freqs, grads), args.repeats, "ours")
    compiled.set_mode("eager")
    eager_s = _seconds(_q_and_k(ours, q, k, freqs, grads), args.repeats, "ours_eager")
    compiled.set_mode(None)
    missing = liger_anchor.unavailable(device)
    liger_s = None
    if missing is None:
        # Liger rotates in place: its own copies, so megatron's and ours above saw the same inputs
        q_l, k_l = (t.detach().clone().requires_grad_() for t in (q, k))
        missing = common.anchor_fails(_liger_q_and_k(q_l, k_l, freqs, grads))
        if missing is None:
            liger_s = _seconds(_liger_q_and_k(q_l, k_l, freqs, grads), args.repeats, "liger")
    results.add(
        op="rope q+k",
        dtype="bfloat16",
        shape=f"q {seq}x1x{q_heads}x{dim}, k {seq}x1x{kv_heads}x{dim}",
        megatron_ms=base_s * 1e3,
        ours_ms=ours_s * 1e3,
        ours_eager_ms=eager_s * 1e3,
        speedup=base_s / ours_s,
        **common.anchor_columns("liger", None if liger_s is None else liger_s * 1e3, ours_s * 1e3, missing),
    )


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    results = common.Results("fused_ops_rope")
    run(args, results)
    results.print_table()
    results.write_json(args.json)


if __name__ == "__main__":
    main()
