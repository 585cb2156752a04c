"""CPU adapter, pipeline parallelism: megatron's pipelined schedules and p2p communication.

``get_forward_backward_func()`` returns ``forward_backward_pipelining_without_interleaving`` for
PP>1 and ``forward_backward_pipelining_with_interleaving`` with a virtual pipeline; both (like
the no-pipelining schedule adapted in ``cpu_devices``) put their token counter on
``device="cuda"``. Their activations travel through ``P2PCommunicator``, whose receive buffers
and shape messages are allocated on ``torch.cuda.current_device()`` and which calls
``torch.cuda.synchronize()`` after ``batch_isend_irecv``. gloo sends and receives CPU tensors,
so each of these functions runs as its host twin (``mindspeed_like.adapters.cpu.host_view``).
Targets (megatron/core/pipeline_parallel, 0.13-0.16):

* ``schedules.forward_backward_pipelining_without_interleaving`` and
  ``schedules.forward_backward_pipelining_with_interleaving``: ``device="cuda"`` token count;
* ``p2p_communication.P2PCommunicator._communicate_shapes`` (variable sequence lengths) and
  ``P2PCommunicator._communicate`` (its nested ``create_tensor_recv_prev/next`` allocate the
  buffers and run in the twin's globals): every send/receive of the schedules goes through
  these two. 0.13 has the same code as module functions ``p2p_communication._communicate`` and
  ``_communicate_shapes`` (the class arrived in 0.14); the target follows the installed version;
* ``models.common.language_module.language_module.LanguageModule.setup_embeddings_and_output_layer``:
  with PP>1 and tied embeddings the last stage's output-layer copy is moved with
  ``weight.data.cuda()`` before the all-reduce that makes it equal to the first stage's
  embedding; its twin sees the host spelling ``.cpu()`` (see ``host_view``: method calls named
  ``cuda`` are read as ``cpu`` in a twin).
* ``p2p_communication._p2p_ops`` (the unbatched sends, which the interleaved schedule overlaps with
  compute: ``--overlap-p2p-communication``, Megatron-LM's default, the only way it takes virtual stages
  at PP 2): the interleaved schedule frees each sent stage output (``deallocate_output_tensor``:
  ``out.data = torch.empty((1,))``) before it waits for that send. On gloo the send reads the storage
  when the receiver is ready, by then often memory the host allocator has handed out again (gloo's
  request does not keep it; 2 gloo ranks, the receive posted 20 ms after the send and the storage freed in
  between: 19 of 20 receives held other numbers), so the receiving stage computed on other numbers:
  Megatron-LM PP 2 x VPP 2 x CP 2 on 4 gloo ranks (dropout 0.1, fp32), the same flags in three launches,
  printed lm loss 5.574856 and 5.575351 (Megatron-FSDP) and 5.574901 (the distributed optimizer) at
  iteration 1. Each tensor is now sent as a copy that the send's request holds (one copy of a stage
  output a send): Megatron-FSDP's straight, saving and resumed launches and the distributed optimizer's
  printed the same digits (5.575351 / 1.485, 5.521214 / 1.958 at iterations 1-2 of 6; docs/features/fsdp.md).
  (On CUDA megatron relies on the NCCL process group to keep the sent storage from reuse; not run here.)
  Test: tests/adapters/test_pipeline_sends.py.
"""

from __future__ import annotations

import torch

from mindspeed_like.adapters.cpu.devices import on_host
from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.targets import CORE

PIPE = "pipeline_parallel"
_P2P_CLASS = f"{PIPE}.p2p_communication.P2PCommunicator"  # 0.14+
_P2P_MODULE = f"{PIPE}.p2p_communication"  # 0.13: the same code as module functions

SENDS = {"tensor_send_next": "send_next", "tensor_send_prev": "send_prev"}  # argument -> its request's key


class SendHoldingItsCopy:
    """A send's request that holds the copy being sent until the request is released (gloo's own request
    does not keep it alive, and takes no attributes); everything else is the request's."""

    def __init__(self, request, copy: torch.Tensor):
        self._request, self._copy = request, copy

    def wait(self, *args, **kwargs):
        return self._request.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._request, name)


def send_copies(wrapped, instance, args, kwargs):
    """megatron's ``_p2p_ops`` sending a copy of each tensor it sends, held by that send's request: gloo reads
    a sent tensor's storage until the send completes, and megatron may free that storage first
    (``deallocate_output_tensor``)."""
    copies = {
        request: kwargs[argument].detach().clone()
        for argument, request in SENDS.items()
        if kwargs.get(argument) is not None
    }
    kwargs = {**kwargs, **{argument: copies[request] for argument, request in SENDS.items() if request in copies}}
    requests = wrapped(*args, **kwargs)
    for key, copy in copies.items():
        requests[key] = SendHoldingItsCopy(requests[key], copy)
    return requests


PATCHES = [
    *[
        on_host(
            f"{owner}._communicate_shapes",
            "shape tensors on torch.cuda.current_device(), torch.cuda.synchronize()",
            versions=versions,
        )
        for owner, versions in ((_P2P_CLASS, ">=0.14"), (_P2P_MODULE, "<0.14"))
    ],
    *[
        on_host(
            f"{owner}._communicate",
            "receive buffers on torch.cuda.current_device(), torch.cuda.synchronize()",
            versions=versions,
        )
        for owner, versions in ((_P2P_CLASS, ">=0.14"), (_P2P_MODULE, "<0.14"))
    ],
    on_host(f"{PIPE}.schedules.forward_backward_pipelining_without_interleaving", "device='cuda' token count"),
    on_host(f"{PIPE}.schedules.forward_backward_pipelining_with_interleaving", "device='cuda' token count"),
    on_host(
        "models.common.language_module.language_module.LanguageModule.setup_embeddings_and_output_layer",
        "tied output weight moved with .cuda() before the embedding-group all-reduce",
    ),
    Patch(
        f"{CORE}.{_P2P_MODULE}._p2p_ops",
        Kind.WRAP,
        send_copies,
        why="the interleaved schedule frees a sent stage output before its overlapped send completes; gloo "
        "reads the freed storage (NCCL keeps it out of reuse until sent): each send gets a copy of its own",
    ),
]
