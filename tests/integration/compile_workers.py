"""Runs for test_compile.py in spawned gloo processes (must be importable).

megatron's ``jit_fuser`` is ``torch.compile``: with compile on (the compile lane), megatron's
bias-activation and bias-dropout-add fusions are compiled graphs, and our features must
replace, wrap or sit beside them without changing the numbers. Each acceleration runs alone,
on a model it acts on, at TP=2 + sequence parallel (tp-overlap needs TP > 1), then all of
them together; the baselines are the same models with every feature off.
"""

from __future__ import annotations

from all_features_workers import BF16_ONLY, EXERCISED_ELSEWHERE, accelerations, applied_features, off_flags, on_flags

from mindspeed_like.testing.parity import SEED

STEPS = 5
JIT_FUSIONS = dict(add_bias_linear=True, bias_activation_fusion=True, bias_dropout_fusion=True)
"""megatron's jit_fuser'd paths (bias_swiglu_impl, bias_dropout_add_fused_train) switched on."""
MOE = dict(num_moe_experts=4, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall", add_bias_linear=False)
"""megatron's GroupedMLP takes no biases: the MoE model keeps the dropout-add fusion only."""
MODEL_FOR = {"grouped-gemm": "moe", **{name: "bf16" for name in BF16_ONLY}}
"""The model an acceleration acts on (dense fp32 for every other one)."""
MODELS = {"dense": JIT_FUSIONS, "moe": dict(JIT_FUSIONS, **MOE), "bf16": dict(JIT_FUSIONS, bf16=True)}


def _train(flags: dict, seed: int, model: str) -> tuple[list[float], set[str], int]:
    from torch._dynamo.utils import counters

    import mindspeed_like
    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt, train_steps

    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", **flags)
    applied = applied_features()
    init_parallel(tp=2, seed=seed)
    try:
        losses = train_steps(tiny_gpt(sequence_parallel=True, **MODELS[model]), STEPS, seed=seed, lr=1e-3)
    finally:
        destroy_parallel()
    return losses, applied, counters["stats"]["unique_graphs"]


def compile_parity(seed: int = SEED) -> dict:
    """{"baseline": {model: losses}, "graphs": compiled graphs after the baselines,
    "feature": {name: (losses, applied)}, "all": {model: (losses, applied)}}."""
    import mindspeed_like

    out: dict = {"baseline": {}, "feature": {}, "all": {}}
    for model in MODELS:
        out["baseline"][model], _, out["graphs"] = _train(off_flags(), seed, model)
    for feature in accelerations():
        if feature.switch_on and feature.name not in EXERCISED_ELSEWHERE:  # these runs are TP=2, EP=1
            flags = dict(off_flags(), strict=True, **feature.switch_on)
            losses, applied, _ = _train(flags, seed, MODEL_FOR.get(feature.name, "dense"))
            out["feature"][feature.name] = (losses, applied)
    for model in MODELS:
        losses, applied, _ = _train(on_flags(bf16=model == "bf16"), seed, model)
        out["all"][model] = (losses, applied)
    mindspeed_like.reset()
    return out
