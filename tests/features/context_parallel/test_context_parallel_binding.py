"""How the context-parallel wrapper reads megatron's attention call (features/context_parallel/attention.py)."""

from __future__ import annotations

import inspect

from mindspeed_like.features.context_parallel.attention import _signature_without_self


class _Attention:
    def forward(self, query, key, value, attention_mask, attn_mask_type=None):
        return query


def test_the_stand_in_drops_self_only() -> None:
    """Called through the class (te-backend's TEDotProductAttention), the partial's target is the plain
    function: ``self`` goes. Under another feature's wrapper it may be bound already: nothing goes (the
    stand-in dropped ``query`` then, and megatron's MTP tests at CP=2, level 1 raised "multiple values
    for argument 'attn_mask_type'")."""
    plain = inspect.signature(_signature_without_self(_Attention.forward))
    bound = inspect.signature(_signature_without_self(_Attention().forward))
    assert list(plain.parameters)[:2] == ["query", "key"]
    assert list(bound.parameters)[:2] == ["query", "key"]
    bound.bind(1, 2, 3, None, attn_mask_type="causal")
