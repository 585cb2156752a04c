"""Runs for tests/test_all_features_together.py in spawned gloo processes (must be importable)."""

from __future__ import annotations

STEPS = 10
KERNELS_AND_OVERLAP = dict(
    use_flash_attn=True,
    use_fused_rmsnorm=True,
    use_fused_rotary_pos_emb=True,
    use_fused_swiglu=True,
    recompute_activation_function=True,
    use_tiled_tp_overlap=True,
    tiled_tp_overlap_chunks=2,
)
OFF = {name: False for name in KERNELS_AND_OVERLAP if isinstance(KERNELS_AND_OVERLAP[name], bool)}
# strict: a call any feature hands back to megatron is an error, so "on" means every call ran ours.
KERNELS_AND_OVERLAP["strict"] = True


def _train(flags: dict, seed: int, **model_overrides) -> tuple[list[float], set[str]]:
    import mindspeed_like
    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt, train_steps

    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", **flags)
    applied = {r.feature for r in mindspeed_like.report() if r.status == "applied"}
    init_parallel(tp=2, seed=seed)
    try:
        losses = train_steps(tiny_gpt(sequence_parallel=True, **model_overrides), STEPS, seed=seed, lr=1e-3)
    finally:
        destroy_parallel()
    return losses, applied


def all_features_tp2_sp(seed: int = 1234) -> dict:
    """TP=2+SP: every feature off vs on, dense fp32, MoE (GroupedMLP) fp32, dense bf16 with and
    without reuse-fp32-param."""
    moe = dict(num_moe_experts=4, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall")
    out = {}
    out["dense_off"], _ = _train(OFF, seed)
    out["dense_on"], out["applied"] = _train(KERNELS_AND_OVERLAP, seed)
    out["moe_off"], _ = _train(OFF, seed, **moe)
    out["moe_on"], _ = _train(KERNELS_AND_OVERLAP, seed, **moe)
    out["bf16_off"], _ = _train(OFF, seed, bf16=True)
    out["bf16_on"], _ = _train(KERNELS_AND_OVERLAP, seed, bf16=True)
    out["bf16_on_reuse"], applied = _train(dict(KERNELS_AND_OVERLAP, reuse_fp32_param=True), seed, bf16=True)
    out["applied_reuse"] = applied
    import mindspeed_like

    mindspeed_like.reset()
    return out
