"""recompute-activation-function on the real megatron-core modules (CPU, fp32 unless stated).

Every comparison with the baseline is bitwise (``torch.equal``): the recompute runs the same
ops on the same inputs with the same RNG state, so there is no tolerance to state.
Saved-for-backward bytes are measured with SavedBytesMeter (saved-tensor hooks); the freed
activation stays referenced by fc2 with its storage resized to 0, so what the MLP holds
between forward and backward is the sum of the saved storages' sizes *now*
(``current_bytes``), parameters excluded (held anyway, not activation memory).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mindspeed_like
from mindspeed_like import runtime
from mindspeed_like.features.recompute_activation import mlp as ra
from mindspeed_like.features.recompute_activation.checkpoint import hook_safe_checkpoint_class
from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.testing import SavedBytesMeter, init_parallel, tiny_gpt, train_steps
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.fallback import forget_logged

# megatron-core 0.17 deleted GroupedMLP: moe_grouped_gemm builds SequentialMLP (its experts are MLPs)
HAS_GROUPED_MLP = megatron_core_version() is not None and megatron_core_version().release < (0, 17)

SEQ, BATCH, HIDDEN = 32, 2, 64
FFN = 2 * HIDDEN  # tiny_gpt default ffn_hidden_size


def _configure(on: bool, **flags) -> None:
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", recompute_activation_function=on, **flags)


def _count_checkpoints(monkeypatch) -> list:
    """Counts our CheckpointWithoutOutput constructions (one per recomputing MLP call)."""
    made: list = []
    original = ra.Recompute.checkpoint

    def counting(self):
        made.append(1)
        return original(self)

    monkeypatch.setattr(ra.Recompute, "checkpoint", counting)
    return made


def _mlp_pass(on: bool, model_kwargs: dict, flags: dict | None = None, dtype=torch.float32):
    """One MLP fwd+bwd of layer 0; returns output, input grad, param grads, bytes held."""
    _configure(on, **(flags or {}))
    init_parallel(seed=1234)
    model = tiny_gpt(wrap_float16=False, **model_kwargs)
    if dtype != torch.float32:
        model = model.to(dtype)
    mlp = model.decoder.layers[0].mlp
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(7)).to(dtype).requires_grad_()
    with SavedBytesMeter() as meter:
        out, bias = mlp(x)
    held = meter.current_bytes(exclude=model.parameters())
    loss = out.float().pow(2).sum() + (bias.float().sum() if bias is not None else 0.0)
    loss.backward()
    grads = {name: p.grad for name, p in mlp.named_parameters()}
    return out.detach(), x.grad, grads, held


def _assert_same(a, b) -> None:
    assert torch.equal(a[0], b[0]), "MLP outputs differ"
    assert torch.equal(a[1], b[1]), "input gradients differ"
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        assert torch.equal(a[2][name], b[2][name]), f"gradient of {name} differs"


def _inline_glu_units() -> int:
    """Megatron's inline GLU keeps ``silu(gate)`` and, where it has ``glu_linear_offset`` (0.15+),
    ``up + offset`` too, each the output's size: freed as well, so 3 (else 2) outputs."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    return 3 if "glu_linear_offset" in names else 2


