"""grouped-gemm on the real megatron-core GPTModel: GroupedMLP (``moe_grouped_gemm=True``) with
our gmm vs SequentialMLP on identical weights, training parity over dispatchers and EP=2, the
flags, and that switching the feature off restores megatron's objects.

Tolerances:
- one forward+backward, fp32: outputs and grads rtol 1e-5 / atol 1e-6. Both modules do the
  same per-expert matmuls; only the operand layout (x @ W^T of a [out, in] weight vs x @ W of
  an [in, out] view) differs, which changes BLAS blocking, i.e. fp32 summation order.
- 10 training steps, fp32: per-step losses within 1e-5 relative (the same summation-order
  noise carried through 10 Adam steps stays ~1e-6 here).
- bf16 (10 steps): 1e-2 relative: bf16 rounding of activations/grads in a different order,
  amplified by Adam.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import mindspeed_like
from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.testing import (
    destroy_parallel,
    init_parallel,
    make_batches,
    run_distributed,
    tiny_gpt,
    train_steps,
)
from mindspeed_like.testing.moe import copy_sequential_into_grouped, sequential_to_grouped_state
from mindspeed_like.testing.npu_emulator import emulated_torch_npu
from mindspeed_like.testing.parity import SEED, rel_close
from mindspeed_like.testing.training import unwrap
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.fallback import forget_logged

# GroupedMLP and grouped_gemm_util were deleted in megatron-core 0.17: test_grouped_gemm_sequential.py
pytestmark = pytest.mark.skipif(
    megatron_core_version() is None or megatron_core_version().release >= (0, 17),
    reason="megatron-core 0.17+ has no GroupedMLP: test_grouped_gemm_sequential.py",
)

STEPS = 10
EXPERTS = 4


def _pair(ep: int = 1, **model):
    """A SequentialMLP GPT and a GroupedMLP GPT with the same weights (parallel state set up)."""
    init_parallel(ep=ep, seed=SEED)
    sequential = tiny_gpt(num_moe_experts=EXPERTS, moe_grouped_gemm=False, **model)
    grouped = tiny_gpt(num_moe_experts=EXPERTS, moe_grouped_gemm=True, **model)
    copy_sequential_into_grouped(unwrap(sequential), unwrap(grouped), EXPERTS // ep)
    return sequential, grouped


def test_weight_mapping_matches_megatrons_views():
    """Expert e of SequentialMLP lands where GroupedMLP's forward views it: w1[e] = fc1_e.W^T."""
    fc1 = {e: torch.randn(6, 4) for e in range(3)}  # [2*ffn, hidden], ffn 3
    fc2 = {e: torch.randn(4, 3) for e in range(3)}  # [hidden, ffn]
    state = {
        f"l.mlp.experts.local_experts.{e}.linear_fc{i}.weight": w[e] for e in range(3) for i, w in ((1, fc1), (2, fc2))
    }
    state["l.other.weight"] = torch.ones(2)
    mapped = sequential_to_grouped_state(state, 3)
    assert mapped.keys() == {"l.mlp.experts.weight1", "l.mlp.experts.weight2", "l.other.weight"}
    w1 = mapped["l.mlp.experts.weight1"]
    w2 = mapped["l.mlp.experts.weight2"]
    assert w1.shape == (4, 18) and w2.shape == (9, 4)  # megatron's parameter shapes
    for e in range(3):
        torch.testing.assert_close(w1.view(3, 4, -1)[e], fc1[e].t(), rtol=0, atol=0)
        torch.testing.assert_close(w2.view(3, -1, 4)[e], fc2[e].t(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="expected experts"):
        sequential_to_grouped_state({k: v for k, v in state.items() if ".1." not in k}, 3)


def _forward_backward(model, tokens):
    gpt = unwrap(model)
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    loss = model(tokens, position_ids, None, labels=tokens)
    loss.float().mean().backward()
    return loss.detach(), {n: p.grad if p.grad is not None else p.main_grad for n, p in gpt.named_parameters()}


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_grouped_mlp_matches_sequential_outputs_and_grads(cpu_config, dispatcher):
    cpu_config()
    sequential, grouped = _pair(moe_token_dispatcher_type=dispatcher)
    assert type(unwrap(grouped).decoder.layers[0].mlp.experts).__name__ == "GroupedMLP"
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    loss_s, grads_s = _forward_backward(sequential, tokens)
    loss_g, grads_g = _forward_backward(grouped, tokens)
    torch.testing.assert_close(loss_g, loss_s, rtol=1e-5, atol=1e-6)
    expected = sequential_to_grouped_state(grads_s, EXPERTS)
    assert expected.keys() == grads_g.keys()
    for name, grad in grads_g.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)
        if name.endswith(("weight1", "weight2")):
            assert torch.count_nonzero(grad) > 0


