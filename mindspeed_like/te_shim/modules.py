"""TE's layer modules on our kernels: what ``transformer_engine.pytorch`` (``pytorch.py``) serves, less the
whole-layer modules built from them (``layers.py``).

What clients build themselves (Megatron-Bridge subclasses ``te.Linear`` at import and tests
``isinstance(m, (te.Linear, te.LayerNormLinear))``; megatron's own TE layers are the te-backend's):

  TE name            here                                              kernel
  Linear             weight [out, in], bias; ``return_bias``;         torch linear
                     ``parameters_split`` ({name}_weight / _bias)
  LayerNormLinear    layer_norm_weight(/_bias) + weight/bias          our RMSNorm / layer_norm, linear
  LayerNorm, RMSNorm weight (bias); ``zero_centered_gamma``           our RMSNorm / layer_norm
  DotProductAttention sbhd / bshd / thd, GQA, causal / padding masks, our flash attention
                     sliding windows, separate K/V head dims
  GroupedLinear      weight0..N-1 / bias0..; ``forward(x, m_splits)`` our grouped GEMM
  TransformerLayer,  TE's whole-layer modules, built from the classes above (``layers.py``)
  MultiheadAttention,
  LayerNormMLP
  fp8_autocast, autocast, fp8_model_init, quantized_model_init: with ``enabled=False`` nothing to do

Single-device semantics (``tp_size`` 1: TE's ``parallel_mode`` then changes nothing); tensor
parallelism is megatron's (its TE layers, the te-backend). One class per TE name: the te-backend's
classes for megatron's TE wrappers derive from these, as megatron's derive from TE's
(``TELinear``, ``TEColumnParallelLinear``, ``TERowParallelLinear`` -> ``Linear``,
``TELayerNormColumnParallelLinear`` -> ``LayerNormLinear``, ``TEDotProductAttention`` ->
``DotProductAttention``, the grouped linears -> ``GroupedLinear``, and ``TENorm`` builds a
``LayerNorm`` or ``RMSNorm``), so a client's ``isinstance(m, te.pytorch.X)`` answers as with TE.
They are registered subclasses (``_TEModule`` is an ``ABCMeta`` class): built on megatron's own
layers, whose methods and constructors stay theirs. Every module keeps TE's
``_extra_state`` (an empty uint8 tensor), registers its parameters in TE's order with TE's init
function (weights ``init_method``, default ``normal_(0, 0.023)``; biases 0; norm weights 1, or 0
with ``zero_centered_gamma``), defers it on the meta device and has TE's ``reset_parameters()``
(Megatron-FSDP's ``init_model_with_meta_device`` calls it). Refused by name, with the
alternative: fp8 (enabled autocasts, recipes), userbuffers (``ub_*``, ``initialize_ub``), CUDA
graphs (``make_graphed_callables``), TE's CPU offload (``get_cpu_offload_context``), fusible
``ops``.
"""

from __future__ import annotations

import abc
import math
import warnings
from typing import Any

import torch

from mindspeed_like.kernels.flash_attention import CAUSAL, Band, flash_attention
from mindspeed_like.kernels.grouped_gemm import gmm_experts
from mindspeed_like.kernels.rmsnorm import rms_norm
from mindspeed_like.te_backend.extra_state import TEExtraState
from mindspeed_like.te_backend.refusals import refuse
from mindspeed_like.te_shim.refusals import (
    CPU_OFFLOAD,
    CUDA_GRAPHS,
    FP8,
    USERBUFFERS,
    check_no_userbuffers,
    disabled_only,
    refused_module_getattr,
)

DEFAULT_INIT_STD = 0.023  # TE's get_default_init_method()


def _device(device: Any) -> torch.device:
    """TE's default is "cuda"; on a host without one the parameters live on the host."""
    if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def _dtype(params_dtype: torch.dtype | None) -> torch.dtype:
    return params_dtype if params_dtype is not None else torch.get_default_dtype()


def _single_device(name: str, tp_size: int, tp_group, sequence_parallel: bool) -> None:
    size = tp_size if tp_group is None else torch.distributed.get_world_size(tp_group)
    if size != 1 or sequence_parallel:
        raise ValueError(
            f"transformer_engine.pytorch.{name} (mindspeed_like client module): tensor/sequence parallelism is "
            "megatron's here; build the model with megatron's TE specs (the te-backend) or use tp_size=1"
        )


