"""One reason class for every test that does not pass, read from what pytest reported.

The record and docs/megatron-tests.md count tests per class, so a class must say what it would
take to make those tests run (the table in the docs). A class is decided from the failure's text
(exception type, message, traceback) by the first matching rule; rules are ordered from the
specific to the general. ``HOST_SKIPS`` are the classes of tests that cannot run on a CPU host at
all: the plugin turns those failures into skips with the class as the reason (a GPU-only Triton
kernel cannot be made to pass by any host), never into a pass. A failure no rule matches is
``unknown``: the record counts those, and the target is none.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: re.Pattern[str]
    what_it_would_take: str


def _rule(name: str, pattern: str, take: str) -> Rule:
    return Rule(name, re.compile(pattern, re.S), take)


# ranks: a test written for more ranks than it ran with (the plugin relaunches it at that size)
_NEEDS_RANKS = [
    re.compile(r"world_size \((\d+)\) is not divisible by (?:expert_tensor_model_pipeline_parallel size \()?(\d+)"),
    re.compile(r"(?:requires|needs|at least) (\d+) (?:GPUs|gpus|ranks|processes)"),
    re.compile(r"[Tt]est requires world_size=(\d+), but got"),
    # Megatron-LM's validate_args (megatron/training/arguments.py), which tests building from args reach
    re.compile(r"world size \((\d+)\) is not divisible by total_model_size \(total_model_size=(\d+)\)"),
    # torch's init_device_mesh for a mesh larger than the world (megatron_fsdp's tests build 8-rank meshes)
    re.compile(r"Mesh should not be bigger than default world size \d+, but found (\d+) ranks"),
]
MEGATRON_CI_WORLD_SIZE = 8
_NEEDS_CI_SIZE = re.compile(r"should be divisible by partial DistOpt shard factor")
"""parallel_state's check that the (expert) data-parallel size divides ``num_distributed_optimizer_instances``:
the message names no size, and the tests that reach it (test_param_and_grad_buffer, test_grad_sync_with_expert_parallel,
Megatron-FSDP's HSDP cases) pick their instances and expert sizes for megatron's CI world size."""
_WORLD_SIZE_SKIP = re.compile(r"world[_ ]size|GPUs|gpus|number of ranks|rank count", re.I)

FAILURE_RULES: list[Rule] = [
    _rule(
        "needs-transformer-engine",
        r"Please install TE|apply_rope_fusion is not available|requires? (?:TE|TransformerEngine) ?(?:>=|version)",
        "real TransformerEngine (the te-backend reports 2.1.0 and refuses TE-only features)",
    ),
    _rule(
        "thd-cp-whole-batch",
        r"split_with_sizes expects split_sizes to sum exactly to (\d+) \(input tensor's size at dimension 0\)",
        "the test feeds a whole packed (thd) batch to each context-parallel rank: megatron's unfused thd RoPE "
        "(rope_utils) splits each rank's 1/cp share of every sequence, so the sizes cannot add up; TE's fused "
        "RoPE kernel, which the test takes on a GPU, does not check. A test that partitions the batch per rank "
        "(megatron's get_batch_on_this_cp_rank) would run",
    ),
    _rule(
        "te-names-unbound",
        r"LayerNorm\.__init__\(\) got an unexpected keyword argument 'config'"
        r"|cannot unpack non-iterable NoneType object when instantiating",
        "megatron modules that chose their no-TE fallback at import (clip_vit_model's NORM_IMPL = torch.nn.LayerNorm "
        "given config=; heterogeneous_layer_specs' None modules): the te-backend binding TE's names there too",
    ),
    _rule(
        "asserts-cuda-device",
        r"'cpu' == 'cuda'|device\(type='cpu'\) == device\(type='cuda'|where False = .*\.is_cuda\b",
        "the test asserts its tensors are on a CUDA device",
    ),
    _rule(
        "cuda-rng-is-host-rng",
        r"(?!x)x",  # only through BY_FILE
        "cannot hold on a host: tensor_parallel/test_initialization.py asserts torch.equal (allclose for the TE "
        "classes) of a TP=4 weight built after torch.manual_seed(42); model_parallel_cuda_manual_seed(41) and the "
        "TP=1 weight's slice built after the same with 42. With use_cpu_initialization the master weight is "
        "drawn from the CPU generator, and megatron's torch.cuda.manual_seed(data_parallel_seed) (= 41 vs 42) "
        "reseeds it, because on a host every 'device' random op (dropout, the tracker's forks) draws from the "
        "CPU generator: a separate device generator would be seeded but never drawn from. Measured: the 41-run "
        "weight equals a plain torch.manual_seed(41) draw; with 42 in both runs the weights are equal",
    ),
    _rule(
        "megatron-fixed-later",
        r"'FileSystemWriter' object has no attribute 'metadata_path'",
        "megatron's own bug, fixed in a later release: 0.16.1's remove_sharded_tensors renames "
        "FileSystemWriter.metadata_path, which torch's writer no longer has (Megatron-LM #5759, in core_v0.19.0, "
        "also corrects the test's expected keys; 0.16.1 marks the test flaky, which megatron's CI deselects)",
    ),
    _rule(
        "checkpoint-folder-race",
        r"(?:FileExistsError|FileNotFoundError): .*tmp_dist_ckpt",
        "megatron's test shares one checkpoint folder among its ranks without a barrier "
        "(TempNamedDir(..., sync=False) in test_chained_optimizer_resharding): rank 0 empties or removes it while "
        "another rank still writes or reads it. Ranks that run in step (one GPU each) rarely see it; 4 ranks on a "
        "2-core host drift apart. A barrier in the test (sync=True) would remove it",
    ),
    _rule(
        "torch-dtensor-deepcopy",
        # torch's message for copying a storage that has bytes but no data: a wrapper subclass's storage
        r"Attempted to call copy_\(\) on an invalid python storage",
        "torch's, on any device: torch 2.13's DTensor takes its local tensor's storage offset (pytorch #167597, "
        "'Correctly populate storage offset in DTensor constructor'), so a DTensor over a view at a non-zero offset "
        "has data_ptr() = offset x itemsize, not 0; Tensor.__deepcopy__ then takes it for a plain tensor and copies "
        "the wrapper's storage, which has bytes but no data. Megatron-FSDP's parameters are views into its flat "
        "buffers and test_dcp_checkpoint_save_and_load deep-copies model.state_dict(): every rank holding a "
        "parameter that does not start its buffer fails (the CNN cases too, at 2 ranks). Measured at 2 ranks: with "
        "DTensor deep-copied by clone() the test passes (transformer and TE-layer cases, 4 of 4); a torch whose "
        "Tensor.__deepcopy__ clones such wrappers would run it",
    ),
    _rule(
        "router-near-tie",
        r"(?!x)x",  # only through BY_TEST
        "nothing in the library: a MoE router's top-k choice for a token whose candidate logits differ by less "
        "than one bf16 rounding step flips when the attention's rounding changes (a TP or CP split; the flash "
        "kernel at level 1, closer to float64 than megatron's unfused path), and the test compares whole outputs "
        "at a tolerance that one flipped token exceeds (measured in docs/megatron-tests.md)",
    ),
    _rule(
        "assumes-8-ranks",
        r"(?!x)x",  # only through ASSUMES_8_RANKS
        "megatron's CI world size: the test's expected values name ranks up to 7 ('10 shards and 8 ranks', saving "
        "ranks 4-6) while its parallel state asks for fewer, so at the size it asked for it checks the wrong "
        "numbers; run its file at 8 ranks",
    ),
    _rule(
        "timeout",
        r"rank-timeout|Timeout|timed out|DeadlineExceeded",
        "a collective or a test ran past the harness' limit: look at the test's communication on gloo",
    ),
    _rule(
        "triton-kernel-no-gpu",
        r"0 active drivers|libcuda\.so cannot found|triton.*(?:driver|launch)|Triton",
        "megatron's Triton kernels need a GPU; a portable path in the cpu adapter for each kernel (done for "
        "fused_indices_to_multihot and the fused MLA YaRN RoPE apply, kernels/mla_yarn_rope.py)",
    ),
    _rule(
        "needs-more-ranks",
        r"is not divisible by|is over sized with world size|world size .* too small|requires \d+ (?:GPUs|ranks)"
        r"|where \d+ = Utils\.world_size|" + _NEEDS_CI_SIZE.pattern,
        "more gloo ranks than the launch sizes allowed (--megatron-ranks 2,4,8)",
    ),
    _rule(
        "hybrid-device-optimizer",
        r"HybridDeviceOptimizer|hybrid_optimizer|cpu_offloading",
        "megatron's CPU-offloading HybridDeviceOptimizer on one device: the cpu adapter splits its parameters as "
        "megatron does on a GPU (adapters/cpu/hybrid_optimizer.py); a failure left here is its own",
    ),
    _rule(
        "te-cpp-extensions",
        r"transformer_engine\.pytorch\.cpp_extensions|cpp_extensions",
        "TE's compiled GEMM/cast entry points; the te-shim would have to serve them",
    ),
    _rule(
        "te-feature-refused",
        r"TransformerEngineFeatureUnsupported|TransformerEngineAttributeRefused"
        r"|mindspeed_like te-backend|te-client-module",
        "a TE feature the te-backend refuses by name (fp8, TE ops, CUDA graphs): implementing it in the te-backend",
    ),
    _rule(
        "packed-thd-attention",
        r"thd|packed_seq|PackedSeqParams|cu_seqlens",
        "packed-sequence (thd) attention without TE/flash-attn: a varlen path in the attention backend",
    ),
    _rule(
        "adamw-lr-none",
        r"lr=None|Invalid learning rate|'<=' not supported between instances of 'float' and 'NoneType'",
        "torch AdamW given lr=None on megatron's no-TE/apex path (megatron sets lr per group later)",
    ),
    _rule(
        "cuda-graphs",
        r"cudagraph|CUDA ?[Gg]raph|cuda_graph",
        "CUDA graphs (capture/replay, the graph-safe RNG) exist only on a CUDA device",
    ),
    _rule(
        "numerics",
        r"(?m)^(?:assert |AssertionError\s*$|AssertionError: assert|AssertionError: Tensor)"
        r"|Mismatched elements|not close|allclose|torch\.equal|are not equal",
        "the test's numbers differ on the host (tolerances set for CUDA kernels, or a real difference)",
    ),
    _rule("fp8", r"fp8|FP8|Float8|float8|mxfp8|nvfp4", "FP8/FP4 training needs TE and an FP8-capable GPU"),
    _rule(
        "cuda-only-api",
        r"Torch not compiled with CUDA enabled|not linked with support for cuda|CUDA driver|cudaGetDevice"
        r"|torch\._C\._cuda|_cuda_|nvml|pynvml|CUDA error|cuda runtime|NCCL|nccl",
        "an API that exists only with a CUDA build (CUDA graphs, NVML, CUDA IPC, NCCL-only features)",
    ),
    _rule(
        "asserts-cuda-device",
        r"device\(type='cpu'\).*cuda|is_cuda|device.type == .cuda.|Expected .*cuda",
        "the test asserts its tensors are on a CUDA device",
    ),
    _rule(
        "gloo-unsupported",
        r"ProcessGroupGloo|gloo|Gloo",
        "a collective or option gloo does not implement (NCCL-only): an emulation in the harness",
    ),
    _rule(
        "missing-package",
        r"ModuleNotFoundError|No module named|ImportError"
        r"|is not (?:available|installed)\. Please (?:run `)?pip install|Emerging Optimizers is not installed",
        "an optional package the test needs (apex, flash_attn, nvidia-resiliency, mamba-ssm, grouped_gemm, deep_ep): "
        "not installable from PyPI on a CPU host. emerging_optimizers, which megatron's Muon asserts: megatron pins "
        "v0.1.0 from GitHub, which make's megatron-unit targets install (EMERGING_OPTIMIZERS_SRC: a checkout of that "
        "tag where GitHub cannot be reached); PyPI's only release, 0.3.0, declares Python 3.12 and renamed the "
        "optimizer's use_nesterov (megatron 0.16.1's Muon then fails: missing keyword 'nesterov')",
    ),
    _rule("memory", r"MemoryError|out of memory|Cannot allocate memory|Killed", "the test is sized for a GPU's memory"),
    _rule(
        "test-assertion", r"AssertionError", "the test asserts a condition the host run does not meet (see the reason)"
    ),
]

SKIP_RULES: list[Rule] = [
    _rule(
        "measures-cuda-memory",
        r"measures CUDA memory",
        "the test's subject is CUDA memory (max_memory_allocated): a host has none to measure",
    ),
    _rule(
        "needs-more-ranks",
        r"rank|world.size|GPUs|gpus|devices",
        "launch at the size the test asks for (--megatron-ranks)",
    ),
    _rule(
        "cuda-not-available",
        r"CUDA not available|CUDA is required|cuda.*available|requires? CUDA",
        "a CUDA device (the harness answers for one with --megatron-host-cuda)",
    ),
    _rule(
        "needs-transformer-engine",
        r"(?i)transformer.?engine|\bTE\b|te_version|is_te_min_version",
        "real TransformerEngine (the te-backend reports 2.1.0 and refuses TE-only features)",
    ),
    _rule("triton-kernel-no-gpu", r"0 active drivers|Triton|triton", "megatron's Triton kernels need a GPU"),
    _rule(
        "needs-newer-hardware", r"Hopper|Blackwell|Ampere|sm_?\d|compute capability|arch", "a specific GPU architecture"
    ),
    _rule("fp8", r"fp8|FP8|mxfp8|fp4|FP4", "FP8/FP4 needs TE and an FP8-capable GPU"),
    _rule(
        "missing-package",
        # "requires" alone is not a package: megatron's own config skips say "strategy optim requires
        # zero_dp_strategy ..." and "instances requires distributed optimizer ..."
        r"(?i)not installed|not available|required for|requires? (?:apex|flash|mamba|nvidia|kitchen|deep.?ep)"
        r"|No module named|kitchen|apex|flash|mamba|nvidia",
        "an optional package the test needs",
    ),
    _rule(
        "deselected-gpu-sized",
        r"GPU-sized|megatron-unit harness: deselected",
        "sized for a GPU (time or memory): deselected by the harness",
    ),
    _rule(
        "megatron-skip",
        r".",
        "skipped by the test itself for a reason unrelated to the host "
        "(a known issue, a flaky test, a config it does not cover)",
    ),
]

# Failures whose text (an assertion on numbers) cannot tell their cause, classified by reading the
# test: file (under tests/unit_tests) -> class. Each class is in FAILURE_RULES' table of what it takes.
BY_FILE = {
    # model_parallel_cuda_manual_seed(41) "intentionally different" must leave CPU initialization alone;
    # the cpu adapter's "device" generator is the CPU generator, so it reseeds the CPU stream (all 5 tests:
    # test_{embedding,row,col,te_col,te_row}_init, their last assertion; the shape assertions hold)
    "tensor_parallel/test_initialization.py": "cuda-rng-is-host-rng",
}
# Numbers-only failures whose cause was measured test by test (node ids under tests/unit_tests):
# router-near-tie: the routing maps of both runs recorded; the tokens over the test's tolerance are
# tokens whose top-k expert set differs, with a logit gap of 0 (an exact bf16 tie) to 8e-3 there (median
# 0.05-0.1). MTP at TP=2/4 vs TP=1 (levels 1 and 2) and at TP=2 x CP=2 (level 0: exact ties at positions
# 5 and 31, 5 over the tolerance); upcycling with granularity 2 (levels 1 and 2). A test of these that
# fails otherwise keeps its own class.
BY_TEST = {
    **{
        f"transformer/test_multi_token_prediction.py::TestMultiTokenPrediction::test_forward_backward[{tp_cp}-{r}]": (
            "router-near-tie"
        )
        for tp_cp in ("2-1", "4-1", "2-2")
        for r in ("False", "True")
    },
    **{
        f"transformer/moe/test_upcycling.py::TestGPTModel::test_upcycling_TE[{case}]": "router-near-tie"
        for case in ("tp_ep1-2-False-False-False", "tp_ep4-2-True-False-False")
    },
}
# Files whose expected values are written for 8 ranks whatever size their parallel state asks for
# (read from the tests): any failure below 8 ranks is that.
ASSUMES_8_RANKS = {"dist_checkpointing/test_fully_parallel.py"}
HOST_SKIPS = {"triton-kernel-no-gpu", "fp8"}
UNKNOWN = "unknown"


def error_lines(text: str) -> str:
    """The exception's own lines of a pytest longrepr (``E ...``), else the whole text.

    Classes are read from these, not from the traceback: a traceback through megatron's
    ``_cuda_rng_state`` helpers says nothing about why an assertion failed.
    """
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    return "\n".join(lines) if lines else text


def classify_failure(text: str, nodeid: str = "", world_size: int | None = None) -> str:
    """The class of a failed or errored test, from its longrepr text (its ``E`` lines first); a
    numbers-only assertion of a test in :data:`BY_TEST` or a file in :data:`BY_FILE` gets that
    class; a failure below 8 ranks in a file of :data:`ASSUMES_8_RANKS` is ``assumes-8-ranks``."""
    test = nodeid.split("unit_tests/", 1)[-1]
    path = test.split("::")[0]
    if path in ASSUMES_8_RANKS and (world_size or 1) < 8:
        return "assumes-8-ranks"
    if _numbers_only(text):
        if test in BY_TEST:
            return BY_TEST[test]
        if path in BY_FILE:
            return BY_FILE[path]
    for source in (error_lines(text), text):
        for rule in FAILURE_RULES:
            if rule.pattern.search(source):
                return rule.name
    return UNKNOWN


def _numbers_only(text: str) -> bool:
    for source in (error_lines(text), text):
        for rule in FAILURE_RULES:
            if rule.pattern.search(source):  # the table-only classes' patterns match nothing
                return rule.name == "numerics"
    return False


def classify_skip(reason: str) -> str:
    """The class of a skipped test, from its skip reason."""
    for rule in SKIP_RULES:
        if rule.pattern.search(reason):
            return rule.name
    return UNKNOWN


_GRID = re.compile(r"Grid shape \[([\d, ]+)\] is over sized")


def ranks_needed(text: str) -> int | None:
    """How many ranks a failure asks for (``world_size (1) is not divisible by 8`` -> 8, megatron's
    ``HyperCommGrid`` ``Grid shape [2, 1, 1, 4] is over sized`` -> 8; the partial distributed optimizer's
    check, which names no size -> megatron's CI size, 8), else None."""
    grid = _GRID.search(text)
    if grid:
        return math.prod(int(n) for n in grid.group(1).split(","))
    for pattern in _NEEDS_RANKS:
        match = pattern.search(text)
        if match:
            return int(match.groups()[-1])
    if _NEEDS_CI_SIZE.search(text):
        return MEGATRON_CI_WORLD_SIZE
    return None


def launch_size(needed: int, sizes: list[int]) -> int | None:
    """The smallest allowed launch size that the needed size divides, else None (not opted in)."""
    for size in sorted(sizes):
        if size >= needed and size % needed == 0:
            return size
    return None


def what_it_would_take(name: str) -> str:
    for rule in [*FAILURE_RULES, *SKIP_RULES]:
        if rule.name == name:
            return rule.what_it_would_take
    return ""
