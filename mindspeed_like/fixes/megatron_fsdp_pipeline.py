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
   digits, docs/features/fsdp.md). Saving stopped twice, on any device. megatron-core's distributed optimizer
   names each parameter by its path within its chunk, the same in every chunk (``decoder.layers.0...``), and
   raised "Parameter names conflict between model chunks: ... Ensure that each model chunk has unique
   parameter names." (``DistributedOptimizer._param_name``) at the first save, after the iterations before
   it. With several chunks each name now carries its layer's index in the whole model (``layer_number - 1``,
   what item 4 writes to the checkpoint; megatron's own ``get_global_unique_param_name`` means the same), the
   rest of megatron's naming (experts made global) kept. Then Megatron-LM's fsdp_dtensor save and load
   (``preprocess_fsdp_dtensor_state_dict(args, state_dict, model[0])``) prepare ``state_dict["model"]``
   with ``model[0]``, where several chunks are ``model0``, ``model1``, ... (a ``KeyError: 'model'``).
   megatron's preparation now runs once per chunk, with that chunk's model state, the optimizer entries of
   its parameters under megatron's own names and that chunk as the model, and each result is named by
   global layer index as in item 4 and merged into ``model`` / ``optimizer``: the checkpoint holds the keys
   a run without virtual stages writes. After the load megatron hands the model's own state dict back
   to ``load_state_dict`` (``model``), not the chunks' (``model0``, ...): they are handed back too. The
   chunks come from ``generate_state_dict(args, model, ...)``, which Megatron-LM calls with the whole list
   just before, on save and on load. Saved at iteration 3 and resumed (PP 2 x VPP 2 x DP 2,
   ``optim_grads_params``, dropout 0.1), iterations 4-6 print the uninterrupted run's digits, fp32 and bf16.

With these, PP 2 x DP 2 (two microbatches a step) prints the distributed optimizer's lm loss and grad
norm at every digit, fp32 and bf16, for ``optim``, ``optim_grads`` and ``optim_grads_params`` (also with
``--overlap-grad-reduce --overlap-param-gather``), and resumes exactly (docs/features/fsdp.md).
megatron-core 0.19.2 has the same lines unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import re
import weakref
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
OPTIMIZER_NAMES = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._param_name"
STATE_DICT = "megatron.training.checkpointing.generate_state_dict"
LOAD = "megatron.training.checkpointing._load_base_checkpoint"
CHUNKS_VERSIONS = ">=0.16"  # read in 0.16.1 (with Megatron-LM core_v0.16.1), 0.17.1 and 0.19.2


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


def _global_name(name: str, indices: dict[int, int]) -> str:
    """``name`` with a stage-local layer index made global where ``indices`` knows it."""
    return LAYER.sub(lambda m: f"decoder.layers.{indices.get(int(m.group(1)), int(m.group(1)))}.", name)


def _renamed(entries: dict, indices: dict[int, int]) -> dict:
    """``entries`` with each key's layer index made global (:func:`_global_name`): a new dict holding the
    same values (DCP loads tensors in place and sets other values inside them, so what megatron kept of
    the state dict sees what was loaded)."""
    return {_global_name(key, indices): value for key, value in entries.items()}


def chunk_parameter_names(chunk, num_experts) -> dict[str, tuple[str, torch.nn.Parameter]]:
    """A model chunk's parameters as the distributed optimizer names them with several chunks: the global
    name (megatron's: the path within the chunk, experts' indices made global; then the layer's index in
    the whole model) -> (megatron's name, the parameter)."""
    optimizer = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    named = optimizer.handle_experts_in_state_dict(dict(chunk.named_parameters()), num_experts)
    indices = _global_layer_indices(chunk)
    return {_global_name(name, indices): (name, param) for name, param in named.items()}


def _num_experts(chunks) -> int | None:
    return getattr(chunks[0].config, "num_moe_experts", None)


