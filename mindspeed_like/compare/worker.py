"""One arm of a comparison, run in its own process(es): megatron-core's own path, or the features.

The parent hands over everything explicitly (the spec): the child forgets the command line and,
for megatron's arm, ``MINDSPEED_LIKE_ARGS``, then configures exactly what the spec says, so the
two arms differ only in the features. Both build the model from the same seed and train on the
same batches (windows of megatron-core's own source, byte-level).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

MEGATRON = "megatron"
FEATURES = "features"


def _configure(spec: dict[str, Any]) -> list[str]:
    """Apply the arm's configuration; return the features it switches on."""
    sys.argv = sys.argv[:1]  # the parent's command line is not this run's
    if spec["arm"] == MEGATRON:
        os.environ.pop("MINDSPEED_LIKE_ARGS", None)
    import collections

    import mindspeed_like
    from mindspeed_like.runtime import ENGINE, enabled_feature_names

    ENGINE.calls = collections.Counter()  # which features megatron actually called into

    if spec["arm"] == MEGATRON:
        # the context-parallel algorithm is shared: on this host it is the only CP attention megatron has
        # megatron's precision-aware optimizer needs TE's FusedAdam: without TE it runs precision-aware-optimizer's
        # Adam (the same contract), as megatron's TE spec runs on the te-backend
        precision_aware = (spec.get("optimizer") or {}).get("use_precision_aware_optimizer", False)
        own = {"no_portable_precision_aware_optimizer": False} if precision_aware else {}
        config = mindspeed_like.configure(
            optimization_level=0, device=spec["device"], **own, **spec.get("shared_flags", {})
        )
    else:
        config = mindspeed_like.configure(**spec["flags"])
    return enabled_feature_names(config)


def _reseed(seed: int) -> None:
    """What ``init_parallel`` seeds, without re-creating the process groups (model chunks built
    after the first keep the groups the first one was built with)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _init_parallel(spec: dict[str, Any]) -> None:
    """megatron's parallel state for the spec: TP, PP (with virtual stages), CP, EP; DP is the rest."""
    from mindspeed_like.workloads.parallel import init_parallel

    init_parallel(
        tp=spec["tp"],
        pp=spec.get("pp", 1),
        ep=spec["ep"],
        seed=spec["seed"],
        context_parallel_size=spec.get("cp", 1),
        virtual_pipeline_model_parallel_size=spec.get("vpp"),
        num_distributed_optimizer_instances=spec.get("instances", 1),
    )


def _model_args(spec: dict[str, Any]) -> dict[str, Any]:
    from mindspeed_like.compare.presets import PRESETS

    args = PRESETS[spec["preset"]].model_args(**spec["size"])
    args.update(bf16=spec["bf16"], sequence_parallel=spec["sp"], **parallel_config(spec))
    return args


def parallel_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The TransformerConfig (ModelParallelConfig) fields of the spec's layout, as Megatron-LM's
    ``core_transformer_config_from_args`` sets them: the sizes, ``pipeline_dtype`` at PP > 1, and
    with virtual stages its defaults ``overlap_p2p_comm=True`` / ``batch_p2p_comm=False``
    (``--no-overlap-p2p-communication`` off)."""
    pp, vpp = spec.get("pp", 1), spec.get("vpp")
    values: dict[str, Any] = dict(
        tensor_model_parallel_size=spec["tp"],
        pipeline_model_parallel_size=pp,
        context_parallel_size=spec.get("cp", 1),
        expert_model_parallel_size=spec["ep"],
    )
    if pp > 1:
        values["pipeline_dtype"] = torch.bfloat16 if spec["bf16"] else torch.float32
    if vpp:
        values.update(virtual_pipeline_model_parallel_size=vpp, overlap_p2p_comm=True, batch_p2p_comm=False)
    return values


def megatron_config(spec: dict[str, Any]):
    """The TransformerConfig the children's model is built with (``tiny_gpt``'s, from the same
    values): `compare` builds it before starting any process, so megatron's own checks refuse a bad
    combination there, with megatron's message."""
    from mindspeed_like.workloads.models import MODEL_DEFAULTS, gpt_config

    args = _model_args(spec)
    for key in (*MODEL_DEFAULTS, "seq_length"):
        args.pop(key, None)
    if not args.get("multi_latent_attention"):
        args.pop("rotary_base", None)  # GPTModel's argument, not the config's
    return gpt_config(**args)