SILU, GELU = F.silu, F.gelu
GLU = _inline_glu_units()
# name -> (TransformerConfig overrides, extra flags, saved bytes dropped in units of the
# activation output's size; GLU for megatron's inline GLU, see _inline_glu_units).
CASES = {
    "swiglu": (dict(), {}, GLU),
    "swiglu-bias": (dict(add_bias_linear=True), {}, GLU),
    "swiglu-bias-fusion": (dict(add_bias_linear=True, bias_activation_fusion=True), {}, 1),
    "swiglu-fusion": (dict(bias_activation_fusion=True), {}, 1),
    "swiglu-fused-kernel": (dict(), {"use_fused_swiglu": True}, 1),
    "geglu": (dict(activation_func=GELU), {}, GLU),
    "geglu-bias-fusion": (dict(activation_func=GELU, add_bias_linear=True, bias_activation_fusion=True), {}, 1),
    "gelu": (dict(gated_linear_unit=False), {}, 1),
    "gelu-bias": (dict(gated_linear_unit=False, add_bias_linear=True), {}, 1),
    "gelu-bias-fusion": (dict(gated_linear_unit=False, add_bias_linear=True, bias_activation_fusion=True), {}, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dense_mlp_bitwise_and_frees_the_activation_output(adapter, case):
    model_kwargs, flags, units = CASES[case]
    base = _mlp_pass(False, model_kwargs, flags)
    ours = _mlp_pass(True, model_kwargs, flags)
    _assert_same(base, ours)
    output_bytes = SEQ * BATCH * FFN * 4
    assert base[3] - ours[3] == units * output_bytes


def test_dense_mlp_bf16_bitwise(adapter):
    kwargs = dict(bias_activation_fusion=True)
    base = _mlp_pass(False, kwargs, dtype=torch.bfloat16)
    ours = _mlp_pass(True, kwargs, dtype=torch.bfloat16)
    _assert_same(base, ours)
    assert base[3] - ours[3] == SEQ * BATCH * FFN * 2


def test_fused_swiglu_kernel_runs_inside_the_recompute(adapter, monkeypatch):
    from mindspeed_like.kernels import swiglu as kernel

    calls: list = []
    original = kernel.swiglu
    monkeypatch.setattr(kernel, "swiglu", lambda *a, **k: calls.append(1) or original(*a, **k))
    _mlp_pass(False, {}, {"use_fused_swiglu": True})
    assert len(calls) == 1
    calls.clear()
    _mlp_pass(True, {}, {"use_fused_swiglu": True})
    assert len(calls) == 2  # forward, then the recompute in backward


def test_activation_aliasing_its_input_is_not_freed(adapter, caplog):
    """An activation returning its input (a view) must not free fc1's output."""
    base = _mlp_pass(False, dict(gated_linear_unit=False, activation_func=lambda x: x))
    with caplog.at_level("WARNING"):
        ours = _mlp_pass(True, dict(gated_linear_unit=False, activation_func=lambda x: x))
    _assert_same(base, ours)
    assert "shares storage" in caplog.text


def test_an_expert_with_no_tokens_is_not_a_fallback(adapter, caplog):
    """A routed expert that got no tokens sees 0-row tensors, whose storages all report data
    pointer 0: that is not an activation sharing fc1's storage, and must not be logged as one."""
    _configure(True)
    init_parallel(seed=1234)
    mlp = tiny_gpt(wrap_float16=False).decoder.layers[0].mlp
    x = torch.zeros(0, BATCH, HIDDEN, requires_grad=True)
    with caplog.at_level("WARNING"):
        out, _ = mlp(x)
        out.sum().backward()
    assert out.shape == (0, BATCH, HIDDEN) and x.grad.shape == x.shape
    assert all(p.grad is not None and not p.grad.any() for p in mlp.parameters())
    assert "fell back" not in caplog.text and "shares storage" not in caplog.text


def _gpt_grads(on: bool, flags: dict | None = None, *, meter: bool = True, **model_kwargs):
    """One fwd+bwd of the whole GPTModel (no DDP): loss, every parameter's gradient, and the
    bytes held for backward (None with ``meter=False``: no saved-tensor hooks)."""
    _configure(on, **(flags or {}))
    init_parallel(seed=1234)
    model = tiny_gpt(**model_kwargs)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    held = None
    if meter:
        with SavedBytesMeter() as saved:
            loss = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).float().mean()
        held = saved.current_bytes(exclude=model.parameters())
    else:
        loss = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, held


def _assert_same_grads(a, b) -> None:
    assert torch.equal(a[0], b[0]), f"loss {a[0].item()} != {b[0].item()}"
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        ga, gb = a[1][name], b[1][name]
        assert (ga is None) == (gb is None) and (ga is None or torch.equal(ga, gb)), f"grad of {name} differs"


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_gpt_training_bitwise(adapter, dropout):
    """10 training steps, fp32: losses and final weights bitwise equal; with dropout the
    recompute restores the RNG state so the stream consumed afterwards is unchanged."""
    kwargs = dict(hidden_dropout=dropout, attention_dropout=dropout)
    runs = []
    for on in (False, True):
        base_grads = _gpt_grads(on, **kwargs)
        _configure(on)
        init_parallel(seed=1234)
        model = tiny_gpt(**kwargs)
        losses = train_steps(model, 10, seed=1234)
        runs.append((base_grads, losses, [p.detach().clone() for p in model.parameters()]))
    (grads_off, losses_off, weights_off), (grads_on, losses_on, weights_on) = runs
    _assert_same_grads(grads_off, grads_on)
    assert losses_off == losses_on
    assert all(torch.equal(a, b) for a, b in zip(weights_off, weights_on))
    per_layer = SEQ * BATCH * FFN * 4 * GLU  # inline swiglu
    assert grads_off[2] - grads_on[2] == 2 * per_layer


@pytest.mark.parametrize("limit,recomputed", [(2, 2), (0, 0), (5, 3)])
def test_num_layers_selects_first_layers_of_the_stage(adapter, monkeypatch, limit, recomputed):
    made = _count_checkpoints(monkeypatch)
    base = _gpt_grads(False, num_layers=3, bias_activation_fusion=True)
    ours = _gpt_grads(
        True, {"recompute_activation_function_num_layers": limit}, num_layers=3, bias_activation_fusion=True
    )
    _assert_same_grads(base, ours)
    assert len(made) == recomputed
    assert base[2] - ours[2] == recomputed * SEQ * BATCH * FFN * 4


def test_layers_are_tagged_with_their_number_in_the_stage(adapter):
    _configure(True, recompute_activation_function_num_layers=1)
    init_parallel(seed=1234)
    model = tiny_gpt(num_layers=3)
    numbers = [getattr(layer.mlp, ra.STAGE_LAYER_ATTR) for layer in model.decoder.layers]
    assert numbers == [1, 2, 3]


@pytest.mark.parametrize(
    "recompute,ours_made",
    [
        (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), 0),
        (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1), 1),
        (dict(recompute_granularity="selective", recompute_modules=["mlp"]), 0),
        (dict(recompute_granularity="selective", recompute_modules=["layernorm"]), 2),
        (dict(recompute_granularity="selective", recompute_modules=["core_attn"]), 2),
    ],
    ids=["full-uniform", "full-block-1-of-2", "selective-mlp", "selective-layernorm", "selective-core-attn"],
)
def test_composes_with_megatron_recompute(adapter, monkeypatch, recompute, ours_made):
    """No double recompute: an MLP already under megatron's recompute is left alone (its
    forward runs without grad, its re-forward inside backward); bitwise equal losses/grads."""
    made = _count_checkpoints(monkeypatch)
    kwargs = dict(hidden_dropout=0.1, **recompute)
    base = _gpt_grads(False, **kwargs)
    ours = _gpt_grads(True, **kwargs)
    _assert_same_grads(base, ours)
    assert len(made) == ours_made
    assert base[2] - ours[2] == ours_made * SEQ * BATCH * FFN * 4 * GLU


