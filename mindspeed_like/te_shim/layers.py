"""TE's whole-layer modules for clients: ``LayerNormMLP``, ``MultiheadAttention``, ``TransformerLayer``.

Built from the client module's own ``LayerNormLinear``, ``Linear``, ``DotProductAttention`` and
norms (``pytorch.py``), so the kernels are ours (norms, flash attention, SwiGLU, RoPE), with TE
2.x's constructor arguments and defaults, parameter names and shapes, forward signatures and
input formats (read from TransformerEngine's ``transformer.py``,
``attention/multi_head_attention.py`` and ``module/layernorm_mlp.py``):

  TransformerLayer     self_attention (MultiheadAttention), inter_attention (layer_type="decoder"),
                       layernorm_mlp (LayerNormMLP), layernorm (output_layernorm); a plain
                       ``torch.nn.Module`` as in TE (its children carry ``_extra_state``)
  MultiheadAttention   self: layernorm_qkv (LayerNormLinear) or qkv (Linear); cross:
                       layernorm_query / query_layer and key_value; core_attention; proj.
                       ``fuse_qkv_params=False`` (TE's default) splits the QKV weight into
                       ``query_weight`` / ``key_weight`` / ``value_weight`` (cross:
                       ``query_weight``, ``key_weight`` / ``value_weight``) and forces
                       ``qkv_weight_interleaved=False``; with True the one ``weight`` is read
                       per GQA group ([q.., k, v] per group) when interleaved, else [Q; K; V]
  LayerNormMLP         layer_norm_weight(/_bias), fc1_weight/fc1_bias (2x rows for gated
                       activations), fc2_weight/fc2_bias; activations gelu (tanh), geglu, glu,
                       qgelu, qgeglu, relu, reglu, srelu, sreglu, silu, swiglu (our kernel)

Initialisation as TE: QKV and FC1 weights by ``init_method``, PROJ and FC2 by
``output_layer_init_method`` (both default ``normal_(0, 0.023)``), biases 0, norm weights 1 (0 with
``zero_centered_gamma``); each parameter on its own (TE initialises split parameters one by
one); nothing on the meta device until ``reset_parameters()`` (the leaf modules').

Single device, no fp8: what only TE's CUDA machinery does is refused at construction by name
(``refusals.py`` / ``TransformerEngineFeatureUnsupported``): fp8, userbuffers (``ub_*``),
tensor/sequence parallelism above 1 (megatron's TE specs do it here), ``clamped_swiglu`` and
``activation_params``, ``qk_norm_type``, ``softmax_type`` other than "vanilla",
``attn_input_format="thd"``, ``rotary_pos_interleaved``, ``checkpoint`` (LayerNormMLP's selective
recompute), ``delay_wgrad_compute`` / ``fuse_wgrad_accumulation``; in ``forward``:
``inference_params``, attention biases and ALiBi, ``pad_between_seqs``, a
``bottom_right_diagonal`` other than TE's default for the mask type.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mindspeed_like.kernels.swiglu import swiglu
from mindspeed_like.te_backend.refusals import refuse
from mindspeed_like.te_backend.rope import apply_rotary_pos_emb
from mindspeed_like.te_shim.modules import (
    DotProductAttention,
    LayerNorm,
    LayerNormLinear,
    Linear,
    RMSNorm,
    _check_common,
    _device,
    _dtype,
    _Norm,
    _norm_params,
    _single_device,
    _TEModule,
    check_normalization,
    check_set_window_size,
    default_init_method,
    init_method_constant,
    is_window,
)

_PLAIN_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "qgelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "srelu": lambda x: F.relu(x).square(),
    "silu": F.silu,
}
# gated: act(first half) * second half of FC1's output
_GATED_ACTIVATIONS = {
    "geglu": _PLAIN_ACTIVATIONS["gelu"],
    "glu": torch.sigmoid,
    "qgeglu": _PLAIN_ACTIVATIONS["qgelu"],
    "reglu": F.relu,
    "sreglu": _PLAIN_ACTIVATIONS["srelu"],
    "swiglu": F.silu,  # computed by our SwiGLU kernel
}
ACTIVATIONS = (*_PLAIN_ACTIVATIONS, *_GATED_ACTIVATIONS)
ATTN_MASK_TYPES = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
    "arbitrary",
)
_NAME = "transformer_engine.pytorch.{} (mindspeed_like client module)"


def _check_activation(activation: str, activation_params) -> None:
    if activation == "clamped_swiglu" or activation_params:
        refuse(
            f"activation {activation!r} with activation_params (clamped SwiGLU)",
            f"use one of {', '.join(ACTIVATIONS)}",
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of TE's; supported here: {', '.join(ACTIVATIONS)}")


def _check_mask_type(argument: str, mask_type: str) -> None:
    if mask_type not in ATTN_MASK_TYPES:
        raise ValueError(f"{argument} {mask_type!r} is not one of TE's: {', '.join(ATTN_MASK_TYPES)}")


def _check_format(name: str, qkv_format: str) -> None:
    if qkv_format == "thd":
        refuse(
            f"{_NAME.format(name)} packed sequences (thd input format)",
            "use DotProductAttention with qkv_format='thd', or sbhd/bshd inputs",
        )
    if qkv_format not in ("sbhd", "bshd"):
        raise ValueError(f"{name}: input format {qkv_format!r} is not one of sbhd, bshd")


def activate(activation: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """TE's activation of FC1's output (plus its bias)."""
    if activation == "swiglu":
        return swiglu(x, bias)
    if bias is not None:
        x = x + bias
    if activation in _PLAIN_ACTIVATIONS:
        return _PLAIN_ACTIVATIONS[activation](x)
    a, b = x.chunk(2, dim=-1)
    return _GATED_ACTIVATIONS[activation](a) * b


class LayerNormMLP(_TEModule):
    """TE's ``LayerNormMLP(hidden_size, ffn_hidden_size, eps=1e-5, ..., bias=True,
    normalization="LayerNorm", activation="gelu", ...)``: norm -> FC1 -> activation -> FC2.
    ``forward(inp, is_first_microbatch=None)`` returns ``out`` (``, fc2_bias`` with
    ``return_bias``; ``, ln_out`` with ``return_layernorm_output``)."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        return_bias: bool = False,
        get_rng_state_tracker=None,
        tp_group=None,
        tp_size: int = 1,
        init_method=None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        activation_params: dict | None = None,
        output_layer_init_method=None,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: torch.dtype | None = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        set_parallel_mode: bool = False,
        zero_centered_gamma: bool = False,
        device: Any = "cuda",
        name: str | None = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: str | None = None,
        checkpoint: bool = False,
        **kwargs: Any,
    ) -> None:
        _check_common(
            "LayerNormMLP",
            {
                **kwargs,
                "fuse_wgrad_accumulation": fuse_wgrad_accumulation,
                "delay_wgrad_compute": delay_wgrad_compute,
            },
            {"fuse_wgrad_accumulation", "delay_wgrad_compute"},
        )
        _single_device("LayerNormMLP", tp_size, tp_group, sequence_parallel)
        check_normalization(normalization)
        _check_activation(activation, activation_params)
        if symmetric_ar_type is not None:
            refuse("symmetric-memory all-reduce (symmetric_ar_type)", "leave it None (single device)")
        if checkpoint:
            refuse(
                "LayerNormMLP's selective activation recompute (checkpoint=True)",
                "wrap the layer in torch.utils.checkpoint, or use megatron's --recompute-activation-function",
            )
        super().__init__()
        device, dtype = _device(device), _dtype(params_dtype)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.activation, self.activation_params = activation, activation_params
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = return_layernorm_output_gathered
        self.set_parallel_mode = set_parallel_mode
        self.sequence_parallel = False
        self.tp_size = 1
        self.name = name
        init_method = init_method if init_method is not None else default_init_method
        output_layer_init_method = (
            output_layer_init_method if output_layer_init_method is not None else default_init_method
        )
        fc1_rows = 2 * ffn_hidden_size if activation in _GATED_ACTIVATIONS else ffn_hidden_size
        _norm_params(self, "layer_norm_", hidden_size, normalization, zero_centered_gamma, device, dtype)

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))

        self._register("fc1_weight", param(fc1_rows, hidden_size), init_method)
        if bias:
            self._register("fc1_bias", param(fc1_rows), init_method_constant(0.0))
        else:
            self.register_parameter("fc1_bias", None)
        self._register("fc2_weight", param(hidden_size, ffn_hidden_size), output_layer_init_method)
        if bias:
            self._register("fc2_bias", param(hidden_size), init_method_constant(0.0))
        else:
            self.register_parameter("fc2_bias", None)
        self._materialise(device)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        ln_out = _Norm.apply(
            inp, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.zero_centered_gamma
        )
        hidden = F.linear(ln_out, self.fc1_weight)
        hidden = activate(self.activation, hidden, self.fc1_bias)
        out = F.linear(hidden, self.fc2_weight, self.fc2_bias if self.apply_bias else None)
        result = (out, self.fc2_bias) if self.return_bias else (out,)
        if self.return_layernorm_output:
            result = (*result, ln_out)
        return result if len(result) > 1 else result[0]


