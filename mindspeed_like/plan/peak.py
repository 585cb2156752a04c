"""A rank's process peak: what it holds all run, plus the largest of its busy phases.

    peak = runtime + max(the model build's own peak,
                         buffers + model state + max(activations in flight + the largest transient
                                                     of one microbatch's forward/backward,
                                                     the optimizer step's temporaries))

- runtime: on a CPU host the process's resident set before any tensor (Python, torch, megatron,
  gloo), read from the smallest compare record (``compare-plan-baseline``: a 1-layer, hidden-64
  model); an accelerator's allocator peak has none (0).
- the model build (CPU hosts, compare's workers): they initialise in fp32 and cast, and on the TE
  spec or with grouped-gemm build a second model to copy its weights from, then hand the freed pages
  back to the system (``malloc_trim``), so the build is a phase of its own, not a leftover.
- transients (created and freed inside one op, never saved): megatron's attention materialises
  the s x s scores' gradients (8-12 bytes per score element at bf16); the loss the model-dtype
  logits or their gradient beside the fp32 softmax it saves (on a CPU host also two fp32 copies;
  fused-linear-cross-entropy: one chunk); an MLP's fc1 output gradient; recomputation's
  re-created activations on top. On an accelerator each is net of what backward has freed when it
  runs (:func:`_freed`); a CPU host's resident set keeps freed pages, so there they count whole.
  The largest is taken.
- buffers (:func:`buffer_bytes`): megatron's attention-score buffer, and on CUDA the cuBLAS workspaces.
- the optimizer step: torch's Adam on a CPU runs per tensor (its temporary is ~2 fp32 copies of the
  largest parameter); on an accelerator ``foreach`` (one fp32 temporary of every parameter it
  steps). reuse-fp32-param's chunked step needs one chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from mindspeed_like.plan import host_kernels
from mindspeed_like.plan.activations import FP32, Dims, Saved, softmax_upcast
from mindspeed_like.plan.paths import Paths
from mindspeed_like.plan.spec import Run
from mindspeed_like.plan.state import Line

BASELINE_RECORD = "compare-plan-baseline"
GLIBC_MMAP_CEILING = 32 * 2**20
"""glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: its adaptive mmap threshold (128 KiB at start,
raised to the size of each mmapped block freed) stops here, so a block this large or larger is
always its own mapping, given back to the system when freed; smaller ones end up in the heap, which
keeps the pages. host-allocator (``M_MMAP_MAX=0``) puts every block in the heap."""
LCE_CHUNK_BYTES = 64 * 2**20  # fused-linear-cross-entropy's default chunk: fp32 logits within 64 MiB


@dataclass(frozen=True)
class Peak:
    runtime: int
    build: int  # the model build's own peak, tensors only (compare's workers on a CPU host)
    model_state: int
    activations: int  # in flight at the peak
    temporary: int
    temporary_what: str
    optimizer_temporary: int
    features: tuple[str, ...] = ()  # features that changed a transient
    kernels: int = 0  # the experts' GEMM kernels a CPU host keeps (plan/host_kernels.py)
    buffers: int = 0  # held from the first step on beside the model state (buffer_bytes)
    grad_sync: int = 0  # the gradient reduce-scatter's copy after backward (grad_sync_bytes)
    gathered: int = 0  # FSDP: the unsharded units in flight beside the activations (plan/fsdp.py)
    gathered_what: str = ""

    @property
    def training(self) -> int:
        """What a training step's tensors hold at its peak."""
        busy = self.activations + self.temporary + self.grad_sync + self.gathered
        return self.buffers + self.model_state + max(busy, self.optimizer_temporary)

    @property
    def phase(self) -> str:
        if self.build > self.training:
            return "model build"
        busy = self.activations + self.temporary + self.grad_sync + self.gathered
        if busy < self.optimizer_temporary:
            return "optimizer step"
        return "forward/backward, then the gradients' reduce-scatter" if self.grad_sync else "forward/backward"

    @property
    def total(self) -> int:
        return self.runtime + self.kernels + max(self.build, self.training)