def _check_common(name: str, kwargs: dict[str, Any], known: set[str]) -> None:
    check_no_userbuffers(kwargs)
    if kwargs.get("delay_wgrad_compute"):
        refuse("delayed weight-gradient computation (delay_wgrad_compute)", "leave it off")
    if kwargs.get("fuse_wgrad_accumulation"):
        refuse("fused weight-gradient accumulation (fuse_wgrad_accumulation)", "leave it off")
    unknown = {k for k, v in kwargs.items() if not k.startswith("ub_") and k not in known and v not in (None, False)}
    if unknown:
        raise TypeError(f"transformer_engine.pytorch.{name}() got unsupported keyword arguments {sorted(unknown)}")


# Accepted and meaningless on one device without fp8 (TE's other constructor arguments).
_IGNORED = {
    "get_rng_state_tracker",
    "rng_tracker_name",
    "name",
    "symmetric_ar_type",
    "save_original_input",
    "ub_name",
    "delay_wgrad_compute",
    "fuse_wgrad_accumulation",
    "sequence_parallel",
    "tp_group",
    "tp_size",
}


def default_init_method(weight: torch.Tensor) -> torch.Tensor:
    """TE's ``get_default_init_method()``: ``normal_(mean=0, std=0.023)``."""
    return torch.nn.init.normal_(weight, mean=0.0, std=DEFAULT_INIT_STD)


def init_method_constant(value: float):
    """TE's ``init_method_constant``: fill with ``value`` (norm weights 1 or 0, biases 0)."""

    def init(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.constant_(tensor, value)

    return init


class _TEModule(TEExtraState, torch.nn.Module, metaclass=abc.ABCMeta):
    """TE's module base here: ``_extra_state`` as TE writes it without fp8. An ``ABCMeta`` class,
    so the te-backend registers its classes for megatron's TE wrappers under the TE name they
    derive from in TE (``register``): they are built on megatron's own layers (whose cooperative
    ``super().__init__()`` would reach a real base's TE constructor), and ``isinstance`` /
    ``issubclass`` against the TE name holds for them, as with TE.

    Parameters are registered with their init function, as TE's ``register_parameter(...,
    init_fn=)`` does, and initialised at construction unless on the meta device (TE's
    ``reset_parameters(defer_init=device == "meta")``). ``reset_parameters()`` initialises them
    again; a parameter still on the meta device is first materialised on the host device (TE:
    on CUDA) as a new ``Parameter``; others are initialised in place. Megatron-FSDP's
    ``init_model_with_meta_device`` calls it on each module owning meta parameters after
    ``to_empty``."""

    def _register(self, name: str, param: torch.nn.Parameter | None, init_fn) -> None:
        self.register_parameter(name, param)
        if param is not None:
            self.__dict__.setdefault("_te_init_fns", {})[name] = init_fn

    def reset_parameters(self, defer_init: bool | None = False) -> None:
        if defer_init:
            return
        init_fns = self.__dict__.get("_te_init_fns", {})
        for name, param in list(self.named_parameters(recurse=False)):
            if name not in init_fns:
                continue
            if param.is_meta:
                fresh = torch.empty_like(param, device=_device("cuda"))
                with torch.no_grad():
                    init_fns[name](fresh)
                setattr(self, name, torch.nn.Parameter(fresh, requires_grad=param.requires_grad))
            else:
                with torch.no_grad():
                    init_fns[name](param)

    def _materialise(self, device: torch.device) -> None:
        """Initialise the parameters now unless they live on the meta device (TE's defer_init)."""
        self.reset_parameters(defer_init=device.type == "meta")


class _Norm(torch.nn.Module):
    """One normalization (the parameters belong to the caller: plain or LayerNormLinear's)."""

    @staticmethod
    def apply(x, normalization: str, weight, bias, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
        if normalization == "RMSNorm":
            return rms_norm(x, weight, eps, zero_centered_gamma=zero_centered_gamma)
        gamma = weight + 1 if zero_centered_gamma else weight
        return torch.nn.functional.layer_norm(x, weight.shape, gamma, bias, eps)


def check_normalization(normalization: str) -> None:
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm' (TE's), got {normalization!r}")


def _norm_params(module: _TEModule, prefix: str, hidden: int, normalization: str, zcg: bool, device, dtype):
    """TE's norm parameters: weight filled with 1 (0 with ``zero_centered_gamma``), bias 0 (LayerNorm)."""
    check_normalization(normalization)
    empty = torch.empty(hidden, device=device, dtype=dtype)
    module._register(f"{prefix}weight", torch.nn.Parameter(empty), init_method_constant(float(not zcg)))
    if normalization == "LayerNorm":
        bias = torch.nn.Parameter(torch.empty(hidden, device=device, dtype=dtype))
        module._register(f"{prefix}bias", bias, init_method_constant(0.0))
    else:
        module.register_parameter(f"{prefix}bias", None)


class _BaseNorm(_TEModule):
    """TE's ``LayerNorm`` / ``RMSNorm`` (siblings in TE: neither is an instance of the other)."""

    normalization = ""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool | None = None,
        params_dtype: torch.dtype | None = None,
        zero_centered_gamma: bool = False,
        device: Any = "cuda",
        **kwargs: Any,
    ) -> None:
        _check_common(type(self).__name__, kwargs, {"sm_margin", "normalization"})
        super().__init__()
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.sequence_parallel = bool(sequence_parallel)
        device = _device(device)
        _norm_params(self, "", hidden_size, self.normalization, zero_centered_gamma, device, _dtype(params_dtype))
        self._materialise(device)
        if self.sequence_parallel:
            for param in self.parameters():
                param.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Norm.apply(x, self.normalization, self.weight, self.bias, self.eps, self.zero_centered_gamma)


