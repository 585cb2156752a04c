"""Fix: Megatron-FSDP (``--use-megatron-fsdp``) with pipeline parallelism: three stops, and checkpoints lose layers.

Megatron-LM's argument validation refuses pipeline parallelism with ``--use-torch-fsdp2`` but not with
``--use-megatron-fsdp``, and Megatron-FSDP is built for it: its buffers put a tied embedding in a
bucket of its own "so that the first and last pipeline stage partition [it] the same way"
(``param_and_grad_buffer._get_parameter_groups``), and ``finalize_model_grads`` all-reduces that
shard across the two stages. On every device (each is Python, nothing of the device), measured with
Megatron-LM core_v0.16.1's pretrain_gpt.py on 4 gloo ranks (PP 2 x DP 2, ``optim_grads_params``):

1. The wrapper's device mesh is built from ``torch.arange(world_size)`` split as DP x EP x TP
   (``mcore_fsdp_adapter._get_dp_tp_mesh``): with PP the world is PP times larger and construction
   stops ("Error while processing rearrange-reduction pattern "(dp_cp ep tp) -> ep dp_cp tp" ...
   Shape mismatch, 4 != 2"). Megatron's rank order puts PP outermost (``tp-cp-ep-dp-pp``), so a
   stage's ranks are the contiguous block of DP x EP x TP ranks holding this rank; the mesh is built
   from that block, megatron's own consistency checks against the DP and TP groups kept (another
   order, e.g. ``--use-tp-pp-dp-mapping``, fails those checks by name). Hybrid sharding
   (``--num-distributed-optimizer-instances``) builds its outer x inner x TP mesh the same way
   (``_get_hsdp_tp_mesh``) and stops the same way at PP 2 x DP 2 with 2 instances ("Shape mismatch,
   2 != 1"); it is built from the stage's block too, megatron's three checks kept.
2. Megatron-FSDP's forward hook on each unit (``TransformerLayer``) returns its output as
   ``t.view_as(t)``; on a stage other than the last that view is the model chunk's output, which the
   pipeline schedule frees once sent (``deallocate_output_tensor``: "counter-productive to free a
   view of another tensor"). The chunk's output is made viewless, as ``TransformerBlock`` does after
   its final norm (``make_viewless_tensor``, keeping the graph and the hook on the view).
3. Tied embeddings (megatron's default): ``_allreduce_embedding_grad`` all-reduces the local shard
   of the Megatron-FSDP gradient (``grad._local_tensor``) in place across the first and last stage,
   then sets that shard as the parameter's ``.grad`` ("attempting to assign a gradient of size
   '[128, 64]' to a tensor of size '[256, 64]'"). The shard is reduced in place exactly as megatron
   does; the gradient stays the DTensor it is.

4. Checkpoints (Megatron-LM): ``--ckpt-format fsdp_dtensor`` (the only format Megatron-LM takes with
   Megatron-FSDP) names each parameter by its module path within the stage
   (``state_dict_for_save_checkpoint``), so every stage writes ``decoder.layers.0..``: a 4-layer model at
   PP 2 saved keys for layers 0 and 1 only, the stages overwriting each other's layers, and a resumed
   run trained other numbers (micro-batch 2: lm loss 5.460116 at iteration 4 against the uninterrupted
   run's 5.412386). megatron makes expert indices global for this format (``handle_experts_in_state_dict``)
   and keys the RNG states by pipeline rank, but not the layers. After megatron's own preparation of
   the state dict (``preprocess_fsdp_dtensor_state_dict``, on save and on load) the layer index in each
   model and optimizer key becomes the layer's index in the whole model (``layer_number - 1``); the
   dicts holding the renamed keys are new, their values megatron's (DCP loads tensors in place and sets
   the other values inside them), so what megatron keeps of the state dict sees what was loaded. The
   resumed run then prints the uninterrupted run's digits.

5. Reduction on the last microbatch (``optim`` / ``no_shard`` with ``--overlap-grad-reduce``, and hybrid
   sharding's all-reduce across the instances): Megatron-LM's ``align_grad_reduce`` (its default) keeps the
   last backward of every stage but the first inside ``no_sync`` and leaves the reduction to
   ``start_grad_sync``, which Megatron-FSDP skips when it overlaps: those stages never reduced (PP 2 x DP 2,
   ``optim --overlap-grad-reduce``, micro-batch 1: grad norm 1.569 against 1.488; PP 2 x DP 4 with 2
   instances: 1.126 against 1.307). A validate_args hook sets ``--no-align-grad-reduce`` for Megatron-FSDP
   under PP with overlap (logged); then each stage reduces in its own last backward and both print the
   distributed optimizer's digits.

6. Virtual pipeline stages (``--num-layers-per-virtual-pipeline-stage`` /
   ``--num-virtual-stages-per-pipeline-rank``): each model chunk is a Megatron-FSDP wrapper of its own and
   trains as the distributed optimizer does (PP 2 x VPP 2 x DP 2, every strategy, fp32 and bf16: the same
   digits, docs/features/fsdp.md). But megatron-core's distributed optimizer names each Megatron-FSDP
   parameter by its path within its chunk, the same in every chunk (``decoder.layers.0...``), and its
   fsdp_dtensor state dict stops at the first save ("Parameter names conflict between model chunks: ...
   Ensure that each model chunk has unique parameter names.", ``DistributedOptimizer._param_name``, any
   device): the run trained up to its first save and died there. Megatron-LM's argument validation lets it
   through; the validate_args hook refuses ``--save`` there, with megatron's words and the ways out.

With these, PP 2 x DP 2 (two microbatches a step) prints the distributed optimizer's lm loss and grad
norm at every digit, fp32 and bf16, for ``optim``, ``optim_grads`` and ``optim_grads_params`` (also with
``--overlap-grad-reduce --overlap-param-gather``), and resumes exactly (docs/features/fsdp.md).
megatron-core 0.19.2 has the same lines unchanged.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterator

import torch

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.argument_changes import say_adjusted
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.errors import ConfigError

NAME = "fix-megatron-fsdp-pipeline"
VERSIONS = ">=0.14"
ADAPTER = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"
MESH = f"{ADAPTER}._get_dp_tp_mesh"
HSDP_MESH = f"{ADAPTER}._get_hsdp_tp_mesh"
FORWARD = "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp.MegatronFSDP.forward"
EMBEDDING = "megatron.core.distributed.finalize_model_grads._allreduce_embedding_grad"
CHECKPOINT = "megatron.training.checkpointing.preprocess_fsdp_dtensor_state_dict"


def stage_ranks(block: int) -> torch.Tensor:
    """The global ranks of this rank's pipeline stage: the contiguous ``block`` holding it."""
    rank = torch.distributed.get_rank()
    return torch.arange(block) + rank // block * block