BASELINE_RECORDS = {
    "dense": "compare-plan-baseline",
    "moe": "compare-plan-baseline-moe",
    "mla": "compare-plan-baseline-mla",
}


def family(run: Run) -> str:
    """Which baseline record stands for the code this model runs (MoE, MLA and MTP load more of
    megatron and of this library)."""
    if run.model.multi_latent_attention:
        return "mla"
    return "moe" if run.model.is_moe else "dense"


def launcher(run: Run) -> str:
    """What runs the model on a CPU host: compare's workers (``--preset``) or Megatron-LM's
    pretrain_gpt.py (a Megatron-LM command line). Their processes load different code, and build
    the model differently."""
    return "compare" if run.source == "compare" else "megatron-lm"


# what Megatron-LM printed for its runs on a CPU host (plan/megatron_lm_check.py --measure writes it)
MEGATRON_LM_MEMORY_RECORD = "megatron-lm-memory"
calibrating: list[bool] = []  # set while the Megatron-LM baseline's own tensors are predicted


@functools.lru_cache(maxsize=16)
def megatron_lm_runtime_bytes(arm: str) -> int:
    """A Megatron-LM rank's memory before any model tensor on a CPU host: the smallest run's peak as
    Megatron-LM printed it less what the plan says that run's tensors held, both kept in
    results/megatron-lm-memory.json (plan/megatron_lm_check.py measures the one and refreshes the
    other); 0 before the record exists."""
    from mindspeed_like.toolkit import records

    path = records.results_dir() / f"{MEGATRON_LM_MEMORY_RECORD}.json"
    if not path.exists():
        return 0
    baseline = records.read(path)["extra"]["baseline"]
    side = arm if arm in baseline["peak"] else "megatron"
    return int(baseline["peak"][side] - baseline["held"][side])


def runtime_bytes(device: str, kind: str = "dense", arm: str = "megatron", launched_by: str = "compare") -> int:
    """The process's memory before any model tensor: on a CPU host the baseline record's measured
    peak of that arm (the features load more code than megatron's path) minus what that tiny
    run's tensors held (predicted by this model); 0 for an accelerator's allocator. A Megatron-LM
    rank has its own baseline (:func:`megatron_lm_runtime_bytes`: one dense run stands for every model family)."""
    if device != "cpu" or calibrating:
        return 0  # (not cached: a calibration's zeros must not outlive it)
    if launched_by == "megatron-lm":
        return megatron_lm_runtime_bytes(arm)
    return _compare_runtime_bytes(kind, arm, host_kernels.host_has_bf16_units())


@functools.lru_cache(maxsize=16)
def _compare_runtime_bytes(kind: str, arm: str, bf16_units: bool) -> int:
    """(``bf16_units`` is in the cache key only: the baseline's own GEMM kernels depend on it.)"""
    import argparse

    from mindspeed_like.plan.compare_args import run_from_compare
    from mindspeed_like.plan.paths import megatron_paths
    from mindspeed_like.toolkit import records

    path = records.results_dir() / f"{BASELINE_RECORDS[kind]}.json"
    if not path.exists():
        return 0
    record = records.read(path)
    rows = {row["metric"]: row for row in record["rows"] if "metric" in row}
    run = run_from_compare(argparse.Namespace(**record["options"]), {}, "cpu")
    side = arm if arm in ("megatron", "features") else "features"
    paths = megatron_paths()
    held = max(rows["model_state_bytes"][side] + rows["activations_bytes"][side], build_bytes(run, paths))
    held += host_kernels.kernel_bytes(run, 0, grouped=expert_gemm_is_grouped(run, paths))
    return int(rows["process_peak_bytes"][side] - held)


def expert_gemm_is_grouped(run: Run, paths: Paths) -> bool:
    """Whether the experts run as one grouped GEMM (bucketed row counts): the TE spec's grouped
    linears (the te-backend's, both arms) or the grouped-gemm feature; megatron's own SequentialMLP
    (the local spec) runs one GEMM per expert at its exact count."""
    return run.transformer_impl == "transformer_engine" or paths.grouped_gemm


