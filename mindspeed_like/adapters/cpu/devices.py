"""CPU adapter, model and tensor-parallel code: ``torch.cuda.current_device()`` as a device.

Each target below is a megatron function whose body uses ``torch.cuda.current_device()`` (or a
``'cuda'`` device string) to place a tensor. Each runs as its host twin: the same bytecode with
``torch.cuda`` seen as the CPU (``mindspeed_like.adapters.cpu.host_view``), so no megatron source is
copied and the patch follows whatever the installed version's body is. Targets are the
smallest enclosing functions (nested helpers are covered by their enclosing function):

* ``utils.GlobalMemoryBuffer.get_tensor``: scratch buffers (core attention, SP all-gather);
* ``tensor_parallel.layers.VocabParallelEmbedding/ColumnParallelLinear/RowParallelLinear.__init__``:
  weight allocation when ``use_cpu_initialization`` is off;
* ``tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.forward/backward``:
  the SP all-gather buffers;
* ``tensor_parallel.mappings._gather_along_last_dim / _gather_along_first_dim /
  _reduce_scatter_along_first_dim``: collective outputs (TP/SP); ``_gather_along_first_dim`` with
  uneven ``output_split_sizes`` on gloo (which refuses uneven all-gather lists): ``uneven_gather``;
* ``tensor_parallel.mappings._AllToAll.forward``, ``tensor_parallel.utils`` 1-D split/gather;
* ``models.gpt.gpt_model.GPTModel._preprocess`` (optional: not in every version),
  ``RotaryEmbedding.__init__``: rotary buffers; the "move ``inv_freq`` to
  ``torch.cuda.current_device()`` at the first forward" line is in ``RotaryEmbedding.get_emb``
  from megatron-core 0.16 and in the ``lru_cache``-decorated ``RotaryEmbedding.forward`` before
  (0.13-0.15, where ``get_emb`` does not exist): the patch targets the one the installed
  version has (chosen each time the feature is applied); the host twin keeps the ``lru_cache``;
* ``transformer.utils.get_sliding_window_causal_mask``: megatron-core 0.15+ only;
* ``transformer.utils.get_default_causal_mask``: ``device="cuda"``;
* ``DotProductAttention.__init__``: softmax-offset buffers;
* ``pipeline_parallel.schedules.forward_step/forward_backward_no_pipelining``: loss-scale and
  token-count tensors on ``'cuda'`` (users' training loops call these);
* ``distributed.*``: DDP's communication stream and gradient buffers; ``offload_grad_buffers`` /
  ``restore_grad_buffers`` (0.16+; RL clients): ``torch.cuda.synchronize()``.

Reached only behind a flag or by a client (issue 37: items 1, 5 and 9a were one class, megatron
code behind a flag calling CUDA outside what the adapter covered; ``cuda_sites`` lists every
such function of the installed megatron, and ``tests/adapters/test_cuda_sites.py`` fails on one
that is neither adapted nor declared in ``not_adapted``):

* ``utils.check_param_hashes_across_dp_replicas``: ``--check-weight-hash-across-dp-replicas-interval``
  all-gathers the hashes after ``.cuda()`` (issue 37 item 5);
* ``tensor_parallel.data.broadcast_data`` and ``_build_key_size_numel_dictionaries``: the batch
  broadcast of users' ``get_batch`` (Megatron-LM's BERT/T5/multimodal scripts, clients) on
  ``device='cuda'`` after ``.cuda()``;
* ``utils.nvtx_range_push`` / ``nvtx_range_pop`` (optional): ``torch.cuda.nvtx`` once megatron's
  NVTX ranges are switched on (``configure_nvtx_profiling``);
* ``parallel_state.update_pg_timeout`` (0.15+): ``--distributed-timeout-seconds-after-init``
  syncs the device after its barrier;
* ``MultimodalRotaryEmbedding.__init__`` (``--position-embedding-type mrope``) and
  ``DSAIndexerLossLoggingHelper.save_loss_to_tracker`` (DeepSeek sparse attention's indexer loss,
  0.16+): ``torch.cuda.current_device()`` as a device, as their dense siblings above.
"""

from __future__ import annotations

from mindspeed_like.adapters.cpu.host_view import run_on_host
from mindspeed_like.adapters.cpu.uneven_gather import gather_along_first_dim
from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.targets import CORE

ROTARY = "models.common.embeddings.rotary_pos_embedding.RotaryEmbedding"


def on_host(target: str, why: str, optional: bool = False, versions: str | None = None, **order) -> Patch:
    """A patch running ``megatron.core.<target>`` as its host twin."""
    return Patch(f"{CORE}.{target}", Kind.WRAP, run_on_host, optional=optional, why=why, versions=versions, **order)


