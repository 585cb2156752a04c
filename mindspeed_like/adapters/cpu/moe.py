"""CPU adapter, mixture of experts (SequentialMLP; allgather and alltoall dispatchers; EP).

Targets (megatron/core/transformer/moe, 0.13-0.16):
* ``moe_utils.maybe_move_tensor_to_cpu``: converts split sizes to host numbers only for CUDA
  tensors; on CPU the ``as_numpy`` request is ignored and gloo's ``all_to_all_single`` gets
  tensors as split sizes (TypeError with EP>1). Wrapped: a CPU tensor asked for ``as_numpy``
  becomes a numpy array, exactly what the CUDA path returns; everything else is unchanged.
* ``token_dispatcher.MoEAlltoAllTokenDispatcher.__init__`` and ``._maybe_dtoh_and_synchronize``:
  create and use ``torch.cuda.Stream()``; host twins (no-op streams/events).
* ``shared_experts.SharedExpertMLP``: with megatron's ``moe_shared_expert_overlap`` the shared
  experts' pieces (``pre_forward_comm`` ... ``get_output``, called by the alltoall dispatcher)
  run on a second ``torch.cuda.Stream`` made in ``__init__`` (0.18+: also ``wait_current_stream``
  and ``_BackwardStreamWait.backward``); host twins run them in program order (one host stream),
  so megatron's flag trains as megatron computes it. What overlaps them with the all-to-alls on a
  host is moe-alltoall-overlap's pipeline (asynchronous collectives).
* ``router.TopKRouter.__init__``, ``router.Router.gating``: buffers/weights on
  ``torch.cuda.current_device()``; ``moe_utils.track_moe_metrics`` (optional): ``'cuda'``
  metric tensors; host twins.

The router's gating GEMM (``moe_utils.RouterGatingLinearFunction``, whose ``te_general_gemm`` is
unbound without TransformerEngine) is not a host matter: fix-moe-router-without-te covers it on
every device.
"""

from __future__ import annotations

from mindspeed_like.adapters.cpu.devices import on_host
from mindspeed_like.adapters.cpu.host_view import run_on_host
from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.fallback import Fallback
from mindspeed_like.toolkit.targets import CORE, MOE


def _host_numbers(wrapped, instance, args, kwargs):
    call = Call(wrapped, args, kwargs)
    tensor, as_numpy = call["tensor"], call.get("as_numpy", False)
    if as_numpy and hasattr(tensor, "is_cuda") and tensor.device.type == "cpu":
        return tensor.numpy()
    return wrapped(*args, **kwargs)


SHARED_OVERLAP_ON_HOST = (
    "moe_shared_expert_overlap on a host: megatron's second CUDA stream does not exist, so its shared-expert "
    "pieces run in program order (same results); what overlaps them with the dispatcher's all-to-alls here is "
    "moe-alltoall-overlap's pipeline (--moe-alltoall-overlap-comm, alltoall dispatcher, EP > 1), which runs them "
    "under its asynchronous all-to-alls; without it nothing overlaps"
)


def _shared_experts_init(wrapped, instance, args, kwargs):
    """``SharedExpertMLP.__init__`` as its host twin, saying once what the overlap flag does here."""
    result = run_on_host(wrapped, instance, args, kwargs)
    if getattr(instance.config, "moe_shared_expert_overlap", False):
        Fallback("cpu-adapter", strict=False).once("moe_shared_expert_overlap", SHARED_OVERLAP_ON_HOST)
    return result


PATCHES = [
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
    Patch(
        f"{CORE}.transformer.moe.shared_experts.SharedExpertMLP.__init__",
        Kind.WRAP,
        _shared_experts_init,
        why="moe_shared_expert_overlap makes a torch.cuda.Stream() (host twin; what the flag does here, said once)",
    ),
    *[
        on_host(f"transformer.moe.shared_experts.SharedExpertMLP.{name}", "runs on the shared experts' CUDA stream")
        for name in (
            "pre_forward_comm",
            "linear_fc1_forward_and_act",
            "linear_fc2_forward",
            "post_forward_comm",
            "get_output",
        )
    ],
    on_host(
        "transformer.moe.shared_experts.SharedExpertMLP.wait_current_stream",
        "waits on torch.cuda.current_stream()",
        versions=">=0.18",
    ),
    on_host(
        "transformer.moe.shared_experts._BackwardStreamWait.backward",
        "waits on torch.cuda.current_stream()",
        versions=">=0.18",
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
