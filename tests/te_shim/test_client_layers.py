"""te-client-module: TE's whole-layer modules (``TransformerLayer``, ``MultiheadAttention``,
``LayerNormMLP``) served on the client module's layers.

Forward and backward against a float64 reference written here in plain torch from TE's
documented math (norm -> QKV -> attention -> proj -> dropout + residual -> norm -> FC1 ->
activation -> FC2 -> dropout + residual; TE's QKV layouts, GQA head order, activations as TE's own
tests define them); parameter names and shapes as TE 2.x registers them (read from
TransformerEngine's transformer.py, attention/multi_head_attention.py, module/layernorm_mlp.py,
module/layernorm_linear.py); TE's initialisation rules; meta-device construction materialised the
way Megatron-FSDP does it (``to_empty`` then ``reset_parameters`` on each module owning the
parameters); and the refusals.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mindspeed_like.te_backend.refusals import TransformerEngineFeatureUnsupported
from mindspeed_like.te_shim import pytorch as te

F64 = torch.float64


# ------------------------------------------------------------------------------------ reference
def _ref_norm(x, weight, bias, normalization, eps, zcg):
    gamma = weight + 1 if zcg else weight
    if normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * gamma + (bias if bias is not None else 0)


_REF_ACT = {  # TE's tests/pytorch/test_numerics.py definitions
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "qgelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": torch.relu,
    "srelu": lambda x: (x > 0) * x * x,
    "silu": F.silu,
    "geglu": lambda x: F.gelu(x, approximate="tanh"),
    "glu": torch.sigmoid,
    "qgeglu": lambda x: x * torch.sigmoid(1.702 * x),
    "reglu": torch.relu,
    "sreglu": lambda x: (x > 0) * x * x,
    "swiglu": F.silu,
}


def _ref_act(name, x):
    if "glu" in name:
        a, b = x.chunk(2, dim=-1)
        return _REF_ACT[name](a) * b
    return _REF_ACT[name](x)


def _p(module, name):
    value = getattr(module, name, None)
    return None if value is None else value


def ref_mlp(m, x):
    """LayerNormMLP: fc2(act(fc1(norm(x)))) (+ biases), and the norm's output."""
    ln = _ref_norm(x, m.layer_norm_weight, m.layer_norm_bias, m.normalization, m.eps, m.zero_centered_gamma)
    h = ln @ m.fc1_weight.t() + (m.fc1_bias if m.fc1_bias is not None else 0)
    out = _ref_act(m.activation, h) @ m.fc2_weight.t()
    return out, m.fc2_bias, ln


def _ref_linear_weight(linear):
    return torch.cat([getattr(linear, n) for n in linear.weight_names])


def _ref_linear_bias(linear):
    return torch.cat([getattr(linear, n) for n in linear.bias_names]) if linear.use_bias else None


def _ref_linear(linear, x, with_bias=True):
    out = x @ _ref_linear_weight(linear).t()
    bias = _ref_linear_bias(linear)
    return out + bias if (with_bias and bias is not None) else out