def mesh_of_the_stage(wrapped, instance, args, kwargs):
    """megatron's ``_get_dp_tp_mesh(dp_cp_group, tp_group, ep_size=1)`` over this stage's ranks."""
    import einops

    adapter = importlib.import_module(ADAPTER)
    dp_cp_group, tp_group = args[0], args[1]
    ep_size = args[2] if len(args) > 2 else kwargs.get("ep_size", 1)
    tp_size = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
    block = dp_cp_group.size() * ep_size * tp_size
    world = torch.distributed.get_world_size()
    if block == world or world % block:
        return wrapped(*args, **kwargs)  # no pipeline (or a layout megatron's own errors name)
    mesh = einops.rearrange(
        stage_ranks(block), "(dp_cp ep tp) -> ep dp_cp tp", dp_cp=dp_cp_group.size(), tp=tp_size, ep=ep_size
    )
    check = adapter._check_mesh_ranks_and_group_ranks_are_consistent
    check(
        einops.rearrange(mesh, "ep dp_cp tp -> (ep tp) dp_cp"), torch.distributed.get_process_group_ranks(dp_cp_group)
    )
    check(einops.rearrange(mesh, "ep dp_cp tp -> (dp_cp ep) tp"), torch.distributed.get_process_group_ranks(tp_group))
    return _this_ranks(mesh)