def test_gmm_route_is_ours_and_npu_path_runs_in_gpt(cpu_config):
    """GroupedMLP calls our op; with the npu backend forced, the GPT step goes through the
    emulated npu_grouped_matmul (2 forward + 4 backward calls per layer) with the same loss."""
    from mindspeed_like.kernels.backend import force_backend

    cpu_config()
    sequential, grouped = _pair()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(4))
    loss_s, _ = _forward_backward(sequential, tokens)
    with emulated_torch_npu() as npu, force_backend("npu"):
        loss_g, grads = _forward_backward(grouped, tokens)
    assert npu.calls["npu_grouped_matmul"] == 6 * 2
    torch.testing.assert_close(loss_g, loss_s, rtol=1e-5, atol=1e-6)
    assert all(torch.count_nonzero(g) > 0 for n, g in grads.items() if n.endswith("weight1"))


def _train_pair(steps=STEPS, ep=1, **model):
    """Both models trained on one fixed batch (so the loss must fall if expert grads flow)."""
    sequential, grouped = _pair(ep=ep, **model)
    data = make_batches(1, 2, 32, 256, SEED)[0]
    base = train_steps(sequential, steps, seed=SEED, data=data)
    ours = train_steps(grouped, steps, seed=SEED, data=data)
    return base, ours


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_gpt_trains_like_sequential_fp32(cpu_config, dispatcher):
    cpu_config()
    base, ours = _train_pair(moe_token_dispatcher_type=dispatcher)
    assert rel_close(ours, base, 1e-5), (ours, base)
    assert ours[-1] < ours[0]


@pytest.mark.slow
def test_gpt_trains_like_sequential_bf16(cpu_config):
    cpu_config()
    base, ours = _train_pair(bf16=True)
    assert rel_close(ours, base, 1e-2), (ours, base)


@pytest.mark.parametrize("flags", [{}, {"gemm_gradient_accumulation_fusion": True}], ids=["default", "required"])
def test_gemm_gradient_accumulation_fusion_parity(cpu_config, monkeypatch, flags):
    """Under megatron's DDP the expert weight grads go into main_grad straight from the kernel (by
    default, and with the flag that requires it; DDP's hook skips the dummy .grad): the same
    training as megatron's unfused gradient (--no-gemm-gradient-accumulation-fusion)."""
    from mindspeed_like.kernels import grouped_gemm as kernel

    fused_calls = []
    real = kernel._accumulate_grad_b
    monkeypatch.setattr(kernel, "_accumulate_grad_b", lambda *a: fused_calls.append(1) or real(*a))
    cpu_config(no_gemm_gradient_accumulation_fusion=True)
    base, unfused = _train_pair(moe_token_dispatcher_type="alltoall")
    assert fused_calls == []
    cpu_config(**flags)
    _, fused = _train_pair(moe_token_dispatcher_type="alltoall")
    assert len(fused_calls) == 2 * 2 * STEPS  # weight1 and weight2, 2 layers, every step
    assert rel_close(fused, unfused, 1e-5), (fused, unfused)
    assert rel_close(fused, base, 1e-5)


