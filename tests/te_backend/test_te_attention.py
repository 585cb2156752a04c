"""``TEDotProductAttention``'s sliding window and packed sequences (issue 48 items 2 and 4), at
level 0 (megatron's math) and with flash-attention on (level 1's kernel), against float64 references.

* Sliding window: megatron's wrapper hands ``config.window_size`` to TE on the layers
  ``window_attn_skip_freq`` leaves it, and megatron (its tests, its SWA decode) reads
  ``core_attention.window_size``, TE's checked value: ``(-1, 0)`` for a causal layer without a window,
  an int refused. The window must act: outputs equal masked attention in float64.
* Packed sequences (``PackedSeqParams(qkv_format="thd")``): each sequence attends only to itself,
  causally; TE's padded layout (``cu_seqlens_*_padded``) puts sequence i at its padded offset and
  leaves the rows between sequences zero. Before, level 0 reached megatron's local assertion ("use
  TEDotProductAttention", the class in use) and the padded layout did at every level.
"""

from __future__ import annotations

import importlib
import importlib.util
import math

import pytest
import torch

import mindspeed_like
from mindspeed_like.testing import destroy_parallel, init_parallel
from mindspeed_like.testing.models import gpt_config
from mindspeed_like.testing.parity import SEED, assert_close_to_reference

LEVELS = {"level0": {}, "flash": {"use_flash_attn": True}}
# megatron-core 0.15 gave its local attention (the te-backend's base) the sliding window; before, it is refused
WINDOWS = importlib.util.find_spec("megatron.core.transformer.utils") is not None and hasattr(
    importlib.import_module("megatron.core.transformer.utils"), "is_layer_window_attention"
)
needs_windows = pytest.mark.skipif(not WINDOWS, reason="megatron-core < 0.15: no sliding window (refused, see below)")


@pytest.fixture(params=list(LEVELS))
def level(request):
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", **LEVELS[request.param])
    init_parallel(seed=SEED)
    yield request.param
    destroy_parallel()
    mindspeed_like.reset()


def _attention(mask_type: str = "causal", layer_number: int = 1, **config):
    from megatron.core.transformer.enums import AttnMaskType

    from mindspeed_like.te_backend.attention import TEDotProductAttention

    return TEDotProductAttention(gpt_config(**config), layer_number, getattr(AttnMaskType, mask_type), "self")