def build_chunks(spec: dict[str, Any], grouped_gemm_on: bool) -> list[torch.nn.Module]:
    """The model of this rank: one chunk, or one per virtual pipeline stage (Megatron-LM's get_model:
    each chunk knows whether it holds the embedding / the output layer from its stage)."""
    from megatron.core import parallel_state

    _init_parallel(spec)
    if spec.get("pp", 1) == 1:
        return [_build_model(spec, grouped_gemm_on, initialized=True)]
    chunks = []
    for stage in range(spec.get("vpp") or 1):
        vp_stage = stage if spec.get("vpp") else None
        _reseed(spec["seed"] + stage)
        place = dict(
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
        chunks.append(_build_model(spec, grouped_gemm_on, initialized=True, place=place, seed=spec["seed"] + stage))
    return chunks


def _build_model(
    spec: dict[str, Any],
    grouped_gemm_on: bool,
    *,
    initialized: bool = False,
    place: dict[str, Any] | None = None,
    seed: int | None = None,
):
    """The preset's GPT. MoE on the local spec: megatron's arm runs its expert loop (SequentialMLP:
    its GroupedMLP needs the CUDA grouped_gemm package); the features arm, with grouped-gemm on,
    megatron's ``moe_grouped_gemm=True`` given the expert loop's weights, so both arms start from
    the same function. The TE spec builds the preset as it is (TEGroupedMLP for the MoE presets) in
    both arms. ``place``: a pipeline chunk's ``pre_process`` / ``post_process`` / ``vp_stage``."""
    from mindspeed_like.compare.presets import PRESETS
    from mindspeed_like.workloads import tiny_gpt

    preset = PRESETS[spec["preset"]]
    args = dict(_model_args(spec), **(place or {}))
    seed = spec["seed"] if seed is None else seed
    if not initialized:
        _init_parallel(spec)
    if spec.get("transformer_impl", "local") == "transformer_engine":
        return _te_spec_model(spec, args, seed)
    if not preset.moe or not grouped_gemm_on:
        # megatron's local GroupedMLP needs the CUDA grouped_gemm package: without the feature, the loop
        return tiny_gpt(**dict(args, moe_grouped_gemm=False) if preset.moe else args)
    reference = tiny_gpt(wrap_float16=False, **dict(args, moe_grouped_gemm=False))
    _reseed(seed)
    model = tiny_gpt(wrap_float16=False, **dict(args, moe_grouped_gemm=True))
    if any(".experts.weight1" in name for name, _ in model.named_parameters()):  # GroupedMLP (< 0.17)
        from mindspeed_like.workloads.moe import copy_sequential_into_grouped

        copy_sequential_into_grouped(reference, model, 8 // spec["ep"])
    else:  # 0.17+: SequentialMLP either way, the same parameters from the same seed
        model.load_state_dict(reference.state_dict())
    del reference
    if spec["bf16"]:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    return model


def _te_spec_model(spec: dict[str, Any], args: dict[str, Any], seed: int):
    """The TE-spec GPT (``get_gpt_layer_with_transformer_engine_spec``), given the weights of the
    local-spec model of the same seed by distributed-checkpoint key: both arms, and both
    ``--transformer-impl`` choices, start from the same function (TE's grouped experts take
    SequentialMLP's weights as ``weight0..N-1``)."""
    from mindspeed_like.workloads import tiny_gpt
    from mindspeed_like.workloads.checkpoint_keys import copy_weights

    local = tiny_gpt(wrap_float16=False, **dict(args, moe_grouped_gemm=False))
    _reseed(seed)
    model = tiny_gpt(wrap_float16=False, transformer_impl="transformer_engine", **args)
    _name_mla_qk_norms_as_te(local)
    copy_weights(local, model)
    del local
    if spec["bf16"]:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    return model


# MLA's q/kv LoRA norms: the local spec's separate modules, fused into the up projections on the TE
# spec; megatron's local layer spec declares no checkpoint renaming for them (its TE spec names them
# ``linear_q_up_proj.layer_norm_weight``), so the local model is told the TE names here.
_MLA_QK_NORM_KEYS = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}


def _name_mla_qk_norms_as_te(model) -> None:
    """Add the MLA qk-norm renaming to the checkpoint-key map of each local MLA layer with qk-layernorm
    (decoder and MTP layers), so ``copy_weights`` matches them by key like every other weight."""
    import dataclasses

    from megatron.core.transformer.transformer_layer import TransformerLayer

    for layer in model.modules():
        attention = getattr(layer, "self_attention", None)
        if not isinstance(layer, TransformerLayer) or getattr(attention, "q_layernorm", None) is None:
            continue
        if not hasattr(attention, "linear_q_down_proj"):  # not MLA
            continue
        submodules = layer.submodules_config
        keys = {**submodules.sharded_state_dict_keys_map, **_MLA_QK_NORM_KEYS}
        layer.submodules_config = dataclasses.replace(submodules, sharded_state_dict_keys_map=keys)


@contextlib.contextmanager
def engine_calls_restored() -> Iterator[None]:
    """:func:`_configure` makes the engine count calls into every patch (``ENGINE.calls``); the count
    is switched back to what it was on leaving, so a caller in the same process (tests, plan-parity)
    does not get every later patch wrapped in a counter (a later test's check that megatron's
    function is the feature's wrapper then failed)."""
    from mindspeed_like.runtime import ENGINE

    counting_before = ENGINE.calls
    try:
        yield
    finally:
        ENGINE.calls = counting_before


def run_arm(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one arm; return its losses, step times, memory split and the features that ran
    (calls counted while it runs: :func:`engine_calls_restored`)."""
    with engine_calls_restored():
        return _run_arm(spec)


def _run_arm(spec: dict[str, Any]) -> dict[str, Any]:
    from mindspeed_like.adapters.detect import detect_device
    from mindspeed_like.compare.measure import ActivationProbe, process_peak_bytes, state_bytes, step_time_summary
    from mindspeed_like.compare.profile import StepProfiler
    from mindspeed_like.run_arguments import quiet_expected_warnings
    from mindspeed_like.runtime import ENGINE
    from mindspeed_like.toolkit import allocator_history
    from mindspeed_like.toolkit.fallback import fell_back, served
    from mindspeed_like.workloads import destroy_parallel, train_steps

    quiet_expected_warnings()
    features_on = _configure(spec)
    torch.set_num_threads(spec["threads"])  # run_distributed starts each child with one
    from megatron.core import parallel_state

    device = detect_device(spec["device"])
    rank = torch.distributed.get_rank()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    chunks = build_chunks(spec, grouped_gemm_on="grouped-gemm" in features_on)
    if device == "cpu":
        _release_build_pages()
    recording = allocator_history.start(device)  # $MINDSPEED_LIKE_MEMORY_HISTORY: from the model's move on
    if device != "cpu":
        index = torch.cuda.current_device() if device == "cuda" else 0
        chunks = [chunk.to(torch.device(device, index)) for chunk in chunks]
    probe = ActivationProbe(step=spec["steps"] - 1)
    label = spec["arm"] + (f"-r{spec['repeat'] + 1}" if spec.get("repeats", 1) > 1 else "")
    profiler = StepProfiler(label, spec["steps"], device, rank)
    held: dict[str, Any] = {}
    stamps: list[float] = []

    def on_optimizer(ddp_model, optimizer) -> None:
        ddp_models = ddp_model if isinstance(ddp_model, list) else [ddp_model]
        held.update(models=ddp_models, optimizer=optimizer)
        probe.exclude = [*(p for m in ddp_models for p in m.parameters()), *_masters(optimizer)]
        _measure_state_as_the_last_step_starts(optimizer, ddp_models, spec["steps"], held)
        stamps.append(time.perf_counter())

    def on_step(step: int, loss: float) -> None:
        stamps.append(time.perf_counter())
        profiler.after_step(step)
        if rank == 0 and spec.get("progress", True):
            ms = (stamps[-1] - stamps[-2]) * 1000
            label = f"{spec['arm']}" + (f" #{spec['repeat'] + 1}" if spec.get("repeats", 1) > 1 else "")
            print(f"  [{label:>11}] step {step + 1:3d}/{spec['steps']}  loss {loss:.4f}  {ms:7.0f} ms", flush=True)

    pipelined = spec.get("pp", 1) > 1
    try:
        common = dict(
            lr=spec["lr"],
            micro_batch_size=spec["micro_batch_size"],
            seq_length=spec["size"]["seq_length"],
            use_distributed_optimizer=spec["distributed_optimizer"],
            on_step=on_step,
            on_optimizer=on_optimizer,
            forward_context=probe,
        )
        optimizer = spec.get("optimizer") or {"optimizer": "adam", "clip_grad": 1.0}
        if pipelined:
            from mindspeed_like.compare.pipeline import train_pipeline

            losses = train_pipeline(
                chunks,
                spec["steps"],
                data=spec["data"],
                optimizer=optimizer,
                grad_reduce_in_fp32=spec.get("grad_reduce_in_fp32", True),
                **common,
            )
        else:
            losses = train_steps(
                chunks[0],
                spec["steps"],
                data=spec["data"],
                device=None if device == "cpu" else next(chunks[0].parameters()).device,
                # megatron's finalize_model_grads also updates the router's expert bias (DeepSeek's
                # aux-loss-free balancing), as Megatron-LM's training loop does
                finalize_grads=bool(getattr(chunks[0].config, "moe_router_enable_expert_bias", False)),
                data_parallel=spec.get("data_parallel", "ddp"),
                ddp_options=spec.get("ddp_options"),
                optimizer=optimizer,
                grad_reduce_in_fp32=spec.get("grad_reduce_in_fp32", True),
                **common,
            )
        memory = held.get("state_before_last_step") or state_bytes(held["models"], held["optimizer"])
        microbatches = spec.get("microbatches", 1)
        tokens_per_step = spec["micro_batch_size"] * microbatches * parallel_state.get_data_parallel_world_size()
        tokens_per_step *= spec["size"]["seq_length"]
        place = {  # this rank's coordinates in the dimensions in use
            name: rank_of()
            for name, size_of, rank_of in (
                (
                    "tp",
                    parallel_state.get_tensor_model_parallel_world_size,
                    parallel_state.get_tensor_model_parallel_rank,
                ),
                (
                    "pp",
                    parallel_state.get_pipeline_model_parallel_world_size,
                    parallel_state.get_pipeline_model_parallel_rank,
                ),
                ("cp", parallel_state.get_context_parallel_world_size, parallel_state.get_context_parallel_rank),
                ("dp", parallel_state.get_data_parallel_world_size, parallel_state.get_data_parallel_rank),
            )
            if size_of() > 1
        }
    finally:
        destroy_parallel()
    times = [b - a for a, b in zip(stamps, stamps[1:])]
    if recording:
        allocator_history.dump(label, rank)
    return {
        "arm": spec["arm"],
        "rank": rank,
        "place": place,
        "device": device,
        "features_on": features_on,
        "fell_back": fell_back(),
        "served": served(),
        "calls": dict(ENGINE.calls or {}),
        "losses": losses,
        "step_times_s": times,
        "step_time": step_time_summary(times),
        "tokens_per_step": tokens_per_step,
        "memory": {**memory, "activations": probe.bytes, "process_peak": process_peak_bytes(device)},
    }


def _measure_state_as_the_last_step_starts(optimizer, models: list, steps: int, held: dict[str, Any]) -> None:
    """Measure the model state when the last optimizer step starts, where every kind is alive at
    once: torch FSDP2's sharded gradients exist only from a backward to megatron's optimizer step
    (which drops them once copied to the masters), so a count after training would leave them out.
    DDP's and Megatron-FSDP's gradient buffers live all run and count the same either way. A
    one-step run is measured after its step (Adam's moments are made by the first step)."""
    from mindspeed_like.compare.measure import state_bytes

    step = optimizer.step
    calls = [0]

    def step_measured(*args, **kwargs):
        calls[0] += 1
        if calls[0] == steps > 1:
            held["state_before_last_step"] = state_bytes(models, optimizer)
        return step(*args, **kwargs)

    optimizer.step = step_measured


def _release_build_pages() -> None:
    """Give back what building the model freed before training starts. The workers initialise in
    fp32 and cast, and for the TE spec or grouped-gemm build a second model to copy weights from
    (``_build_model``): up to 8 bytes a parameter that a Megatron-LM run, which builds in its
    parameter dtype, never holds. glibc keeps such freed blocks in its heap, where they would sit in
    the process peak (RSS) beside the training step's own memory, an artifact of this harness; after
    ``malloc_trim`` the peak is the build's or training's, whichever is larger (plan/peak.py)."""
    import gc

    from mindspeed_like.features.host_allocator import glibc

    gc.collect()
    glibc.release_free_pages()


def _masters(optimizer) -> list[torch.Tensor]:
    from mindspeed_like.compare.measure import _optimizer_tensors

    return list(_optimizer_tensors(optimizer))
