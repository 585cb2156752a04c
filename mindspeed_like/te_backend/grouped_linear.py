"""``TEGroupedLinear`` / ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``: MoE
experts' linears as one grouped GEMM, with TE's parameter names.

TE's ``GroupedLinear`` (what megatron's ``TEGroupedMLP`` builds its fc1/fc2 from) holds one weight
per local expert, ``weight0 .. weight{N-1}`` (each ``[out, in]`` like a ColumnParallelLinear
weight; ``bias0 ..`` likewise), and ``forward(x, m_splits)`` multiplies the rows of expert ``e``
(``m_splits[e]`` of them, in order) by ``weight{e}``. megatron makes TE agnostic of model
parallelism for experts (the token dispatcher does the communication): with expert TP or EP the
sizes are divided by the expert-TP size and the GEMMs communicate nothing; this module does the
same, so it never communicates. megatron-core 0.17+ has no other grouped expert path (GroupedMLP
was deleted), so this is also how those releases get grouped experts without TE.

The GEMM is :func:`mindspeed_like.kernels.grouped_gemm.gmm_experts` (the grouped-gemm feature's
kernel: ``torch._grouped_mm`` / an ``mm`` loop into one buffer on CPU, ``npu_grouped_matmul`` on NPU)
on the experts' own weights: autograd keeps the weights themselves, not a stacked copy of them (a
stack is made for one kernel call at a time where the kernel takes one tensor), and an expert
without rows costs no GEMM (moe-alltoall-overlap calls the module once per local expert).
``sharded_state_dict`` is megatron's for its TE grouped linears: one
sharded tensor per expert under the module prefix with the expert axis as an offset (or
``{expert}.``-prefixed singleton shards), replica ids over the expert data-parallel group,
``_extra_state``, ``_extra_state1``, ... per expert; the keys are those of SequentialMLP's
checkpoints, so expert checkpoints move between the two.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu, _initialize_affine_weight_gpu

from mindspeed_like.kernels.grouped_gemm import gmm_experts
from mindspeed_like.te_backend.extra_state import TEExtraState, holds_nothing
from mindspeed_like.te_backend.initialization import te_initialization
from mindspeed_like.te_backend.linear import mark_tensor_parallel, parameter_device
from mindspeed_like.te_backend.refusals import check_config
from mindspeed_like.te_backend.sharding import dp_cp_group, sharded_tensors
from mindspeed_like.te_shim import modules as te_pytorch


def _expert_groups(pg_collection, tp_group) -> tuple[Any, Any, Any]:
    """(expert TP, EP, expert DP) groups: from megatron's pg_collection (0.14+) or its globals."""
    if pg_collection is not None:
        return pg_collection.expt_tp, pg_collection.ep, getattr(pg_collection, "expt_dp", None)
    return (
        tp_group if tp_group is not None else parallel_state.get_expert_tensor_parallel_group(),
        parallel_state.get_expert_model_parallel_group(),
        None,
    )


def _size(group) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else torch.distributed.get_rank(group)


def _merge_extra_states(module: TEGroupedLinear, state_dict: dict, prefix: str, *_args: Any) -> None:
    """``_extra_state1`` .. ``_extra_state{N-1}`` into the one ``_extra_state`` the module has, as
    megatron's TEGroupedLinear does on load: its sharded state dict writes one per expert (so does
    :meth:`TEGroupedLinear.sharded_state_dict`), a distributed checkpoint loads them all back, and a
    strict ``load_state_dict`` would otherwise call them unexpected. The first non-empty one stands
    for all (fp8 scaling state, which ``set_extra_state`` drops, saying so)."""
    extras = [state_dict.pop(f"{prefix}_extra_state{e}", None) for e in range(1, module.num_gemms)]
    if holds_nothing(state_dict.get(f"{prefix}_extra_state")):
        filled = [extra for extra in extras if not holds_nothing(extra)]
        if filled:
            state_dict[f"{prefix}_extra_state"] = filled[0]