def _reference(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """float64 attention of one sequence ``[s, h, d]`` (GQA: k/v heads repeated), ``allowed[i, j]``."""
    q, k, v = (t.double() for t in (q, k, v))
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def _band(sq: int, sk: int, left: int, right: int) -> torch.Tensor:
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    return (j >= i - left if left >= 0 else torch.ones(sq, sk, dtype=torch.bool)) & (j <= i + right)


# ------------------------------------------------------------------ sliding window (item 2)


def test_a_window_is_refused_by_name_where_megatron_has_none(level):
    if WINDOWS:
        pytest.skip("megatron-core >= 0.15 applies the window (tested below)")
    with pytest.raises(ValueError, match=r"config.window_size=\(10, 0\): sliding window attention needs megatron-core"):
        _attention(window_size=(10, 0))
    assert _attention().window_size == (-1, 0)


@needs_windows
def test_window_size_is_te_s_checked_value(level):
    """megatron's test_spec_customization.py::test_sliding_window_attention, and what it implies."""
    assert _attention(window_size=(10, 0)).window_size == (10, 0)
    assert _attention().window_size == (-1, 0)  # None: causal
    assert _attention("no_mask").window_size == (-1, -1)
    with pytest.raises(ValueError, match=r"config.window_size=11: window_size must be a \(left, right\) pair"):
        _attention(window_size=11)
    with pytest.raises(ValueError, match="window_size should be"):
        _attention(window_size=(-5, 0))
    with pytest.warns(UserWarning, match="window_size should be"):
        assert _attention(window_size=(4, 4)).window_size == (4, 0)  # TE: a causal layer sees no keys ahead
    # window_attn_skip_freq=2: every second layer attends to everything, as megatron's wrapper hands it to TE
    assert _attention(layer_number=2, window_size=(4, 0), window_attn_skip_freq=2).window_size == (-1, 0)
    assert _attention(layer_number=1, window_size=(4, 0), window_attn_skip_freq=2).window_size == (4, 0)


@pytest.mark.parametrize(
    ("mask_type", "window"),
    [
        pytest.param("causal", (3, 0), marks=needs_windows),
        pytest.param("no_mask", (2, 1), marks=needs_windows),
        ("causal", None),
    ],
)
def test_sliding_window_attends_inside_its_window(level, mask_type, window):
    attention = _attention(mask_type, window_size=window, num_query_groups=2)
    s, b, heads, groups, d = 11, 2, 4, 2, 16
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(s, b, heads, d, generator=gen)
    k, v = torch.randn(2, s, b, groups, d, generator=gen).unbind(0)
    out = attention(q, k, v, None)
    left, right = attention.window_size
    allowed = _band(s, s, left, right if right >= 0 else s)
    for i in range(b):
        assert_close_to_reference(out[:, i], _reference(q[:, i], k[:, i], v[:, i], allowed), torch.float32)


@needs_windows
def test_window_with_a_padding_mask_is_refused_by_name(level):
    attention = _attention("padding", window_size=(2, 2))
    q = torch.randn(5, 1, 4, 16)
    with pytest.raises(ValueError, match="sliding window .* together with an attention_mask of type padding"):
        attention(q, q, q, torch.zeros(1, 1, 5, 5, dtype=torch.bool))


# ------------------------------------------------------------------ packed sequences (item 4)


def _packed(lengths, padded_lengths=None):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    extra = {}
    if padded_lengths is not None:
        cu_padded = torch.tensor([0, *torch.tensor(padded_lengths).cumsum(0).tolist()], dtype=torch.int32)
        extra = dict(cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded)
    longest = max(padded_lengths or lengths)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest, **extra
    )
    return params, int(sum(padded_lengths or lengths))


