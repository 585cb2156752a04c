"""``TELinear``, ``TEColumnParallelLinear``, ``TERowParallelLinear``: megatron's TE linears on
megatron's own parallel layers.

megatron's TE wrappers subclass TE's ``Linear``; the column and row ones behave as megatron's
``ColumnParallelLinear`` / ``RowParallelLinear`` (same shards, same ``(output, bias)`` return with
``skip_bias_add``, same ``sharded_state_dict`` axes), plus TE's ``_extra_state``. So here they ARE
megatron's parallel linears (subclasses), with TE's constructor contract (keyword arguments,
``tp_comm_buffer_name``/``symmetric_ar_type`` accepted, ``gather_output``/``input_is_parallel=False``
refused like TE) and TE's ``_extra_state``: everything that acts on megatron's linears (the
tp-overlap feature's wrap of ``linear_with_grad_accumulation_and_async_allreduce`` and of
``RowParallelLinear.forward``, DDP's gradient hooks, SP) acts on these. Their forward and
``sharded_state_dict`` are looked up on megatron's class at call time, so a feature's wrap of
``RowParallelLinear.forward`` reaches them.

``TELinear`` itself is the "duplicated" linear (no tensor parallelism, the weight replicated over
TP ranks; MLA's down projections, MoE latent projections): weight ``[out, in]``, initialised under
the data-parallel RNG tracker as TE does (the same weights on every TP rank), parameters marked
``sequence_parallel`` under SP (their inputs are sequence shards, so their gradients are summed
over TP), computed by megatron's ``linear_with_grad_accumulation_and_async_allreduce`` without
communication. ``isinstance(x, TELinear)`` holds for the column and row linears, as in megatron,
and so does ``isinstance(x, transformer_engine.pytorch.Linear)`` (the te-client-module's class).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel import layers
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from mindspeed_like.te_backend.extra_state import TEExtraState
from mindspeed_like.te_backend.initialization import te_initialization
from mindspeed_like.te_backend.refusals import check_config
from mindspeed_like.te_backend.sharding import sharded_tensors
from mindspeed_like.te_shim import modules as te_pytorch
from mindspeed_like.toolkit.binding import accepted


def parameter_device(config) -> str | int:
    """Where megatron allocates a new parameter: the host for CPU initialisation or without an
    accelerator, else the current device (torch_npu's transfer_to_npu maps torch.cuda to the NPU)."""
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.current_device()


def mark_tensor_parallel(tensor: torch.Tensor, dim: int, stride: int) -> None:
    """Mark ``tensor`` as a TP shard along ``dim`` (megatron's ``tensor_model_parallel``,
    ``partition_dim``, ``partition_stride``), as TE's ``Linear`` / ``LayerNormLinear`` /
    ``GroupedLinear`` ``reset_parameters`` does for every column / row weight and column bias
    whatever megatron's ``perform_initialization`` says (megatron's wrappers then set
    ``partition_stride``). megatron-core < 0.18's parallel linears set these only while
    initialising; a model built with ``perform_initialization=False`` (weights loaded afterwards)
    would otherwise count only TP rank 0's shards in megatron's grad norm and clipping
    (``param_is_not_tensor_parallel_duplicate``). Overwrites: where megatron's initialisation set
    them the values are the same."""
    tensor.tensor_model_parallel = True
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def _ignored_newer(name: str, values: dict[str, Any]) -> None:
    """Keyword arguments newer megatron releases pass that change nothing here."""
    unknown = set(values) - {"name", "gtp_remat_group", "gtp_remat_size"}
    if unknown:
        raise TypeError(f"{name}() got unexpected keyword arguments {sorted(unknown)}")


def _column_row_kwargs(base: type, tp_group, stride: int | None, name: str | None) -> dict[str, Any]:
    optional: dict[str, Any] = {"tp_group": tp_group, "name": name}
    if stride is not None:
        optional["stride"] = stride
    return accepted(base.__init__, **optional)


def set_te_sizes(linear: torch.nn.Module, in_features: int, out_features: int, *, tp_size: int, bias: bool) -> None:
    """TE's public attributes of a ``transformer_engine.pytorch.Linear``, which clients read:
    mcore-bridge's ``TELinear.__repr__`` (called when ms-swift logs the model before LoRA) and its
    LoRA layers size their adapters from ``in_features`` / ``out_features`` / ``tp_size``. As TE
    sets them: this rank's shard (a column linear's ``out_features`` and a row linear's
    ``in_features`` divided by ``tp_size``), ``tp_size`` 1 where megatron gives TE no tensor-parallel
    group (duplicated, and experts under explicit expert communication), ``use_bias`` as asked."""
    linear.in_features, linear.out_features = in_features, out_features
    linear.tp_size = tp_size
    linear.use_bias = bias


def hide_megatron_sizes(linear: ColumnParallelLinear) -> None:
    """Take megatron's ``input_size`` / ``output_size`` (the full sizes) off a column linear, which
    TE's ``Linear`` does not have; they stay readable as ``_megatron_sizes``.

    peft's ``_get_in_out_features`` reads ``input_size`` / ``output_size`` ("megatron's parallel
    linears") before ``in_features`` / ``out_features``, so a LoRA layer on this linear took the full
    output size for TE's per-rank one. mcore-bridge's LoRA multiplies that by ``tp_size`` for its
    column-parallel ``lora_B``: at TP=2 the adapter gave twice the base layer's outputs
    (ms-swift ``--tuner_type lora`` at TP=2 stopped on ``64 vs 128`` in mcore-bridge's
    ``tuners/lora.py``). The row linear keeps them: mcore-bridge takes it for megatron's
    ``RowParallelLinear`` (it is one) and then sizes its row-parallel ``lora_A`` from the full input
    size peft reads there, which is right."""
    linear._megatron_sizes = (linear.__dict__.pop("input_size"), linear.__dict__.pop("output_size"))


class TELinear(TEExtraState, torch.nn.Module):
    """megatron's ``TELinear`` with ``parallel_mode="duplicated"`` (column/row: the subclasses)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str | None,
        config,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        skip_weight_param_allocation: bool,
        tp_comm_buffer_name: str | None = None,
        is_expert: bool = False,
        symmetric_ar_type: str | None = None,
        tp_group=None,
        **newer: Any,
    ) -> None:
        _ignored_newer("TELinear", newer)
        if parallel_mode != "duplicated":
            raise ValueError(
                f"TELinear(parallel_mode={parallel_mode!r}): this backend builds TELinear as the duplicated linear; "
                "use TEColumnParallelLinear / TERowParallelLinear for column / row parallelism"
            )
        if tp_group is not None:
            raise ValueError("duplicated linear should not have tp_group set")  # megatron's assertion
        if skip_weight_param_allocation:
            raise ValueError("Transformer Engine linear layers do not support skip_weight_param_allocation")
        check_config(config)
        super().__init__()
        self.config = config
        self.input_size, self.output_size = input_size, output_size
        self.parallel_mode = None  # TE's value for duplicated (megatron's sharded_state_dict asserts it)
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.tp_comm_buffer_name = tp_comm_buffer_name
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.expert_parallel = config.expert_model_parallel_size > 1
        from megatron.core.utils import get_tensor_model_parallel_group_if_none

        self._tp_group = get_tensor_model_parallel_group_if_none(None, is_expert=is_expert)
        device = (
            "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        )
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype, device=device))
        else:
            self.register_parameter("bias", None)
        set_te_sizes(self, input_size, output_size, tp_size=1, bias=bias)
        if config.perform_initialization:
            self._initialize(init_method)
        for param in self.parameters():
            if is_expert:
                param.allreduce = not self.expert_parallel
            else:
                param.allreduce = True
                param.sequence_parallel = config.sequence_parallel

    def _initialize(self, init_method) -> None:
        """Under the tracker TE forks: experts' for experts, else the data-parallel one (one
        seed on every TP rank: the weight is the same on all of them)."""
        from megatron.core.tensor_parallel import random

        name = (
            random.get_expert_parallel_rng_tracker_name()
            if self.is_expert
            else random.get_data_parallel_rng_tracker_name()
        )
        with torch.no_grad():
            if self.config.use_cpu_initialization:
                init_method(self.weight)
            else:
                with te_initialization(), get_cuda_rng_tracker().fork(name):
                    init_method(self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if self.skip_bias_add else self.bias
        out = layers.linear_with_grad_accumulation_and_async_allreduce(
            input=x,
            weight=self.weight,
            bias=bias,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=False,
            sequence_parallel=False,
        )
        return out, (self.bias if self.skip_bias_add else None)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Replicated over TP and DP (megatron's TELinear: duplicated mode only)."""
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return sharded_tensors(state_dict, prefix, None, sharded_offsets, self._tp_group, metadata)

    def backward_dw(self) -> None:
        """TE's delayed weight-gradient hook; nothing is delayed here (refused at construction)."""

    def extra_repr(self) -> str:
        return f"in_features={self.input_size}, out_features={self.output_size}, bias={self.bias is not None}"