class LayerNorm(_BaseNorm):
    """TE's ``LayerNorm(hidden_size, eps=1e-5, ..., zero_centered_gamma=False)``."""

    normalization = "LayerNorm"


class RMSNorm(_BaseNorm):
    """TE's ``RMSNorm(hidden_size, eps=1e-5, ..., zero_centered_gamma=False)`` (our RMSNorm kernel)."""

    normalization = "RMSNorm"


def parameter_splits(parameters_split, out_features: int) -> list[tuple[str, int]]:
    """TE's ``parameters_split``: ``None`` is one ``weight``/``bias``; a dict ``{name: rows}`` or a
    tuple of names (equal rows) gives ``{name}_weight`` / ``{name}_bias`` parameters (a trailing
    ``_`` of the name dropped), concatenated along dim 0 for the GEMM. Returns (prefix, rows)."""
    if parameters_split is None:
        return [("", out_features)]
    if isinstance(parameters_split, dict):
        splits = [(f"{name.rstrip('_')}_", int(size)) for name, size in parameters_split.items()]
    elif isinstance(parameters_split, (tuple, list)) and all(isinstance(n, str) for n in parameters_split):
        if not parameters_split:
            raise ValueError("parameters_split: cannot split the weight into 0 parameters")
        size = out_features // len(parameters_split)
        splits = [(f"{name.rstrip('_')}_", size) for name in parameters_split]
    else:
        raise TypeError(f"parameters_split must be None, a dict of sizes or a tuple of names, got {parameters_split!r}")
    if not splits:
        raise ValueError("parameters_split: cannot split the weight into 0 parameters")
    if sum(size for _, size in splits) != out_features:
        raise ValueError(
            f"parameters_split sizes {[size for _, size in splits]} do not add up to out_features={out_features}"
        )
    return splits