def test_composes_with_the_fused_kernels(adapter):
    flags = dict(use_fused_swiglu=True, use_fused_rmsnorm=True, use_fused_rotary_pos_emb=True)
    base = _gpt_grads(False, flags)
    ours = _gpt_grads(True, flags)
    _assert_same_grads(base, ours)
    assert base[2] - ours[2] == 2 * SEQ * BATCH * FFN * 4


def test_sequential_mlp_experts(adapter, monkeypatch):
    """SequentialMLP's experts are MLPs called with the routing probs as per_token_scale
    (megatron's ``moe_act`` covers only grouped experts). With the fused weighted swiglu the
    experts' activation outputs (routed tokens x ffn in total) are exactly what is freed."""
    made = _count_checkpoints(monkeypatch)
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=False, bias_activation_fusion=True)
    base = _gpt_grads(False, **moe)
    made.clear()
    ours = _gpt_grads(True, **moe)
    _assert_same_grads(base, ours)
    routed = SEQ * BATCH * 2  # tokens x topk, per layer
    assert base[2] - ours[2] == 2 * routed * FFN * 4
    assert len(made) == 2 * 4  # every expert of both layers


@pytest.fixture
def grouped_gemm_op():
    """GroupedMLP needs a ``gmm``: the grouped-gemm feature (on by default where the CUDA
    ``grouped_gemm`` package is absent) provides it."""

    assert "grouped-gemm" in runtime.enabled_feature_names(runtime.current_config())


@pytest.mark.skipif(HAS_GROUPED_MLP, reason="megatron-core < 0.17 builds GroupedMLP: test_grouped_mlp_experts")
def test_grouped_gemm_experts_on_sequential_mlp(adapter, grouped_gemm_op, monkeypatch):
    """megatron-core 0.17+: moe_grouped_gemm builds SequentialMLP and grouped-gemm runs all its
    experts as one call of the lead expert's MLP.forward (grouped linears): the recompute wraps
    that one call per layer, bitwise equal to the baseline, and frees every routed token's
    activation output (as many bytes as with megatron's per-expert loop)."""
    made = _count_checkpoints(monkeypatch)
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True, bias_activation_fusion=True)
    base = _gpt_grads(False, **moe)
    made.clear()
    ours = _gpt_grads(True, **moe)
    _assert_same_grads(base, ours)
    routed = SEQ * BATCH * 2  # tokens x topk, per layer
    assert base[2] - ours[2] == 2 * routed * FFN * 4
    assert len(made) == 2  # one grouped expert call per layer


