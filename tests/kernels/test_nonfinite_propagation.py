"""Issue 37 item 3: a fused kernel propagates non-finite values as megatron's path does.

A diverging run (``--lr 1e3``) is stopped by megatron's NaN guard (``found NaN in local grad
norm``) at the iteration where a NaN or inf first reaches a gradient. Our RMSNorm's analytic
backward once returned 0 where megatron's autograd returns NaN (``mean(x^2)`` overflowed: rstd 0
times an overflowing sum), and level 1 ran a dead model for 10 more iterations. Each kernel here
gets inputs with NaN, +-inf and overflowing values injected (into every input and into the
incoming gradient) and is compared with megatron's own op on the same inputs:

* RMSNorm, SwiGLU, RoPE compute what megatron's ops compute, in megatron's order: output and
  gradients equal megatron's bitwise, NaN and inf included (the compiled kernels too: SwiGLU's
  custom op against megatron's fused SwiGLU, both Inductor-compiled where TorchDynamo runs, both
  eager where it does not; the others' bodies eagerly);
* the rest (flash attention, linear cross-entropy, grouped GEMM, MoE permute/unpermute and
  routing) are other algorithms for the same math: the positions that are NaN or inf must be
  megatron's (exactly, or where stated the exception and why: flash attention never multiplies
  the keys a query masks out, megatron's dense ``probs @ v`` does).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mindspeed_like.kernels import compiled
from mindspeed_like.kernels.rmsnorm import _PortableRMSNorm, rms_norm_backward
from mindspeed_like.testing.parity import SEED

DTYPES = [torch.float32, torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)]  # fp16: make test-all
SPECIALS = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}


def _huge(dtype: torch.dtype) -> float:
    """A finite value whose square (and products with other such values) overflows ``dtype``."""
    return torch.finfo(dtype).max / 4


def _inject(t: torch.Tensor, value: float, where: tuple) -> torch.Tensor:
    t = t.clone()
    t[where] = value
    return t


def _grads(fn, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    """``fn(*inputs)`` and the gradients of its floating inputs for the incoming ``grad``."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach(), *[t.grad for t in leaves if t.is_floating_point()]]


def assert_bitwise(ours: list[torch.Tensor], theirs: list[torch.Tensor], case: str) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m, i=i: f"{case}, tensor {i}: {m}")