def _check_alignment(mask_type: str, window_size, bottom_right_diagonal: bool | None, argument: str) -> None:
    """TE aligns causal / padding_causal masks top-left and ``*_bottom_right`` ones bottom-right
    whatever ``bottom_right_diagonal`` says; other masks' sliding windows follow it (None: bottom-right).
    Our DotProductAttention aligns windows bottom-right, so a top-left window is refused."""
    if bottom_right_diagonal is False and mask_type in ("no_mask", "padding", "arbitrary") and is_window(window_size):
        refuse(
            f"top-left aligned sliding window ({argument}=False with attn_mask_type={mask_type!r})",
            "leave it None (bottom-right, TE's default for this mask type)",
        )


class MultiheadAttention(torch.nn.Module):
    """TE's ``MultiheadAttention(hidden_size, num_attention_heads, kv_channels=None,
    attention_dropout=0.1, layernorm_epsilon=1e-5, init_method=None, output_layer_init_method=None,
    layer_number=None, attn_mask_type="causal", ..., num_gqa_groups=None, ..., return_bias=False,
    return_layernorm_output=False, input_layernorm=False, attention_type="self", ...,
    fuse_qkv_params=False, zero_centered_gamma=False, qkv_weight_interleaved=True, ..., bias=True,
    normalization="LayerNorm", device="cuda", qkv_format="sbhd", ...)``.
    ``forward(hidden_states, attention_mask=None, encoder_output=None, attn_mask_type=None,
    window_size=None, ...)`` returns the projection (``, bias`` with ``return_bias``; ``,
    layernorm_output`` with ``input_layernorm`` and ``return_layernorm_output``)."""

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        kv_channels: int | None = None,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        init_method=None,
        output_layer_init_method=None,
        layer_number: int | None = None,
        attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        tp_group=None,
        tp_size: int = 1,
        num_gqa_groups: int | None = None,
        fuse_wgrad_accumulation: bool = False,
        get_rng_state_tracker=None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype | None = None,
        return_bias: bool = False,
        return_layernorm_output: bool = False,
        input_layernorm: bool = False,
        attention_type: str = "self",
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        rotary_pos_interleaved: bool = False,
        bias: bool = True,
        normalization: str = "LayerNorm",
        device: Any = "cuda",
        qkv_format: str = "sbhd",
        name: str | None = None,
        qk_norm_type: str | None = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        softmax_type: str = "vanilla",
        **kwargs: Any,
    ) -> None:
        _check_common(
            "MultiheadAttention",
            {**kwargs, "fuse_wgrad_accumulation": fuse_wgrad_accumulation},
            {"fuse_wgrad_accumulation"},
        )
        _single_device("MultiheadAttention", tp_size, tp_group, sequence_parallel)
        _check_mask_type("attn_mask_type", attn_mask_type)
        _check_format("MultiheadAttention", qkv_format)
        check_normalization(normalization)
        if attention_type not in ("self", "cross"):
            raise ValueError(f"attention_type must be 'self' or 'cross' (TE's), got {attention_type!r}")
        if layer_number is not None and layer_number <= 0:
            raise ValueError(f"layer_number must be a positive integer, got {layer_number}")
        if qk_norm_type is not None:
            refuse(f"query/key normalization (qk_norm_type={qk_norm_type!r})", "leave qk_norm_type None")
        if softmax_type != "vanilla":
            refuse(f"sink attention (softmax_type={softmax_type!r})", "use softmax_type='vanilla'")
        if rotary_pos_interleaved:
            refuse("interleaved rotary embeddings (rotary_pos_interleaved=True)", "use the non-interleaved layout")
        heads = num_attention_heads
        groups = heads if num_gqa_groups is None else num_gqa_groups
        if heads % groups != 0:
            raise ValueError(
                f"num_attention_heads ({heads}) must be divisible by num_gqa_groups ({groups}) (TE's requirement)"
            )
        super().__init__()
        kv_channels = kv_channels if kv_channels else hidden_size // heads
        if not fuse_qkv_params:
            qkv_weight_interleaved = False
        self.qkv_format, self.attn_mask_type = qkv_format, attn_mask_type
        self.window_size, self.bottom_right_diagonal = window_size, bottom_right_diagonal
        check_set_window_size(attn_mask_type, window_size)
        self.layer_number = 1 if layer_number is None else layer_number
        self.input_layernorm, self.attention_type = input_layernorm, attention_type
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        self.params_dtype = _dtype(params_dtype)
        self.num_attention_heads = self.num_attention_heads_per_partition = heads
        self.num_gqa_groups = self.num_gqa_groups_per_partition = groups
        self.hidden_size_per_attention_head = kv_channels
        self.hidden_size_q, self.hidden_size_kv = kv_channels * heads, kv_channels * groups
        self.qkv_weight_interleaved = qkv_weight_interleaved
        self.rotary_pos_interleaved = False
        self.tp_size, self.sequence_parallel, self.tp_group = 1, False, tp_group
        self.name = name
        self.q_norm = self.k_norm = None
        gemm = {"params_dtype": params_dtype, "device": device}
        column = "column" if set_parallel_mode else None
        norm = {"eps": layernorm_epsilon, "normalization": normalization, "zero_centered_gamma": zero_centered_gamma}
        if attention_type == "self":
            split = (
                None
                if fuse_qkv_params
                else {"query": self.hidden_size_q, "key": self.hidden_size_kv, "value": self.hidden_size_kv}
            )
            rows = self.hidden_size_q + 2 * self.hidden_size_kv
            if input_layernorm:
                self.layernorm_qkv = LayerNormLinear(
                    hidden_size,
                    rows,
                    init_method=init_method,
                    bias=bias,
                    parallel_mode=column,
                    return_layernorm_output=return_layernorm_output,
                    parameters_split=split,
                    **norm,
                    **gemm,
                )
            else:
                self.qkv = Linear(
                    hidden_size,
                    rows,
                    init_method=init_method,
                    bias=bias,
                    parallel_mode=column,
                    parameters_split=split,
                    **gemm,
                )
        else:
            if input_layernorm:
                self.layernorm_query = LayerNormLinear(
                    hidden_size,
                    self.hidden_size_q,
                    init_method=init_method,
                    bias=bias,
                    parallel_mode=column,
                    parameters_split=None if fuse_qkv_params else ("query",),
                    return_layernorm_output=return_layernorm_output,
                    **norm,
                    **gemm,
                )
            else:
                self.query_layer = Linear(
                    hidden_size, self.hidden_size_q, init_method=init_method, bias=bias, parallel_mode=column, **gemm
                )
            self.key_value = Linear(
                hidden_size,
                2 * self.hidden_size_kv,
                init_method=init_method,
                bias=bias,
                parallel_mode=column,
                parameters_split=None if fuse_qkv_params else ("key", "value"),
                **gemm,
            )
        self.core_attention = DotProductAttention(
            heads,
            kv_channels,
            num_gqa_groups=groups,
            attention_dropout=attention_dropout,
            qkv_format=qkv_format,
            attn_mask_type=attn_mask_type,
            window_size=window_size,
            layer_number=self.layer_number,
            attention_type=attention_type,
        )
        self.proj = Linear(
            self.hidden_size_q,
            hidden_size,
            init_method=output_layer_init_method,
            bias=bias,
            return_bias=return_bias,
            parallel_mode="row" if set_parallel_mode else None,
            **gemm,
        )

    def set_tensor_parallel_group(self, tp_group) -> None:
        _single_device("MultiheadAttention", 1, tp_group, False)
        self.tp_group = tp_group

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.size(0), x.size(1), -1, self.hidden_size_per_attention_head)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        encoder_output: torch.Tensor | None = None,
        attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        is_first_microbatch: bool | None = None,
        checkpoint_core_attention: bool = False,
        inference_params=None,
        rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        fast_zero_fill: bool = True,
        pad_between_seqs: bool | None = None,
    ):
        attn_mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        _check_mask_type("attn_mask_type", attn_mask_type)
        window_size = check_set_window_size(attn_mask_type, self.window_size if window_size is None else window_size)
        bottom_right = self.bottom_right_diagonal if bottom_right_diagonal is None else bottom_right_diagonal
        _check_alignment(attn_mask_type, window_size, bottom_right, "bottom_right_diagonal")
        _forward_refusals(
            inference_params, core_attention_bias_type, core_attention_bias, alibi_slopes, pad_between_seqs
        )
        if "padding" in attn_mask_type and attention_mask is not None:
            masks = attention_mask if isinstance(attention_mask, (tuple, list)) else (attention_mask,)
            if any(m.dtype != torch.bool for m in masks):
                raise TypeError("attention_mask must be boolean (True: masked out), as TE requires")

        layernorm_output = None
        d = self.hidden_size_per_attention_head
        per_group = self.num_attention_heads // self.num_gqa_groups
        if self.attention_type == "self":
            if self.input_layernorm:
                mixed = self.layernorm_qkv(hidden_states)
                if self.return_layernorm_output:
                    mixed, layernorm_output = mixed
            else:
                mixed = self.qkv(hidden_states)
            if self.qkv_weight_interleaved:  # [.., groups, (per_group + 2), d]
                mixed = mixed.view(*mixed.shape[:-1], self.num_gqa_groups, per_group + 2, d)
                split_dim = -2
            else:  # [.., (per_group + 2), groups, d]
                mixed = mixed.view(*mixed.shape[:-1], per_group + 2, self.num_gqa_groups, d)
                split_dim = -3
            query, key, value = (self._heads(t) for t in torch.split(mixed, [per_group, 1, 1], dim=split_dim))
        else:
            if encoder_output is None:
                raise ValueError("MultiheadAttention(attention_type='cross'): forward needs encoder_output")
            mixed_kv = self.key_value(encoder_output)
            if self.qkv_weight_interleaved:  # [.., groups, 2 d]
                mixed_kv = mixed_kv.view(*mixed_kv.shape[:-1], self.num_gqa_groups, 2 * d)
                split_dim = -1
            else:  # [.., 2 groups, d]
                mixed_kv = mixed_kv.view(*mixed_kv.shape[:-1], 2 * self.num_gqa_groups, d)
                split_dim = -2
            key, value = (self._heads(t) for t in torch.split(mixed_kv, mixed_kv.shape[split_dim] // 2, dim=split_dim))
            if self.input_layernorm:
                query = self.layernorm_query(hidden_states)
                if self.return_layernorm_output:
                    query, layernorm_output = query
            else:
                query = self.query_layer(hidden_states)
            query = query.view(*query.shape[:-1], self.num_attention_heads, d)

        if rotary_pos_emb is not None:
            q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            query = apply_rotary_pos_emb(query, q_freqs, self.qkv_format, fused=True)
            key = apply_rotary_pos_emb(key, k_freqs, self.qkv_format, fused=True)

        def attend(q, k, v, mask):
            return self.core_attention(
                q,
                k,
                v,
                attention_mask=mask,
                qkv_format=self.qkv_format,
                attn_mask_type=attn_mask_type,
                window_size=window_size,
            )

        if checkpoint_core_attention and torch.is_grad_enabled():
            context = checkpoint(attend, query, key, value, attention_mask, use_reentrant=False)
        else:
            context = attend(query, key, value, attention_mask)
        projection = self.proj(context)
        outputs = projection if self.return_bias else (projection,)
        if self.input_layernorm and self.return_layernorm_output:
            outputs = (*outputs, layernorm_output)
        return outputs if len(outputs) > 1 else outputs[0]


def _forward_refusals(inference_params, bias_type, bias, alibi_slopes, pad_between_seqs) -> None:
    if inference_params is not None:
        refuse("KV-cache inference (inference_params)", "run inference with megatron's inference engine")
    if bias_type != "no_bias" or bias is not None or alibi_slopes is not None:
        refuse(
            f"attention biases (core_attention_bias_type={bias_type!r}, core_attention_bias, alibi_slopes)",
            "use core_attention_bias_type='no_bias'",
        )
    if pad_between_seqs:
        refuse("padding between packed sequences (pad_between_seqs)", "use sbhd/bshd inputs")


class _DropPath(torch.nn.Module):
    """TE's ``DropPath``: drops whole samples (dim 0) with ``drop_prob``, scaling the kept ones."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return hidden_state
        keep = 1 - self.drop_prob
        shape = (hidden_state.shape[0],) + (1,) * (hidden_state.ndim - 1)
        mask = (keep + torch.rand(shape, dtype=hidden_state.dtype, device=hidden_state.device)).floor_()
        return hidden_state.div(keep) * mask


class TransformerLayer(torch.nn.Module):
    """TE's ``TransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups=None,
    layernorm_epsilon=1e-5, hidden_dropout=0.1, attention_dropout=0.1, init_method=None,
    output_layer_init_method=None, layer_number=None, kv_channels=None, self_attn_mask_type="causal",
    window_size=None, ..., enc_dec_attn_mask_type="no_mask", ..., params_dtype=None, ...,
    apply_residual_connection_post_layernorm=False, output_layernorm=False,
    parallel_attention_mlp=False, layer_type="encoder", drop_path_rate=0.0, set_parallel_mode=False,
    fuse_qkv_params=False, zero_centered_gamma=False, qkv_weight_interleaved=True, bias=True,
    activation="gelu", normalization="LayerNorm", device="cuda", attn_input_format="sbhd", ...)``.

    ``forward(hidden_states, attention_mask=None, self_attn_mask_type=None, window_size=None, ...,
    encoder_output=None, enc_dec_attn_mask=None, ...)``: ``x + dropout(attn(norm(x)))`` (the
    residual from the norm's output with ``apply_residual_connection_post_layernorm``), cross
    attention likewise for decoders, then ``+ dropout(mlp(norm(.)))``; ``output_layernorm`` moves
    the norm to the output (BERT)."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_gqa_groups: int | None = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        init_method=None,
        output_layer_init_method=None,
        layer_number: int | None = None,
        kv_channels: int | None = None,
        self_attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        enc_dec_attn_mask_type: str = "no_mask",
        enc_dec_bottom_right_diagonal: bool | None = None,
        enc_dec_window_size: tuple[int, int] | None = None,
        tp_group=None,
        tp_size: int = 1,
        params_dtype: torch.dtype | None = None,
        get_rng_state_tracker=None,
        fuse_wgrad_accumulation: bool = False,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        sequence_parallel: bool = False,
        apply_residual_connection_post_layernorm: bool = False,
        output_layernorm: bool = False,
        parallel_attention_mlp: bool = False,
        layer_type: str = "encoder",
        drop_path_rate: float = 0.0,
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        rotary_pos_interleaved: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        ub_tp_comm_overlap: bool = False,
        bias: bool = True,
        activation: str = "gelu",
        activation_params: dict | None = None,
        normalization: str = "LayerNorm",
        device: Any = "cuda",
        attn_input_format: str = "sbhd",
        name: str | None = None,
        qk_norm_type: str | None = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        softmax_type: str = "vanilla",
        **kwargs: Any,
    ) -> None:
        if ub_tp_comm_overlap:
            refuse("userbuffers TP communication overlap (ub_tp_comm_overlap)", "use --use-tiled-tp-overlap")
        ub_flags = {k: v for k, v in kwargs.items() if k.startswith("ub_")}  # only act with ub_tp_comm_overlap
        _check_common(
            "TransformerLayer",
            {k: v for k, v in kwargs.items() if k not in ub_flags},
            set(),
        )
        if fuse_wgrad_accumulation:
            if not fuse_qkv_params:
                raise ValueError(
                    "Gradient accumulation fusion (fuse_wgrad_accumulation=True) requires fuse_qkv_params=True"
                )
            refuse("fused weight-gradient accumulation (fuse_wgrad_accumulation)", "leave it off")
        _single_device("TransformerLayer", tp_size, tp_group, sequence_parallel)
        if layer_type not in ("encoder", "decoder"):
            raise ValueError(f"layer_type {layer_type!r} is not supported; TE's are 'encoder', 'decoder'")
        if parallel_attention_mlp:
            if layer_type != "encoder":
                raise ValueError(f"parallel_attention requires layer_type='encoder', got {layer_type!r}")
            if apply_residual_connection_post_layernorm:
                raise ValueError(
                    "parallel_attention and apply_residual_connection_post_layernorm are not supported together"
                )
            if output_layernorm:
                raise ValueError("parallel_attention and output_layernorm are not supported together")
        _check_mask_type("self_attn_mask_type", self_attn_mask_type)
        _check_mask_type("enc_dec_attn_mask_type", enc_dec_attn_mask_type)
        _check_format("TransformerLayer", attn_input_format)
        check_normalization(normalization)
        _check_activation(activation, activation_params)
        super().__init__()
        self.self_attn_mask_type, self.window_size = self_attn_mask_type, window_size
        self.bottom_right_diagonal = bottom_right_diagonal
        self.enc_dec_attn_mask_type, self.enc_dec_window_size = enc_dec_attn_mask_type, enc_dec_window_size
        self.enc_dec_bottom_right_diagonal = enc_dec_bottom_right_diagonal
        self.layer_number, self.output_layernorm, self.layer_type = layer_number, output_layernorm, layer_type
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.parallel_attention_mlp = parallel_attention_mlp
        self.kv_channels = kv_channels if kv_channels else hidden_size // num_attention_heads
        self.tp_size, self.sequence_parallel, self.seq_length = 1, False, seq_length
        self.attn_input_format, self.softmax_type, self.name = attn_input_format, softmax_type, name
        self.hidden_dropout = hidden_dropout
        params_dtype = _dtype(params_dtype)
        attention_args = (
            hidden_size,
            num_attention_heads,
            self.kv_channels,
            attention_dropout,
            layernorm_epsilon,
            init_method,
            output_layer_init_method,
        )
        common = {
            "layer_number": layer_number,
            "tp_group": tp_group,
            "tp_size": tp_size,
            "num_gqa_groups": num_gqa_groups,
            "sequence_parallel": sequence_parallel,
            "params_dtype": params_dtype,
            "return_layernorm_output": apply_residual_connection_post_layernorm,
            "set_parallel_mode": set_parallel_mode,
            "fuse_qkv_params": fuse_qkv_params,
            "zero_centered_gamma": zero_centered_gamma,
            "qkv_weight_interleaved": qkv_weight_interleaved,
            "rotary_pos_interleaved": rotary_pos_interleaved,
            "qkv_format": attn_input_format,
            "softmax_type": softmax_type,
            "qk_norm_type": qk_norm_type,
            "bias": bias,
            "normalization": normalization,
            "device": device,
        }
        self.self_attention = MultiheadAttention(
            *attention_args,
            **common,
            input_layernorm=not output_layernorm,
            attention_type="self",
            return_bias=not parallel_attention_mlp,
        )
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                *attention_args,
                **common,
                attn_mask_type=enc_dec_attn_mask_type,
                input_layernorm=True,
                attention_type="cross",
                return_bias=True,
            )
        self.layernorm_mlp = LayerNormMLP(
            hidden_size,
            ffn_hidden_size,
            eps=layernorm_epsilon,
            tp_group=tp_group,
            tp_size=tp_size,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            bias=bias,
            return_bias=not parallel_attention_mlp,
            sequence_parallel=sequence_parallel,
            params_dtype=params_dtype,
            return_layernorm_output=apply_residual_connection_post_layernorm,
            set_parallel_mode=set_parallel_mode,
            zero_centered_gamma=zero_centered_gamma,
            activation=activation,
            normalization=normalization,
            device=device,
        )
        self.drop_path = _DropPath(drop_path_rate) if drop_path_rate > 0.0 else None
        if output_layernorm:
            norm_class = LayerNorm if normalization == "LayerNorm" else RMSNorm
            self.layernorm = norm_class(
                hidden_size,
                eps=layernorm_epsilon,
                params_dtype=params_dtype,
                zero_centered_gamma=zero_centered_gamma,
                device=device,
            )

    def set_tensor_parallel_group(self, tp_group) -> None:
        for child in list(self.modules())[1:]:
            if hasattr(child, "set_tensor_parallel_group"):
                child.set_tensor_parallel_group(tp_group)

    def _bias_dropout_add(self, hidden, bias, residual, drop_path=None) -> torch.Tensor:
        """TE's bias-dropout-add: ``residual + drop_path(dropout(hidden + bias))``."""
        if bias is not None and bias.numel() != 0:
            hidden = hidden + bias
        out = F.dropout(hidden, p=self.hidden_dropout, training=self.training)
        if drop_path is not None:
            out = drop_path(out)
        return residual + out

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        self_attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        encoder_output: torch.Tensor | None = None,
        enc_dec_attn_mask: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        enc_dec_attn_mask_type: str | None = None,
        enc_dec_window_size: tuple[int, int] | None = None,
        enc_dec_bottom_right_diagonal: bool | None = None,
        is_first_microbatch: bool | None = None,
        checkpoint_core_attention: bool = False,
        inference_params=None,
        rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        fast_zero_fill: bool = True,
        pad_between_seqs: bool | None = None,
    ) -> torch.Tensor:
        self_attn_mask_type = self.self_attn_mask_type if self_attn_mask_type is None else self_attn_mask_type
        enc_dec_attn_mask_type = (
            self.enc_dec_attn_mask_type if enc_dec_attn_mask_type is None else enc_dec_attn_mask_type
        )
        _check_mask_type("self_attn_mask_type", self_attn_mask_type)
        _check_mask_type("enc_dec_attn_mask_type", enc_dec_attn_mask_type)
        window_size = self.window_size if window_size is None else window_size
        enc_dec_window_size = self.enc_dec_window_size if enc_dec_window_size is None else enc_dec_window_size
        bottom_right_diagonal = self.bottom_right_diagonal if bottom_right_diagonal is None else bottom_right_diagonal
        if enc_dec_bottom_right_diagonal is None:
            enc_dec_bottom_right_diagonal = self.enc_dec_bottom_right_diagonal
        for mask, mask_type, what in (
            (attention_mask, self_attn_mask_type, "attention_mask"),
            (enc_dec_attn_mask, enc_dec_attn_mask_type, "enc_dec_attn_mask"),
        ):
            if mask is not None and ("padding" in mask_type or mask_type == "arbitrary"):
                masks = mask if isinstance(mask, (tuple, list)) else (mask,)
                if any(m.dtype != torch.bool for m in masks):
                    raise TypeError(f"{what} must be boolean (True: masked out), as TE requires")
        hidden_states = hidden_states.contiguous()
        shared = {
            "is_first_microbatch": is_first_microbatch,
            "checkpoint_core_attention": checkpoint_core_attention,
            "inference_params": inference_params,
            "rotary_pos_emb": rotary_pos_emb,
            "core_attention_bias_type": core_attention_bias_type,
            "core_attention_bias": core_attention_bias,
            "alibi_slopes": alibi_slopes,
            "fast_zero_fill": fast_zero_fill,
            "pad_between_seqs": pad_between_seqs,
        }
        attention_outputs = self.self_attention(
            hidden_states,
            attention_mask=attention_mask,
            attn_mask_type=self_attn_mask_type,
            window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_q,
            **shared,
        )
        if self.apply_residual_connection_post_layernorm and not self.output_layernorm:
            attention_output, attention_bias, residual = attention_outputs
            hidden_states = self._bias_dropout_add(attention_output, attention_bias, residual, self.drop_path)
        elif not self.parallel_attention_mlp:
            attention_output, attention_bias = attention_outputs
            hidden_states = self._bias_dropout_add(attention_output, attention_bias, hidden_states, self.drop_path)

        if self.layer_type == "decoder":
            inter_outputs = self.inter_attention(
                hidden_states,
                attention_mask=enc_dec_attn_mask,
                attn_mask_type=enc_dec_attn_mask_type,
                window_size=enc_dec_window_size,
                bottom_right_diagonal=enc_dec_bottom_right_diagonal,
                encoder_output=encoder_output,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_kv=cu_seqlens_kv,
                **shared,
            )
            if self.apply_residual_connection_post_layernorm:
                attention_output, attention_bias, residual = inter_outputs
            else:
                (attention_output, attention_bias), residual = inter_outputs, hidden_states
            hidden_states = self._bias_dropout_add(attention_output, attention_bias, residual)

        mlp_outputs = self.layernorm_mlp(hidden_states, is_first_microbatch=is_first_microbatch)
        if self.apply_residual_connection_post_layernorm:
            mlp_output, mlp_bias, residual = mlp_outputs
            output = self._bias_dropout_add(mlp_output, mlp_bias, residual, self.drop_path)
        elif self.parallel_attention_mlp:
            output = self._bias_dropout_add(attention_outputs, mlp_outputs, hidden_states, self.drop_path)
        else:
            mlp_output, mlp_bias = mlp_outputs
            output = self._bias_dropout_add(mlp_output, mlp_bias, hidden_states, self.drop_path)
        if self.output_layernorm:
            output = self.layernorm(output)
        return output


__all__ = ["ACTIVATIONS", "LayerNormMLP", "MultiheadAttention", "TransformerLayer", "activate"]