def _ref_attention(q, k, v, mask_type, key_padding, scale):
    """q [b, h, sq, d], k/v [b, g, sk, d] (head h reads group h // (h/g)); key_padding [b, sk] True=masked."""
    heads, groups = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // groups, dim=1)
    v = v.repeat_interleave(heads // groups, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    sq, sk = scores.shape[-2:]
    masked = torch.zeros(sq, sk, dtype=torch.bool)
    if "causal" in mask_type:
        masked = torch.ones(sq, sk, dtype=torch.bool).triu(1)
    masked = masked.expand(q.shape[0], 1, sq, sk)
    if key_padding is not None:
        masked = masked | key_padding[:, None, None, :]
    scores = scores.masked_fill(masked, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _rope(t, freqs):
    """TE's non-interleaved RoPE on [s, b, h, d] with freqs [s, 1, 1, d]."""
    d2 = freqs.shape[-1]
    rot, rest = t[..., :d2], t[..., d2:]
    f = freqs[: t.shape[0]]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((rot * f.cos() + rotated * f.sin(), rest), dim=-1)


def ref_mha(m, x, mask_type, key_padding=None, encoder_output=None, rope=None):
    """MultiheadAttention on sbhd x [s, b, H]: returns (proj without bias, proj bias, norm output)."""
    d, heads, groups = m.hidden_size_per_attention_head, m.num_attention_heads, m.num_gqa_groups
    per = heads // groups
    ln = None
    if m.attention_type == "self":
        lin = m.layernorm_qkv if m.input_layernorm else m.qkv
        src = x
        if m.input_layernorm:
            src = ln = _ref_norm(
                x, lin.layer_norm_weight, lin.layer_norm_bias, lin.normalization, lin.eps, lin.zero_centered_gamma
            )
        mixed = _ref_linear(lin, src)
        if m.qkv_weight_interleaved:
            mixed = mixed.view(*mixed.shape[:-1], groups, per + 2, d)
            q, k, v = mixed[..., :per, :], mixed[..., per : per + 1, :], mixed[..., per + 1 :, :]
        else:
            mixed = mixed.view(*mixed.shape[:-1], per + 2, groups, d)
            q, k, v = mixed[..., :per, :, :], mixed[..., per : per + 1, :, :], mixed[..., per + 1 :, :, :]
        q, k, v = (t.reshape(t.shape[0], t.shape[1], -1, d) for t in (q, k, v))
    else:
        kv = _ref_linear(m.key_value, encoder_output)
        if m.qkv_weight_interleaved:
            kv = kv.view(*kv.shape[:-1], groups, 2 * d)
            k, v = kv[..., :d], kv[..., d:]
        else:
            kv = kv.view(*kv.shape[:-1], 2 * groups, d)
            k, v = kv[..., :groups, :], kv[..., groups:, :]
        lin = m.layernorm_query if m.input_layernorm else m.query_layer
        src = x
        if m.input_layernorm:
            src = ln = _ref_norm(
                x, lin.layer_norm_weight, lin.layer_norm_bias, lin.normalization, lin.eps, lin.zero_centered_gamma
            )
        q = _ref_linear(lin, src).view(*x.shape[:-1], heads, d)
    if rope is not None:
        q, k = _rope(q, rope), _rope(k, rope)
    to_bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
    ctx = _ref_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), mask_type, key_padding, 1 / math.sqrt(d))
    ctx = ctx.permute(2, 0, 1, 3).reshape(x.shape[0], x.shape[1], heads * d)
    return _ref_linear(m.proj, ctx, with_bias=False), _ref_linear_bias(m.proj), ln


def ref_layer(layer, x, mask_type="causal", key_padding=None, encoder_output=None, rope=None):
    """TransformerLayer in eval (no dropout), sbhd."""

    def add(out, bias, residual):
        return residual + (out + bias if bias is not None else out)

    attn, attn_bias, ln = ref_mha(layer.self_attention, x, mask_type, key_padding, rope=rope)
    if layer.parallel_attention_mlp:
        mlp, mlp_bias, _ = ref_mlp(layer.layernorm_mlp, x)
        attn = attn + attn_bias if attn_bias is not None else attn
        mlp = mlp + mlp_bias if mlp_bias is not None else mlp
        return x + attn + mlp
    residual = ln if (layer.apply_residual_connection_post_layernorm and not layer.output_layernorm) else x
    h = add(attn, attn_bias, residual)
    if layer.layer_type == "decoder":
        cross, cross_bias, ln2 = ref_mha(layer.inter_attention, h, layer.enc_dec_attn_mask_type, None, encoder_output)
        h = add(cross, cross_bias, ln2 if layer.apply_residual_connection_post_layernorm else h)
    mlp, mlp_bias, ln3 = ref_mlp(layer.layernorm_mlp, h)
    out = add(mlp, mlp_bias, ln3 if layer.apply_residual_connection_post_layernorm else h)
    if layer.output_layernorm:
        n = layer.layernorm
        out = _ref_norm(out, n.weight, n.bias, n.normalization, n.eps, n.zero_centered_gamma)
    return out


