"""What a CPU host's GEMM kernels hold: oneDNN builds one per bf16 GEMM shape and keeps it.

torch's CPU bf16/fp16 matmul is oneDNN's brgemm, which JIT-builds a kernel for every GEMM shape it
meets and keeps it for the life of the process. Measured on this host (torch 2.13.0+cpu, oneDNN
3.12, AVX512-BF16, one thread): 544 KiB of heap a shape, whatever the shape's size (K x N from
64 x 64 to 1024 x 4096: 540-568 KiB). A dense model meets a fixed set of shapes, about as many as
the tiny baseline run whose resident set calibrates the runtime (18-19 per arm, counted with
``ONEDNN_VERBOSE=profile_create``), so those are inside the runtime term. An MoE model's experts
meet one shape per token count an expert receives, for each of six GEMMs (fc1 and fc2: forward,
input gradient, weight gradient), and the counts change by step, layer and microbatch: those are
counted here, less what the baseline run met.

The grouped GEMM rounds each count up to a bucket (kernels/row_buckets.py); megatron's own
SequentialMLP (the local spec's megatron arm) runs each exact count. Expected distinct shapes after
``n`` counts drawn: ``sum over buckets b of 1 - (1 - p_b)**n``, ``p_b`` the share of counts that
round to ``b`` when a count is uniform on ``[0, SPREAD x mean]``, the mean being an expert's
share of the routed tokens. ``SPREAD`` is the range compare's runs spanned at initialisation
(DeepSeek preset, mean 256: 16-832 rows). Checked against ``ONEDNN_VERBOSE=profile_create`` on
compare's runs, distinct expert counts per arm: DeepSeek 2L s512 mbs2 25-26 (this model 22.8),
Qwen3-MoE 2L s512 mbs2 20-21 (22.8), the 1-layer hidden-64 MoE baseline 3 (5.9). A run of unknown
length (a Megatron-LM command line) is counted as long: every bucket in the range met.

An accelerator's GEMM libraries keep no per-shape state of that size, and fp32 (MKL's sgemm) none
either: 0 there, and on a CPU without bf16 units (bf16 GEMMs run in fp32 there).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

from mindspeed_like.plan.spec import Run, stage_layers

KERNEL_BYTES = 544 * 2**10
GEMMS_PER_COUNT = 6
SPREAD = 3.5


def distinct_counts(mean: float, draws: int | None, bucketed: bool) -> float:
    """Expected distinct GEMM row counts (bucketed or exact) after ``draws`` expert token counts
    (None: a long run, every count in the range met)."""
    from mindspeed_like.kernels.row_buckets import bucket

    top = max(0, math.ceil(SPREAD * mean))
    if top == 0:
        return 0.0
    share = 1.0 / (top + 1)  # each count in 0..top alike; 0 runs no GEMM
    if not bucketed:  # every count its own shape
        return float(top) if draws is None else top * (1.0 - (1.0 - share) ** draws)
    expected, low = 0.0, 1
    while low <= top:
        high = min(top, bucket(low))  # counts low..high share a kernel
        p = (high - low + 1) * share
        expected += 1.0 if draws is None else 1.0 - (1.0 - p) ** draws
        low = high + 1
    return expected


def expert_gemm_kernels(run: Run, stage_index: int, bucketed: bool) -> float:
    """Expected distinct expert GEMM shapes one rank of ``stage_index`` builds in the run."""
    model, lay = run.model, run.layout
    if not model.is_moe:
        return 0.0
    moe_layers = sum(model.layer_is_moe(i) for layers in stage_layers(model, lay)[stage_index] for i in layers)
    if stage_index == lay.pp - 1 and model.layer_is_moe(model.num_layers - 1):
        moe_layers += model.mtp_num_layers  # MTP layers are built from the last decoder layer's spec
    local_experts = model.num_experts // lay.ep
    tokens = model.seq_length * lay.micro_batch_size // lay.cp  # a microbatch's tokens entering MoE on a rank
    mean = tokens * lay.ep * model.moe_router_topk / model.num_experts
    draws = None if run.steps is None else run.steps * lay.num_microbatches * moe_layers * local_experts
    return GEMMS_PER_COUNT * distinct_counts(mean, draws, bucketed)


_MEASURED_ON: list[bool] = []  # while a record is predicted: whether its host had bf16 units


@contextlib.contextmanager
def measured_on(bf16_units: bool) -> Iterator[None]:
    """Predict as for a host with (or without) bf16 GEMM units: a record's host, not this one."""
    _MEASURED_ON.append(bf16_units)
    try:
        yield
    finally:
        _MEASURED_ON.pop()


def host_has_bf16_units() -> bool:
    """This host (the one-time GEMM speed probe of kernels/host_gemm.py), or the record's host being predicted."""
    if _MEASURED_ON:
        return _MEASURED_ON[-1]
    from mindspeed_like.kernels.grouped_gemm import cpu_has_bf16_gemm

    return cpu_has_bf16_gemm()


def applies(run: Run) -> bool:
    """Whether the run's GEMMs go through a per-shape kernel cache: bf16/fp16 on a CPU host with
    bf16 units."""
    return run.device == "cpu" and run.precision.params in ("bf16", "fp16") and host_has_bf16_units()


def kernel_bytes(run: Run, stage_index: int, grouped: bool) -> int:
    """Bytes of the expert GEMMs' kernels on a rank of ``stage_index`` (``grouped``: the experts run
    through the grouped GEMM's bucketed counts)."""
    if not applies(run):
        return 0
    return int(KERNEL_BYTES * expert_gemm_kernels(run, stage_index, bucketed=grouped))
