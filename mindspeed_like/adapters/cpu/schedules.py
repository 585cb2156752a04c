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
"""

from __future__ import annotations

from mindspeed_like.adapters.cpu.devices import on_host

PIPE = "pipeline_parallel"
_P2P_CLASS = f"{PIPE}.p2p_communication.P2PCommunicator"  # 0.14+
_P2P_MODULE = f"{PIPE}.p2p_communication"  # 0.13: the same code as module functions

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
]