def hsdp_mesh_of_the_stage(wrapped, instance, args, kwargs):
    """megatron's ``_get_hsdp_tp_mesh(outer_fsdp_dp_group, dp_cp_group, tp_group)`` (0.19 adds
    ``ep_size``) over this stage's ranks: megatron's outer x inner x EP x TP split of them (the instances
    are contiguous blocks of the stage's data-parallel ranks, ``parallel_state``), its consistency checks
    against the groups, and, as 0.19 returns, the mesh of this rank's expert-parallel index (at EP 1, 0.16's
    whole mesh)."""
    import einops

    adapter = importlib.import_module(ADAPTER)
    outer_group, dp_cp_group, tp_group = args[:3]
    ep = args[3] if len(args) > 3 else kwargs.get("ep_size", 1)
    outer, fsdp, tp = outer_group.size(), dp_cp_group.size(), tp_group.size()
    block = outer * fsdp * ep * tp
    world = torch.distributed.get_world_size()
    if block == world or world % block:
        return wrapped(*args, **kwargs)  # no pipeline (or a layout megatron's own errors name)
    mesh = einops.rearrange(
        stage_ranks(block), "(outer fsdp ep tp) -> ep outer fsdp tp", outer=outer, fsdp=fsdp, ep=ep, tp=tp
    )
    check = adapter._check_mesh_ranks_and_group_ranks_are_consistent
    ranks = torch.distributed.get_process_group_ranks
    check(einops.rearrange(mesh, "ep outer fsdp tp -> (outer ep tp) fsdp"), ranks(dp_cp_group))
    check(einops.rearrange(mesh, "ep outer fsdp tp -> (outer fsdp ep) tp"), ranks(tp_group))
    check(einops.rearrange(mesh, "ep outer fsdp tp -> (fsdp ep tp) outer"), ranks(outer_group))
    return _this_ranks(mesh)


def _this_ranks(mesh: torch.Tensor) -> torch.Tensor:
    """The mesh of this rank's expert-parallel index (``mesh[ep]`` holding this rank), as megatron returns it."""
    rank = torch.distributed.get_rank()
    (per_ep,) = [per_ep for per_ep in mesh if rank in per_ep.reshape(-1).tolist()]
    return per_ep


def _pipelined() -> bool:
    from megatron.core import parallel_state

    return (
        parallel_state.model_parallel_is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1
    )


def viewless_output(wrapped, instance, args, kwargs):
    """A pipeline stage's output without the view Megatron-FSDP's unit hook made (elsewhere megatron's)."""
    output = wrapped(*args, **kwargs)
    if torch.is_tensor(output) and output._base is not None and _pipelined():
        from megatron.core.utils import make_viewless_tensor

        output = make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True)
    return output


def _chunk_holding_the_embedding(model, pp_group, config):
    """The model chunk megatron's ``_allreduce_embedding_grad`` picks on this stage."""
    from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage

    if is_pp_first_stage(pp_group):
        return model[0]
    if is_pp_last_stage(pp_group) or (getattr(config, "mtp_num_layers", None) or 0) > 0:
        return model[-1]
    return model[0]


