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
--batch-invariant-mode, --use-torch-fsdp2, --use-megatron-fsdp and --fine-grained-activation-offloading;
--optimizer-cpu-offload was one until the cpu adapter ran its optimizer on one device (hybrid_optimizer.py;
below offload fraction 1.0 ``refuse_host_unsupported`` still refuses it, measured to train slower);
the flag sweep, ``make test-megatron-lm-flags``: --profile without --use-pytorch-profiler); the
cpu-training-loop refuses them at start-up with the entry's reason
(``cpu_training.arguments.refuse_host_unsupported``) instead, unless an argument of the entry's
``unless`` takes the flag off its CUDA path. A flag listed without
a refusal was not seen to crash (--log-straggler and --log-energy train) or was not tried.

An entry whose functions exist only in some megatron-core releases declares them (``versions``, a
PEP 440 specifier as on patches): the test scans the installed release, so an entry counts only
where its release range includes the installed one, and it is stale there when it matches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

from mindspeed_like.megatron_version import megatron_core_version, release_in


@dataclass(frozen=True)
class NotAdapted:
    where: str  # "module" (and everything under it) or "module:Qualname"
    why: str
    refused_flags: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()  # arguments that, given, take the refused flags off the CUDA path
    only_with: tuple[str, ...] = ()  # the refused flags reach the CUDA path only beside one of these
    versions: str | None = None  # the megatron-core releases whose source holds these sites; None: all

    def applies_to(self, version: Version | None) -> bool:
        """The entry names sites of megatron-core ``version`` (None: unknown, taken as the newest)."""
        if self.versions is None or version is None:
            return True
        return release_in(self.versions, version)

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
    *(
        NotAdapted(f"{CORE}.distributed.fsdp.src.megatron_fsdp.utils:{name}", why, versions=">=0.14")
        for name, why in (
            (
                "initialize_rng_tracker",
                "megatron-FSDP's standalone RNG tracker: inside megatron-core it takes megatron's (adapted)",
            ),
            ("_get_cuda_rng_state", "megatron-FSDP's standalone RNG tracker (megatron-core brings its own)"),
            ("_set_cuda_rng_state", "megatron-FSDP's standalone RNG tracker (megatron-core brings its own)"),
            ("<module>", "'cuda' at import: the standalone RNG tracker's default device name"),
        )
    ),
    *(
        NotAdapted(f"{CORE}.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer:{name}", why, versions=">=0.14")
        for name, why in (
            ("MultiGroupUBRAllocator.__enter__", "NCCL user buffers (--nccl-ub): NCCL's memory pool"),
            ("MultiGroupUBRAllocator.__exit__", "NCCL user buffers (--nccl-ub): NCCL's memory pool"),
            (
                "ParamAndGradBuffer.manual_buffer_registration",
                "NCCL user buffers (--nccl-ub): registration with NCCL",
            ),
            (
                "ParamAndGradBuffer",
                "'cuda' as a default argument, evaluated at import; megatron-FSDP passes its own device",
            ),
            (
                "ParamAndGradBuffer._init_each_parameter_group_buffers",
                "'cuda' compared with a buffer's device type (a host's buffers are 'cpu')",
            ),
            (
                "check_gpu_memory",
                "only with --init-model-with-meta-device (refused on a host: training.get_model's entry)",
            ),
        )
    ),
    NotAdapted(
        f"{CORE}.distributed.fsdp.src.megatron_fsdp.experimental",
        "megatron-FSDP's experimental module API (FsdpModule, symmetric-memory parameter groups): not what "
        "--use-megatron-fsdp builds; not run on a host",
        versions=">=0.19",
    ),
    NotAdapted(
        f"{CORE}.distributed.fsdp.src.megatron_fsdp.mixed_precision:_fp8_quantize_fallback",
        "FP8 parameters need TransformerEngine",
        versions=">=0.14",
    ),
    NotAdapted(f"{CORE}.distributed.custom_fsdp", "megatron-FSDP's 0.13 home (--use-custom-fsdp)", versions="<0.14"),
    NotAdapted(f"{CORE}.transformer.cuda_graphs", "CUDA graphs (--cuda-graph-impl, --enable-cuda-graph)"),
    NotAdapted(
        f"{CORE}.full_cuda_graph",
        "CUDA graphs of the whole step (--cuda-graph-scope full_iteration)",
        versions=">=0.14",
    ),
    NotAdapted(
        f"{CORE}.transformer.module:GraphableMegatronModule.get_layer_static_inputs",
        "CUDA graph capture",
        versions=">=0.15",
    ),
    NotAdapted(f"{CORE}.transformer.transformer_layer:TransformerLayer.get_layer_static_inputs", "CUDA graph capture"),
    NotAdapted(
        f"{CORE}.transformer.transformer_layer:TransformerLayer._get_te_cuda_graph_replay_args",
        "CUDA graph replay",
        versions=">=0.15",
    ),
    NotAdapted(
        f"{CORE}.transformer.transformer_layer:TransformerLayer._cuda_graph_replay",
        "CUDA graph replay",
        versions="<0.15",
    ),
    NotAdapted(
        f"{CORE}.transformer.transformer_layer:MoETransformerLayer.transition_cudagraph_scope",
        "partial CUDA graphs of MoE layers (--cuda-graph-impl local)",
        versions=">=0.17",
    ),
    NotAdapted(f"{CORE}.nccl_allocator", "NCCL user buffers (--nccl-ub): NCCL's memory pool", versions=">=0.14"),
    NotAdapted(
        f"{CORE}.utils:GlobalSymmetricMemoryBuffer.__init__",
        "symmetric memory for NCCL/NVSHMEM collectives (CUDA)",
        versions=">=0.16,<0.17",
    ),
    NotAdapted(
        f"{CORE}.resharding",
        "RL weight refit between training and inference layouts (NCCL/NVSHMEM copies)",
        versions=">=0.16",
    ),
    NotAdapted(f"{CORE}.export", "TensorRT-LLM export"),
    NotAdapted(
        f"{CORE}.pipeline_parallel.fine_grained_activation_offload",
        "activation offloading to the host (--fine-grained-activation-offloading): the activations are on the host",
        ("fine_grained_activation_offloading",),
        versions=">=0.16",
    ),
    NotAdapted(f"{CORE}.extensions.transformer_engine", "TE's wrappers: the te-backend binds its own classes in place"),
    NotAdapted(f"{CORE}.ssm", "Mamba / gated delta net layers: their kernels (mamba_ssm, causal_conv1d) are CUDA"),
    NotAdapted(f"{CORE}.fp8_utils", "FP8 parameters need TransformerEngine"),
    NotAdapted(
        f"{CORE}.extensions.kitchen", "Kitchen's quantized layers need NVIDIA's kitchen (CUDA)", versions="<0.16"
    ),
    NotAdapted(
        f"{CORE}.fusions.fused_indices_converter",
        "Triton kernel on CUDA (--moe-permute-fusion is served by moe-permute)",
    ),
    NotAdapted(
        f"{CORE}.tensor_parallel.inference_layers",
        "inference-optimized linears (symmetric memory)",
        versions=">=0.16,<0.17",
    ),
    NotAdapted(
        f"{CORE}.tensor_parallel.generalized_tensor_parallelism",
        "generalized tensor parallelism (--tensor-parallel-num-weight-shards): weight all-gathers on CUDA streams",
        versions=">=0.19",
    ),
    NotAdapted(f"{CORE}.transformer.attention:Attention._allocate_memory", "inference KV cache"),
    NotAdapted(
        f"{CORE}.transformer.custom_layers.batch_invariant_kernels",
        "batch-invariant Triton kernels (--batch-invariant-mode)",
        ("batch_invariant_mode",),
        versions=">=0.16",
    ),
    # hybrid context parallel and the A2A-overlap schedule: CUDA streams and events throughout
    NotAdapted(
        f"{CORE}.pipeline_parallel.hybrid_cp_schedule",
        "hybrid context parallel (--hybrid-context-parallel)",
        versions=">=0.16",
    ),
    NotAdapted(f"{CORE}.datasets.data_schedule", "hybrid context parallel's data loader", versions=">=0.16"),
    NotAdapted(
        f"{CORE}.utils:get_batch_on_this_hybrid_cp_rank",
        "hybrid context parallel's batch split",
        versions=">=0.16,<0.18",
    ),
    NotAdapted(
        f"{CORE}.pipeline_parallel.combined_1f1b",
        "EP all-to-all overlap with a second CUDA stream (--overlap-moe-expert-parallel-comm); "
        "moe-alltoall-overlap is the host's overlap",
        versions=">=0.14",
    ),
    NotAdapted(f"{CORE}.pipeline_parallel.utils", "streams of the A2A-overlap schedule"),
    NotAdapted(f"{CORE}.models.common.model_chunk_schedule_plan", "the A2A-overlap schedule plan", versions=">=0.14"),
    NotAdapted(
        f"{CORE}.models.common.utils:TransformerLayerNode.backward_dw",
        "the A2A-overlap schedule's delayed weight gradients (--delay-wgrad-compute) on its stream",
        versions=">=0.19",
    ),
    NotAdapted(f"{CORE}.models.gpt.fine_grained_callables", "the A2A-overlap layer callables"),
    NotAdapted(
        f"{CORE}.pipeline_parallel.bridge_communicator",
        "pipelines between modules of different layouts (multimodal)",
        versions=">=0.15",
    ),
    # MoE paths that need a GPU (streams, CUDA graphs, NVLink/NCCL dispatchers) or serve inference
    NotAdapted(
        f"{CORE}.transformer.moe.moe_layer:MoELayer.backward_dw",
        "latent MoE's fc2 weight gradient on the A2A-overlap schedule's communication stream",
        versions=">=0.17",
    ),
    *(
        NotAdapted(
            f"{CORE}.transformer.moe.moe_layer:{where}",
            "the NVLS inference dispatcher's shared-expert overlap of latent MoEs (inference only)",
            versions=">=0.18",
        )
        for where in ("MoELayer.preprocess", "MoELayer.postprocess")
    ),
    *(
        NotAdapted(
            f"{CORE}.transformer.moe.moe_layer:{where}",
            "expert weight gradients delayed onto a second CUDA stream "
            "(TransformerConfig.overlap_dispatch_backward_with_experts_wgrad)",
            versions=">=0.18",
        )
        for where in (
            "MoELayer.setup_delayed_wgrad_for_dispatch_backward_overlap",
            "_RecordExpertDgradCompletion.backward",
            "_RegisterDelayedWgradForExperts.backward",
        )
    ),
    NotAdapted(
        f"{CORE}.transformer.moe.paged_stash", "paged stashing of MoE activations (moe_paged_stash)", versions=">=0.18"
    ),
    NotAdapted(
        f"{CORE}.transformer.moe.token_dispatcher:_HybridEPManager.__init__",
        "the HybridEP flex dispatcher (--moe-flex-dispatcher-backend hybridep) needs DeepEP's CUDA package",
        versions=">=0.18",
    ),
    *(
        NotAdapted(
            f"{CORE}.transformer.moe.token_dispatcher:_NCCLEPManager.{name}",
            "the NCCL EP flex dispatcher (--moe-flex-dispatcher-backend ncclep) needs TransformerEngine and NCCL",
            versions=">=0.19",
        )
        for name in ("__init__", "_ensure_bootstrap")
    ),
    NotAdapted(
        f"{CORE}.transformer.moe.token_dispatcher_inference", "MoE dispatchers of inference (NVLS)", versions=">=0.18"
    ),
    NotAdapted(
        f"{CORE}.transformer.moe.shared_experts:FusedSharedExpertMLP.linear_fc1_forward_and_act",
        "TE's fused shared experts (GroupedLinear), overlapped on a CUDA stream",
        versions=">=0.19",
    ),
    NotAdapted(
        f"{CORE}.transformer.moe.router_trace:RouterTracer.make_hook",
        "--moe-routing-trace-path: its hook asks torch.cuda.is_current_stream_capturing(), which raises on a "
        "CPU-only torch (not tried on a host)",
        versions=">=0.19",
    ),
    NotAdapted(
        f"{CORE}.transformer.moe.moe_logging:MoEMetricsTracker.ensure_initialized",
        "torch.cuda.current_device() only where torch.cuda.is_available(); a host gets 'cpu'",
        versions=">=0.18",
    ),
    NotAdapted(
        f"{CORE}.transformer.experimental_attention_variant.dsa_cudnn_kernels",
        "DeepSeek sparse attention's cuDNN / FlashMLA kernels (CUDA)",
        versions=">=0.19",
    ),
    NotAdapted(
        f"{CORE}.transformer.attention:Attention._get_inference_softmax_offset", "inference only", versions=">=0.19"
    ),
    NotAdapted(
        f"{CORE}.optimizer.optimizer_cuda_graph",
        "a CUDA graph of the optimizer step (OptimizerConfig.optimizer_cuda_graph)",
        versions=">=0.17",
    ),
    NotAdapted(
        f"{CORE}.optimizer.layer_wise_optimizer:LayerWiseDistributedOptimizer.has_grad_norm_group",
        "the layer-wise distributed optimizer (emerging optimizers, e.g. Muon) needs the emerging-optimizers package",
        versions=">=0.19",
    ),
    # models other than GPT: not run on a host by this project
    NotAdapted(f"{CORE}.models.bert", "BERT is not run on a host by this project"),
    NotAdapted(f"{CORE}.models.vision", "vision encoders are not run on a host by this project"),
    NotAdapted(f"{CORE}.models.multimodal", "LLaVA is not run on a host by this project", versions=">=0.18"),
    NotAdapted(
        f"{CORE}.models.mimo", "MIMO multimodal models are not run on a host by this project", versions=">=0.17"
    ),
    NotAdapted(
        f"{CORE}.models.audio",
        "audio models are not run on a host by this project (CPU tensors skip the CUDA check anyway)",
        versions=">=0.19",
    ),
    NotAdapted(
        f"{CORE}.models.hybrid",
        "Mamba hybrid models (as ssm); the site is inference with CUDA graphs or flash decode",
        versions=">=0.18",
    ),
    NotAdapted(f"{CORE}.datasets.retro", "Retro is not run on a host by this project", versions="<0.16"),
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
    NotAdapted(f"{CORE}.fault_injector", "fault injection needs nvidia-resiliency-ext", versions=">=0.18"),
    NotAdapted(
        f"{CORE}.dist_checkpointing.strategies.async_utils:PersistentAsyncCaller.async_loop",
        "the persistent async-save worker (--use-persistent-ckpt-worker) sets a CUDA device in its new process "
        "(adapted on megatron-core < 0.17: adapters/cpu/ckpt_worker.py)",
        ("use_persistent_ckpt_worker",),  # seen by the flag sweep: with --async-save the run never ends
        only_with=("async_save",),
        versions=">=0.17",
    ),
    NotAdapted(
        f"{CORE}.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync.prepare_write_data",
        "'cuda' is compared with a tensor's device type (a host's tensors are 'cpu')",
        versions=">=0.17",
    ),
    NotAdapted(
        f"{CORE}.dist_checkpointing.strategies.two_stage",
        "a load strategy that megatron never selects itself (clients pass it)",
        versions="<0.16",
    ),
    NotAdapted(
        f"{CORE}.dist_checkpointing.strategies.zarr", "the deprecated zarr checkpoint backend", versions="<0.16"
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


def installed_entries(version: Version | None = None) -> list[NotAdapted]:
    """The entries for megatron-core ``version`` (default: the installed one)."""
    version = megatron_core_version() if version is None else version
    return [entry for entry in NOT_ADAPTED if entry.applies_to(version)]


def entry_for(key: str, version: Version | None = None) -> NotAdapted | None:
    """The most specific entry naming ``key`` ("module:Qualname") in megatron-core ``version``
    (default: the installed one): a function's own before its area's."""
    matches = [entry for entry in installed_entries(version) if entry.matches(key)]
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
    version = megatron_core_version()
    given: dict[str, str] = {}
    for entry in NOT_ADAPTED:
        if not entry.applies_to(version):  # its sites are not in this release (or adapted there)
            continue
        if any(getattr(args, name, None) for name in entry.unless):
            continue
        if entry.only_with and not any(getattr(args, name, None) for name in entry.only_with):
            continue
        for flag in entry.refused_flags:
            if getattr(args, flag, None):
                given.setdefault(flag, entry.why)
    return given