class TEGroupedLinear(TEExtraState, torch.nn.Module):
    """megatron's ``TEGroupedLinear`` contract (experts only, as in megatron)."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str | None,
        config,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        pg_collection=None,
        tp_group=None,
        **newer: Any,
    ) -> None:
        unknown = set(newer) - {"name"}
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword arguments {sorted(unknown)}")
        assert is_expert, "TEGroupedLinear only supports expert parallelism"  # megatron's assertion
        check_config(config)
        super().__init__()
        self.config = config
        self.num_gemms = num_gemms
        self.skip_bias_add = skip_bias_add
        self.use_bias = bias
        self.te_return_bias = skip_bias_add and bias
        self.parallel_mode = parallel_mode
        self.tp_comm_buffer_name = tp_comm_buffer_name
        self._pg_collection = pg_collection
        self._tp_group, self._ep_group, self._edp_group = _expert_groups(pg_collection, tp_group)
        self.expert_parallel = config.expert_model_parallel_size > 1
        tp_size, tp_rank = _size(self._tp_group), _rank(self._tp_group)
        partition_dim = 1 if parallel_mode == "row" else 0
        self.in_features = input_size // tp_size if parallel_mode == "row" else input_size
        self.out_features = output_size // tp_size if parallel_mode == "column" else output_size
        if (input_size if parallel_mode == "row" else output_size) % tp_size:
            raise ValueError(f"{type(self).__name__}: size not divisible by the expert TP size {tp_size}")
        device = parameter_device(config)
        for e in range(num_gemms):
            weight = torch.nn.Parameter(
                torch.empty(self.out_features, self.in_features, dtype=config.params_dtype, device=device)
            )
            if config.perform_initialization:  # megatron's initialisation (it marks the shard too)
                if config.use_cpu_initialization:
                    _initialize_affine_weight_cpu(
                        weight,
                        output_size,
                        input_size,
                        self.out_features if partition_dim == 0 else self.in_features,
                        partition_dim,
                        init_method,
                        params_dtype=config.params_dtype,
                        rank=tp_rank,
                        world_size=tp_size,
                    )
                else:
                    with te_initialization():
                        _initialize_affine_weight_gpu(weight, init_method, partition_dim=partition_dim, is_expert=True)
            # TE's GroupedLinear marks every weight, and column biases, whatever perform_initialization says
            mark_tensor_parallel(weight, partition_dim, 1)
            self.register_parameter(f"weight{e}", weight)
            if bias:
                b = torch.nn.Parameter(torch.zeros(self.out_features, dtype=config.params_dtype, device=device))
                if parallel_mode == "column":
                    mark_tensor_parallel(b, 0, 1)
                else:  # TE: its sequence_parallel, False for experts (megatron hands TE a TP size of 1)
                    b.sequence_parallel = False
                self.register_parameter(f"bias{e}", b)
        for param in self.parameters():
            param.allreduce = not (is_expert and self.expert_parallel)
        self._register_load_state_dict_pre_hook(_merge_extra_states, with_module=True)

    def weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"weight{e}") for e in range(self.num_gemms)]

    def biases(self) -> list[torch.Tensor]:
        return [getattr(self, f"bias{e}") for e in range(self.num_gemms)] if self.use_bias else []

    def forward(self, x: torch.Tensor, m_splits) -> tuple[torch.Tensor, Any]:
        counts = [int(c) for c in (m_splits.tolist() if isinstance(m_splits, torch.Tensor) else m_splits)]
        if len(counts) != self.num_gemms:
            raise ValueError(f"{type(self).__name__}: {len(counts)} m_splits for {self.num_gemms} GEMMs")
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        out = gmm_experts(rows, self.weights(), counts, trans_b=True)  # keeps no stack of the weights
        if self.use_bias and not self.skip_bias_add:
            per_row = torch.repeat_interleave(torch.stack(self.biases()), torch.tensor(counts), dim=0)
            out = out + per_row.to(out.dtype)
        out = out.view(*shape[:-1], self.out_features)
        if self.te_return_bias:
            return out, self.biases()
        return out, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        return self._sharded_state_dict_grouped(self._tp_axis_map(), prefix, sharded_offsets, metadata)

    def _sharded_state_dict_grouped(self, tp_axis_map, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """megatron's ``TEGroupedLinear._sharded_state_dict_grouped`` contract (``tp_axis_map`` None:
        not split over TP). Clients call it by name: mcore-bridge 1.6.5 replaces the base class's
        ``sharded_state_dict`` with a call of it (ms-swift's MoE checkpoint save stopped on its absence)."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

        singleton_local_shards = (metadata or {}).get("singleton_local_shards", False)
        axis_map = tp_axis_map
        num_global = _size(self._ep_group) * self.num_gemms
        offset = _rank(self._ep_group) * self.num_gemms
        ep_axis = len(sharded_offsets)
        extra = self.get_extra_state()
        result: dict = {}
        metadata = {**(metadata or {}), "dp_cp_group": dp_cp_group(metadata)}
        for e in range(self.num_gemms):
            expert = offset + e
            state_dict = {f"{e}.weight": getattr(self, f"weight{e}"), f"{e}._extra_state": extra}
            if self.use_bias:
                state_dict[f"{e}.bias"] = getattr(self, f"bias{e}")
            if singleton_local_shards:
                expert_prefix, offsets = f"{expert}.{prefix}", tuple(sharded_offsets)
            else:
                expert_prefix, offsets = prefix, (*sharded_offsets, (ep_axis, expert, num_global))
            sub = sharded_tensors(state_dict, "", axis_map, offsets, self._tp_group, metadata)
            replace_prefix_for_sharding(sub, f"{e}.", expert_prefix)
            result[f"{prefix}weight{e}"] = sub[f"{e}.weight"]
            result[f"{prefix}_extra_state{'' if e == 0 else e}"] = sub[f"{e}._extra_state"]
            if self.use_bias:
                result[f"{prefix}bias{e}"] = sub[f"{e}.bias"]
        edp_rank = self._expert_dp_rank()
        for sharded in result.values():  # replication along DP modulo EP, as megatron's
            replica = sharded.replica_id
            edp = 0 if getattr(sharded, "is_data_parallel_fully_shard", False) else edp_rank
            sharded.replica_id = (*replica[:2], edp)
        return result

    def _tp_axis_map(self) -> dict[str, int]:
        if self.parallel_mode == "row":
            return {f"{e}.weight": 1 for e in range(self.num_gemms)}
        return {name: 0 for e in range(self.num_gemms) for name in (f"{e}.weight", f"{e}.bias")}

    def _expert_dp_rank(self) -> int:
        if self._edp_group is not None:
            return _rank(self._edp_group)
        return parallel_state.get_expert_data_parallel_rank()

    def backward_dw(self) -> None:
        """TE's delayed weight-gradient hook; nothing is delayed here."""

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}"
        )


te_pytorch.GroupedLinear.register(TEGroupedLinear)  # and its column / row subclasses


class TEColumnParallelGroupedLinear(TEGroupedLinear):
    """megatron's column-parallel grouped linear (fc1): weights split along the output."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, **kwargs: Any) -> None:
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Its own, as megatron's subclass has: a client's patch of the base class's (mcore-bridge's
        passes no TP axes) leaves the TP-split experts' checkpoint as it is."""
        return self._sharded_state_dict_grouped(self._tp_axis_map(), prefix, sharded_offsets, metadata)


class TERowParallelGroupedLinear(TEGroupedLinear):
    """megatron's row-parallel grouped linear (fc2): weights split along the input."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, **kwargs: Any) -> None:
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Its own, as megatron's subclass has: a client's patch of the base class's (mcore-bridge's
        passes no TP axes) leaves the TP-split experts' checkpoint as it is."""
        return self._sharded_state_dict_grouped(self._tp_axis_map(), prefix, sharded_offsets, metadata)