@pytest.mark.parametrize(
    ("lengths", "padded"),
    [([5, 9, 1, 3], None), ([5, 9, 1, 3], [8, 12, 4, 4]), ([6, 7], [6, 10])],
    ids=["back-to-back", "padded", "padded-tail"],
)
@pytest.mark.parametrize("window", [None, pytest.param((2, 0), marks=needs_windows)], ids=["full", "window"])
def test_packed_sequences_attend_per_sequence(level, lengths, padded, window):
    attention = _attention(window_size=window, num_query_groups=2)
    params, t = _packed(lengths, padded)
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(t, 4, 16, generator=gen, requires_grad=True)
    k, v = (x.requires_grad_() for x in torch.randn(2, t, 2, 16, generator=gen).unbind(0))
    out = attention(q, k, v, None, packed_seq_params=params)
    assert out.shape == (t, 4 * 16)
    starts = params.cu_seqlens_q_padded if padded else params.cu_seqlens_q
    left, right = attention.window_size
    covered = torch.zeros(t, dtype=torch.bool)
    for start, n in zip(starts[:-1].tolist(), lengths, strict=True):
        rows = slice(start, start + n)
        expected = _reference(q[rows], k[rows], v[rows], _band(n, n, left, right))
        assert_close_to_reference(out[rows], expected, torch.float32, what=f"sequence at {start}")
        covered[rows] = True
    assert torch.equal(out[~covered], torch.zeros_like(out[~covered]))  # TE's padding rows
    out.sum().backward()
    assert torch.equal(q.grad[~covered], torch.zeros_like(q.grad[~covered]))
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_packed_padded_sequences_through_te_spec_self_attention(level):
    """megatron's test_attention_packed_seq.py::TestParallelAttentionWithPackedPaddedSequence, with the
    outputs checked: the TE-spec SelfAttention on a padded thd batch equals it on each sequence alone."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.attention import SelfAttention

    config = gpt_config(num_query_groups=2)
    spec = get_gpt_layer_with_transformer_engine_spec().submodules.self_attention
    attention = SelfAttention(config, spec.submodules, layer_number=1, **spec.params)
    lengths, padded = [18, 26, 8], [20, 28, 16]
    params, t = _packed(lengths, padded)
    hidden = torch.randn(t, 1, config.hidden_size, generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        out, _ = attention(hidden, None, packed_seq_params=params)
        assert out.shape == (t, 1, config.hidden_size)
        for start, n in zip(params.cu_seqlens_q_padded[:-1].tolist(), lengths, strict=True):
            alone, _ = attention(hidden[start : start + n], None)
            torch.testing.assert_close(out[start : start + n], alone, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the mask type decides (item 5)


def test_a_causal_layer_reads_no_attention_mask_as_te(level):
    """megatron's test_multi_latent_attention.py::TestParallelMLAAttentionPrecision hands a causal TE
    layer an all-True mask (every key masked, in megatron's convention) in sbhd and None in thd, and
    asserts the two outputs equal bitwise: TE never reads the mask of a causal layer. Honouring it gave
    megatron's uniform average of V in sbhd (with V ~ U(0, 0.02): max 1.3e-2 against the causal 2.0e-2,
    1.2e-2 apart), at level 0 and 1 alike. MLA's head dims: K 192, V 128."""
    import math as _math

    from megatron.core.transformer.enums import AttnMaskType

    from mindspeed_like.te_backend.attention import TEDotProductAttention

    config = gpt_config(bf16=True, num_attention_heads=4)
    attention = TEDotProductAttention(
        config, 1, AttnMaskType.causal, "self", softmax_scale=1 / _math.sqrt(192), k_channels=192, v_channels=128
    )
    s, b, h = 32, 4, 4
    gen = torch.Generator().manual_seed(SEED)
    q, k = torch.randn(2, s, b, h, 192, generator=gen).bfloat16().unbind(0)
    v = torch.randn(s, b, h, 128, generator=gen).bfloat16()
    params, _ = _packed([s] * b)
    all_masked = torch.ones(1, 1, s, s, dtype=torch.bool)
    sbhd = attention(q, k, v, all_masked, attn_mask_type=AttnMaskType.causal)
    thd = attention(
        *(x.transpose(0, 1).reshape(b * s, h, -1) for x in (q, k, v)),
        None,
        attn_mask_type=AttnMaskType.causal,
        packed_seq_params=params,
    )
    assert torch.equal(sbhd.transpose(0, 1).reshape(thd.shape), thd)
    assert torch.equal(sbhd, attention(q, k, v, None, attn_mask_type=AttnMaskType.causal))
    for i in range(b):
        assert_close_to_reference(sbhd[:, i], _reference(q[:, i], k[:, i], v[:, i], _band(s, s, -1, 0)), torch.bfloat16)


def test_attention_needs_no_global_memory_buffer_from_megatron(level):
    """TE's attention needs nothing of megatron's parallel state; megatron's math path (level 0) takes its
    score buffer from parallel_state's global memory buffer, which only initialize_model_parallel makes: a
    model on its own process groups (megatron's TestGPTModelWithCustomPG at 8 ranks) stopped with "global
    memory buffer is not initialized". The te-backend makes it when absent."""
    from megatron.core import parallel_state

    attention = _attention()
    parallel_state.destroy_global_memory_buffer()
    q, k, v = torch.randn(3, 8, 2, 4, 16).unbind(0)  # [s, b, heads, head dim]
    out = attention(q, k, v, None)
    assert out.shape == (8, 2, 64) and torch.isfinite(out).all()