def build_bytes(run: Run, paths: Paths) -> int:
    """The model build's peak in a CPU process of compare's workers (tensors only): they initialise
    in fp32, and where the arm runs a different module than the local spec's (the TE spec, the
    grouped-gemm feature's GroupedMLP) they first build the local-spec model of the same seed and
    copy its weights, so two fp32 models are alive at once (8 bytes a parameter, else 4); the cast
    to the parameter dtype then converts one tensor at a time. The worker hands the freed pages back
    (compare/worker.py), so this is a phase of its own. Megatron-LM builds in the parameter dtype
    (``--bf16``: 2 bytes, below any training step's), an accelerator run on the device (0)."""
    if run.device != "cpu" or launcher(run) == "megatron-lm":
        return 0
    twice = run.transformer_impl == "transformer_engine" or (run.model.is_moe and paths.grouped_gemm)
    return (8 if twice else 4) * _rank_params(run)


CUBLAS_WORKSPACE = 32 * 2**20
"""torch's default cuBLAS workspace on Hopper (sm90), taken from the device's allocator once per
thread that runs GEMMs: the training loop's and autograd's backward thread. Read off an H200's
allocator trace: two 32 MiB blocks, at the first forward and the first backward GEMM, held to the
end, in both arms. ``CUBLAS_WORKSPACE_CONFIG`` set where plan runs replaces it
(:func:`cublas_workspace_bytes`)."""


def cublas_workspace_bytes(config: str | None = None) -> int:
    """One cuBLAS workspace: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs, summed as cuBLAS
    and torch read it, e.g. ``:4096:8`` = 32 MiB, ``:4096:2:16:8`` = 8.125 MiB) when given or set,
    else :data:`CUBLAS_WORKSPACE` (Hopper's default; other GPUs default to 8.125 MiB)."""
    import os

    config = config if config is not None else os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    numbers = [part for part in config.split(":") if part]
    if not numbers:
        return CUBLAS_WORKSPACE
    if len(numbers) % 2 or not all(part.isdigit() for part in numbers):
        from mindspeed_like.toolkit.errors import ConfigError

        raise ConfigError(
            f"CUBLAS_WORKSPACE_CONFIG={config!r}: expected ':SIZE_KiB:COUNT' pairs such as ':4096:8' "
            "(cuBLAS's format), or unset it for Hopper's default"
        )
    pairs = zip(numbers[::2], numbers[1::2])
    return sum(int(size) * int(count) for size, count in pairs) * 1024


def buffer_bytes(run: Run, paths: Paths) -> int:
    """What a rank holds from its first step on beside the model state: megatron's global memory
    buffer for the attention scores (``DotProductAttention`` computes every layer's ``baddbmm``
    into one b x heads x s x s tensor in the model dtype, kept for the run) where megatron's own
    attention runs, and on CUDA the cuBLAS workspaces (:data:`CUBLAS_WORKSPACE`). Both read off the
    H200's allocator trace of compare's and Megatron-LM's runs (utils.py ``get_tensor`` 64 / 512
    MiB; two 32 MiB blocks)."""
    dims = Dims.of(run)
    held = 0
    if not paths.flash_attention and run.layout.cp == 1:
        held += dims.p * dims.b * dims.a * dims.s**2
    if run.device == "cuda":
        held += 2 * cublas_workspace_bytes()
    return held