te_pytorch.Linear.register(TELinear)  # the column and row linears too: one class per TE name


class TEColumnParallelLinear(TELinear, ColumnParallelLinear):
    """megatron's ``TEColumnParallelLinear``: a ``ColumnParallelLinear`` with TE's contract."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group=None,
        stride: int = 1,
        **newer: Any,
    ) -> None:
        _ignored_newer(type(self).__name__, newer)
        if gather_output:
            raise ValueError("Transformer Engine linear layers do not support gather_output = True")
        if skip_weight_param_allocation:
            raise ValueError("Transformer Engine linear layers do not support skip_weight_param_allocation")
        check_config(config)
        with te_initialization():
            ColumnParallelLinear.__init__(
                self,
                input_size,
                output_size,
                config=config,
                init_method=init_method,
                bias=bias,
                gather_output=False,
                skip_bias_add=skip_bias_add,
                is_expert=is_expert,
                tp_comm_buffer_name=tp_comm_buffer_name,
                **_column_row_kwargs(ColumnParallelLinear, tp_group, stride, newer.get("name")),
            )
        self.parallel_mode = "column"
        self._tp_group = self.tp_group
        split = 1 if self.explicit_expert_comm else self.output_size // self.output_size_per_partition
        set_te_sizes(self, input_size, self.output_size_per_partition, tp_size=split, bias=bias)
        hide_megatron_sizes(self)
        # TE's reset_parameters (dim 0), then megatron's wrapper's partition_stride
        mark_tensor_parallel(self.weight, 0, stride)
        if self.bias is not None:
            mark_tensor_parallel(self.bias, 0, stride)

    def forward(self, *args: Any, **kwargs: Any):
        if (len(args) > 1 and args[1] is not None) or kwargs.get("weight") is not None:
            # megatron's ColumnParallelLinear takes an outside weight (checked against its
            # input_size, hidden here); TE's linear owns its weight: megatron's wrapper is forward(x)
            raise TypeError(f"{type(self).__name__}.forward(x) takes no weight: a TE linear owns its weight")
        _no_tp_comm_when_unset(self)
        return ColumnParallelLinear.forward(self, *args, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Sharding along axis 0, bias sharded (megatron's)."""
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return sharded_tensors(state_dict, prefix, {"weight": 0, "bias": 0}, sharded_offsets, self.tp_group, metadata)

    def backward_dw(self) -> None:
        ColumnParallelLinear.backward_dw(self)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        """megatron's ColumnParallelLinear's text (full sizes), from the sizes hidden at construction."""
        full_in, full_out = self._megatron_sizes
        return (
            f"{type(self).__name__}(in_features={full_in}, out_features={full_out}, "
            f"bias={self.bias is not None}, TP={full_out // self.output_size_per_partition})"
        )