def test_fusion_flags_contradict():
    from mindspeed_like.toolkit.errors import ConfigError

    with pytest.raises(ConfigError, match="contradict"):
        mindspeed_like.configure(gemm_gradient_accumulation_fusion=True, no_gemm_gradient_accumulation_fusion=True)
    mindspeed_like.reset()


def test_moe_act_recompute_parity(cpu_config):
    """GroupedMLP's moe_act recompute (CheckpointWithoutOutput around the activation, only
    valid with moe_grouped_gemm) trains like SequentialMLP without recompute."""
    cpu_config()
    sequential, _ = _pair()
    recomputed = tiny_gpt(
        num_moe_experts=EXPERTS, moe_grouped_gemm=True, recompute_granularity="selective", recompute_modules=["moe_act"]
    )
    assert unwrap(recomputed).decoder.layers[0].mlp.experts.activation_recompute
    copy_sequential_into_grouped(unwrap(sequential), unwrap(recomputed), EXPERTS)
    data = make_batches(1, 2, 32, 256, SEED)[0]
    base = train_steps(sequential, STEPS, seed=SEED, data=data)
    ours = train_steps(recomputed, STEPS, seed=SEED, data=data)
    assert rel_close(ours, base, 1e-5), (ours, base)


def test_gpu_style_init_builds_on_cpu(cpu_config):
    """Without use_cpu_initialization GroupedMLP puts its weights on torch.cuda.current_device();
    on a CPU host its constructor runs as the host twin and the model trains."""
    cpu_config()
    init_parallel(seed=SEED)
    model = tiny_gpt(num_moe_experts=EXPERTS, moe_grouped_gemm=True, use_cpu_initialization=False)
    experts = unwrap(model).decoder.layers[0].mlp.experts
    assert experts.weight1.device.type == "cpu" and experts.weight1.std() > 0
    losses = train_steps(model, 3, seed=SEED, data=make_batches(1, 2, 32, 256, SEED)[0])
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


# ---------------------------------------------------------------- flags and reversibility


def test_on_by_default_and_off_restores_megatron(cpu_config):
    import megatron.core.transformer.moe.experts as experts
    import megatron.core.transformer.moe.grouped_gemm_util as gg

    from mindspeed_like.features import grouped_gemm as feature

    cpu_config(grouped_gemm="off")
    original_assert, original_forward = gg.assert_grouped_gemm_is_available, experts.GroupedMLP.__dict__["forward"]
    assert gg.ops is None and not gg.grouped_gemm_is_available()
    init_parallel(seed=SEED)
    with pytest.raises(AssertionError, match="Grouped GEMM is not available"):  # megatron's own failure
        tiny_gpt(num_moe_experts=EXPERTS, moe_grouped_gemm=True)
    cpu_config()  # default: auto, and the CUDA package is absent here
    assert isinstance(gg.ops, feature.GroupedGemmOps) and experts.gg is gg
    assert experts.GroupedMLP.__dict__["forward"] is not original_forward
    tiny_gpt(num_moe_experts=EXPERTS, moe_grouped_gemm=True)
    mindspeed_like.configure(grouped_gemm="off")
    assert gg.ops is None and gg.assert_grouped_gemm_is_available is original_assert
    assert experts.GroupedMLP.__dict__["forward"] is original_forward


def test_installed_package_is_kept_unless_asked(cpu_config, monkeypatch):
    import megatron.core.transformer.moe.grouped_gemm_util as gg

    from mindspeed_like.features import grouped_gemm as feature

    monkeypatch.setattr(feature, "grouped_gemm_package_installed", lambda: True)
    cpu_config()
    assert gg.ops is None  # auto: megatron's own (here: the would-be package) stays in charge
    cpu_config(grouped_gemm="on")
    assert isinstance(gg.ops, feature.GroupedGemmOps)
    with pytest.raises(ConfigError, match="--grouped-gemm on"):
        cpu_config(gemm_gradient_accumulation_fusion=True)
    with pytest.raises(ConfigError, match="--grouped-gemm off"):
        cpu_config(grouped_gemm="off", gemm_gradient_accumulation_fusion=True)