def optimizer_names(chunks) -> dict[str, torch.nn.Parameter]:
    """Every chunk's parameters by their global name; a name in two chunks is megatron's own error."""
    names: dict[str, torch.nn.Parameter] = {}
    for chunk in chunks:
        named = {name: param for name, (_, param) in chunk_parameter_names(chunk, _num_experts(chunks)).items()}
        common = names.keys() & named.keys()
        if common:
            raise ValueError(
                f"Parameter names conflict between model chunks: {common}. Ensure that each model chunk has "
                f"unique parameter names ({NAME}: the names carry each layer's index in the whole model)."
            )
        names.update(named)
    return names


def unique_names_across_chunks(wrapped, instance, args, kwargs):
    """``DistributedOptimizer._param_name``: with several model chunks, megatron's mapping (which it builds
    once, as ``param_to_name``) built from the global names; with one chunk, megatron's own."""
    chunks = list(getattr(instance, "model_chunks", None) or [])
    if len(chunks) > 1 and not hasattr(instance, "param_to_name"):
        instance.param_to_name = {param: name for name, param in optimizer_names(chunks).items()}
    return wrapped(*args, **kwargs)


_CHUNKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model[0] -> the model chunks it stands for in ``preprocess_fsdp_dtensor_state_dict`` (weak references)."""
CHUNK_KEY = re.compile(r"model\d+")


def remember_model_chunks(wrapped, instance, args, kwargs):
    """``generate_state_dict(args, model, ...)``: Megatron-LM's fsdp_dtensor save and load call it with the
    whole list of chunks just before ``preprocess_fsdp_dtensor_state_dict(args, state_dict, model[0])``."""
    model = args[1] if len(args) > 1 else kwargs.get("model")
    if isinstance(model, (list, tuple)) and len(model) > 1:
        _CHUNKS[model[0]] = [weakref.ref(chunk) for chunk in model]
    return wrapped(*args, **kwargs)


def _model_chunks(model) -> list | None:
    refs = _CHUNKS.get(model) if model is not None else None
    chunks = [ref() for ref in refs] if refs else None
    return chunks if chunks and all(chunk is not None for chunk in chunks) else None


def _merge(into: dict, entries: dict, what: str) -> None:
    common = into.keys() & entries.keys()
    if common:
        raise ValueError(f"{NAME}: two model chunks name the same {what} entries {sorted(common)}")
    into.update(entries)


WRAPPERS = re.compile(r"^(module\.)+")


def _chunks_entries(chunk, entries: dict) -> dict[str, str]:
    """The optimizer's ``entries`` (named as ``unique_names_across_chunks`` names them) of ``chunk``'s
    parameters: megatron's name within the chunk -> the entry's key. A layer's index goes back to the
    chunk's own; a name outside the layers is the chunk's where it has that parameter, wrappers aside (the
    optimizer's chunks and Megatron-LM's differ by one: ``module.module.`` against ``module.``)."""
    local = {index: position for position, index in _global_layer_indices(chunk).items()}
    others = {WRAPPERS.sub("", name) for name, _ in chunk.named_parameters() if not LAYER.search(name)}
    mine = {}
    for key in entries:
        layer = LAYER.search(key)
        if layer is not None and int(layer.group(1)) in local:
            mine[LAYER.sub(lambda m: f"decoder.layers.{local[int(m.group(1))]}.", key)] = key
        elif layer is None and WRAPPERS.sub("", key) in others:
            mine[key] = key
    return mine


def _each_chunk(wrapped, megatron_args, state_dict: dict, chunks: list) -> dict:
    """megatron's preparation once per chunk (``model{i}``, the optimizer entries of its parameters under
    megatron's names, the chunk as the model), each result named by global layer index and merged into
    ``model`` / ``optimizer``."""
    prepared = {key: value for key, value in state_dict.items() if not CHUNK_KEY.fullmatch(key)}
    optimizer = state_dict.get("optimizer")
    parts = ("state", "param_to_group_meta")
    if optimizer is not None and not all(isinstance(optimizer.get(part), dict) for part in parts):
        raise ValueError(
            f"{NAME}: the optimizer's fsdp_dtensor state dict holds {sorted(map(str, optimizer))}, not "
            f"{list(parts)} (one distributed optimizer over the model chunks)"
        )
    model: dict = {}
    merged: dict = {part: {} for part in parts}
    claimed: set = set()
    for i, chunk in enumerate(chunks):
        if f"model{i}" not in state_dict:
            continue
        one = {"model": dict(state_dict[f"model{i}"])}  # megatron deletes FP8 extra states in place
        if optimizer is not None:
            one["optimizer"] = copy.copy(optimizer)  # megatron's dict, or fix-megatron-fsdp-dtensor-checkpoint's
            for part in parts:
                mine = _chunks_entries(chunk, optimizer[part])
                one["optimizer"][part] = {name: optimizer[part][key] for name, key in mine.items()}
                claimed |= set(mine.values())
            placeholders = getattr(optimizer, "placeholders", None)  # that fix's state of every rank's parameters
            if isinstance(placeholders, dict):
                mine = _chunks_entries(chunk, placeholders)
                one["optimizer"].placeholders = {name: placeholders[key] for name, key in mine.items()}
        done = wrapped(megatron_args, one, chunk)
        indices = _global_layer_indices(chunk)
        _merge(model, _renamed(done["model"], indices), "model")
        for part in parts if optimizer is not None else ():
            _merge(merged[part], _renamed(done["optimizer"][part], indices), f"optimizer {part}")
    prepared["model"] = model
    if optimizer is not None:
        left = [key for part in parts for key in optimizer[part] if key not in claimed]
        if left:
            raise ValueError(f"{NAME}: optimizer entries of no model chunk's parameter: {left}")
        prepared["optimizer"] = {**optimizer, **merged}
    return prepared


def global_layer_names(wrapped, instance, args, kwargs):
    """megatron's fsdp_dtensor state dict, its layers named by their index in the whole model; with several
    model chunks, megatron's preparation of each chunk, merged."""
    model = args[2] if len(args) > 2 else kwargs["model"]
    raw = args[1] if len(args) > 1 else kwargs["raw_state_dict"]
    chunks = _model_chunks(model)
    if chunks is not None and "model" not in raw and any(CHUNK_KEY.fullmatch(key) for key in raw):
        megatron_args = args[0] if args else kwargs["args"]
        return _each_chunk(wrapped, megatron_args, raw, chunks)
    state_dict = wrapped(*args, **kwargs)
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