def _no_tp_comm_when_unset(linear: Any) -> None:
    """TE's ``parallel_mode=None`` means "no tensor-parallel communication"; megatron sets it on a
    built TE linear to do the communication itself (its shared experts under
    ``moe_shared_expert_overlap``: ``pre_forward_comm`` / ``post_forward_comm``). megatron's parallel
    linears say the same with ``explicit_expert_comm``."""
    if linear.parallel_mode is None:
        linear.explicit_expert_comm = True


class TERowParallelLinear(TELinear, RowParallelLinear):
    """megatron's ``TERowParallelLinear``: a ``RowParallelLinear`` with TE's contract."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        tp_group=None,
        **newer: Any,
    ) -> None:
        _ignored_newer(type(self).__name__, newer)
        if not input_is_parallel:
            raise ValueError("Transformer Engine linear layers do not support input_is_parallel = False")
        check_config(config)
        with te_initialization():
            RowParallelLinear.__init__(
                self,
                input_size,
                output_size,
                config=config,
                init_method=init_method,
                bias=bias,
                input_is_parallel=True,
                skip_bias_add=skip_bias_add,
                is_expert=is_expert,
                tp_comm_buffer_name=tp_comm_buffer_name,
                **_column_row_kwargs(RowParallelLinear, tp_group, None, newer.get("name")),
            )
        self.parallel_mode = "row"
        self._tp_group = self.tp_group
        split = 1 if self.explicit_expert_comm else self.input_size // self.input_size_per_partition
        set_te_sizes(self, self.input_size_per_partition, output_size, tp_size=split, bias=bias)
        mark_tensor_parallel(self.weight, 1, 1)  # TE's reset_parameters; the bias is megatron's (sequence_parallel)

    def forward(self, *args: Any, **kwargs: Any):
        _no_tp_comm_when_unset(self)
        return RowParallelLinear.forward(self, *args, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Sharding along axis 1, bias not sharded (megatron's)."""
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return sharded_tensors(state_dict, prefix, {"weight": 1}, sharded_offsets, self.tp_group, metadata)

    def backward_dw(self) -> None:
        RowParallelLinear.backward_dw(self)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        return RowParallelLinear.__repr__(self)