@pytest.mark.skipif(not HAS_GROUPED_MLP, reason="megatron-core 0.17 deleted GroupedMLP")
def test_grouped_mlp_experts(adapter, grouped_gemm_op, monkeypatch, caplog):
    """GroupedMLP (bf16, as megatron requires): the feature switches on megatron's own
    moe_act recompute: bitwise equal to the baseline, holds exactly what moe_act holds,
    and with moe_act already on nothing is added (no double recompute).

    megatron-core < 0.16's moe_act loses gradients under saved-tensor hooks (the byte meter
    uses them), so there the bytes are not measured and the meter's run must fall back."""
    from megatron.core import tensor_parallel

    made: list = []
    original = tensor_parallel.CheckpointWithoutOutput.checkpoint

    def counting(self, *args):
        made.append(1)
        return original(self, *args)

    monkeypatch.setattr(tensor_parallel.CheckpointWithoutOutput, "checkpoint", counting)
    hook_safe = runtime.current_context().megatron_at_least("0.16")  # megatron's own class keeps grads
    moe = dict(bf16=True, num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True, meter=hook_safe)
    moe_act = dict(recompute_granularity="selective", recompute_modules=["moe_act"])
    base = _gpt_grads(False, **moe)
    assert len(made) == 0
    ours = _gpt_grads(True, **moe)
    assert len(made) == 2
    megatron_only = _gpt_grads(False, **moe, **moe_act)
    both = _gpt_grads(True, **moe, **moe_act)
    assert len(made) == 6  # 2 + 2 + 2: never two per layer
    _assert_same_grads(base, ours)
    _assert_same_grads(base, megatron_only)
    _assert_same_grads(base, both)
    if hook_safe:
        routed = SEQ * BATCH * 2
        assert base[2] - ours[2] >= 2 * routed * FFN * 2  # at least the bf16 activation outputs
        assert ours[2] == megatron_only[2] == both[2]
    else:
        forget_logged()
        made.clear()
        with caplog.at_level("WARNING"):
            _gpt_grads(True, **dict(moe, meter=True))
        assert len(made) == 0 and "saved-tensor hooks" in caplog.text


def test_flags_and_errors(adapter):
    config = mindspeed_like.configure(recompute_activation_function=True, recompute_activation_function_num_layers=2)
    assert config.recompute_activation_function_num_layers == 2
    mindspeed_like.reset()
    with pytest.raises(ConfigError, match="--recompute-activation-function is not"):
        mindspeed_like.configure(device="cpu", recompute_activation_function_num_layers=2)
    mindspeed_like.reset()
    with pytest.raises(ConfigError, match=">= 0"):
        mindspeed_like.configure(
            device="cpu", recompute_activation_function=True, recompute_activation_function_num_layers=-1
        )
    mindspeed_like.reset()
    with pytest.raises(ConfigError, match="expected int"):
        mindspeed_like.configure(
            device="cpu", recompute_activation_function=True, recompute_activation_function_num_layers="2"
        )


def test_flags_from_the_command_line():
    from mindspeed_like import config as config_mod
    from mindspeed_like.runtime import flags

    argv = ["--recompute-activation-function", "--recompute-activation-function-num-layers", "3", "--lr", "1e-4"]
    config = config_mod.resolve(flags(), argv=argv)
    assert config.recompute_activation_function is True
    assert config.recompute_activation_function_num_layers == 3


def test_switching_off_restores_megatron(adapter):
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe import experts
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def chain(obj):
        """The wrapper objects down to megatron's function (outer first), then that function."""
        links = []
        while hasattr(obj, "__wrapped__"):
            links.append(obj._self_wrapper)
            obj = obj.__wrapped__
        return links, obj

    grouped = getattr(experts, "GroupedMLP", None)  # deleted in megatron-core 0.17
    targets = ((MLP, "forward"), (TransformerLayer, "__init__")) + (((grouped, "forward"),) if grouped else ())
    before = [chain(owner.__dict__[name]) for owner, name in targets]
    mindspeed_like.configure(recompute_activation_function=True)
    during = [chain(owner.__dict__[name]) for owner, name in targets]
    for (links, raw), (new_links, new_raw) in zip(before, during):
        assert new_raw is raw and len(new_links) == len(links) + 1
    if grouped is not None:  # GroupedMLP.forward: grouped-gemm (on by default here) is declared to sit above us
        assert during[2][0][0] is before[2][0][0] and type(during[2][0][1]).__name__ == "GroupedMLPForward"
    mindspeed_like.configure(recompute_activation_function=False)
    after = [chain(owner.__dict__[name]) for owner, name in targets]
    assert after == before  # the same wrappers (none of ours) over the same megatron functions
    assert MLP.__dict__["forward"] is before[0][1] and TransformerLayer.__dict__["__init__"] is before[1][1]