class Linear(_TEModule):
    """TE's ``Linear(in_features, out_features, bias=True, init_method=None, return_bias=False,
    params_dtype=None, parallel_mode=None, device="cuda", ...)``; ``forward(x, is_first_microbatch=None)``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        init_method=None,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        device: Any = "cuda",
        tp_size: int = 1,
        tp_group=None,
        sequence_parallel: bool = False,
        parameters_split: dict[str, int] | tuple[str, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        _check_common(type(self).__name__, kwargs, _IGNORED)
        _single_device(type(self).__name__, tp_size, tp_group, sequence_parallel)
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")
        splits = parameter_splits(parameters_split, out_features)
        super().__init__()
        device, dtype = _device(device), _dtype(params_dtype)
        self.in_features, self.out_features = in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.parallel_mode = parallel_mode
        self.sequence_parallel = sequence_parallel
        self.tp_size = 1
        self._register_before_weights(device, dtype)
        self.weight_names = [f"{prefix}weight" for prefix, _ in splits]
        self.bias_names = [f"{prefix}bias" for prefix, _ in splits]
        init_fn = init_method if init_method is not None else default_init_method
        for name, (_, size) in zip(self.weight_names, splits):
            weight = torch.nn.Parameter(torch.empty(size, in_features, device=device, dtype=dtype))
            self._register(name, weight, init_fn)
        for name, (_, size) in zip(self.bias_names, splits):
            if bias:
                value = torch.nn.Parameter(torch.empty(size, device=device, dtype=dtype))
                self._register(name, value, init_method_constant(0.0))
            else:
                self.register_parameter(name, None)
        self._materialise(device)

    def _register_before_weights(self, device: torch.device, dtype: torch.dtype) -> None:
        """Parameters TE registers ahead of the weights (LayerNormLinear's norm)."""

    def _joined(self, names: list[str]) -> torch.Tensor:
        """The weight (or bias) the GEMM uses: TE's split parameters concatenated along dim 0."""
        tensors = [getattr(self, name) for name in names]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)

    def _bias_value(self) -> torch.Tensor | None:
        return self._joined(self.bias_names) if self.use_bias else None

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(
            x, self._joined(self.weight_names), self._bias_value() if self.apply_bias else None
        )

    def forward(
        self,
        inp: torch.Tensor,
        is_first_microbatch: bool | None = None,
        fp8_output: bool = False,
        fp8_grad: bool = False,
    ):
        if fp8_output or fp8_grad:
            refuse(*FP8)
        out = self._linear(inp)
        return (out, self._bias_value()) if self.return_bias else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}"


