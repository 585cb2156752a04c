"""Emulator of torch_npu's MC2 kernels (notes/torch-npu-ops.md), performing the REAL collective
on the process group the communicator name stands for (gloo here):

    npu_all_gather_base_mm(input (m, k), x2 (k, n), hcom, world_size, *, bias=None,
                           gather_index=0, gather_output=True, comm_turn=0)
        -> (all_gather(input) @ x2 (m*ws, n), all_gather(input) (m*ws, k) or empty)
    npu_mm_reduce_scatter_base(input (m, k), x2 (k, n), hcom, world_size, *, reduce_op='sum',
                               bias=None, comm_turn=0) -> reduce_scatter(input @ x2) (m/ws, n)

Contract enforced (ContractError): exactly four positional arguments, the rest keyword-only and
known; 2-D tensors of one dtype, fp16 or bf16 (the kernels' dtypes); ``input`` contiguous;
k = input.shape[1] == x2.shape[0] and 256 <= k < 65535; ``hcom`` a name this emulator gave
out (``emulator_hccl_comm_name``) and ``world_size`` in {2, 4, 8} equal to that group's size;
no non-zero bias; ``comm_turn == 0``; ``reduce_op == 'sum'``; m divisible by world_size for
the reduce-scatter; one communicator for every MC2 call under one emulator (A2 hardware).
No autograd, like the real kernels: outputs never carry a grad_fn.
``gather_index=1`` (gathering x2) is a valid call the emulator does not model: it raises
NotImplementedError rather than pretend.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from mindspeed_like.testing.npu_emulator import ContractError, register

_GROUPS: dict[str, object] = {}
_DTYPES = (torch.float16, torch.bfloat16)
WORLD_SIZES = (2, 4, 8)


@register("emulator_hccl_comm_name")
def emulator_hccl_comm_name(group) -> str:
    """Stand-in for ``group._get_backend(npu).get_hccl_comm_name(rank)``: a name for a gloo group."""
    for name, known in _GROUPS.items():
        if known is group:
            return name
    ranks = "_".join(str(r) for r in dist.get_process_group_ranks(group))
    name = f"emulated_hccl_{len(_GROUPS)}_ranks_{ranks}"  # one name per group object, like HCCL
    _GROUPS[name] = group
    return name


def _check(op: str, args: tuple, kwargs: dict, allowed: dict) -> tuple:
    if len(args) != 4:
        raise ContractError(f"{op}(input, x2, hcom, world_size, *, ...) takes 4 positional arguments, got {len(args)}")
    unknown = set(kwargs) - set(allowed)
    if unknown:
        raise ContractError(f"{op}: unexpected keyword(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    options = {**allowed, **kwargs}
    input, x2, hcom, world_size = args
    for name, tensor in (("input", input), ("x2", x2)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
            raise ContractError(f"{op}: {name} must be a 2-D tensor, got {getattr(tensor, 'shape', type(tensor))}")
        if tensor.dtype not in _DTYPES:
            raise ContractError(f"{op}: {name} dtype {tensor.dtype} unsupported (fp16/bf16)")
    if input.dtype != x2.dtype:
        raise ContractError(f"{op}: input {input.dtype} and x2 {x2.dtype} differ")
    if not input.is_contiguous():
        raise ContractError(f"{op}: input must be contiguous")
    k = input.shape[1]
    if x2.shape[0] != k:
        raise ContractError(f"{op}: input (m, k={k}) and x2 {tuple(x2.shape)} do not chain (x2 must be (k, n))")
    if not 256 <= k < 65535:
        raise ContractError(f"{op}: k={k} outside [256, 65535)")
    if not isinstance(hcom, str) or hcom not in _GROUPS:
        raise ContractError(f"{op}: hcom {hcom!r} is not a communicator name (use the group's hccl comm name)")
    group = _GROUPS[hcom]
    if not isinstance(world_size, int) or world_size not in WORLD_SIZES:
        raise ContractError(f"{op}: world_size {world_size!r} not in {WORLD_SIZES}")
    if world_size != group.size():
        raise ContractError(f"{op}: world_size {world_size} but communicator {hcom} has {group.size()} ranks")
    bias = options.get("bias")
    if bias is not None and bool(torch.count_nonzero(bias)):
        raise ContractError(f"{op}: a non-zero bias is unsupported; add it after the kernel")
    if options.get("comm_turn", 0) != 0:
        raise ContractError(f"{op}: comm_turn must be 0")
    module = sys.modules.get("torch_npu")
    first = module.__dict__.setdefault("_mc2_hcom", hcom) if module is not None else hcom
    if first != hcom:
        raise ContractError(f"{op}: communicator {hcom} differs from {first}; all MC2 ops must share one")
    return input, x2, group, world_size, options


@register("npu_all_gather_base_mm")
def npu_all_gather_base_mm(*args, **kwargs):
    allowed = dict(bias=None, gather_index=0, gather_output=True, comm_turn=0)
    input, x2, group, world_size, options = _check("npu_all_gather_base_mm", args, kwargs, allowed)
    if options["gather_index"] not in (0, 1):
        raise ContractError(f"npu_all_gather_base_mm: gather_index must be 0 or 1, got {options['gather_index']!r}")
    if options["gather_index"] == 1:
        raise NotImplementedError("the emulator models gather_index=0 (gather the first input) only")
    with torch.no_grad():
        gathered = torch.empty((input.shape[0] * world_size, input.shape[1]), dtype=input.dtype)
        dist.all_gather_into_tensor(gathered, input, group=group)
        out = gathered @ x2
    return out, gathered if options["gather_output"] else torch.empty(0, dtype=input.dtype)


@register("npu_mm_reduce_scatter_base")
def npu_mm_reduce_scatter_base(*args, **kwargs):
    allowed = dict(reduce_op="sum", bias=None, comm_turn=0)
    input, x2, group, world_size, options = _check("npu_mm_reduce_scatter_base", args, kwargs, allowed)
    if options["reduce_op"] != "sum":
        raise ContractError(f"npu_mm_reduce_scatter_base: reduce_op {options['reduce_op']!r} unsupported (sum)")
    if input.shape[0] % world_size != 0:
        raise ContractError(f"npu_mm_reduce_scatter_base: m={input.shape[0]} not divisible by world_size {world_size}")
    with torch.no_grad():
        product = (input @ x2).float()  # gloo reduces in fp32 here; the kernel accumulates wider too
        out = torch.empty((input.shape[0] // world_size, x2.shape[1]), dtype=torch.float32)
        dist.reduce_scatter_tensor(out, product, group=group)
    return out.to(input.dtype)
