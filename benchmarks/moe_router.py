"""MoE top-k routing fwd+bwd: megatron's unfused ``topk_routing_with_score_function`` (eager, and
``torch.compile``'d as users compile it) vs ours (``mindspeed_like.kernels.moe_router``, portable
backend), plus the aux-loss scores (``compute_routing_scores_for_aux_loss``).

Cases: Mixtral (8 experts, softmax top-2), Qwen-MoE-like (128 experts, softmax top-8) and
DeepSeek-V3 (256 experts, sigmoid top-8, expert bias, 8 groups / top-4 groups, scaling 2.5),
fp32 and bf16 logits. The upstream gradient is dense ([tokens, experts], as the probabilities'
consumers give it). Time: median of ``--repeats`` fwd+bwd runs after ``WARMUP`` runs, same
process, same inputs. Saved: bytes autograd keeps for backward (saved-tensor hooks).
``compiled`` runs need dynamo on (run without TORCHDYNAMO_DISABLE); with it off the column is
left empty.

    python benchmarks/moe_router.py [--quick] [--repeats N] [--json out.json]
"""

from __future__ import annotations

import inspect
import os

import common  # benchmarks/ is the script directory
import torch

from mindspeed_like.kernels.moe_router import aux_loss_scores, topk_routing
from mindspeed_like.testing import SavedBytesMeter

MiB = 2**20
WARMUP = 3

CASES = {
    "mixtral": dict(experts=8, topk=2, score_function="softmax"),
    "qwen-moe": dict(experts=128, topk=8, score_function="softmax"),
    "deepseek-v3": dict(
        experts=256, topk=8, score_function="sigmoid", bias=True, num_groups=8, group_topk=4, scaling_factor=2.5
    ),
}


def _megatron():
    from megatron.core.transformer.moe import moe_utils

    from mindspeed_like.features.moe_router.routing import routing_layout

    fn = inspect.unwrap(moe_utils.topk_routing_with_score_function)
    aux = inspect.unwrap(moe_utils.compute_routing_scores_for_aux_loss)
    return fn, aux, routing_layout(fn)


def _step(fn, x, grad):
    def step():
        x.grad = None
        out = fn(x)
        out.backward(grad)

    return step


def _saved_mib(fn, x) -> float:
    with SavedBytesMeter() as meter:
        out = fn(x)
    del out
    return meter.bytes / MiB


def run(args, results: common.Results) -> None:
    megatron_fn, megatron_aux, layout = _megatron()
    tokens = 1024 if args.quick else 8192
    device = common.device()
    can_compile = os.environ.get("TORCHDYNAMO_DISABLE", "0") != "1"  # torch's own reading (make bench sets 0)
    for case, spec in CASES.items():
        experts, topk = spec["experts"], spec["topk"]
        kwargs = dict(
            use_pre_softmax=False,
            num_groups=spec.get("num_groups"),
            group_topk=spec.get("group_topk"),
            scaling_factor=spec.get("scaling_factor"),
            score_function=spec["score_function"],
            expert_bias=torch.randn(experts, device=device) * 0.01 if spec.get("bias") else None,
        )
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            x = torch.randn(tokens, experts, dtype=dtype, device=device, requires_grad=True)
            grad = torch.randn(tokens, experts, dtype=dtype, device=device)

            def theirs(t, fn=megatron_fn, kwargs=kwargs, topk=topk):
                return fn(t, topk, **kwargs)[0]

            def ours(t, kwargs=kwargs, topk=topk):
                with common.users_backend():
                    return topk_routing(t, topk, **kwargs, fp32_intermediates=layout.fp32_intermediates)[0]

            ours_s = common.median_seconds(_step(ours, x, grad), args.repeats, WARMUP, label="ours")
            eager_s = common.median_seconds(_step(theirs, x, grad), args.repeats, WARMUP, label="megatron")
            compiled_s = None
            if can_compile:
                torch._dynamo.reset()
                compiled = torch.compile(theirs)
                compiled_s = common.median_seconds(
                    _step(compiled, x, grad), args.repeats, WARMUP, label="megatron_compiled"
                )
            results.add(
                op=f"topk routing {case}",
                dtype=str(dtype).replace("torch.", ""),
                shape=f"{tokens}x{experts} top{topk}",
                megatron_eager_ms=eager_s * 1e3,
                megatron_compiled_ms=None if compiled_s is None else compiled_s * 1e3,
                ours_ms=ours_s * 1e3,
                vs_eager=eager_s / ours_s,
                vs_compiled=None if compiled_s is None else compiled_s / ours_s,
                megatron_saved_MiB=_saved_mib(theirs, x),
                ours_saved_MiB=_saved_mib(ours, x),
            )
        # the aux-loss scores (fp32 logits)
        x = torch.randn(tokens, experts, device=device, requires_grad=True)
        grad = torch.randn(tokens, experts, device=device)
        sf = spec["score_function"]

        def aux_theirs(t, sf=sf, topk=topk):
            return megatron_aux(t, topk, sf)[1]

        def aux_ours(t, sf=sf, topk=topk):
            with common.users_backend():
                return aux_loss_scores(t, topk, sf, sigmoid_in_fp32=layout.aux_sigmoid_in_fp32)[1]

        ours_s = common.median_seconds(_step(aux_ours, x, grad), args.repeats, WARMUP, label="ours")
        eager_s = common.median_seconds(_step(aux_theirs, x, grad), args.repeats, WARMUP, label="megatron")
        compiled_s = None
        if can_compile:
            torch._dynamo.reset()
            compiled = torch.compile(aux_theirs)
            compiled_s = common.median_seconds(
                _step(compiled, x, grad), args.repeats, WARMUP, label="megatron_compiled"
            )
        results.add(
            op=f"aux-loss scores {case}",
            dtype="float32",
            shape=f"{tokens}x{experts} top{topk}",
            megatron_eager_ms=eager_s * 1e3,
            megatron_compiled_ms=None if compiled_s is None else compiled_s * 1e3,
            ours_ms=ours_s * 1e3,
            vs_eager=eager_s / ours_s,
            vs_compiled=None if compiled_s is None else compiled_s / ours_s,
            megatron_saved_MiB=_saved_mib(aux_theirs, x),
            ours_saved_MiB=_saved_mib(aux_ours, x),
        )


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    results = common.Results("moe_router")
    run(args, results)
    results.print_table()
    results.write_json(args.json)


if __name__ == "__main__":
    main()
