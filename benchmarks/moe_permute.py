"""MoE token permute + unpermute fwd+bwd: megatron's unfused ``moe_utils.permute/unpermute`` vs
ours (``moe-permute`` feature, portable backend), same inputs, same process.

One step = permute (tokens and probs, as the alltoall dispatcher does) -> a row-wise stand-in for
the experts (``rows + permuted_probs``: it saves nothing, so the saved bytes are the two ops')
-> unpermute -> backward. ``merge`` cases instead pass the
probs to unpermute (``unpermute(..., probs=)``, megatron's API path that merges the weights there).
``pad`` cases use drop-and-pad (capacity factor 1, padded to capacity). Routing: top-2 of 8
experts from random logits.

``megatron_ms`` is megatron's path as users run it: these two functions are plain eager code
(no ``jit_fuser``), so torch.compile does not touch them in a training run. ``megatron_compiled_ms``
additionally wraps megatron's step in ``torch.compile`` (what a user compiling the MoE layer would
get; data-dependent shapes break the graph), for the fp32 cases without ``merge`` (each compile
takes minutes here); left out under TORCHDYNAMO_DISABLE. Time: median of
``--repeats`` runs after ``WARMUP`` runs. Saved: bytes autograd keeps between forward and backward
(saved-tensor hooks, storages counted once). Peak: highest live allocator bytes above the start
of one fwd+bwd (torch.profiler memory events).

    python benchmarks/moe_permute.py [--quick] [--repeats N] [--json out.json]
"""

from __future__ import annotations

import os

import common  # benchmarks/ is the script directory (as in import_overhead.py)
import torch

from mindspeed_like.kernels import moe_permute as ours_kernel
from mindspeed_like.testing import SavedBytesMeter

MiB = 2**20
WARMUP = 3
EXPERTS, TOPK = 8, 2


def _routing(tokens: int, generator: torch.Generator):
    values, experts = torch.softmax(torch.randn(tokens, EXPERTS, generator=generator), -1).topk(TOPK)
    routing_map = torch.zeros(tokens, EXPERTS, dtype=torch.bool).scatter(1, experts, True)
    probs = torch.zeros(tokens, EXPERTS).scatter(1, experts, values)
    return routing_map, probs


def _pad_map(routing_map: torch.Tensor, probs: torch.Tensor, capacity: int) -> torch.Tensor:
    scores = torch.where(routing_map, probs, torch.full_like(probs, -1.0))
    return torch.zeros_like(routing_map).scatter(0, scores.topk(capacity, dim=0).indices, True)


def megatron_step(x, routing_map, probs, num_out, pad, merge):
    from megatron.core.transformer.moe import moe_utils

    out = moe_utils.permute(x, routing_map, probs=None if merge else probs, num_out_tokens=num_out, drop_and_pad=pad)
    permuted, permuted_probs, idx = out[0], out[1], out[2]
    rows = permuted * 1.0 if merge else permuted + permuted_probs.unsqueeze(-1).to(permuted.dtype)
    return moe_utils.unpermute(
        rows, idx, restore_shape=x.shape, probs=probs if merge else None, routing_map=routing_map, drop_and_pad=pad
    )


def ours_step(x, routing_map, probs, num_out, pad, merge):
    with common.users_backend():
        permuted, permuted_probs, idx = ours_kernel.permute(
            x, routing_map, probs=None if merge else probs, num_out_tokens=num_out, drop_and_pad=pad
        )
        rows = permuted * 1.0 if merge else permuted + permuted_probs.unsqueeze(-1).to(permuted.dtype)
        return ours_kernel.unpermute(
            rows, idx, x.shape, probs=probs if merge else None, routing_map=routing_map, drop_and_pad=pad
        )


def _fwd_bwd(fn, x, probs, grad, *rest):
    def step():
        x.grad = None
        probs.grad = None
        fn(x, *rest[:1], probs, *rest[1:]).backward(grad)

    return step


def _saved_mib(fn, x, probs, *rest) -> float:
    with SavedBytesMeter() as meter:
        out = fn(x, rest[0], probs, *rest[1:])
    del out
    return meter.bytes / MiB


def run(args, results: common.Results) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, hidden = (1024, 256) if args.quick else (8192, 1024)
    compile_on = os.environ.get("TORCHDYNAMO_DISABLE", "0") != "1"  # torch's own reading (make bench sets 0)
    compiled_megatron = torch.compile(megatron_step, dynamic=True) if compile_on else None
    for dtype in (torch.float32, torch.bfloat16):
        for pad in (False, True):
            for merge in (False, True):
                routing_map, probs = _routing(tokens, gen)
                num_out = int(routing_map.sum())
                if pad:
                    capacity = tokens * TOPK // EXPERTS  # capacity factor 1
                    routing_map = _pad_map(routing_map, probs, capacity)
                    num_out = capacity * EXPERTS
                device = common.device()
                routing_map, probs = routing_map.to(device), probs.to(device)
                x = torch.randn(tokens, hidden, generator=gen).to(device, dtype).requires_grad_()
                probs = probs.requires_grad_()
                grad = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
                rest = (routing_map, num_out, pad, merge)
                base = common.median_seconds(
                    _fwd_bwd(megatron_step, x, probs, grad, *rest), args.repeats, WARMUP, label="megatron"
                )
                mine = common.median_seconds(
                    _fwd_bwd(ours_step, x, probs, grad, *rest), args.repeats, WARMUP, label="ours"
                )
                comp = None
                # compiling costs minutes per case on the 2-core host: fp32 routing-only cases
                if compiled_megatron is not None and dtype == torch.float32 and not merge:
                    comp = common.median_seconds(
                        _fwd_bwd(compiled_megatron, x, probs, grad, *rest),
                        args.repeats,
                        WARMUP,
                        label="megatron_compiled",
                    )
                results.add(
                    case=f"{'pad' if pad else 'dropless'}{'+merge' if merge else ''}",
                    dtype=str(dtype).replace("torch.", ""),
                    shape=f"{tokens}x{hidden} E{EXPERTS} k{TOPK}",
                    megatron_ms=base * 1e3,
                    megatron_compiled_ms=comp * 1e3 if comp is not None else "-",
                    ours_ms=mine * 1e3,
                    speedup=base / mine,
                    megatron_saved_MiB=_saved_mib(megatron_step, x, probs, *rest),
                    ours_saved_MiB=_saved_mib(ours_step, x, probs, *rest),
                    megatron_peak_MiB=common.peak_bytes(_fwd_bwd(megatron_step, x, probs, grad, *rest)) / MiB,
                    ours_peak_MiB=common.peak_bytes(_fwd_bwd(ours_step, x, probs, grad, *rest)) / MiB,
                )


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    results = common.Results("moe_permute")
    run(args, results)
    results.print_table()
    results.write_json(args.json)


if __name__ == "__main__":
    main()