def _randomise(module, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("layer_norm_weight") or name.split(".")[-2:-1] == ["layernorm"]:
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) * 0.5 + 0.75 - (1 if "zcg" in name else 0))
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)


def _tolerance(normalization):
    """Our RMSNorm kernel computes in float32 whatever the input dtype; everything else runs in float64."""
    return 2e-5 if normalization == "RMSNorm" else 1e-9


def _check_grads(module, out, ref, inputs, ref_inputs, atol=1e-9):
    torch.testing.assert_close(out, ref, rtol=atol, atol=atol)
    grad = torch.randn_like(out)
    params = [p for _, p in module.named_parameters()]
    got = torch.autograd.grad(out, [*inputs, *params], grad, allow_unused=True)
    want = torch.autograd.grad(ref, [*ref_inputs, *params], grad, allow_unused=True)
    names = [f"input{i}" for i in range(len(inputs))] + [n for n, _ in module.named_parameters()]
    for name, g, w in zip(names, got, want):
        assert (g is None) == (w is None), name
        if g is not None:
            torch.testing.assert_close(g, w, rtol=atol * 10, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


# ------------------------------------------------------------------------------------ LayerNormMLP
@pytest.mark.parametrize("activation", list(_REF_ACT))
def test_layernorm_mlp_activations_match_reference(activation):
    m = te.LayerNormMLP(8, 12, activation=activation, params_dtype=F64, device="cpu")
    gated = "glu" in activation
    assert dict((n, tuple(p.shape)) for n, p in m.named_parameters()) == {
        "layer_norm_weight": (8,),
        "layer_norm_bias": (8,),
        "fc1_weight": (24 if gated else 12, 8),
        "fc1_bias": (24 if gated else 12,),
        "fc2_weight": (8, 12),
        "fc2_bias": (8,),
    }
    _randomise(m)
    x = torch.randn(5, 3, 8, dtype=F64, requires_grad=True)
    out, bias, ln = ref_mlp(m, x)
    _check_grads(m, m(x), out + bias, [x], [x])


@pytest.mark.parametrize(
    ("normalization", "bias", "zcg", "returns"),
    [("RMSNorm", False, True, "bias+ln"), ("LayerNorm", True, True, "ln"), ("LayerNorm", True, False, "bias")],
)
def test_layernorm_mlp_options(normalization, bias, zcg, returns):
    m = te.LayerNormMLP(
        8,
        16,
        eps=1e-6,
        bias=bias,
        normalization=normalization,
        zero_centered_gamma=zcg,
        return_bias="bias" in returns,
        return_layernorm_output="ln" in returns,
        activation="swiglu",
        params_dtype=F64,
        device="cpu",
    )
    names = {n for n, _ in m.named_parameters()}
    assert ("layer_norm_bias" in names) == (normalization == "LayerNorm")
    assert ("fc1_bias" in names) == bias and ("fc2_bias" in names) == bias
    assert torch.equal(m.layer_norm_weight, torch.zeros(8 if zcg else 0, dtype=F64)) or not zcg
    _randomise(m)
    tol = _tolerance(normalization)
    x = torch.randn(4, 2, 8, dtype=F64)
    got = m(x)
    out, fc2_bias, ln = ref_mlp(m, x)
    got = got if isinstance(got, tuple) else (got,)
    if "bias" in returns:
        assert got[1] is m.fc2_bias
        torch.testing.assert_close(got[0], out, rtol=tol, atol=tol)
    else:
        torch.testing.assert_close(got[0], out + (fc2_bias if bias else 0), rtol=tol, atol=tol)
    if "ln" in returns:
        torch.testing.assert_close(got[-1], ln, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------ names, shapes
def _shapes(module):
    return [(n, tuple(p.shape)) for n, p in module.named_parameters()]


def test_transformer_layer_parameters_as_te_registers_them():
    """TE's defaults: fuse_qkv_params=False splits layernorm_qkv's weight into query/key/value."""
    layer = te.TransformerLayer(16, 24, 4, num_gqa_groups=2, device="cpu")
    qkv = "self_attention.layernorm_qkv."
    assert _shapes(layer) == [
        (qkv + "layer_norm_weight", (16,)),
        (qkv + "layer_norm_bias", (16,)),
        (qkv + "query_weight", (16, 16)),
        (qkv + "key_weight", (8, 16)),
        (qkv + "value_weight", (8, 16)),
        (qkv + "query_bias", (16,)),
        (qkv + "key_bias", (8,)),
        (qkv + "value_bias", (8,)),
        ("self_attention.proj.weight", (16, 16)),
        ("self_attention.proj.bias", (16,)),
        ("layernorm_mlp.layer_norm_weight", (16,)),
        ("layernorm_mlp.layer_norm_bias", (16,)),
        ("layernorm_mlp.fc1_weight", (24, 16)),
        ("layernorm_mlp.fc1_bias", (24,)),
        ("layernorm_mlp.fc2_weight", (16, 24)),
        ("layernorm_mlp.fc2_bias", (16,)),
    ]
    assert not layer.self_attention.qkv_weight_interleaved  # forced off without fused QKV, as TE does
    extra = sorted(k for k in layer.state_dict() if k.endswith("_extra_state"))
    assert extra == [
        "layernorm_mlp._extra_state",
        "self_attention.core_attention._extra_state",
        "self_attention.layernorm_qkv._extra_state",
        "self_attention.proj._extra_state",
    ]
    assert isinstance(layer.self_attention, te.MultiheadAttention)
    assert isinstance(layer.layernorm_mlp, te.LayerNormMLP)
    assert isinstance(layer.self_attention.layernorm_qkv, te.LayerNormLinear)
    assert isinstance(layer.self_attention.core_attention, te.DotProductAttention)


def test_fused_rmsnorm_decoder_and_output_layernorm_names():
    layer = te.TransformerLayer(
        16, 24, 4, fuse_qkv_params=True, normalization="RMSNorm", bias=False, activation="swiglu", device="cpu"
    )
    assert _shapes(layer) == [
        ("self_attention.layernorm_qkv.layer_norm_weight", (16,)),
        ("self_attention.layernorm_qkv.weight", (48, 16)),
        ("self_attention.proj.weight", (16, 16)),
        ("layernorm_mlp.layer_norm_weight", (16,)),
        ("layernorm_mlp.fc1_weight", (48, 16)),
        ("layernorm_mlp.fc2_weight", (16, 24)),
    ]
    decoder = te.TransformerLayer(16, 24, 4, layer_type="decoder", output_layernorm=True, device="cpu")
    names = [n for n, _ in decoder.named_parameters()]
    assert names[:4] == [  # output_layernorm: no input norm, a plain qkv Linear
        "self_attention.qkv.query_weight",
        "self_attention.qkv.key_weight",
        "self_attention.qkv.value_weight",
        "self_attention.qkv.query_bias",
    ]
    assert [n for n in names if n.startswith("inter_attention.")] == [
        "inter_attention.layernorm_query.layer_norm_weight",
        "inter_attention.layernorm_query.layer_norm_bias",
        "inter_attention.layernorm_query.query_weight",
        "inter_attention.layernorm_query.query_bias",
        "inter_attention.key_value.key_weight",
        "inter_attention.key_value.value_weight",
        "inter_attention.key_value.key_bias",
        "inter_attention.key_value.value_bias",
        "inter_attention.proj.weight",
        "inter_attention.proj.bias",
    ]
    assert names[-2:] == ["layernorm.weight", "layernorm.bias"]


# ------------------------------------------------------------------------------------ numerics
LAYER_CASES = {
    "default": {},
    "fused-interleaved-gqa": {"fuse_qkv_params": True, "num_gqa_groups": 2},
    "fused-concatenated-gqa": {"fuse_qkv_params": True, "qkv_weight_interleaved": False, "num_gqa_groups": 2},
    "split-gqa-rms-zcg-nobias": {
        "num_gqa_groups": 1,
        "normalization": "RMSNorm",
        "zero_centered_gamma": True,
        "bias": False,
        "activation": "swiglu",
    },
    "bshd-no_mask-relu-kv": {
        "attn_input_format": "bshd",
        "self_attn_mask_type": "no_mask",
        "activation": "relu",
        "kv_channels": 6,
    },
    "post-ln-residual": {"apply_residual_connection_post_layernorm": True, "activation": "geglu"},
    "output-layernorm": {"output_layernorm": True, "normalization": "RMSNorm"},
    "parallel-attention-mlp": {"parallel_attention_mlp": True},
    "decoder": {"layer_type": "decoder", "num_gqa_groups": 2},
    "decoder-fused-post-ln": {
        "layer_type": "decoder",
        "fuse_qkv_params": True,
        "apply_residual_connection_post_layernorm": True,
    },
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_transformer_layer_matches_float64_reference(case):
    kwargs = LAYER_CASES[case]
    torch.manual_seed(0)
    layer = te.TransformerLayer(16, 24, 4, params_dtype=F64, device="cpu", **kwargs)
    layer.eval()  # TE's dropouts (0.1 by default) off
    _randomise(layer)
    s, b = 5, 3
    bshd = kwargs.get("attn_input_format") == "bshd"
    x = (
        torch.randn(b, s, 16, dtype=F64, requires_grad=True)
        if bshd
        else torch.randn(s, b, 16, dtype=F64, requires_grad=True)
    )
    enc = torch.randn(7, b, 16, dtype=F64, requires_grad=True) if kwargs.get("layer_type") == "decoder" else None
    out = layer(x, encoder_output=enc)
    x_sbhd = x.transpose(0, 1) if bshd else x
    ref = ref_layer(layer, x_sbhd, kwargs.get("self_attn_mask_type", "causal"), encoder_output=enc)
    ref = ref.transpose(0, 1) if bshd else ref
    inputs = [x] if enc is None else [x, enc]
    _check_grads(layer, out, ref, inputs, inputs, atol=_tolerance(kwargs.get("normalization")))


def test_padding_mask_and_rope_match_reference():
    """``self_attn_mask_type="padding"`` with TE's [b, 1, 1, s] mask (True: padded): the tokens
    that are not padding match; rotary embeddings as TE's non-interleaved RoPE."""
    layer = te.TransformerLayer(16, 24, 4, self_attn_mask_type="padding", params_dtype=F64, device="cpu").eval()
    _randomise(layer)
    s, b = 6, 2
    x = torch.randn(s, b, 16, dtype=F64)
    padded = torch.zeros(b, s, dtype=torch.bool)
    padded[0, 4:] = True
    padded[1, 5:] = True
    freqs = torch.randn(s, 1, 1, 4, dtype=F64)
    out = layer(x, attention_mask=padded[:, None, None, :], rotary_pos_emb=freqs)
    ref = ref_layer(layer, x, "no_mask", key_padding=padded, rope=freqs)
    valid = ~padded.t()  # [s, b]
    # our RoPE kernel rotates in float32 (TE's fused RoPE takes its angles in float32 too)
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-5, atol=1e-6)
    no_rope = layer(x, attention_mask=padded[:, None, None, :])  # without RoPE: float64 throughout
    ref = ref_layer(layer, x, "no_mask", key_padding=padded)
    torch.testing.assert_close(no_rope[valid], ref[valid], rtol=1e-9, atol=1e-9)
    with pytest.raises(TypeError, match="boolean"):
        layer(x, attention_mask=padded[:, None, None, :].float())


def test_dropout_and_checkpointed_attention():
    torch.manual_seed(0)
    layer = te.TransformerLayer(16, 24, 4, hidden_dropout=0.5, attention_dropout=0.0, params_dtype=F64, device="cpu")
    x = torch.randn(5, 2, 16, dtype=F64)
    layer.eval()
    evaluated = layer(x)
    torch.testing.assert_close(evaluated, ref_layer(layer, x), rtol=1e-9, atol=1e-9)
    layer.train()
    torch.manual_seed(1)
    first = layer(x)
    torch.manual_seed(1)
    again = layer(x, checkpoint_core_attention=True)
    assert not torch.allclose(first, evaluated)  # hidden dropout is applied in training
    torch.testing.assert_close(first, again, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ initialisation
def test_initialisation_follows_te():
    torch.manual_seed(0)
    layer = te.TransformerLayer(256, 512, 4, fuse_qkv_params=True, zero_centered_gamma=True, device="cpu")
    for name, p in layer.named_parameters():
        if name.endswith("layer_norm_weight"):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:  # get_default_init_method(): normal(0, 0.023)
            assert abs(p.std().item() - 0.023) < 0.002, (name, p.std().item())
    marked = te.TransformerLayer(
        8,
        8,
        2,
        init_method=lambda w: torch.nn.init.constant_(w, 1.0),
        output_layer_init_method=lambda w: torch.nn.init.constant_(w, 2.0),
        device="cpu",
    )
    qkv = marked.self_attention.layernorm_qkv
    for weight in (qkv.query_weight, qkv.key_weight, qkv.value_weight, marked.layernorm_mlp.fc1_weight):
        assert torch.equal(weight, torch.ones_like(weight))
    for weight in (marked.self_attention.proj.weight, marked.layernorm_mlp.fc2_weight):
        assert torch.equal(weight, torch.full_like(weight, 2.0))
    assert marked.layernorm_mlp.layer_norm_weight.dtype == torch.get_default_dtype()


def _materialise_as_megatron_fsdp(model, device="cpu"):
    """Megatron-FSDP's init_model_with_meta_device: each module owning meta parameters is
    ``to_empty(recurse=False)``-ed, then its ``reset_parameters()`` initialises them."""
    for module in model.modules():
        if any(p.is_meta for p in module.parameters(recurse=False)):
            assert hasattr(module, "reset_parameters"), type(module).__name__
            module.to_empty(device=device, recurse=False)
            module.reset_parameters()


@pytest.mark.parametrize("fuse_qkv_params", [False, True])
def test_meta_device_then_reset_as_megatron_fsdp(fuse_qkv_params):
    """megatron's ToyTETransformer: TransformerLayers + a Linear built on "meta"."""
    torch.manual_seed(0)
    model = torch.nn.ModuleList(
        [
            te.TransformerLayer(64, 64, 2, fuse_qkv_params=fuse_qkv_params, params_dtype=torch.float32, device="meta"),
            te.Linear(64, 64, params_dtype=torch.float32, device="meta"),
        ]
    )
    assert all(p.is_meta for p in model.parameters())
    _materialise_as_megatron_fsdp(model)
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.float32, name
        if name.endswith("layer_norm_weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert 0.015 < p.std().item() < 0.031, (name, p.std().item())
    x = torch.randn(1, 64, 64)
    model[1](model[0](x)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    # reset_parameters() on a materialised module re-initialises in place (same Parameter objects)
    weight = model[1].weight
    with torch.no_grad():
        weight.zero_()
    model[1].reset_parameters()
    assert model[1].weight is weight and weight.std() > 0
    # parameters left on meta are materialised on the host device by reset_parameters itself
    norm = te.RMSNorm(8, device="meta")
    norm.reset_parameters()
    assert norm.weight.device.type == "cpu" and torch.equal(norm.weight, torch.ones(8))


# ------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ub_tp_comm_overlap": True}, "--use-tiled-tp-overlap"),
        ({"activation": "clamped_swiglu"}, "clamped SwiGLU.*gelu, qgelu"),
        ({"qk_norm_type": "RMSNorm"}, "qk_norm_type"),
        ({"softmax_type": "learnable"}, "softmax_type"),
        ({"attn_input_format": "thd"}, "thd"),
        ({"rotary_pos_interleaved": True}, "rotary_pos_interleaved"),
        ({"fuse_qkv_params": True, "fuse_wgrad_accumulation": True}, "fuse_wgrad_accumulation"),
    ],
)
def test_transformer_layer_refusals(kwargs, match):
    with pytest.raises(TransformerEngineFeatureUnsupported, match=match):
        te.TransformerLayer(16, 16, 2, device="cpu", **kwargs)


def test_invalid_arguments_and_other_refusals():
    with pytest.raises(ValueError, match="tensor/sequence parallelism is megatron's"):
        te.TransformerLayer(16, 16, 2, tp_size=2, device="cpu")
    with pytest.raises(ValueError, match="activation 'gelu2' is not one of TE's; supported here: gelu"):
        te.TransformerLayer(16, 16, 2, activation="gelu2", device="cpu")
    with pytest.raises(ValueError, match="layer_type"):
        te.TransformerLayer(16, 16, 2, layer_type="encoder_decoder", device="cpu")
    with pytest.raises(ValueError, match="self_attn_mask_type 'diagonal'"):
        te.TransformerLayer(16, 16, 2, self_attn_mask_type="diagonal", device="cpu")
    with pytest.raises(ValueError, match="divisible by num_gqa_groups"):
        te.MultiheadAttention(16, 4, num_gqa_groups=3, device="cpu")
    with pytest.raises(ValueError, match="parallel_attention and output_layernorm"):
        te.TransformerLayer(16, 16, 2, parallel_attention_mlp=True, output_layernorm=True, device="cpu")
    with pytest.raises(TransformerEngineFeatureUnsupported, match="selective activation recompute"):
        te.LayerNormMLP(16, 16, checkpoint=True, device="cpu")
    with pytest.raises(TransformerEngineFeatureUnsupported, match="--use-tiled-tp-overlap"):
        te.LayerNormMLP(16, 16, ub_overlap_ag=True, device="cpu")
    with pytest.raises(TypeError, match="unsupported keyword arguments"):
        te.MultiheadAttention(16, 2, no_such_argument=True, device="cpu")
    layer = te.TransformerLayer(16, 16, 2, device="cpu")
    x = torch.randn(3, 1, 16)
    with pytest.raises(TransformerEngineFeatureUnsupported, match="KV-cache"):
        layer(x, inference_params=object())
    with pytest.raises(TransformerEngineFeatureUnsupported, match="attention biases"):
        layer(x, core_attention_bias_type="alibi", alibi_slopes=torch.ones(2))
    # TE's ub_* defaults of TransformerLayer (ub_overlap_ag=True, ...) act only with ub_tp_comm_overlap
    te.TransformerLayer(16, 16, 2, ub_overlap_ag=True, ub_bulk_wgrad=True, device="cpu")


def test_client_subclass_constructs_and_lazy_names():
    class ClientLayer(te.TransformerLayer):  # clients subclass TE's classes
        pass

    layer = ClientLayer(16, 16, 2, device="cpu")
    assert isinstance(layer, te.TransformerLayer)
    from mindspeed_like.te_shim import attention, layers

    assert te.TransformerLayer is layers.TransformerLayer
    assert attention.MultiheadAttention is te.MultiheadAttention
    assert {"TransformerLayer", "MultiheadAttention", "LayerNormMLP"} <= set(te.__all__)