def placement(t: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +inf, 3 -inf, per element."""
    code = torch.zeros(t.shape, dtype=torch.int8)
    code[t.isnan()] = 1
    code[t.isposinf()] = 2
    code[t.isneginf()] = 3
    return code


def assert_same_placement(ours: list[torch.Tensor], theirs: list[torch.Tensor], case: str) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        pa, pb = placement(a), placement(b)
        differ = (pa != pb).nonzero()
        assert differ.numel() == 0, (
            f"{case}, tensor {i}: non-finite placement differs at {differ[:5].tolist()} "
            f"(ours {pa[tuple(differ[0])].item()}, megatron {pb[tuple(differ[0])].item()}; 1 NaN 2 +inf 3 -inf)"
        )


def _cases(shapes: dict[str, tuple], dtype: torch.dtype, where: dict[str, tuple], huge_together: tuple = ()):
    """(label, {name: tensor}): the clean inputs; one special value (NaN, +-inf, a huge finite
    value) injected into one tensor at a time at ``where[name]``; and the tensors named in
    ``huge_together`` huge at once (products of huge values overflow)."""
    gen = torch.Generator().manual_seed(SEED)
    base = {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in shapes.items()}
    yield "clean", base
    for name in shapes:
        for label, value in {**SPECIALS, "huge": _huge(dtype)}.items():
            yield f"{name}={label}", {**base, name: _inject(base[name], value, where[name])}
    if huge_together:
        huge = {name: _inject(base[name], _huge(dtype), where[name]) for name in huge_together}
        yield "+".join(huge_together) + "=huge", {**base, **huge}


# ---------------------------------------------------------------- RMSNorm (megatron: torch.nn.RMSNorm)


def _torch_rms_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-5)


def _eager_rms_norm(x, w):
    return _PortableRMSNorm.apply(x, w, 1e-5, False)


class _CompiledMathRMSNorm(torch.autograd.Function):
    """The compiled kernel's bodies (``compiled.rms_norm_math`` / ``rms_norm_backward_math``),
    run eagerly: Inductor compiles these very operations."""

    @staticmethod
    def forward(ctx, x, w):
        y, rstd = compiled.rms_norm_math(x.reshape(-1, x.shape[-1]), w.float(), 1e-5)
        ctx.save_for_backward(x, w, rstd)
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, w, rstd = ctx.saved_tensors
        dx, dw = compiled.rms_norm_backward_math(
            grad.reshape(-1, x.shape[-1]), x.reshape(-1, x.shape[-1]), w.float(), rstd
        )
        return dx.reshape(x.shape), dw.to(w.dtype)


RMS_WHERE = {"x": (1, 2), "w": (5,), "grad": (1, 2)}  # whole rows of x and grad: mean(x^2) overflows


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ours", [_eager_rms_norm, _CompiledMathRMSNorm.apply], ids=["eager", "compiled-math"])
def test_rmsnorm_is_megatrons_bitwise_with_nonfinite_inputs(dtype, ours):
    for case, t in _cases({"x": (3, 4, 32), "w": (32,), "grad": (3, 4, 32)}, dtype, RMS_WHERE, ("x", "grad")):
        expected = _grads(_torch_rms_norm, [t["x"], t["w"]], t["grad"])
        assert_bitwise(_grads(ours, [t["x"], t["w"]], t["grad"]), expected, f"{dtype} {case}")


def test_rmsnorm_overflowing_mean_square_gives_megatrons_nan_not_zero():
    """The issue's case: mean(x^2) overflows, rstd is 0; megatron's dx is NaN where the incoming
    gradient times x overflows too (inf * 0). The analytic backward scaled by rstd first and
    returned 0 there."""
    x = torch.full((2, 8), 1e20)
    grad = torch.full((2, 8), 1e30)
    rstd = torch.rsqrt((x * x).mean(1, keepdim=True) + 1e-5)
    assert (rstd == 0).all()
    dx, _ = rms_norm_backward(grad, x, torch.ones(8), rstd)
    assert dx.isnan().all()
    assert _grads(_torch_rms_norm, [x, torch.ones(8)], grad)[1].isnan().all()


# ---------------------------------------------------------------- SwiGLU (megatron: inline GLU, bias_swiglu_impl)


def _megatron_inline_swiglu(x):
    """megatron's MLP without bias_activation_fusion: ``glu(x) = act(x0) * x1`` under autograd."""
    a, b = torch.chunk(x, 2, dim=-1)
    return F.silu(a) * b


def _megatron_fused_swiglu(x):
    """megatron's MLP with bias_activation_fusion (Megatron-LM's default --bias-swiglu-fusion)."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    return bias_swiglu_impl(x, None)


def _megatron_weighted_swiglu(x, w):
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

    return weighted_bias_swiglu_impl(x, None, w)


def _our_compiled_swiglu(x):
    """The compiled kernel as a run calls it (``mindspeed_like::swiglu`` and its registered
    backward): Inductor-compiled where TorchDynamo runs, as megatron's fused SwiGLU (jit_fuser) is
    then; their bodies eagerly where it does not. Each pair is compared bitwise."""
    return compiled.swiglu(x)


def _our_swiglu(x):
    from mindspeed_like.kernels.swiglu import _SwiGLU

    return _SwiGLU.apply(x, None)


def _our_weighted_swiglu(x, w):
    from mindspeed_like.kernels.swiglu import _WeightedSwiGLU

    return _WeightedSwiGLU.apply(x, w)


SWIGLU_WHERE = {"x": (1, 3), "grad": (1, 3), "w": (1, 0)}
SWIGLU_GATE_WHERE = {"x": (2, 20), "grad": (2, 3), "w": (2, 0)}  # x's second half (the linear gate)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("ours", "megatron"),
    [
        (_our_swiglu, _megatron_inline_swiglu),
        (_our_compiled_swiglu, _megatron_fused_swiglu),
    ],
    ids=["eager-vs-inline", "compiled-math-vs-fused"],
)
def test_swiglu_is_megatrons_bitwise_with_nonfinite_inputs(dtype, ours, megatron):
    for where in (SWIGLU_WHERE, SWIGLU_GATE_WHERE):
        for case, t in _cases({"x": (4, 32), "grad": (4, 16)}, dtype, where, ("x", "grad")):
            expected = _grads(megatron, [t["x"]], t["grad"])
            assert_bitwise(_grads(ours, [t["x"]], t["grad"]), expected, f"{dtype} {case} at {where['x']}")


@pytest.mark.parametrize("megatron", [_megatron_inline_swiglu, _megatron_fused_swiglu], ids=["inline", "fused"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_nonfinite_placement_is_both_megatron_paths(dtype, megatron):
    for where in (SWIGLU_WHERE, SWIGLU_GATE_WHERE):
        for case, t in _cases({"x": (4, 32), "grad": (4, 16)}, dtype, where, ("x", "grad")):
            expected = _grads(megatron, [t["x"]], t["grad"])
            for ours in (_our_swiglu, _our_compiled_swiglu):
                assert_same_placement(_grads(ours, [t["x"]], t["grad"]), expected, f"{dtype} {case} at {where['x']}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weighted_swiglu_nonfinite_placement_is_megatrons(dtype):
    for where in (SWIGLU_WHERE, SWIGLU_GATE_WHERE):
        for case, t in _cases({"x": (4, 32), "w": (4, 1), "grad": (4, 16)}, dtype, where, ("x", "grad")):
            w = t["w"].float()  # megatron's routing probabilities are fp32
            expected = _grads(_megatron_weighted_swiglu, [t["x"], w], t["grad"])
            assert_same_placement(_grads(_our_weighted_swiglu, [t["x"], w], t["grad"]), expected, f"{dtype} {case}")


# ---------------------------------------------------------------- RoPE (megatron: _apply_rotary_pos_emb_bshd)


def _freqs(s: int, rot: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["half", "interleave"])
@pytest.mark.parametrize("rot", [16, 8], ids=["full", "partial"])
def test_rope_nonfinite_placement_is_megatrons(dtype, mode, rot):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from mindspeed_like.kernels.rope import _signed_sin, apply_rope, cos_sin

    freqs = _freqs(6, rot)
    megatron = lambda t: _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=mode == "interleave")  # noqa: E731
    eager = lambda t: apply_rope(t, freqs, mode=mode, backend="portable")  # noqa: E731
    cos, sin = cos_sin(freqs, dtype, 1.0)
    compiled_math = lambda t: _CompiledMathRope.apply(t, cos, _signed_sin(sin, mode), mode == "interleave")  # noqa: E731
    where = {"t": (0, 1, 1, 3), "grad": (2, 1, 0, 4)}  # position 0: sin 0, where inf * sin is NaN
    for case, t in _cases({"t": (6, 2, 2, 16), "grad": (6, 2, 2, 16)}, dtype, where, ("t", "grad")):
        expected = _grads(megatron, [t["t"]], t["grad"])
        for ours in (eager, compiled_math):
            assert_same_placement(_grads(ours, [t["t"]], t["grad"]), expected, f"{dtype} {case}")


class _CompiledMathRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, signed_sin, interleave):
        ctx.save_for_backward(cos, signed_sin)
        ctx.interleave = interleave
        return compiled.rope_math(t, cos, signed_sin, interleave)

    @staticmethod
    def backward(ctx, grad):
        cos, signed_sin = ctx.saved_tensors
        return compiled.rope_backward_math(grad, cos, signed_sin, ctx.interleave), None, None, None


# ---------------------------------------------------------------- flash attention (megatron: DotProductAttention)

SEQ = 6


def _megatron_core_attention(dtype: torch.dtype):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
    )
    module = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    return module, lambda q, k, v: module(q, k, v, mask, attn_mask_type=AttnMaskType.causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flash_attention_nonfinite_reaches_what_megatrons_reaches(adapter, dtype):
    """The output's NaN/inf positions are megatron's. In the gradients the flash kernel is another
    algorithm: it never forms the masked-out probabilities (megatron's dense ``probs @ v`` and its
    softmax backward multiply their zeros by a NaN or inf), so the positions may differ; each
    gradient holds a non-finite value exactly when megatron's does (the NaN guard sees the same
    step). Before, torch's CPU flash kernel returned a zero row for a query holding a NaN.
    Left out: fp16 with q and k huge at once, where megatron's fp16 ``baddbmm`` overflows the
    scores (|q.k| > 65504) and the flash kernel, accumulating in fp32, does not."""
    from mindspeed_like.kernels.flash_attention import CAUSAL, flash_attention

    module, megatron = _megatron_core_attention(dtype)
    ours = lambda q, k, v: flash_attention(q, k, v, scale=module.softmax_scale or 0.25, band=CAUSAL)  # noqa: E731
    shapes = {"q": (SEQ, 2, 4, 16), "k": (SEQ, 2, 4, 16), "v": (SEQ, 2, 4, 16), "grad": (SEQ, 2, 64)}
    where = {"q": (2, 0, 1, 3), "k": (2, 0, 1, 3), "v": (2, 0, 1, 3), "grad": (3, 0, 20)}
    for case, t in _cases(shapes, dtype, where, ("q", "k") if dtype != torch.float16 else ()):
        inputs = [t["q"], t["k"], t["v"]]
        (out, *grads), (expected, *megatron_grads) = (
            _grads(ours, inputs, t["grad"]),
            _grads(megatron, inputs, t["grad"]),
        )
        assert_same_placement([out], [expected], f"{dtype} {case} output")
        for name, a, b in zip("qkv", grads, megatron_grads):
            assert bool(placement(a).any()) == bool(placement(b).any()), f"{dtype} {case} d{name}"


def test_flash_attention_query_row_with_a_nan_is_nan_as_megatrons():
    from mindspeed_like.kernels.flash_attention import CAUSAL, flash_attention

    q, k, v = torch.randn(3, SEQ, 1, 2, 8).unbind(0)
    q[2, 0, 1, 3] = math.nan
    out = flash_attention(q, k, v, scale=0.3, band=CAUSAL).view(SEQ, 1, 2, 8)
    assert out[2, 0, 1].isnan().all()
    assert out.isnan().sum() == 8


# ---------------------------------------------------------------- linear cross-entropy
# (megatron: the output layer's matmul, then vocab_parallel_cross_entropy)


def _megatron_linear_cross_entropy(labels):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return lambda hidden, weight: vocab_parallel_cross_entropy(torch.matmul(hidden, weight.t()), labels)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk", [pytest.param(0, marks=pytest.mark.slow), 3], ids=["one-chunk", "chunks-of-3"])
def test_linear_cross_entropy_nonfinite_placement_is_megatrons(adapter, dtype, chunk):
    from mindspeed_like.kernels.linear_cross_entropy import linear_cross_entropy

    labels = torch.tensor([3, 0, 7, 7, 1, 5, 2, 6])
    ours = lambda hidden, weight: linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)  # noqa: E731
    megatron = _megatron_linear_cross_entropy(labels)
    shapes = {"hidden": (8, 16), "weight": (11, 16), "grad": (8,)}
    for where in ({"hidden": (2, 5), "weight": (7, 4), "grad": (3,)}, {"hidden": (4,), "weight": (0,), "grad": (0,)}):
        for case, t in _cases(shapes, dtype, where, ("hidden", "weight")):
            grad = t["grad"].float()  # the per-token loss is fp32
            expected = _grads(megatron, [t["hidden"], t["weight"]], grad)
            assert_same_placement(
                _grads(ours, [t["hidden"], t["weight"]], grad), expected, f"{dtype} {case} at {where}"
            )


def _tied_diverging(tokens: int, hidden: int, vocab: int, magnitude: float, dtype: torch.dtype):
    """hidden ``[tokens, hidden]``, the output weight, labels and the incoming per-token gradient;
    logits of ``|x| ~ magnitude``, the largest of every other token tied (vocab rows 0 and 1 equal,
    those tokens leaning their way)."""
    gen = torch.Generator().manual_seed(SEED)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    w[1] = w[0]
    h = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    h[::2] += 2 * w[0]
    h = h * magnitude / (4 * hidden)
    return (
        h.to(dtype),
        w.to(dtype),
        torch.randint(0, vocab, (tokens,), generator=gen),
        torch.rand(tokens, generator=gen),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk", [0, 16], ids=["one-chunk", "chunks-of-16"])
@pytest.mark.parametrize("magnitude", [4e5, 4e7, 4e9])
def test_linear_cross_entropy_gradient_is_megatrons_at_diverging_logits(adapter, dtype, chunk, magnitude):
    """Finite logits of a diverging run (issue 37 item 3: ~1e7-1e9 just before the guard fires): the
    gradients are megatron's ``softmax - onehot``, not a softmax that no longer sums to 1. The
    kernel once saved ``max + log(sum_exp)`` in one fp32, where ``log(sum_exp)`` (<= log V) is
    rounded away as ``|max|`` grows; at max ``|logit|`` 1.4e5 / 1.4e7 / 1.4e9 (the three cases) d
    hidden was 0.09% / 10% / 36% off megatron's and d weight 0.14% / 26% / 97% (a tied maximum
    got probability 1 at each tied logit instead of 1/2), and megatron's ``--lr 1e3`` bf16 run
    stopped at iteration 7 (DP=2) instead of megatron's 3. Tolerance: fp32 summation order (d hidden sums
    vocabulary slices); in bf16 also d hidden's rounding (megatron's bf16 matmul, our fp32 sum), so
    the bf16 case at 1.4e5 (0.26% before) does not tell the two apart."""
    from mindspeed_like.kernels.linear_cross_entropy import linear_cross_entropy

    hidden, weight, labels, grad = _tied_diverging(64, 64, 128, magnitude, dtype)
    ours = lambda h, w: linear_cross_entropy(h, w, labels, chunk_tokens=chunk)  # noqa: E731
    got, expected = (_grads(fn, [hidden, weight], grad) for fn in (ours, _megatron_linear_cross_entropy(labels)))
    tolerance = 1e-6 if dtype == torch.float32 else 5e-3
    for name, a, b in zip(("loss", "d hidden", "d weight"), got, expected, strict=True):
        error = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert error <= tolerance, f"{dtype} |logit| ~{magnitude:g}: {name} {error:.2e} off megatron's (relative norm)"


def test_linear_cross_entropy_recomputed_logit_above_the_max_is_no_inf(adapter):
    """Backward recomputes the logits with another matmul shape (``[tokens, slice]`` instead of
    forward's ``[chunk, vocab]``); BLAS may round them differently (here: MKL's small-matrix kernel,
    16 tokens, hidden 8, slices of 2 columns). At ``|logit|`` ~1e9 one fp32 ulp is 64, so a
    recomputed maximum one ulp above forward's gave ``exp(64+)`` = inf in the gradient where
    megatron's (its softmax saved from forward, never above 1) is finite: ``logits - max`` is
    clamped at 0, megatron's bound (one more pass over each slice: within a CPU's timing noise)."""
    from mindspeed_like.kernels.linear_cross_entropy import linear_cross_entropy

    for seed in range(SEED, SEED + 8):  # unclamped, 4 of these 8 draws gave an inf
        gen = torch.Generator().manual_seed(seed)
        hidden = torch.randn(16, 8, generator=gen) * 1e9
        weight = torch.randn(11, 8, generator=gen)
        labels, grad = torch.randint(0, 11, (16,), generator=gen), torch.rand(16, generator=gen)
        ours = lambda h, w, labels=labels: linear_cross_entropy(h, w, labels, chunk_tokens=3)  # noqa: E731
        expected = _grads(_megatron_linear_cross_entropy(labels), [hidden, weight], grad)
        assert all(bool(t.isfinite().all()) for t in expected)
        assert_same_placement(_grads(ours, [hidden, weight], grad), expected, f"fp32 |logit| ~1e9, seed {seed}")


# ---------------------------------------------------------------- grouped GEMM (megatron: one matmul per expert)


def _per_expert_matmuls(counts: list[int], trans_b: bool):
    """megatron's SequentialMLP arithmetic: each expert's rows times its own weight."""

    def run(a, b):
        pieces = torch.split(a, counts, dim=0)
        return torch.cat([p @ (b[e].t() if trans_b else b[e]) for e, p in enumerate(pieces)], dim=0)

    return run


def _order_decides(t: dict[str, torch.Tensor], counts: list[int], trans_b: bool, dtype: torch.dtype):
    """Per element of (output, dA, dB): True where the order of an fp32 accumulation decides
    whether the element overflows. Every product of two bf16 values is
    exact in fp32; a sum of K of them in any order keeps every partial sum within
    ``S * (1 + 2**-24)**K <= S * (1 + 2**-20)`` (K <= 16 here) of zero, S the sum of the finite
    products' magnitudes, and a value below ``finfo(dtype).max`` rounds to a finite one. So where
    ``S * (1 + 2**-20) < max`` the placement is the math's (NaN where a product is NaN or both
    infinities occur, the infinity's sign where one does, else finite) in every kernel; elsewhere a
    partial sum may overflow in one order and not in another. S is the per-expert GEMMs on the
    magnitudes in float64, for the backward's GEMMs too (autograd of the same matmuls)."""

    def magnitude(x):
        return torch.where(x.isfinite(), x.abs(), 0).double()

    bounds = _grads(_per_expert_matmuls(counts, trans_b), [magnitude(t["a"]), magnitude(t["b"])], magnitude(t["grad"]))
    return [bound * (1 + 2**-20) >= torch.finfo(dtype).max for bound in bounds]


