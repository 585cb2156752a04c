"""upcast-cpu-gemm (``--upcast-cpu-gemm``): on a CPU whose bf16/fp16 GEMM is slower than its fp32
GEMM (no bf16 dot-product units, or torch/oneDNN held below them by ``ONEDNN_MAX_CPU_ISA`` /
``ATEN_CPU_CAPABILITY``), every GEMM of the training step runs in fp32 on upcast inputs and is
rounded once: megatron's linear layers and their weight/input gradients, its attention's
``baddbmm``/``bmm``, SDPA's CPU flash-attention backward, the output layer, fused linear
cross-entropy and the MoE experts. One host-level mechanism (``kernels/host_gemm.py``: a
``torch.library`` override of the aten GEMM ops), decided once per process by a probe of the GEMM
speed this process really gets; where bf16 is faster (AVX512-BF16/AMX) nothing is installed.

A level-1 feature, not part of the cpu adapter: the results are megatron's within fp32 rounding of
each GEMM's sum (the bf16 kernels multiply exactly and accumulate in fp32 too, docs/features/
upcast-cpu-gemm.md), and ``mindspeed-like compare``'s megatron arm then shows megatron's own speed
on the host, which is what the speedup is measured against. No patches of megatron: the override is
process-wide, so the report lists it as a declared global change. Its one patch wraps
``host_gemm.in_fp32``, through which every GEMM the override takes passes: it stands for the
override in the report and counts the calls (`mindspeed-like compare`'s "reached"), one Python call
more per GEMM. Switching the feature off deregisters the override."""

from __future__ import annotations

import logging

from mindspeed_like.engine import Kind, Patch, pass_through
from mindspeed_like.toolkit.declaration import Context, Feature, Flag
from mindspeed_like.toolkit.fallback import Fallback

NAME = "upcast-cpu-gemm"
TAKEN = "mindspeed_like.kernels.host_gemm.in_fp32"


PATCHES = [
    Patch(
        TAKEN,
        Kind.WRAP,
        pass_through,  # the engine counts the GEMMs computed in fp32; the report lists the override
        global_change=True,
        why="torch.library override of aten mm/addmm/bmm/baddbmm (functional, out=, in-place) at ADInplaceOrView "
        "and SDPA's CPU flash backward at AutogradCPU: bf16/fp16 CPU GEMMs computed in fp32 and rounded once, "
        "only where the probe finds fp32 faster; deregistered on switch-off",
    ),
]


def _cannot_act(ctx: Context) -> str | None:
    if ctx.device != "cpu":
        return f"the model runs on {ctx.device}, whose GEMMs are the device's own; CPU GEMMs are not on the step's path"
    from mindspeed_like.kernels import host_gemm

    if not host_gemm.low_precision_gemm_is_slow():
        return f"bf16 GEMMs are fast on this host ({host_gemm.probe().describe()})"
    return None


def _activate(ctx: Context) -> None:
    from mindspeed_like.kernels import host_gemm

    reason = _cannot_act(ctx)
    if reason is not None:
        host_gemm.uninstall()
        # never an error under --strict: torch's own kernels are the right ones here
        Fallback(NAME, strict=False, instead="torch's own GEMM kernels kept")(reason)
        return
    if not host_gemm.installed():
        host_gemm.install()
        logging.getLogger("mindspeed_like").info(
            "%s: bf16/fp16 CPU GEMMs computed in fp32 and rounded once (%s)", NAME, host_gemm.probe().describe()
        )


def _switch_off() -> None:
    from mindspeed_like.kernels import host_gemm

    host_gemm.uninstall()


def _backend(ctx: Context) -> str:
    reason = _cannot_act(ctx)
    if reason is not None:
        return f"torch's kernels: {reason}"
    from mindspeed_like.kernels import host_gemm

    return f"fp32 GEMMs for bf16/fp16 ({host_gemm.probe().describe()})"


def _patches(ctx: Context) -> list[Patch]:
    return PATCHES if _cannot_act(ctx) is None else []


FEATURE = Feature(
    name=NAME,
    summary="bf16/fp16 GEMMs of the whole step computed in fp32 and rounded once on a CPU whose bf16 GEMM is slow "
    "(no AVX512-BF16/AMX, or held below them); decided by a one-time speed probe",
    patches=_patches,
    flags=(
        Flag(
            "upcast_cpu_gemm",
            bool,
            False,
            "on a CPU whose bf16/fp16 GEMM is slower than fp32 (measured once per process: AVX2-only hosts, or "
            "ONEDNN_MAX_CPU_ISA/ATEN_CPU_CAPABILITY below AVX512-BF16), compute every bf16/fp16 GEMM (linear "
            "layers, attention, output layer, experts) in fp32 on upcast inputs, rounded once; a process-wide "
            "torch.library override, nothing installed where bf16 GEMMs are fast",
        ),
    ),
    activate=_activate,
    before_switch_off=_switch_off,
    backend=_backend,
    switch_on={"upcast_cpu_gemm": True},
    optimization_level=1,
)

__all__ = ["FEATURE", "NAME"]