PATCHES = [
    # The RotaryEmbedding method that moves ``inv_freq`` to ``torch.cuda.current_device()``:
    # ``get_emb`` from 0.16, the ``lru_cache``d ``forward`` in 0.13-0.15 (no ``get_emb`` there).
    on_host(f"{ROTARY}.get_emb", "moves inv_freq to torch.cuda.current_device()", versions=">=0.16"),
    on_host(f"{ROTARY}.forward", "moves inv_freq to torch.cuda.current_device() (lru_cache kept)", versions="<0.16"),
    on_host("utils.GlobalMemoryBuffer.get_tensor", "scratch buffer on torch.cuda.current_device()"),
    on_host("tensor_parallel.layers.VocabParallelEmbedding.__init__", "weights on torch.cuda.current_device()"),
    on_host("tensor_parallel.layers.ColumnParallelLinear.__init__", "weights on torch.cuda.current_device()"),
    on_host("tensor_parallel.layers.RowParallelLinear.__init__", "weights on torch.cuda.current_device()"),
    on_host(
        "tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.forward",
        "SP all-gather buffer on torch.cuda.current_device()",
    ),
    on_host(
        "tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.backward",
        "SP all-gather buffer on torch.cuda.current_device()",
    ),
    on_host("tensor_parallel.mappings._gather_along_last_dim", "output on torch.cuda.current_device()"),
    Patch(
        f"{CORE}.tensor_parallel.mappings._gather_along_first_dim",
        Kind.WRAP,
        gather_along_first_dim,
        why="output on torch.cuda.current_device(); uneven pieces (output_split_sizes) gathered padded on gloo",
    ),
    on_host("tensor_parallel.mappings._reduce_scatter_along_first_dim", "output on torch.cuda.current_device()"),
    on_host("tensor_parallel.mappings._AllToAll.forward", "output on torch.cuda.current_device()"),
    on_host("tensor_parallel.utils.split_tensor_into_1d_equal_chunks", "chunk on torch.cuda.current_device()"),
    on_host("tensor_parallel.utils.gather_split_1d_tensor", "output on torch.cuda.current_device()"),
    on_host("models.gpt.gpt_model.GPTModel._preprocess", "buffers on torch.cuda.current_device()", optional=True),
    on_host(
        "models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.__init__",
        "inv_freq on torch.cuda.current_device()",
    ),
    on_host("transformer.utils.get_default_causal_mask", "mask on device='cuda'"),
    on_host("transformer.utils.get_sliding_window_causal_mask", "mask on device='cuda'", versions=">=0.15"),
    on_host(
        "transformer.dot_product_attention.DotProductAttention.__init__",
        "softmax offset on torch.cuda.current_device()",
    ),
    on_host("pipeline_parallel.schedules.forward_step", "device='cuda' loss-scale tensors"),
    on_host("pipeline_parallel.schedules.forward_backward_no_pipelining", "device='cuda' tensors"),
    on_host("distributed.distributed_data_parallel.DistributedDataParallel.__init__", "torch.cuda.Stream, devices"),
    on_host("distributed.param_and_grad_buffer._ParamAndGradBuffer.__init__", "buffers on device='cuda'"),
    on_host("distributed.param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync", "torch.cuda.stream"),
    on_host("distributed.param_and_grad_buffer._ParamAndGradBucketGroup.finish_grad_sync", "torch.cuda streams"),
    *[
        on_host(
            f"distributed.distributed_data_parallel.DistributedDataParallel.{name}",
            "torch.cuda.synchronize()",
            versions=">=0.16",
        )
        for name in ("offload_grad_buffers", "restore_grad_buffers")
    ],
    # behind a flag or called by clients only
    on_host("utils.check_param_hashes_across_dp_replicas", "hashes all-gathered after .cuda()"),
    on_host("tensor_parallel.data.broadcast_data", "batch broadcast on torch.cuda.current_device() after .cuda()"),
    on_host("tensor_parallel.data._build_key_size_numel_dictionaries", "sizes broadcast on device='cuda'"),
    on_host("utils.nvtx_range_push", "torch.cuda.nvtx.range_push", optional=True),
    on_host("utils.nvtx_range_pop", "torch.cuda.nvtx.range_pop", optional=True),
    on_host("parallel_state.update_pg_timeout", "torch.cuda.synchronize() after the barrier", versions=">=0.15"),
    on_host(
        "models.common.embeddings.rotary_pos_embedding.MultimodalRotaryEmbedding.__init__",
        "inv_freq on torch.cuda.current_device()",
        optional=True,
    ),
    on_host(
        "transformer.experimental_attention_variant.dsa.DSAIndexerLossLoggingHelper.save_loss_to_tracker",
        "loss tracker on torch.cuda.current_device()",
        versions=">=0.16",
    ),
]
