"""Attention dropout inside context-parallel blocks: the shared block-mask stream
(:mod:`mindspeed_like.kernels.attention_dropout`), which the blocked kernel uses too."""

from mindspeed_like.kernels.attention_dropout import AttentionDropout, MaskStream

__all__ = ["AttentionDropout", "MaskStream"]
