"""Runs for test_all_features_together.py in spawned gloo processes (must be importable)."""

from __future__ import annotations

from mindspeed_like.registry import all_features
from mindspeed_like.testing.parity import SEED

STEPS = 10
BF16_ONLY = {"reuse-fp32-param": "it shares bf16 parameters with their fp32 masters: an fp32 model has none"}
"""Accelerations switched on only in the bf16 runs, and why."""
EXERCISED_ELSEWHERE: dict[str, str] = {
    "context-parallel": "tests/features/context_parallel/test_context_parallel_gpt.py (CP=2 with fused RoPE and "
    "flash attention; TP=2+SP x CP=2): it acts only at megatron's context_parallel_size > 1",
    "moe-alltoall-overlap": "tests/features/moe_alltoall_overlap/test_moe_alltoall_overlap_distributed.py (EP=2, "
    "stacked with grouped GEMM): it acts only at expert_model_parallel_size > 1 with the alltoall dispatcher, and "
    "these runs are TP=2 with EP=1 (strict would turn its said-once fallback into an error)",
    "moe-zero-memory": "tests/features/moe_zero_memory/test_moe_zero_memory.py (EP=1: the experts call recomputed "
    "whole, with recompute-activation-function) and tests/features/moe_alltoall_overlap/"
    "test_moe_alltoall_overlap_distributed.py (EP=2: per chunk inside moe-alltoall-overlap's pipeline)",
    "fsdp2-config": "tests/fsdp/test_fsdp2_config.py (megatron's torch-FSDP2 wrapper, DP=2 and HSDP over 4): it "
    "acts only on --use-torch-fsdp2 and needs a YAML file, and these runs are TP=2 under megatron's DDP",
}
"""Accelerations the shared TP=2 runs cannot exercise (megatron's own config switches them on, or
they act only under a parallelism these runs do not have), and the test that runs them with
others. test_every_acceleration_is_exercised fails on an acceleration that is in neither the
shared runs nor this table."""
SETTINGS = {"tiled_tp_overlap_chunks": 2}
"""Non-switch settings of the "on" runs (two tiles: the smallest that overlaps anything)."""


def accelerations() -> list:
    """Every registered feature of kind "feature" (built-in and plugin), read from the registry:
    a new acceleration with a ``switch_on`` joins the shared runs without editing this file."""
    return [f for f in all_features() if f.kind == "feature"]


def acts_with_installed_megatron(feature) -> bool:
    """Whether switching ``feature`` on changes anything with the installed megatron-core: it has a
    patch whose declared versions include it, or an ``activate``. (megatron-fsdp-lean-state has a patch on
    every release: on 0.16-0.19 its layouts, on the version lane's 0.13 the wrapper that says, once, that
    custom_fsdp has no layout; these runs build no FSDP wrapper, so it says nothing here.)"""
    from mindspeed_like.testing.declarations import declared_patches

    return feature.activate is not None or bool(declared_patches(feature.name, **feature.switch_on))


def switched_on(*, bf16: bool) -> set[str]:
    return {
        f.name
        for f in accelerations()
        if f.switch_on
        and f.name not in EXERCISED_ELSEWHERE
        and (bf16 or f.name not in BF16_ONLY)
        and acts_with_installed_megatron(f)
    }


def on_flags(*, bf16: bool) -> dict:
    """Every acceleration's ``switch_on``, under strict: a call any feature hands back to megatron
    is an error, so "on" means every call ran ours."""
    flags = dict(SETTINGS, strict=True)
    for feature in accelerations():
        if feature.name in switched_on(bf16=bf16):
            flags.update(feature.switch_on)
    return flags


def off_flags() -> dict:
    """Every boolean switch off. Non-boolean switches keep their defaults: grouped-gemm's
    ``auto`` is what makes megatron's GroupedMLP run at all on a host without the CUDA
    grouped_gemm package (its own tests compare it with SequentialMLP)."""
    return {name: False for f in accelerations() for name, value in f.switch_on.items() if isinstance(value, bool)}


def applied_features() -> set[str]:
    """The features acting now: those with applied patches, and those made of an ``activate()``
    alone (host-allocator) that ran it."""
    import mindspeed_like
    from mindspeed_like import runtime

    return {r.feature for r in mindspeed_like.report() if r.status == "applied"} | set(runtime.activated())


def _train(flags: dict, seed: int, **model_overrides) -> tuple[list[float], set[str]]:
    import mindspeed_like
    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt, train_steps

    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", **flags)
    applied = applied_features()
    init_parallel(tp=2, seed=seed)
    try:
        losses = train_steps(tiny_gpt(sequence_parallel=True, **model_overrides), STEPS, seed=seed, lr=1e-3)
    finally:
        destroy_parallel()
    return losses, applied


def all_features_tp2_sp(seed: int = SEED) -> dict:
    """TP=2+SP: every feature off vs on, dense fp32, MoE (GroupedMLP) fp32, dense bf16 with and
    without reuse-fp32-param."""
    moe = dict(num_moe_experts=4, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall")
    out = {}
    on, off = on_flags(bf16=False), off_flags()
    out["dense_off"], _ = _train(off, seed)
    out["dense_on"], out["applied"] = _train(on, seed)
    out["moe_off"], _ = _train(off, seed, **moe)
    out["moe_on"], _ = _train(on, seed, **moe)
    out["bf16_off"], _ = _train(off, seed, bf16=True)
    out["bf16_on"], _ = _train(on, seed, bf16=True)
    out["bf16_on_reuse"], applied = _train(on_flags(bf16=True), seed, bf16=True)
    out["applied_reuse"] = applied
    import mindspeed_like

    mindspeed_like.reset()
    return out