def chunks_handed_back_after_loading(wrapped, instance, args, kwargs):
    """``_load_base_checkpoint``: megatron puts the model's own state dict back after the fsdp_dtensor load
    (``state_dict["model"] = raw_model_state_dict``) for ``load_state_dict``; with several chunks the chunks'
    (``model0``, ...), which the checkpoint holds merged as ``model`` (``global_layer_names``)."""
    sharded = kwargs.get("sharded_state_dict", args[3] if len(args) > 3 else None)
    kept = {}
    if isinstance(sharded, dict) and "_model" in sharded and "model" not in sharded:  # fsdp_dtensor's load
        kept = {key: value for key, value in sharded.items() if CHUNK_KEY.fullmatch(key)}
    result = wrapped(*args, **kwargs)
    if kept and isinstance(result, tuple) and isinstance(result[0], dict):
        result[0].pop("model", None)
        result[0].update(kept)
    return result


def _virtual_stages(args) -> bool:
    return getattr(args, "num_layers_per_virtual_pipeline_stage", None) is not None or (
        (getattr(args, "num_virtual_stages_per_pipeline_rank", None) or 1) > 1
    )


SAVE_WITH_VIRTUAL_STAGES = (
    "fix-megatron-fsdp-pipeline: --use-megatron-fsdp with virtual pipeline stages ({flag}) and --save {save} on "
    "megatron-core {version}: its distributed optimizer names each parameter by its path within its model chunk, "
    "the same in every chunk, and stops at the first save (DistributedOptimizer._param_name: 'Parameter names "
    "conflict between model chunks: ... Ensure that each model chunk has unique parameter names.'), after the "
    "iterations before it; the fix that names them apart is read for megatron-core {chunks} only. Use such a "
    "release, or train without --save, or drop {flag} (--pipeline-model-parallel-size alone saves and resumes "
    "under Megatron-FSDP), or use --use-distributed-optimizer without --use-megatron-fsdp (--ckpt-format torch_dist)"
)


