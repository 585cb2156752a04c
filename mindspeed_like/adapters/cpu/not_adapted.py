"""megatron's CUDA call sites that the CPU adapters deliberately leave as they are, and why.

``cuda_sites`` finds every function of the installed megatron that spells CUDA; the cpu-adapter
and cpu-training-loop patches adapt most of them (host twins, module views of torch, host
regions). What is left must be named here, as a whole area (a module prefix) or one function,
with the reason and, where a flag reaches it, the flag. ``tests/adapters/test_cuda_sites.py``
fails on a function that is neither adapted nor named here (a new call site upstream, or a patch
removed) and on an entry that no longer matches anything unadapted (stale). So this table is the
only hand-kept part, and it cannot drift from the installed source.

``refused_flags`` are Megatron-LM arguments (``args`` attribute names) whose code is listed here
and was SEEN to crash on a host (each run through pretrain_gpt.py with the import line, issue 37:
--record-memory-history, --log-device-memory-used (at iteration 1), --init-model-with-meta-device,
--batch-invariant-mode, --use-torch-fsdp2, --use-megatron-fsdp, --optimizer-cpu-offload and
--fine-grained-activation-offloading; the flag sweep, ``make test-megatron-lm-flags``: --profile
without --use-pytorch-profiler); the cpu-training-loop refuses them at start-up with the entry's
reason (``cpu_training.arguments.refuse_host_unsupported``) instead, unless an argument of the
entry's ``unless`` takes the flag off its CUDA path. A flag listed without
a refusal was not seen to crash (--log-straggler and --log-energy train) or was not tried.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NotAdapted:
    where: str  # "module" (and everything under it) or "module:Qualname"
    why: str
    refused_flags: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()  # arguments that, given, take the refused flags off the CUDA path

    def matches(self, key: str) -> bool:
        if ":" in self.where:
            return key == self.where
        module = key.split(":", 1)[0]
        return module == self.where or module.startswith(self.where + ".")


CORE = "megatron.core"
TRAINING = "megatron.training"

NOT_ADAPTED: tuple[NotAdapted, ...] = (
    # whole areas that exist for a GPU (or for inference) only
    NotAdapted(f"{CORE}.inference", "inference engines and servers: CUDA graphs, KV caches, unified memory"),
    NotAdapted(f"{CORE}.distributed.fsdp", "megatron-FSDP (--use-megatron-fsdp)", ("use_megatron_fsdp",)),
    NotAdapted(
        f"{CORE}.distributed.torch_fully_sharded_data_parallel",
        "torch FSDP2 (--use-torch-fsdp2): its mesh is built on 'cuda'",
        ("use_torch_fsdp2",),
    ),
    NotAdapted(f"{CORE}.transformer.fsdp_dtensor_checkpoint", "checkpoints of megatron-FSDP's DTensors"),
    NotAdapted(f"{CORE}.transformer.cuda_graphs", "CUDA graphs (--cuda-graph-impl, --enable-cuda-graph)"),
    NotAdapted(f"{CORE}.full_cuda_graph", "CUDA graphs of the whole step (--cuda-graph-scope full_iteration)"),
    NotAdapted(f"{CORE}.transformer.module:GraphableMegatronModule.get_layer_static_inputs", "CUDA graph capture"),
    NotAdapted(f"{CORE}.transformer.transformer_layer:TransformerLayer.get_layer_static_inputs", "CUDA graph capture"),
    NotAdapted(
        f"{CORE}.transformer.transformer_layer:TransformerLayer._get_te_cuda_graph_replay_args", "CUDA graph replay"
    ),
    NotAdapted(f"{CORE}.nccl_allocator", "NCCL user buffers (--nccl-ub): NCCL's memory pool"),
    NotAdapted(
        f"{CORE}.utils:GlobalSymmetricMemoryBuffer.__init__", "symmetric memory for NCCL/NVSHMEM collectives (CUDA)"
    ),
    NotAdapted(f"{CORE}.resharding", "RL weight refit between training and inference layouts (NCCL/NVSHMEM copies)"),
    NotAdapted(f"{CORE}.export", "TensorRT-LLM export"),
    NotAdapted(
        f"{CORE}.pipeline_parallel.fine_grained_activation_offload",
        "activation offloading to the host (--fine-grained-activation-offloading): the activations are on the host",
        ("fine_grained_activation_offloading",),
    ),
    NotAdapted(
        f"{CORE}.optimizer.cpu_offloading",
        "optimizer offloading to the host (--optimizer-cpu-offload): the optimizer is on the host",
        ("optimizer_cpu_offload",),
    ),
    NotAdapted(f"{CORE}.extensions.transformer_engine", "TE's wrappers: the te-backend binds its own classes in place"),
    NotAdapted(f"{CORE}.ssm", "Mamba / gated delta net layers: their kernels (mamba_ssm, causal_conv1d) are CUDA"),
    NotAdapted(f"{CORE}.fp8_utils", "FP8 parameters need TransformerEngine"),
    NotAdapted(
        f"{CORE}.fusions.fused_indices_converter",
        "Triton kernel on CUDA (--moe-permute-fusion is served by moe-permute)",
    ),
    NotAdapted(f"{CORE}.tensor_parallel.inference_layers", "inference-optimized linears (symmetric memory)"),
    NotAdapted(f"{CORE}.transformer.attention:Attention._allocate_memory", "inference KV cache"),
    NotAdapted(
        f"{CORE}.transformer.custom_layers.batch_invariant_kernels",
        "batch-invariant Triton kernels (--batch-invariant-mode)",
        ("batch_invariant_mode",),
    ),
    # hybrid context parallel and the A2A-overlap schedule: CUDA streams and events throughout
    NotAdapted(f"{CORE}.pipeline_parallel.hybrid_cp_schedule", "hybrid context parallel (--hybrid-context-parallel)"),
    NotAdapted(f"{CORE}.datasets.data_schedule", "hybrid context parallel's data loader"),
    NotAdapted(f"{CORE}.utils:get_batch_on_this_hybrid_cp_rank", "hybrid context parallel's batch split"),
    NotAdapted(
        f"{CORE}.pipeline_parallel.combined_1f1b",
        "EP all-to-all overlap with a second CUDA stream (--overlap-moe-expert-parallel-comm); "
        "moe-alltoall-overlap is the host's overlap",
    ),
    NotAdapted(f"{CORE}.pipeline_parallel.utils", "streams of the A2A-overlap schedule"),
    NotAdapted(f"{CORE}.models.common.model_chunk_schedule_plan", "the A2A-overlap schedule plan"),
    NotAdapted(f"{CORE}.models.gpt.fine_grained_callables", "the A2A-overlap layer callables"),
    NotAdapted(
        f"{CORE}.pipeline_parallel.bridge_communicator", "pipelines between modules of different layouts (multimodal)"
    ),
    # models other than GPT: not run on a host by this project
    NotAdapted(f"{CORE}.models.bert", "BERT is not run on a host by this project"),
    NotAdapted(f"{CORE}.models.vision", "vision encoders are not run on a host by this project"),
    # one function each
    NotAdapted(
        f"{CORE}.parallel_state:initialize_model_parallel",
        "only with SHARP (--use-sharp): an NCCL barrier on the device; a host runs gloo",
    ),
    # measured on a host (gloo, no pynvml): both flags train, their CUDA calls are in NCCL/NVML branches
    NotAdapted(
        f"{CORE}.utils:StragglerDetector.configure",
        "--log-straggler: CUDA events only with NCCL; with gloo (a host) the detector times on the CPU",
    ),
    NotAdapted(f"{CORE}.utils:StragglerDetector.start_method", "--log-straggler: CUDA events only with NCCL"),
    NotAdapted(f"{CORE}.utils:StragglerDetector.elapsed", "--log-straggler: GPU readings only with NCCL"),
    NotAdapted(f"{CORE}.energy_monitor", "--log-energy: NVML's counters; without pynvml megatron prints 0.0 J"),
    NotAdapted(
        f"{CORE}.dist_checkpointing.strategies.async_utils:PersistentAsyncCaller.async_loop",
        "the persistent async-save worker (--use-persistent-ckpt-worker) sets a CUDA device in its new process",
    ),
    NotAdapted(
        f"{CORE}.dist_checkpointing.tensor_aware_state_dict",
        "local non-persistent checkpoints (--non-persistent-ckpt-type local) need nvidia-resiliency-ext",
    ),
    NotAdapted(
        f"{CORE}.datasets.blended_megatron_dataset_builder:BlendedMegatronDatasetBuilder._build_megatron_datasets_parallel",
        "torch.cuda.device_count() only scales the dataset-builder thread count; 0 on a host: no scaling",
    ),
    NotAdapted(
        f"{CORE}.tensor_parallel.layers:<module>", "'cuda' at import: a default device name, never used on a host"
    ),
    NotAdapted(f"{CORE}.tensor_parallel.random:<module>", "'cuda' at import: the RNG tracker's default device name"),
    # megatron.training (Megatron-LM)
    NotAdapted(
        f"{TRAINING}.arguments:validate_args",
        "the compute-capability check of --moe-grouped-gemm: hidden by grouped-gemm's validate_args hook",
    ),
    NotAdapted(f"{TRAINING}.yaml_arguments", "YAML configurations (--yaml-cfg): the grouped-GEMM capability check"),
    NotAdapted(f"{TRAINING}.dist_signal_handler:get_device", "'cuda' only with NCCL; with gloo (a host) the CPU"),
    NotAdapted(f"{TRAINING}.ft_integration", "fault tolerance needs nvidia-resiliency-ext"),
    NotAdapted(f"{TRAINING}.inprocess_restart", "in-process restart (--inprocess-restart) needs nvidia-resiliency-ext"),
    NotAdapted(
        f"{TRAINING}.initialize:_initialize_distributed",
        "device_id cuda:N goes to init_process_group, which binds it for NCCL only (gloo ignores it); "
        "set_stream only with --cuda-graph-impl transformer_engine",
    ),
    NotAdapted(
        f"{TRAINING}.training:get_model",
        "'cuda' only with --init-model-with-meta-device (materializes on the device)",
        ("init_model_with_meta_device",),
    ),
    NotAdapted(
        f"{TRAINING}.training:train",
        "--profile without --use-pytorch-profiler starts CUDA's profiler (cudaProfilerStart); "
        "torch's profiler (--use-pytorch-profiler) profiles a host",
        ("profile",),  # seen by the flag sweep: AssertionError at --profile-step-start (tests/megatron_lm_flags)
        unless=("use_pytorch_profiler",),
    ),
    NotAdapted(
        f"{TRAINING}.training:post_training_step_callbacks",
        "--profile without --use-pytorch-profiler: cudaProfilerStop",
    ),
    NotAdapted(
        f"{TRAINING}.training:training_log",
        "--record-memory-history: CUDA caching allocator snapshots",
        ("record_memory_history",),
    ),
    NotAdapted(
        f"{TRAINING}.utils:report_memory",
        "--log-device-memory-used: the device's used memory (NVML)",
        ("log_device_memory_used",),
    ),
    NotAdapted(
        f"{TRAINING}.utils:get_device_arch_version",
        "'cuda:0' handed to the module's host view, whose get_device_properties answers for the host",
    ),
)


def entry_for(key: str) -> NotAdapted | None:
    """The most specific entry naming ``key`` ("module:Qualname"): a function's own before its area's."""
    matches = [entry for entry in NOT_ADAPTED if entry.matches(key)]
    return max(matches, key=lambda entry: (":" in entry.where, len(entry.where)), default=None)


def refused_flags() -> dict[str, str]:
    """Megatron-LM argument -> why a host cannot run it (every entry's ``refused_flags``)."""
    refused: dict[str, str] = {}
    for entry in NOT_ADAPTED:
        for flag in entry.refused_flags:
            refused.setdefault(flag, entry.why)
    return refused


def refused_given(args) -> dict[str, str]:
    """The refused flags set in Megatron-LM's ``args`` (none of the entry's ``unless`` set), and why."""
    given: dict[str, str] = {}
    for entry in NOT_ADAPTED:
        if any(getattr(args, name, None) for name in entry.unless):
            continue
        for flag in entry.refused_flags:
            if getattr(args, flag, None):
                given.setdefault(flag, entry.why)
    return given