def reduce_the_shard_in_place(wrapped, instance, args, kwargs):
    from megatron.core.utils import get_attr_wrapped_model, get_pg_size

    model, embd_group, pp_group, weight_getter = args[:4]
    config = args[5] if len(args) > 5 else kwargs.get("config")
    if get_pg_size(embd_group) <= 1 or torch.distributed.get_rank() not in torch.distributed.get_process_group_ranks(
        embd_group
    ):
        return wrapped(*args, **kwargs)
    chunk = _chunk_holding_the_embedding(model, pp_group, config)
    if not chunk.ddp_config.use_megatron_fsdp:
        return wrapped(*args, **kwargs)
    weight = weight_getter(get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True))
    grad = (
        getattr(weight, "main_grad" if hasattr(weight, "main_grad") else "grad", None) if weight is not None else None
    )
    if grad is None:
        return wrapped(*args, **kwargs)  # megatron's own skip (or its error where skip_if_none is off)
    torch.distributed.all_reduce(getattr(grad, "_local_tensor", grad), group=embd_group)
    return None


LAYER = re.compile(r"(?<![^.])decoder\.layers\.(\d+)\.")


def _global_layer_indices(model) -> dict[int, int]:
    """Each decoder layer's index within this stage -> its index in the whole model (``layer_number``
    counts from 1 over every stage)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    blocks = [module for module in model.modules() if isinstance(module, TransformerBlock)]
    if len(blocks) != 1:
        return {}
    return {local: layer.layer_number - 1 for local, layer in enumerate(blocks[0].layers)}


def _renamed(entries: dict, indices: dict[int, int]) -> dict:
    """``entries`` with each key's stage-local layer index made global: a new dict holding the same
    values (DCP loads tensors in place and sets other values inside them, so what megatron kept of
    the state dict sees what was loaded)."""
    return {LAYER.sub(lambda m: f"decoder.layers.{indices[int(m.group(1))]}.", key): v for key, v in entries.items()}


def global_layer_names(wrapped, instance, args, kwargs):
    """megatron's fsdp_dtensor state dict, its layers named by their index in the whole model."""
    state_dict = wrapped(*args, **kwargs)
    model = args[2] if len(args) > 2 else kwargs["model"]
    indices = _global_layer_indices(model)
    if all(local == index for local, index in indices.items()):
        return state_dict  # the first stage, or no pipeline
    state_dict = dict(state_dict)
    if "model" in state_dict:
        state_dict["model"] = _renamed(state_dict["model"], indices)
    if "optimizer" in state_dict:
        optimizer = dict(state_dict["optimizer"])
        for part in ("state", "param_to_group_meta"):
            if isinstance(optimizer.get(part), dict):
                optimizer[part] = _renamed(optimizer[part], indices)
        state_dict["optimizer"] = optimizer
    return state_dict


def _virtual_stages(args) -> bool:
    return getattr(args, "num_layers_per_virtual_pipeline_stage", None) is not None or (
        (getattr(args, "num_virtual_stages_per_pipeline_rank", None) or 1) > 1
    )


SAVE_WITH_VIRTUAL_STAGES = (
    "fix-megatron-fsdp-pipeline: --use-megatron-fsdp with virtual pipeline stages ({flag}) and --save {save}: "
    "megatron-core's distributed optimizer names each parameter by its path within its model chunk, the same in "
    "every chunk, and stops at the first save (DistributedOptimizer._param_name: 'Parameter names conflict "
    "between model chunks: ... Ensure that each model chunk has unique parameter names.'), after the iterations "
    "before it. Train without --save, or drop {flag} (--pipeline-model-parallel-size alone saves and resumes "
    "under Megatron-FSDP), or use --use-distributed-optimizer without --use-megatron-fsdp (--ckpt-format torch_dist)"
)


def refuse_saving_virtual_stages(args) -> None:
    """Refuse ``--save`` for Megatron-FSDP with virtual pipeline stages (megatron stops at the first save)."""
    if getattr(args, "use_megatron_fsdp", False) and getattr(args, "save", None) and _virtual_stages(args):
        flag = (
            f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}"
            if getattr(args, "num_layers_per_virtual_pipeline_stage", None) is not None
            else f"--num-virtual-stages-per-pipeline-rank {args.num_virtual_stages_per_pipeline_rank}"
        )
        raise ConfigError(SAVE_WITH_VIRTUAL_STAGES.format(flag=flag, save=args.save))


