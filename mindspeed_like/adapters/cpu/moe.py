"""CPU adapter, mixture of experts (SequentialMLP; allgather and alltoall dispatchers; EP).

Targets (megatron/core/transformer/moe, 0.13-0.16):
* ``moe_utils.RouterGatingLinearFunction.forward/backward``: test ``te_general_gemm is not None``,
  a name bound only when TransformerEngine imports (NameError without it). Their host twins
  see ``te_general_gemm = None`` while the module lacks the name (optional: newer helper).
* ``moe_utils.maybe_move_tensor_to_cpu``: converts split sizes to host numbers only for CUDA
  tensors; on CPU the ``as_numpy`` request is ignored and gloo's ``all_to_all_single`` gets
  tensors as split sizes (TypeError with EP>1). Wrapped: a CPU tensor asked for ``as_numpy``
  becomes a numpy array, exactly what the CUDA path returns; everything else is unchanged.
* ``token_dispatcher.MoEAlltoAllTokenDispatcher.__init__`` and ``._maybe_dtoh_and_synchronize``:
  create and use ``torch.cuda.Stream()``; host twins (no-op streams/events).
* ``router.TopKRouter.__init__``, ``router.Router.gating``: buffers/weights on
  ``torch.cuda.current_device()``; ``moe_utils.track_moe_metrics`` (optional): ``'cuda'``
  metric tensors; host twins.
"""

from __future__ import annotations

from mindspeed_like.adapters.cpu.devices import on_host
from mindspeed_like.adapters.cpu.host_view import host_wrapper
from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.targets import MOE

_without_te = host_wrapper(missing_globals={"te_general_gemm": None})


def _host_numbers(wrapped, instance, args, kwargs):
    call = Call(wrapped, args, kwargs)
    tensor, as_numpy = call["tensor"], call.get("as_numpy", False)
    if as_numpy and hasattr(tensor, "is_cuda") and tensor.device.type == "cpu":
        return tensor.numpy()
    return wrapped(*args, **kwargs)


PATCHES = [
    Patch(
        f"{MOE}.moe_utils.RouterGatingLinearFunction.forward",
        Kind.WRAP,
        _without_te,
        optional=True,
        why="te_general_gemm is unbound without TransformerEngine",
    ),
    Patch(
        f"{MOE}.moe_utils.RouterGatingLinearFunction.backward",
        Kind.WRAP,
        _without_te,
        optional=True,
        why="te_general_gemm is unbound without TransformerEngine",
    ),
    Patch(
        f"{MOE}.moe_utils.maybe_move_tensor_to_cpu",
        Kind.WRAP,
        _host_numbers,
        optional=True,
        why="split sizes must be host numbers for gloo all_to_all",
    ),
    on_host("transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher.__init__", "torch.cuda.Stream()"),
    on_host(
        "transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
        "cuda streams and events",
        optional=True,
    ),
    on_host("transformer.moe.router.TopKRouter.__init__", "buffers on torch.cuda.current_device()"),
    on_host("transformer.moe.router.Router.gating", "moves gate weights to torch.cuda.current_device()"),
    on_host("transformer.moe.moe_utils.track_moe_metrics", "metric tensors on device='cuda'", optional=True),
    # Legacy GroupedMLP (megatron's moe_grouped_gemm): without use_cpu_initialization its
    # weights go to torch.cuda.current_device(). Before, megatron's grouped_gemm assertion
    # stopped it earlier; with the grouped-gemm feature providing the op it is reached.
    # Deleted in megatron-core 0.17 (SequentialMLP's experts are MLPs, adapted above).
    on_host("transformer.moe.experts.GroupedMLP.__init__", "weights on torch.cuda.current_device()", versions="<0.17"),
]