def test_a_single_file_module_named_grouped_gemm_is_not_the_package(tmp_path, monkeypatch):
    from mindspeed_like.features import grouped_gemm as feature

    (tmp_path / "grouped_gemm.py").write_text("ops = None\n")  # e.g. benchmarks/grouped_gemm.py
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not feature.grouped_gemm_package_installed()
    (tmp_path / "grouped_gemm.py").unlink()
    (tmp_path / "grouped_gemm").mkdir()
    (tmp_path / "grouped_gemm" / "__init__.py").write_text("")
    assert feature.grouped_gemm_package_installed()


def test_fusion_without_main_grad_logs_once_or_fails_strict(cpu_config, caplog):
    from mindspeed_like.features import grouped_gemm as feature

    cpu_config(gemm_gradient_accumulation_fusion=True)
    forget_logged()
    init_parallel(seed=SEED)
    model = tiny_gpt(num_moe_experts=EXPERTS, moe_grouped_gemm=True)
    tokens = torch.randint(0, 256, (2, 32))
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        _forward_backward(model, tokens)
        _forward_backward(model, tokens)
    assert [r.getMessage() for r in caplog.records].count(
        next(r.getMessage() for r in caplog.records if "main_grad" in r.getMessage())
    ) == 1
    mindspeed_like.configure(strict=True)
    with pytest.raises(feature.GroupedGemmUnsupported, match="main_grad"):
        _forward_backward(model, tokens)


def test_more_than_1024_experts_on_npu_fall_back_to_the_loop(cpu_config, caplog):
    """npu_grouped_matmul takes at most 1024 groups: more experts use the portable loop, logged
    once; under --strict that is an error."""
    import megatron.core.transformer.moe.grouped_gemm_util as gg

    from mindspeed_like.features import grouped_gemm as feature
    from mindspeed_like.kernels.backend import force_backend

    cpu_config()
    forget_logged()
    counts = torch.zeros(1025, dtype=torch.int64)
    counts[::100] = 2
    a, b = torch.randn(int(counts.sum()), 4), torch.randn(1025, 4, 3)
    with emulated_torch_npu() as npu, force_backend("npu"), caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        out = gg.ops.gmm(a, b, counts)
        gg.ops.gmm(a, b, counts)
    assert npu.calls["npu_grouped_matmul"] == 0
    assert sum("at most 1024 groups" in r.getMessage() for r in caplog.records) == 1
    experts = torch.repeat_interleave(torch.arange(1025), counts)
    torch.testing.assert_close(out, torch.einsum("tk,tkn->tn", a, b[experts]))
    mindspeed_like.configure(strict=True)
    with emulated_torch_npu(), force_backend("npu"), pytest.raises(feature.GroupedGemmUnsupported, match="1024"):
        gg.ops.gmm(a, b, counts)


# ---------------------------------------------------------------- EP=2 on gloo (one spawn)


def ep2_worker(seed: int = SEED) -> dict:
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    out = {}
    for dispatcher in ("alltoall", "allgather"):
        sequential, grouped = _pair(ep=2, moe_token_dispatcher_type=dispatcher)
        out[dispatcher] = (train_steps(sequential, STEPS, seed=seed), train_steps(grouped, STEPS, seed=seed))
        destroy_parallel()
    mindspeed_like.reset()
    return out


@pytest.mark.slow
def test_ep2_parity():
    ranks = run_distributed(ep2_worker, 2, SEED, timeout=300)
    for rank in ranks:
        for dispatcher, (base, ours) in rank.items():
            assert rel_close(ours, base, 1e-5), (dispatcher, ours, base)