def _check_grouped_gemm_nonfinite(dtype: torch.dtype, engine: str, trans_b: bool) -> None:
    """Ours against megatron's per-expert matmuls as both run on this host.

    Same GEMM kernel on both sides (fp32; bf16 where ours is not computed in fp32): the placement
    is megatron's at every element. Ours computed in fp32 on upcast inputs while megatron's bf16
    matmul runs torch's bf16 kernel (``fp32_compute``: a CPU without bf16 dot-product units): both
    multiply exactly and accumulate in fp32, in different orders, so the placement is megatron's
    at every element whose placement the math decides (:func:`_order_decides`); at the others
    (a huge row whose fp32 partial sums reach 3.4e38) it is the summation order's, which is the
    host's GEMM kernel's, not megatron's code's: torch's bf16 kernel (4 interleaved fp32 partial
    sums for these shapes) overflows at other columns than an fp32 sgemm, and the sgemm's own
    columns differ between an AVX-512 and an AVX2 host."""
    from mindspeed_like.kernels import grouped_gemm
    from mindspeed_like.kernels.grouped_gemm import _grouped_mm_ok, gmm

    counts = [3, 0, 4, 1]
    shapes = {"a": (8, 16), "b": (4, 16, 16), "grad": (8, 16)}
    if engine == "grouped_mm" and not _grouped_mm_ok(
        torch.zeros(8, 16, dtype=dtype), torch.zeros(4, 16, 16, dtype=dtype)
    ):
        pytest.skip("torch._grouped_mm does not take these tensors on this host")
    same_kernel = not grouped_gemm.fp32_compute(torch.zeros(0, dtype=dtype))
    ours = lambda a, b: gmm(a, b, counts, trans_b, engine=engine)  # noqa: E731
    megatron = _per_expert_matmuls(counts, trans_b)
    decided_by_order = 0
    for where in ({"a": (4, 3), "b": (2, 5, 1), "grad": (5, 2)}, {"a": (7,), "b": (1,), "grad": (0,)}):
        for case, t in _cases(shapes, dtype, where, ("a", "b")):
            expected = _grads(megatron, [t["a"], t["b"]], t["grad"])
            got = _grads(ours, [t["a"], t["b"]], t["grad"])
            if not same_kernel:
                order = _order_decides(t, counts, trans_b, dtype)
                decided_by_order += sum(int(m.sum()) for m in order)
                got = [torch.where(m, e, g) for m, e, g in zip(order, expected, got, strict=True)]
            assert_same_placement(got, expected, f"{dtype} {case} at {where}")
    if not same_kernel:  # the exemption is the huge cases' few sums, not the test
        assert 0 < decided_by_order < 200, decided_by_order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("engine", ["grouped_mm", "loop"])