class LayerNormLinear(Linear):
    """TE's ``LayerNormLinear``: the norm (``layer_norm_weight``/``layer_norm_bias``) then the linear;
    ``return_layernorm_output`` returns the normed input too."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        zero_centered_gamma: bool = False,
        params_dtype: torch.dtype | None = None,
        device: Any = "cuda",
        **kwargs: Any,
    ) -> None:
        check_normalization(normalization)
        self._norm_spec = (normalization, zero_centered_gamma)
        super().__init__(in_features, out_features, bias=bias, params_dtype=params_dtype, device=device, **kwargs)
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = return_layernorm_output_gathered

    def _register_before_weights(self, device: torch.device, dtype: torch.dtype) -> None:
        normalization, zero_centered_gamma = self._norm_spec
        _norm_params(self, "layer_norm_", self.in_features, normalization, zero_centered_gamma, device, dtype)

    def forward(
        self,
        inp: torch.Tensor,
        is_first_microbatch: bool | None = None,
        fp8_output: bool = False,
        fp8_grad: bool = False,
    ):
        if fp8_output or fp8_grad:
            refuse(*FP8)
        normed = _Norm.apply(
            inp, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.zero_centered_gamma
        )
        out = self._linear(normed)
        result = (out, self.bias) if self.return_bias else (out,)
        if self.return_layernorm_output:
            result = (*result, normed)
        return result if len(result) > 1 else result[0]


class GroupedLinear(_TEModule):
    """TE's ``GroupedLinear(num_gemms, in_features, out_features, bias=True, ...)``: ``weight{i}`` /
    ``bias{i}``; ``forward(x, m_splits)`` multiplies the rows of group ``i`` by ``weight{i}``."""

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        init_method=None,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        device: Any = "cuda",
        tp_size: int = 1,
        tp_group=None,
        sequence_parallel: bool = False,
        **kwargs: Any,
    ) -> None:
        _check_common(type(self).__name__, kwargs, _IGNORED | {"is_expert"})
        _single_device(type(self).__name__, tp_size, tp_group, sequence_parallel)
        super().__init__()
        device, dtype = _device(device), _dtype(params_dtype)
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.parallel_mode = parallel_mode
        init_fn = init_method if init_method is not None else default_init_method
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
            self._register(f"weight{i}", weight, init_fn)
        if bias:
            for i in range(num_gemms):
                value = torch.nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
                self._register(f"bias{i}", value, init_method_constant(0.0))
        self._materialise(device)

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: bool | None = None):
        counts = [int(c) for c in (m_splits.tolist() if isinstance(m_splits, torch.Tensor) else m_splits)]
        if len(counts) != self.num_gemms:
            raise ValueError(f"GroupedLinear: {len(counts)} m_splits for {self.num_gemms} GEMMs")
        shape = inp.shape
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]  # no stacked copy kept
        out = gmm_experts(inp.reshape(-1, shape[-1]), weights, counts, trans_b=True)
        out = out.view(*shape[:-1], self.out_features)
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else []
        if self.use_bias and not self.return_bias:
            out = out + torch.repeat_interleave(torch.stack(biases), torch.tensor(counts), dim=0).view_as(out)
        return (out, biases) if self.return_bias else out


def check_set_window_size(attn_mask_type: str, window_size=None) -> tuple[int, int]:
    """TE's ``check_set_window_size``: the sliding window ``(left, right)`` TE's attention uses for
    ``attn_mask_type`` (``-1``: unbounded on that side). ``None`` is no window: ``(-1, 0)`` for causal
    masks, ``(-1, -1)`` otherwise; a causal mask keeps no keys to the right (``right`` becomes 0, with
    TE's warning). What TE rejects with an assertion (or a ``TypeError`` on an int) is a
    ``ValueError`` here naming the argument."""
    if window_size is not None:
        if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
            raise ValueError(
                f"window_size must be a (left, right) pair of ints (TE's sliding window; -1: unbounded), got "
                f"{window_size!r}"
            )
        window_size = (int(window_size[0]), int(window_size[1]))
    if "causal" in attn_mask_type:
        if window_size is None:
            return (-1, 0)
        if window_size == (-1, -1) or (window_size[0] >= 0 and window_size[1] != 0):
            warnings.warn(
                f"window_size should be (-1, 0) or (>=0, 0) for attn_mask_type={attn_mask_type}", stacklevel=2
            )
            return (window_size[0], 0)
        if window_size != (-1, 0) and (window_size[0] < 0 or window_size[1] != 0):
            raise ValueError(f"window_size should be (-1, 0) or (>=0, 0) for attn_mask_type={attn_mask_type}")
        return window_size
    if attn_mask_type in ("no_mask", "padding", "arbitrary"):
        if window_size is None:
            return (-1, -1)
        if window_size == (-1, 0):
            warnings.warn(
                f"window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type={attn_mask_type}", stacklevel=2
            )
            return (-1, -1)
        if window_size != (-1, -1) and (window_size[0] < 0 or window_size[1] < 0):
            raise ValueError(f"window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type={attn_mask_type}")
        return window_size
    raise ValueError(f"attn_mask_type {attn_mask_type!r} is not one of TE's")


def is_window(window_size: tuple[int, int] | None) -> bool:
    """Whether ``window_size`` (after :func:`check_set_window_size`) limits attention at all."""
    return window_size is not None and tuple(window_size) not in ((-1, 0), (-1, -1))


_BANDS = {"no_mask": None, "padding": None, "arbitrary": None, "causal": CAUSAL, "padding_causal": CAUSAL}
_BOTTOM_RIGHT = {"causal_bottom_right": CAUSAL, "padding_causal_bottom_right": CAUSAL}


class DotProductAttention(_TEModule):
    """TE's ``DotProductAttention(num_attention_heads, kv_channels, num_gqa_groups=None,
    attention_dropout=0.0, qkv_format="sbhd", attn_mask_type="causal", window_size=None,
    softmax_scale=None, ...)``; forward ``(query, key, value, attention_mask=None, ...)`` returns
    ``[s, b, heads * v_dim]`` (sbhd), ``[b, s, ...]`` (bshd) or ``[t, ...]`` (thd)."""

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int | tuple[int, int],
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        tp_group=None,
        softmax_scale: float | None = None,
        **kwargs: Any,
    ) -> None:
        cp = kwargs.pop("cp_group", None)
        if cp is not None and torch.distributed.get_world_size(cp) > 1:
            raise ValueError(
                "transformer_engine.pytorch.DotProductAttention (mindspeed_like client module): context parallelism "
                "is megatron's here (--context-parallel-size with megatron's TE specs)"
            )
        _check_common(
            "DotProductAttention",
            kwargs,
            _IGNORED | {"layer_number", "attention_type", "attention_dropout_ctx", "cp_global_ranks", "cp_stream"},
        )
        _single_device("DotProductAttention", tp_size, tp_group, sequence_parallel)
        super().__init__()
        k_dim, v_dim = kv_channels if isinstance(kv_channels, tuple) else (kv_channels, kv_channels)
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups or num_attention_heads
        self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = k_dim, v_dim
        self.attention_dropout = attention_dropout
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type
        self._band(attn_mask_type, None)  # refuse an unknown mask type now
        self.window_size = check_set_window_size(attn_mask_type, window_size)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_dim)

    @staticmethod
    def _band(mask_type: str, window_size) -> Band | None:
        if mask_type in _BANDS:
            band, bottom_right = _BANDS[mask_type], False
        elif mask_type in _BOTTOM_RIGHT:
            band, bottom_right = _BOTTOM_RIGHT[mask_type], True
        else:
            raise ValueError(f"DotProductAttention: attn_mask_type {mask_type!r} is not one of TE's")
        if is_window(window_size):
            left, right = (None if w < 0 else w for w in window_size)
            if band is not None:
                right = 0
            return Band(left, right, bottom_right=True)
        return None if band is None else Band(band.left, band.right, bottom_right=bottom_right)

    def forward(
        self,
        query_layer: torch.Tensor,
        key_layer: torch.Tensor,
        value_layer: torch.Tensor,
        attention_mask: torch.Tensor | tuple | None = None,
        qkv_format: str | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if kwargs.get("fp8_output") or kwargs.get("fp8"):
            refuse(*FP8)
        layout = qkv_format or self.qkv_format
        mask_type = attn_mask_type or self.attn_mask_type
        window = self.window_size if window_size is None else check_set_window_size(mask_type, window_size)
        band = self._band(mask_type, window)
        if isinstance(attention_mask, tuple):  # TE's (q mask, kv mask) for cross attention
            q_mask, kv_mask = attention_mask
            attention_mask = q_mask.transpose(-1, -2) | kv_mask if q_mask is not None else kv_mask
        dropout = self.attention_dropout if self.training else 0.0
        if layout == "thd":
            return flash_attention(
                query_layer,
                key_layer,
                value_layer,
                scale=self.softmax_scale,
                band=band,
                dropout_p=dropout,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_kv=cu_seqlens_kv,
            )
        if layout == "bshd":
            q, k, v = (t.transpose(0, 1) for t in (query_layer, key_layer, value_layer))
        elif layout == "sbhd":
            q, k, v = query_layer, key_layer, value_layer
        else:
            raise ValueError(f"DotProductAttention: qkv_format {layout!r} is not one of sbhd, bshd, thd")
        out = flash_attention(q, k, v, scale=self.softmax_scale, mask=attention_mask, band=band, dropout_p=dropout)
        return out.transpose(0, 1).contiguous() if layout == "bshd" else out


def fp8_autocast(enabled: bool = False, **kwargs: Any):
    """TE's fp8 autocast: ``enabled=False`` (what clients wrap non-fp8 code in) does nothing."""
    return disabled_only(FP8, enabled)


def autocast(enabled: bool = False, **kwargs: Any):
    """TE 2.x's quantization autocast (``fp8_autocast``'s successor)."""
    return disabled_only(FP8, enabled)


def fp8_model_init(enabled: bool = False, **kwargs: Any):
    return disabled_only(FP8, enabled)


def quantized_model_init(enabled: bool = False, **kwargs: Any):
    return disabled_only(FP8, enabled)


_refused_getattr = refused_module_getattr(
    "transformer_engine.pytorch",
    {
        "initialize_ub": USERBUFFERS,
        "make_graphed_callables": CUDA_GRAPHS,
        "get_cpu_offload_context": CPU_OFFLOAD,
        "Float8Tensor": FP8,
    },
)


def __getattr__(name: str) -> Any:
    """The refused names raise their refusal; anything else is absent."""
    return _refused_getattr(name)


__all__ = [
    "DotProductAttention",
    "GroupedLinear",
    "LayerNorm",
    "LayerNormLinear",
    "Linear",
    "RMSNorm",
    "autocast",
    "fp8_autocast",
    "fp8_model_init",
    "quantized_model_init",
]