def test_unknown_layer_number_falls_back_or_errors_under_strict(adapter, caplog):
    """An MLP built before the feature was on has no recorded layer number: with a layer
    selection it keeps its activation (one log line), or raises under strict."""
    init_parallel(seed=1234)
    model = tiny_gpt()
    mlp = model.decoder.layers[0].mlp
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    mindspeed_like.configure(recompute_activation_function=True, recompute_activation_function_num_layers=1)
    forget_logged()
    with caplog.at_level("WARNING"):
        mlp(x)[0].sum().backward()
        mlp(x)[0].sum().backward()
    assert caplog.text.count("layer number is unknown") == 1
    mindspeed_like.configure(strict=True)
    with pytest.raises(ra.RecomputeActivationUnsupported, match="layer number is unknown"):
        mlp(x)


@pytest.mark.parametrize("case", ["swiglu", "gelu-bias", "swiglu-fused-kernel"])
def test_hook_safe_checkpoint_for_megatron_before_0_16(adapter, monkeypatch, case):
    """megatron-core 0.13-0.15's CheckpointWithoutOutput loses the inputs' gradients under
    saved-tensor hooks (SavedBytesMeter is one); the subclass used there is exercised here on
    any version, under the meter's hooks: bitwise equal, same bytes freed."""
    monkeypatch.setattr(ra.Recompute, "checkpoint", lambda self: hook_safe_checkpoint_class()())
    model_kwargs, flags, units = CASES[case]
    _configure(True)
    base = _mlp_pass(False, model_kwargs, flags)
    ours = _mlp_pass(True, model_kwargs, flags)
    _assert_same(base, ours)
    assert base[3] - ours[3] == units * SEQ * BATCH * FFN * 4


def test_meter_keeps_a_retired_storage_when_its_address_is_reused():
    """SavedBytesMeter keys storages by address; after a feature frees a saved storage the
    allocator may hand that address to a new one. Two storages over one buffer
    (``torch.frombuffer``) stand in for that: both are counted, neither overwrites the other."""
    buffer = bytearray(4096)
    first = torch.frombuffer(buffer, dtype=torch.float32)
    second = torch.frombuffer(buffer, dtype=torch.float32)
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    meter = SavedBytesMeter()
    meter._pack(first)
    meter._pack(second)
    meter._pack(second)  # the same storage again: still one
    assert meter.count == 2 and meter.bytes == 2 * 4096
    assert meter.current_bytes() == 2 * 4096


def test_te_spec_grouped_experts(adapter, monkeypatch, caplog):
    """TEGroupedMLP (the TE spec's grouped experts, on the te-backend): before 0.17 the feature
    switches on megatron's moe_act recompute there too, bitwise equal to the baseline and holding
    less; from 0.17 the experts keep their activation output and the feature says so once."""
    from megatron.core import tensor_parallel

    made: list = []
    original = tensor_parallel.CheckpointWithoutOutput.checkpoint
    monkeypatch.setattr(
        tensor_parallel.CheckpointWithoutOutput, "checkpoint", lambda self, *a: made.append(1) or original(self, *a)
    )
    ctx = runtime.current_context()
    covered = not ctx.megatron_at_least("0.17")
    hook_safe = ctx.megatron_at_least("0.16")  # megatron's own class keeps grads under the meter's hooks
    moe = dict(
        transformer_impl="transformer_engine",
        num_moe_experts=4,
        moe_router_topk=2,
        moe_grouped_gemm=True,
        meter=hook_safe or not covered,
    )
    base = _gpt_grads(False, **moe)
    with caplog.at_level("WARNING"):
        ours = _gpt_grads(True, **moe)
    _assert_same_grads(base, ours)
    if covered and hook_safe:
        assert len(made) == 2 and ours[2] < base[2]
    elif not covered:
        assert len(made) == 0 and ours[2] == base[2]
        assert "TEGroupedMLP experts on megatron-core 0.17+" in caplog.text