def grad_sync_bytes(run: Run, stage_index: int) -> int:
    """The copy gloo makes of a bucket to reduce-scatter it: the distributed optimizer's gradient
    sync on a CPU host (``finish_grad_sync`` -> ``reduce_scatter_tensor``, which ProcessGroupGloo
    runs as an all-reduce of a flattened copy). One bucket's gradients at a time: the whole buffer
    without --overlap-grad-reduce (megatron then makes one bucket of it), else megatron's bucket of
    max(40M, 1M x DP) elements on the first stage. Measured on compare's DP2 llama h512 run (an RSS
    probe around megatron's calls): each step's finish_grad_sync raised the resident set 44-46 MiB
    above its entry, the fp32 grad buffer being 44 MiB; the all-reduce without the distributed
    optimizer raised it 1 MiB (in place), and NCCL reduce-scatters in place on a device (0 there).
    On a CPU host it comes on top of what backward left in glibc's heap."""
    lay = run.layout
    if run.device != "cpu" or not lay.distributed_optimizer:
        return 0
    from mindspeed_like.plan.params import stage
    from mindspeed_like.plan.state import buffers

    sharded = [b.padded for b in buffers(run, stage(run, stage_index)) if b.group > 1]
    if not sharded:
        return 0
    bucket = max(sharded)
    if lay.overlap_grad_reduce and stage_index == 0:
        bucket = min(bucket, max(40_000_000, 1_000_000 * lay.dp * lay.cp))
    return run.precision.grad_bytes * bucket


def _rank_params(run: Run) -> int:
    from mindspeed_like.plan.params import stage

    return max(sum(p.numel for chunk in stage(run, s) for p in chunk) for s in range(run.layout.pp))


