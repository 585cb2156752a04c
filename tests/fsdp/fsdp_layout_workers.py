"""Runs for tests/fsdp/test_fsdp_parallel_layouts.py in spawned gloo processes (must be importable).

One spawn sets up one parallel layout (TP, CP, EP, distributed-optimizer instances) and trains
megatron's tiny GPT under each case's data-parallel wrapper on it, so FSDP and the run without it
see the same process groups, seeds and batches."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

STEPS = 3


def train_layout(
    layout: dict, cases: list[dict], model: dict | None = None, without: tuple[str, ...] = ()
) -> dict[str, list[float]]:
    """``layout``: ``tp``, ``ep``, ``cp``, ``instances`` (``num_distributed_optimizer_instances``);
    ``cases``: dicts of ``name``, ``data_parallel`` ('ddp' / 'torch_fsdp2' / 'megatron_fsdp'),
    ``ddp_options``, ``use_distributed_optimizer``, ``optimizer`` (``OptimizerConfig`` fields, e.g.
    ``clip_grad``) and ``keep_tp_rng`` (Megatron-FSDP's broadcast of TP
    rank 0's RNG states taken out, to show what it changes); ``model``: TransformerConfig / GPTModel
    overrides of the tiny GPT (dropout, MoE sizes, ``bf16``, ``transformer_impl``); ``without``:
    features removed first (a fix's test). Returns each case's losses (averaged over the data- and
    context-parallel ranks)."""
    from megatron.core import tensor_parallel

    import mindspeed_like
    from mindspeed_like import runtime
    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt
    from mindspeed_like.testing.training import train_steps

    mindspeed_like.configure(device="cpu")
    for name in without:
        runtime.ENGINE.remove(name)
    cp = layout.get("cp", 1)
    init_parallel(
        tp=layout.get("tp", 1),
        ep=layout.get("ep", 1),
        seed=1234,
        context_parallel_size=cp,
        num_distributed_optimizer_instances=layout.get("instances", 1),
    )
    overrides = dict(model or {})
    impl = overrides.pop("transformer_impl", "transformer_engine")
    losses: dict[str, list[float]] = {}
    try:
        for case in cases:
            torch.manual_seed(1234)
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            gpt = tiny_gpt(transformer_impl=impl, context_parallel_size=cp, **overrides)
            gpt.config.transformer_impl = impl  # what Megatron-LM's config carries (FSDP2's unit choice)
            options = dict(case.get("ddp_options") or {})
            if layout.get("instances", 1) > 1 and case["data_parallel"] != "torch_fsdp2":
                options["num_distributed_optimizer_instances"] = layout["instances"]
            with _tp_rng_kept(case.get("keep_tp_rng", False)):
                losses[case["name"]] = train_steps(
                    gpt,
                    STEPS,
                    lr=1e-2,
                    optimizer=case.get("optimizer", "adam"),
                    data_parallel=case["data_parallel"],
                    ddp_options=options,
                    use_distributed_optimizer=case.get("use_distributed_optimizer", False),
                    finalize_grads=True,
                )
    finally:
        destroy_parallel()
    return losses


@contextlib.contextmanager
def _tp_rng_kept(keep: bool) -> Iterator[None]:
    """Megatron-FSDP's wrapper without its ``sync_rng_states_across_tp_group`` (each TP rank keeps its
    own RNG states, as under DDP), while ``keep``."""
    if not keep:
        yield
        return
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    original = FullyShardedDataParallel.sync_rng_states_across_tp_group
    FullyShardedDataParallel.sync_rng_states_across_tp_group = lambda self: None
    try:
        yield
    finally:
        FullyShardedDataParallel.sync_rng_states_across_tp_group = original


def stage_meshes(tp: int, without: str) -> list:
    """Megatron-FSDP's DP x TP device mesh (``mcore_fsdp_adapter._get_dp_tp_mesh``, as its wrapper's
    ``_init_dist_index`` asks for it) at pipeline-parallel size 2 with ``tp``: as built with every
    feature, then with the feature ``without`` removed (the error's text where megatron cannot build it)."""
    import importlib

    from megatron.core import parallel_state

    import mindspeed_like
    from mindspeed_like import runtime
    from mindspeed_like.testing import destroy_parallel, init_parallel

    mindspeed_like.configure(device="cpu")
    init_parallel(tp=tp, pp=2)
    adapter = importlib.import_module("megatron.core.distributed.fsdp.mcore_fsdp_adapter")
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    meshes: list = []
    try:
        meshes.append(adapter._get_dp_tp_mesh(dp_cp, tp_group).tolist())
        runtime.ENGINE.remove(without)
        try:
            meshes.append(adapter._get_dp_tp_mesh(dp_cp, tp_group).tolist())
        except Exception as error:  # megatron's own failure, compared by the test
            meshes.append(f"{type(error).__name__}: {error}")
    finally:
        destroy_parallel()
    return meshes


def stage_hsdp_meshes(without: str) -> list:
    """Megatron-FSDP's hybrid (HSDP) mesh (``mcore_fsdp_adapter._get_hsdp_tp_mesh``, as its wrapper's
    ``_init_dist_index`` asks for it with ``--num-distributed-optimizer-instances 2``) at pipeline-parallel
    size 2: as built with every feature, then with the feature ``without`` removed (the error's text where
    megatron cannot build it)."""
    import importlib

    from megatron.core import parallel_state

    import mindspeed_like
    from mindspeed_like import runtime
    from mindspeed_like.testing import destroy_parallel, init_parallel

    mindspeed_like.configure(device="cpu")
    init_parallel(pp=2, num_distributed_optimizer_instances=2)
    adapter = importlib.import_module("megatron.core.distributed.fsdp.mcore_fsdp_adapter")
    groups = (
        parallel_state.get_inter_distributed_optimizer_instance_group(),
        parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
        parallel_state.get_tensor_model_parallel_group(),
    )
    meshes: list = []
    try:
        meshes.append(adapter._get_hsdp_tp_mesh(*groups).tolist())
        runtime.ENGINE.remove(without)
        try:
            meshes.append(adapter._get_hsdp_tp_mesh(*groups).tolist())
        except Exception as error:  # megatron's own failure, compared by the test
            meshes.append(f"{type(error).__name__}: {error}")
    finally:
        destroy_parallel()
    return meshes