@pytest.mark.parametrize("trans_b", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_grouped_gemm_nonfinite_stays_in_its_expert(dtype, engine, trans_b):
    """A NaN/inf in one expert's weight or rows reaches exactly the outputs and gradients megatron's
    per-expert matmuls reach, never another expert's (an empty expert included)."""
    _check_grouped_gemm_nonfinite(dtype, engine, trans_b)


@pytest.mark.parametrize("engine", ["grouped_mm", "loop"])
def test_grouped_gemm_nonfinite_as_on_a_cpu_without_bf16_units(monkeypatch, engine):
    """The same on any host with ours' bf16 GEMMs computed in fp32 as a CPU without bf16 units
    (AVX2) computes them, megatron's bf16 matmul unchanged: the contract of that host, here too
    (issue 49 item 1: an AVX2 host failed the bitwise-placement contract at a huge row)."""
    from mindspeed_like.kernels import grouped_gemm

    monkeypatch.setattr(
        grouped_gemm, "fp32_compute", lambda t: t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)
    )
    _check_grouped_gemm_nonfinite(torch.bfloat16, engine, False)


# ------------------------------------------------------------- MoE permute / unpermute, routing (megatron: moe_utils)


def _routing_map(tokens: int, experts: int, topk: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED)
    chosen = torch.rand(tokens, experts, generator=gen).topk(topk, dim=-1).indices
    return torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_moe_permute_and_unpermute_nonfinite_placement_is_megatrons(dtype):
    """Rows move with their NaN/inf; unpermute weights them by the routing probabilities (megatron:
    ``tokens * probs`` then a scatter-add), so a NaN token row or probability reaches exactly the
    sums megatron's reach."""
    from megatron.core.transformer.moe import moe_utils

    from mindspeed_like.kernels.moe_permute import permute, unpermute

    routing_map = _routing_map(6, 4, 2)

    def roundtrip(permute_fn, unpermute_fn):
        def run(tokens, probs):
            permuted, permuted_probs, index = permute_fn(tokens, routing_map, probs=probs)
            expert_out = permuted * 2 + permuted_probs.unsqueeze(-1).to(permuted.dtype)  # a differentiable "expert"
            return unpermute_fn(expert_out, index, tokens.shape, probs=probs, routing_map=routing_map)

        return run

    ours, megatron = roundtrip(permute, unpermute), roundtrip(moe_utils.permute, moe_utils.unpermute)
    shapes = {"tokens": (6, 8), "probs": (6, 4), "grad": (6, 8)}
    chosen = tuple(routing_map.nonzero()[0].tolist())
    for where in ({"tokens": (1, 3), "probs": chosen, "grad": (2, 5)}, {"tokens": (4,), "probs": (0, 1), "grad": (5,)}):
        for case, t in _cases(shapes, dtype, where):
            probs = t["probs"].float()  # megatron's routing probabilities are fp32
            expected = _grads(megatron, [t["tokens"], probs], t["grad"])
            assert_same_placement(_grads(ours, [t["tokens"], probs], t["grad"]), expected, f"{dtype} {case} at {where}")


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("use_pre_softmax", [False, True])
def test_moe_routing_nonfinite_placement_is_megatrons(score_function, use_pre_softmax):
    """NaN/inf logits: the same experts chosen (torch.topk's order, NaN counted largest) and the
    same NaN/inf probabilities and logit gradients as megatron's topk_routing_with_score_function."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from mindspeed_like.kernels.moe_router import topk_routing

    if score_function == "sigmoid" and use_pre_softmax:
        pytest.skip("use_pre_softmax applies to the softmax score function")
    kwargs = dict(topk=2, use_pre_softmax=use_pre_softmax, score_function=score_function)

    def routed(fn, maps: list):
        def run(logits):
            probs, routing_map = fn(logits, **kwargs)
            maps.append(routing_map)
            return probs

        return run

    for case, t in _cases({"logits": (6, 8), "grad": (6, 8)}, torch.float32, {"logits": (2, 5), "grad": (2, 5)}):
        ours_maps, megatron_maps = [], []
        expected = _grads(routed(topk_routing_with_score_function, megatron_maps), [t["logits"]], t["grad"])
        got = _grads(routed(topk_routing, ours_maps), [t["logits"]], t["grad"])
        assert torch.equal(ours_maps[0], megatron_maps[0]), f"{case}: experts chosen"
        assert_same_placement(got, expected, case)


# ---------------------------------------------------------------- optimizer (megatron without TE: torch.optim.AdamW)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
@pytest.mark.parametrize("special", ["nan", "+inf"])
def test_precision_aware_adam_nonfinite_gradient_reaches_the_parameter_as_adamw(state_dtype, special):
    """A NaN/inf gradient (megatron's guard switched off) makes the parameters torch's AdamW makes
    non-finite non-finite; fp32 and bf16 moments exactly there, block-scaled fp8 moments over the
    128-element block whose scale the value poisons (TE's per-tensor scale poisons the tensor)."""
    from mindspeed_like.kernels.adam import BLOCK, PrecisionAwareAdam

    gen = torch.Generator().manual_seed(SEED)
    start, grad = torch.randn(300, generator=gen), torch.randn(300, generator=gen)
    grad[7] = SPECIALS[special]
    params = [start.clone().requires_grad_(), start.clone().requires_grad_()]
    for p in params:
        p.grad = grad.clone()
    adamw = torch.optim.AdamW([params[0]], lr=1e-2, weight_decay=0.1)
    ours = PrecisionAwareAdam(
        [params[1]], lr=1e-2, weight_decay=0.1, exp_avg_dtype=state_dtype, exp_avg_sq_dtype=state_dtype
    )
    for _ in range(2):
        adamw.step()
        ours.step()
    expected, got = (~p.detach().isfinite() for p in params)
    if state_dtype == torch.uint8:
        block = torch.zeros(300, dtype=torch.bool)
        block[:BLOCK] = True
        assert expected.any() and torch.equal(got, block)
    else:
        assert_same_placement([params[1].detach()], [params[0].detach()], f"{state_dtype} {special}")