def refuse_saving_virtual_stages(args) -> None:
    """Refuse ``--save`` for Megatron-FSDP with virtual pipeline stages where the chunks' names are not made
    unique (megatron-core before 0.16: megatron stops at the first save); from 0.16 it saves and resumes."""
    from mindspeed_like.megatron_version import megatron_core_version, release_in

    version = megatron_core_version()
    if version is None or release_in(CHUNKS_VERSIONS, version):
        return
    if getattr(args, "use_megatron_fsdp", False) and getattr(args, "save", None) and _virtual_stages(args):
        flag = (
            f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}"
            if getattr(args, "num_layers_per_virtual_pipeline_stage", None) is not None
            else f"--num-virtual-stages-per-pipeline-rank {args.num_virtual_stages_per_pipeline_rank}"
        )
        raise ConfigError(
            SAVE_WITH_VIRTUAL_STAGES.format(flag=flag, save=args.save, version=version, chunks=CHUNKS_VERSIONS)
        )


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
    Also refuses ``--save`` with virtual pipeline stages where megatron-core is older than the fix for them
    (item 6 of the module's docstring)."""
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
        why="fsdp_dtensor named each stage's layers from 0 (the stages overwrote each other's layers); with "
        "several model chunks it prepared model[0]'s state only ('model': a KeyError)",
    ),
    Patch(
        OPTIMIZER_NAMES,
        Kind.WRAP,
        unique_names_across_chunks,
        versions=CHUNKS_VERSIONS,
        why="the distributed optimizer named each chunk's parameters by their path within the chunk, the same in "
        "every chunk: 'Parameter names conflict between model chunks' at the first fsdp_dtensor save",
    ),
    Patch(
        STATE_DICT,
        Kind.WRAP,
        remember_model_chunks,
        optional=True,
        module="megatron.training.checkpointing",
        versions=CHUNKS_VERSIONS,
        why="the model chunks behind model[0], for their fsdp_dtensor preparation (Megatron-LM hands it model[0])",
    ),
    Patch(
        LOAD,
        Kind.WRAP,
        chunks_handed_back_after_loading,
        optional=True,
        after=("fix-fsdp2-resume",),  # independent: that one acts on torch FSDP2 loads only
        module="megatron.training.checkpointing",
        versions=CHUNKS_VERSIONS,
        why="after an fsdp_dtensor load megatron hands load_state_dict the model's own state dict, not the chunks'",
    ),
]

FEATURE = Feature(
    name=NAME,
    summary="--use-megatron-fsdp with --pipeline-model-parallel-size > 1 runs: the mesh of each stage, a viewless "
    "stage output, the tied embedding's gradient shard all-reduced in place (megatron stopped at each); fsdp_dtensor "
    "checkpoints name layers by their global index (each stage wrote its own from 0: the stages overwrote each other); "
    "Megatron-LM's align_grad_reduce off where Megatron-FSDP overlaps (the stages past the first never reduced); "
    "with virtual pipeline stages the optimizer names each chunk's parameters by global layer index (megatron "
    "stopped at the first save: names conflicted between chunks) and fsdp_dtensor prepares every chunk's state, "
    "not model[0]'s only",
    patches=PATCHES,
    enabled=always_on,
    validate_args_hook=reduce_on_every_stages_last_backward,
    backend="any",
    kind="fix",
)
