"""What the CUDA lane runs, and how (importable by its test modules, like the integration workers).

The GPT parity cases are read from the feature registry: every acceleration (kind "feature") gets a
case per dtype from its ``switch_on`` on the default tiny GPT unless :data:`CASES` says what model,
flags and bound it needs, or :data:`NOT_ON_ONE_GPU` says why one GPU cannot run it. A feature added
later is in the lane without editing this file; if the default model does not reach it, its case
fails saying so (then it gets an entry here).

Each case trains megatron-core's real GPTModel (``testing.tiny_gpt``, ``testing.train_steps``: megatron's
DDP and optimizer) twice on the lane's device from the same seed and batches: megatron's own path
(``optimization_level=0``: device adapters and fixes only) and the feature switched on under
``strict`` (a call handed back to megatron is an error, not a pass). Both arms build the model on
the host (``use_cpu_initialization``: the same weights on every device) and move it to the device,
as ``mindspeed-like compare`` does.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from mindspeed_like.registry import all_features
from mindspeed_like.testing.parity import SEED

DEVICE_ENV = "MINDSPEED_LIKE_TEST_DEVICE"
"""Which device the lane runs on: ``cuda`` (default) or ``cpu`` (the self-check of the lane's own
logic on a host without a GPU: the same tests, the same bounds)."""
RECORD_ENV = "MINDSPEED_LIKE_LANE_RECORD"
"""Where the lane writes its record (a results/ JSON: device, versions, every test's outcome and
every parity case's measured difference); unset: no record."""

MEASURED: dict[str, dict[str, Any]] = {}
"""What each test measured (its id -> figures), for the lane's record: the GPU run's numbers are
kept even where they pass, so a bound can later be set from data."""

STEPS = 5
"""Training steps per parity arm (the compile lane's count: enough for Adam to move every weight
and for a wrong gradient to show in the loss; few enough for the lane's budget)."""

FP32, BF16 = "fp32", "bf16"
DTYPES = {FP32: torch.float32, BF16: torch.bfloat16}
RTOL = MappingProxyType({FP32: 1e-5, BF16: 1e-2})
"""Per-step loss bounds of a feature whose math differs from megatron's (fused kernels reorder
fp32 rounding; bf16 ones round once where megatron's eager chain rounds after every op): each
feature's own GPT parity test on the CPU states these, with the reasoning beside it. They are the
bounds here too: both arms run on the same device with the same cuBLAS/cuDNN GEMMs (TF32 off), so
only the feature's own arithmetic differs, as on the CPU."""

MOE = MappingProxyType(
    dict(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
    )
)
"""A Mixtral-like MoE layer (softmax top-2 with the auxiliary loss) at EP = 1: SequentialMLP experts."""
DEEPSEEK_ROUTER = MappingProxyType(
    dict(
        num_moe_experts=8,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-2,
    )
)
"""DeepSeek-V3's router: sigmoid scores, group-limited top-k, scaling, the aux-loss-free expert bias
(updated by megatron's finalize_model_grads after each step) and the sequence auxiliary loss."""


@dataclass(frozen=True)
class Case:
    """One GPT parity comparison: megatron's own path vs ``feature`` on, same device, seed, batches.

    rtol: per-step loss bound; None: bitwise (losses and every final weight, bit for bit).
    why: the bound's reason (or why the math is identical).
    model: ``tiny_gpt`` overrides (besides the dtype). flags: ``configure`` flags besides the
        feature's ``switch_on``. train: ``train_steps`` arguments for both arms; ours_train: for the
        feature's arm only (e.g. the optimizer config that asks for it).
    acts_on: the devices where the feature acts; elsewhere it must say once why not (a fallback
        line) and change nothing (bitwise).
    grouped_from_sequential: the feature's arm runs megatron's GroupedMLP with the weights of the
        SequentialMLP megatron's arm trains (megatron's own GroupedMLP needs the CUDA grouped_gemm
        package, absent on every host this project runs on).
    optimizer: the name of the optimizer class the feature's arm must train with (proof that a
        feature whose result may equal megatron's did act).
    """

    feature: str
    dtype: str
    rtol: float | None
    why: str
    variant: str = ""
    model: Mapping[str, Any] = field(default_factory=dict)
    flags: Mapping[str, Any] = field(default_factory=dict)
    train: Mapping[str, Any] = field(default_factory=dict)
    ours_train: Mapping[str, Any] = field(default_factory=dict)
    acts_on: tuple[str, ...] = ("cpu", "cuda")
    grouped_from_sequential: bool = False
    optimizer: str | None = None

    @property
    def id(self) -> str:
        return "-".join(p for p in (self.feature, self.variant, self.dtype) if p)


def _tolerance_cases(feature: str, **kwargs: Any) -> list[Case]:
    why = "its own CPU parity bound (fused arithmetic, not megatron's op order)"
    return [Case(feature, dtype, RTOL[dtype], why, **kwargs) for dtype in (FP32, BF16)]


def _bitwise_cases(feature: str, why: str, dtypes: tuple[str, ...] = (FP32, BF16), **kwargs: Any) -> list[Case]:
    return [Case(feature, dtype, None, why, **kwargs) for dtype in dtypes]


def _precision_aware_cases() -> list[Case]:
    """bf16 model, megatron's DistributedOptimizer at DP = 1; the feature's arm asks megatron's
    OptimizerConfig for the precision-aware optimizer (what switches it on)."""
    common = dict(model={}, train=dict(use_distributed_optimizer=True), optimizer="PrecisionAwareAdam")

    def fields(moments: torch.dtype, grads: torch.dtype, remainders: bool) -> dict:
        optimizer = dict(
            optimizer="adam",
            use_precision_aware_optimizer=True,
            exp_avg_dtype=moments,
            exp_avg_sq_dtype=moments,
            main_grads_dtype=grads,
            store_param_remainders=remainders,
        )
        return dict(optimizer=optimizer, grad_reduce_in_fp32=grads == torch.float32)

    name = "precision-aware-optimizer"
    return [
        Case(
            name,
            BF16,
            None,
            "fp32 moments and masters: megatron's Adam arithmetic element for element (its CPU test: bitwise)",
            variant="fp32-moments",
            ours_train=fields(torch.float32, torch.float32, False),
            **common,
        ),
        Case(
            name,
            BF16,
            2e-2,
            "bf16 moments, bf16 main grads, int16 remainders: its CPU test's bound (5.6e-3 measured over 20 steps)",
            variant="bf16-moments",
            ours_train=fields(torch.bfloat16, torch.bfloat16, True),
            **common,
        ),
        Case(
            name,
            BF16,
            6e-2,
            "fp8 (E4M3, per-block scales) moments: its CPU test's bound (2.8e-2 measured over 20 steps)",
            variant="fp8-moments",
            ours_train=fields(torch.uint8, torch.bfloat16, True),
            **common,
        ),
    ]


CASES: dict[str, list[Case]] = {
    "flash-attention": _tolerance_cases("flash-attention", model=dict(num_query_groups=2)),
    "fused-linear-cross-entropy": _tolerance_cases(
        "fused-linear-cross-entropy",
        flags=dict(linear_cross_entropy_chunk_tokens=16),  # 4 chunks of 64 tokens
    ),
    "grouped-gemm": _tolerance_cases(
        "grouped-gemm", model=dict(MOE, moe_grouped_gemm=True), grouped_from_sequential=True
    ),
    "host-allocator": _bitwise_cases(
        "host-allocator",
        "glibc malloc's settings change where freed host blocks go, never a value",
        (FP32,),
        acts_on=("cpu",),
    ),
    "moe-permute": _bitwise_cases("moe-permute", "the same rows gathered and summed in megatron's order", model=MOE),
    "moe-router": [
        *_bitwise_cases("moe-router", "megatron's ATen ops in megatron's order, forward and backward", model=MOE),
        *_bitwise_cases(
            "moe-router",
            "megatron's ATen ops in megatron's order, forward and backward",
            (FP32,),
            variant="deepseek",
            model=DEEPSEEK_ROUTER,
            train=dict(finalize_grads=True),  # megatron's finalize_model_grads updates the expert bias
        ),
    ],
    "moe-zero-memory": _bitwise_cases("moe-zero-memory", "the experts' call recomputed on the same rows", model=MOE),
    "precision-aware-optimizer": _precision_aware_cases(),
    "recompute-activation-function": _bitwise_cases(
        "recompute-activation-function", "the activation recomputed by the same kernel on the same input"
    ),
    "reuse-fp32-param": _bitwise_cases(
        "reuse-fp32-param", "the fp32 master and bf16 weight share bytes; no value changes", (BF16,)
    ),
}
"""Features whose default case (dense tiny GPT, fp32 and bf16, their CPU bounds) does not fit."""

NOT_ON_ONE_GPU: dict[str, str] = {
    "context-parallel": "acts only at context_parallel_size > 1: two ranks, which NCCL cannot place on one GPU. "
    "Its block attention and log-sum-exp merge run in the kernel lane at one rank "
    "(test_context_parallel_blocks_at_one_rank); not covered on CUDA: the ring / all-gather / Ulysses "
    "communication and the GPT at CP > 1",
    "tp-overlap": "acts only at tensor_model_parallel_size > 1 (its tiles overlap TP all-gathers and "
    "reduce-scatters): two ranks. Not covered on CUDA: the tiled column/row linears and their async collectives",
    "moe-alltoall-overlap": "acts only at expert_model_parallel_size > 1 with the alltoall dispatcher: two ranks. "
    "Not covered on CUDA: its dispatch/combine pipeline and its streams (moe-zero-memory's EP = 1 recompute "
    "is covered by its own case)",
    "fsdp2-config": "configures megatron's torch-FSDP2 wrapper (--use-torch-fsdp2 --fsdp2-config-path), which the "
    "lane's GPT parity cases do not build, and shards at data-parallel size > 1: two ranks. Not covered on CUDA: "
    "the YAML's mesh (HSDP), units, mixed precision, offload and recompute (tests/fsdp runs them on a CPU host)",
}
"""Accelerations one GPU cannot run, and what the lane therefore does not cover."""


def accelerations() -> list:
    """Every registered feature of kind "feature" (built-in and plugin), read from the registry."""
    return [f for f in all_features() if f.kind == "feature"]


def parity_cases() -> list[Case]:
    """Every acceleration's cases: :data:`CASES`, else the default on the dense tiny GPT."""
    out: list[Case] = []
    for feature in accelerations():
        if feature.name in NOT_ON_ONE_GPU:
            continue
        out += CASES.get(feature.name) or _tolerance_cases(feature.name)
    return out


def switch_on(feature: str) -> dict[str, Any]:
    for candidate in accelerations():
        if candidate.name == feature:
            return dict(candidate.switch_on)
    raise KeyError(f"no acceleration named {feature!r}")


# ---------------------------------------------------------------- one arm


@dataclass
class Arm:
    """What one training run left: per-step losses, the final weights (on the host), what ran."""

    losses: list[float]
    weights: dict[str, torch.Tensor]
    reached: dict[str, int]
    activated: list[str]
    fell_back: dict[str, list[str]]
    optimizers: list[str]


def _optimizer_classes(opt) -> list[str]:
    """Class names of the torch optimizers under megatron's (chained) optimizer wrappers."""
    names = []
    for inner in getattr(opt, "chained_optimizers", [opt]):
        names.append(type(getattr(inner, "optimizer", inner)).__name__)
    return names


def train_arm(case: Case, device: torch.device, *, ours: bool) -> Arm:
    """Train one arm of ``case`` on ``device`` (megatron's own path, or the feature on under strict)."""
    import mindspeed_like
    from mindspeed_like import runtime
    from mindspeed_like.testing import tiny_gpt, train_steps
    from mindspeed_like.testing.moe import copy_sequential_into_grouped
    from mindspeed_like.testing.training import unwrap
    from mindspeed_like.toolkit.fallback import fell_back

    mindspeed_like.reset()
    runtime.ENGINE.calls = collections.Counter()  # before the features apply: count their calls
    try:
        if ours:
            mindspeed_like.configure(device=device.type, strict=True, **switch_on(case.feature), **case.flags)
        else:
            mindspeed_like.configure(device=device.type, optimization_level=0)
        seed_parallel_state()
        if ours and case.grouped_from_sequential and _has_grouped_mlp():
            # megatron's arm trains SequentialMLP; ours GroupedMLP with exactly its weights
            sequential = tiny_gpt(**megatron_model_args(case))
            model = tiny_gpt(**model_args(case))
            copy_sequential_into_grouped(unwrap(sequential), unwrap(model), case.model["num_moe_experts"])
            del sequential
        else:
            model = tiny_gpt(**(model_args(case) if ours else megatron_model_args(case)))
        model = model.to(device)
        held: dict[str, Any] = {}
        train_args = dict(case.train, **(case.ours_train if ours else {}))
        with as_on_cuda(device):
            losses = train_steps(
                model,
                STEPS,
                seed=SEED,
                device=device,
                on_optimizer=lambda wrapped, opt: held.update(opt=opt),
                **train_args,
            )
        weights = {name: p.detach().to("cpu", copy=True) for name, p in unwrap(model).named_parameters()}
        return Arm(
            losses=losses,
            weights=weights,
            reached=dict(runtime.ENGINE.calls),
            activated=runtime.activated(),
            fell_back=fell_back(),
            optimizers=_optimizer_classes(held["opt"]),
        )
    finally:
        runtime.ENGINE.calls = None
        mindspeed_like.reset()


def seed_parallel_state() -> None:
    """megatron's parallel state (TP = PP = EP = CP = 1) made once per session, then every arm starts
    from the same seeds (``testing.init_parallel``'s). Not re-created per arm: on CUDA each new
    process group is a new NCCL communicator (tens of groups per ``initialize_model_parallel``), which
    the lane's time budget does not have; the self-check runs the same sequence on the CPU."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mindspeed_like.testing import init_parallel

    if not parallel_state.model_parallel_is_initialized():
        init_parallel(seed=SEED)
        return
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)


def model_args(case: Case) -> dict[str, Any]:
    """``tiny_gpt`` arguments of the feature's arm."""
    return dict(case.model, bf16=case.dtype == BF16)


def megatron_model_args(case: Case) -> dict[str, Any]:
    """``tiny_gpt`` arguments of megatron's arm (SequentialMLP where ours runs GroupedMLP)."""
    args = model_args(case)
    if case.grouped_from_sequential:
        args["moe_grouped_gemm"] = False
    return args


def baseline_key(case: Case) -> tuple:
    """Cases whose megatron arms are the same run share one (its result is cached)."""
    return (tuple(sorted(megatron_model_args(case).items())), tuple(sorted(case.train.items())))


def _has_grouped_mlp() -> bool:
    """megatron-core < 0.17 builds GroupedMLP for moe_grouped_gemm (0.17 deleted it: SequentialMLP)."""
    from mindspeed_like.megatron_version import megatron_core_version

    version = megatron_core_version()
    return version is not None and version.release < (0, 17)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit pattern as integers (so -0.0 differs from 0.0 and NaNs compare by payload)."""
    views = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
    return t.contiguous().view(views[t.element_size()])


def weights_differing(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the weights whose bits differ (or that only one side has)."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or not torch.equal(bits(a[n]), bits(b[n]))]


def max_relative_difference(a: list[float], b: list[float]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        scale = max(abs(x), abs(y))
        worst = max(worst, 0.0 if x == y else (abs(x - y) / scale if scale else float("inf")))
    return worst


def cuda_backend_name() -> str:
    """The kernel backend a CUDA tensor gets (``kernels.backend.backend_for``), read from a fake
    ``cuda`` tensor (``FakeTensorMode``), so it is known on a host without CUDA too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mindspeed_like.kernels.backend import backend_for

    with FakeTensorMode():
        probe = torch.empty(1, device="cuda")
    return backend_for(probe)


def as_on_cuda(device: torch.device) -> contextlib.AbstractContextManager:
    """On the CPU (the self-check) the kernels run with the backend CUDA tensors get (forced: an op's
    handling of that backend's name, and the device-independent parts of a CUDA implementation, run
    on the host); on CUDA nothing is forced: the device picks, as in a user's run."""
    from mindspeed_like.kernels.backend import force_backend

    return force_backend(cuda_backend_name()) if device.type == "cpu" else contextlib.nullcontext()


def lane_device_name() -> str:
    name = os.environ.get(DEVICE_ENV, "cuda").strip().lower()
    if name not in ("cuda", "cpu"):
        raise ValueError(f"{DEVICE_ENV}={name!r}: the lane runs on 'cuda' (default) or 'cpu' (its self-check)")
    return name