@contextlib.contextmanager
def reduce_on_every_stages_last_backward(args) -> Iterator[None]:
    """validate_args hook: ``--no-align-grad-reduce`` for Megatron-FSDP under PP with overlapped reduction.

    With ``align_grad_reduce`` (Megatron-LM's default) the pipeline schedule keeps the last backward of every
    stage but the first inside ``no_sync`` and then calls ``grad_sync_func`` (``start_grad_sync``) to launch
    the reductions (megatron's DDP does them there). ``MegatronFSDP.start_grad_sync`` does nothing when it
    overlaps, and its hooks reduce what waits for the last microbatch (``optim`` / ``no_shard``, and HSDP's
    outer all-reduce) only outside ``no_sync``: those stages never reduced them. Megatron-LM PP 2 x DP 2,
    ``optim --overlap-grad-reduce``, micro-batch 1: grad norm 1.569 against the distributed optimizer's 1.488.
    Without alignment every stage's last backward runs outside ``no_sync``, as on the first stage.
    Also refuses ``--save`` with virtual pipeline stages (item 6 of the module's docstring)."""
    refuse_saving_virtual_stages(args)
    if (
        getattr(args, "use_megatron_fsdp", False)
        and (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1
        and getattr(args, "overlap_grad_reduce", False)
        and getattr(args, "align_grad_reduce", False)
    ):
        args.align_grad_reduce = False
        change = (
            "args.align_grad_reduce: True -> False (Megatron-FSDP's start_grad_sync does nothing when it "
            "overlaps: each stage reduces in its own last backward)"
        )
        say_adjusted(NAME, args, [change])
    yield


PATCHES = [
    Patch(
        MESH,
        Kind.WRAP,
        mesh_of_the_stage,
        versions=VERSIONS,
        why="Megatron-FSDP's DP x TP mesh is split from every rank of the world; with PP, from this stage's ranks",
    ),
    Patch(
        HSDP_MESH,
        Kind.WRAP,
        hsdp_mesh_of_the_stage,
        versions=VERSIONS,
        why="Megatron-FSDP's hybrid (HSDP) mesh is split from every rank of the world; with PP, from this stage's",
    ),
    Patch(
        FORWARD,
        Kind.WRAP,
        viewless_output,
        versions=VERSIONS,
        why="a pipeline stage's output (a view made by Megatron-FSDP's unit hook) is freed by the schedule",
    ),
    Patch(
        EMBEDDING,
        Kind.WRAP,
        reduce_the_shard_in_place,
        versions=VERSIONS,
        why="the tied embedding's gradient shard is all-reduced in place across stages, not set as .grad",
    ),
    Patch(
        CHECKPOINT,
        Kind.WRAP,
        global_layer_names,
        optional=True,  # megatron.training: a Megatron-LM checkout (in the wheel from 0.17)
        module="megatron.training.checkpointing",
        versions=VERSIONS,
        why="fsdp_dtensor named each stage's layers from 0: the stages overwrote each other's layers",
    ),
]

FEATURE = Feature(
    name=NAME,
    summary="--use-megatron-fsdp with --pipeline-model-parallel-size > 1 runs: the mesh of each stage, a viewless "
    "stage output, the tied embedding's gradient shard all-reduced in place (megatron stopped at each); fsdp_dtensor "
    "checkpoints name layers by their global index (each stage wrote its own from 0: the stages overwrote each other); "
    "Megatron-LM's align_grad_reduce off where Megatron-FSDP overlaps (the stages past the first never reduced); "
    "--save with virtual pipeline stages refused at argument validation (megatron-core stops at the first save)",
    patches=PATCHES,
    enabled=always_on,
    validate_args_hook=reduce_on_every_stages_last_backward,
    backend="any",
    kind="fix",
)