def transients(run: Run, paths: Paths, last_stage: bool) -> list[tuple[int, str, str | None, str]]:
    """(bytes, what, feature, phase) of the largest op-local temporaries of one microbatch; the
    phase (``attention``, ``mlp``, ``loss``) says what backward has freed by then (:func:`_freed`)."""
    dims = Dims.of(run)
    p, b, a, s, t = dims.p, dims.b, dims.a, dims.s, dims.t
    out: list[tuple[int, str, str | None, str]] = []
    if paths.flash_attention or run.layout.cp > 1:
        out.append(
            (
                2 * p * t * a * dims.d,
                "attention backward: dq, dk, dv",
                "flash-attention" if paths.flash_attention else None,
                "attention",
            )
        )
    else:
        # what megatron's core-attention backward allocates at its peak. On CUDA (an H200's
        # allocator trace of compare's megatron arm, upcast, no dropout) three gradients in the
        # softmax's dtype at once, less the probabilities it freed: 3 x 4 - 2 bytes an element. On a
        # CPU host the new bytes alone (a dispatch mode counting live storages over
        # DotProductAttention's backward): two gradients in the model dtype and two in fp32 when
        # upcast, else four; the saved tensors it frees stay in glibc's heap, not given back.
        upcast = softmax_upcast(run, dims)
        if run.device != "cpu":
            per_element = 3 * (FP32 if upcast else p) - p
        else:
            per_element = 2 * p + 2 * FP32 if upcast else 4 * p
        out.append((per_element * b * a * s * s, "attention: the s x s scores' gradients", None, "attention"))
    width = run.model.moe_ffn_hidden_size if run.model.is_moe else run.model.ffn_hidden_size
    rows = t * (run.model.moe_router_topk if run.model.is_moe else 1)
    out.append((2 * p * rows * 2 * width // run.layout.tp, "MLP backward: fc1 output gradient", None, "mlp"))
    if last_stage:
        logits = t * dims.v * (run.model.mtp_num_layers + 1)
        if paths.fused_linear_cross_entropy:
            out.append(
                (
                    min(LCE_CHUNK_BYTES, FP32 * logits) * 2,
                    "fused linear cross entropy: one chunk's logits",
                    "fused-linear-cross-entropy",
                    "loss",
                )
            )
        else:
            # megatron's cross entropy upcasts the logits into the fp32 softmax it saves (a head
            # row) and turns that into the gradient in place: beyond it only the model-dtype logits
            # (forward) or their gradient (backward). An H200 trace of Megatron-LM's run peaked there.
            # On a CPU host where glibc's heap holds these blocks (all of them under host-allocator,
            # else those under its mmap ceiling) the resident set measured more: the fp32 copy and
            # its gradient whole (Megatron-LM's level 1 and 2 CPU runs were fitted with model dtype
            # + 2 x fp32); a block above the ceiling is a mapping of its own, unmapped when freed.
            retained = run.device == "cpu" and (paths.host_allocator or FP32 * logits < GLIBC_MMAP_CEILING)
            per_logit = p + 2 * FP32 if retained else p
            feature = "host-allocator" if retained and FP32 * logits >= GLIBC_MMAP_CEILING else None
            out.append((per_logit * logits, "loss: the logits and their gradient", feature, "loss"))
    return out


def _freed(chunk_rows: Sequence[dict[str, list[Saved]]]) -> dict[str, int]:
    """What one microbatch's backward has freed when each transient's op runs in the chunk whose
    backward comes first (the stage's last): nothing at the loss; the head's saved tensors by the
    last layer's MLP backward; those and that layer's MLP saves by its attention backward. Seen on
    an H200's allocator trace of Megatron-LM's own run (megatron's path, s 4096): the peak was the
    loss in the forward, the attention backward's s x s gradients came after the head was freed."""
    rows = chunk_rows[-1]
    head = sum(r.total for r in rows.get("head", []))
    # the first layer backward meets: a multi-token-prediction layer's (after the decoder), else the last
    layers = [group for group in rows if group.startswith("mtp ")] or [g for g in rows if g.startswith("layer ")]
    mlp = sum(r.total for r in rows[layers[-1]] if r.component in ("mlp", "moe")) if layers else 0
    return {"loss": 0, "mlp": head, "attention": head + mlp}


def optimizer_temporary(run: Run, lines: Sequence[Line], paths: Paths, largest_param: int) -> int:
    if paths.reuse_fp32_param and not run.layout.distributed_optimizer:
        return 0  # the chunked step's one-chunk workspace
    if run.device == "cpu":
        return 2 * FP32 * largest_param
    masters = sum(line.bytes for line in lines if line.kind == "optimizer" and "exp_avg " in line.what)
    return masters  # foreach: one temporary as large as a moment


def estimate(
    run: Run,
    paths: Paths,
    lines: Sequence[Line],
    chunk_rows: Sequence[dict[str, list[Saved]]],
    in_flight: dict[int, int],
    arm: str = "megatron",
    stage_index: int = 0,
    reforward: int = 0,
    gathered: tuple[int, str] = (0, ""),
) -> Peak:
    """``reforward``: what megatron's recomputation re-creates at once in backward
    (:func:`mindspeed_like.plan.recompute.reforward_bytes`), alive during that unit's backward ops.
    ``gathered``: (bytes, what) of FSDP's unsharded units in flight
    (:func:`mindspeed_like.plan.fsdp.in_flight_bytes`)."""
    held = sum(sum(r.total for rows in chunk_rows[c].values() for r in rows) * n for c, n in in_flight.items())
    last = any("head" in rows for rows in chunk_rows)
    # an allocator's peak counts live bytes: backward's frees make room; a CPU host's resident set
    # keeps the freed pages in glibc's heap (compare's CPU records: with the frees counted, 14 of 42
    # arm peaks missed, without them 9)
    freed = _freed(chunk_rows) if run.device != "cpu" else dict.fromkeys(("loss", "mlp", "attention"), 0)
    net = [
        (size - freed[phase] + (reforward if phase != "loss" else 0), what, feature)
        for size, what, feature, phase in transients(run, paths, last)
    ]
    temp, what, feature = max(net, key=lambda x: x[0])
    temp = max(temp, 0)
    state = sum(line.bytes for line in lines)
    largest = run.model.vocab_size // run.layout.tp * run.model.hidden_size
    return Peak(
        runtime=runtime_bytes(run.device, family(run), arm, launcher(run)),
        build=build_bytes(run, paths),
        model_state=state,
        activations=held,
        temporary=temp,
        temporary_what=what,
        optimizer_temporary=optimizer_temporary(run, lines, paths, largest),
        features=(feature,) if feature else (),
        kernels=host_kernels.kernel_bytes(run, stage_index, grouped=expert_gemm_is_grouped(run, paths)),
        buffers=buffer_bytes(run, paths),
        grad_sync=grad_sync_bytes(run, stage_index),
        gathered=gathered[0],
        gathered_what=gathered[1],
    )
