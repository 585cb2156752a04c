"""reuse-fp32-param for megatron's ``Float16OptimizerWithFloat16Params``: the shared buffers.

Each bf16 parameter and its fp32 master become one 4-byte-per-element buffer
(``mindspeed_like.kernels.bf16_residual``): between steps it holds ``[bf16 weights | int16
residuals]`` and the model's parameter is a contiguous bf16 *view* of its first half; around the
inner ``optimizer.step()`` the buffer is the exact fp32 master (the optimizer's parameter is the
same buffer viewed as fp32). Rare ties that a 16-bit residual cannot hold are kept per parameter
beside the buffer (``side``: an index table on the host, a bitmask of 0.125 B/param on CUDA;
``kernels/bf16_ties.py``). The wrappers that drive the layouts are in ``wrappers.py``; the
optimizer step that never leaves the split layout is ``chunked_step.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mindspeed_like.kernels import bf16_residual as kernel
from mindspeed_like.toolkit.dtensors import is_dtensor
from mindspeed_like.toolkit.errors import ConfigError, FeatureUnsupported
from mindspeed_like.toolkit.fallback import Fallback

STATE_ATTR = "_mindspeed_reuse_fp32"


class ReuseFp32ParamUnsupported(FeatureUnsupported):
    """The feature cannot run on this optimizer and ``strict`` is on."""


def bf16_required_message(what: str) -> str:
    return (
        f"--reuse-fp32-param needs bf16 mixed-precision training, but {what}. "
        "Train with bf16 (Megatron-LM: --bf16; megatron-core: OptimizerConfig(bf16=True) and a bf16 "
        "TransformerConfig) or switch the feature off (drop --reuse-fp32-param / "
        "mindspeed_like.configure(reuse_fp32_param=False))."
    )


@dataclass
class Shared:
    """One parameter's shared buffer: the model param and its master are views of ``buf``."""

    model_param: torch.nn.Parameter
    main_param: torch.Tensor
    buf: torch.Tensor
    side: kernel.Ties

    @property
    def shape(self) -> torch.Size:
        return self.model_param.shape


@dataclass
class ReuseState:
    """All shared buffers of one optimizer and which layout they are in."""

    entries: list[Shared] = field(default_factory=list)
    layout: str = "split"  # "split" between steps, "fp32" around the inner optimizer step
    chunk: int = kernel.DEFAULT_CHUNK  # elements per layout move: the device's (kernel.chunk_for)
    batch: int = kernel.DEFAULT_CHUNK  # elements per batch of the optimizer step (kernel.batch_for)

    def to_fp32(self) -> None:
        if self.layout == "fp32":
            return
        for entry in self.entries:
            kernel.to_fp32(entry.buf, entry.side, self.chunk)
        self.layout = "fp32"

    def to_split(self) -> None:
        if self.layout == "split":
            return
        for entry in self.entries:
            kernel.to_split(entry.buf, entry.side, self.chunk)
        self.layout = "split"

    def side_table_bytes(self) -> int:
        """Bytes of the tie records (index tables or bitmasks)."""
        return sum(e.side.nbytes() for e in self.entries)

    def extra_bytes(self) -> int:
        """Bytes held outside the shared param storages (the tie records)."""
        return self.side_table_bytes()


def state_of(optimizer) -> ReuseState | None:
    """The feature's state on a megatron optimizer, or None when it keeps megatron's layout."""
    return getattr(optimizer, STATE_ATTR, None)


def _owns_its_storage(param: torch.Tensor) -> bool:
    return param.storage_offset() == 0 and param.untyped_storage().nbytes() == param.numel() * param.element_size()


def share(optimizer, fall_back: Fallback) -> None:
    """Move each (bf16 model param, fp32 master) pair of a Float16 optimizer into one buffer."""
    state = ReuseState()
    pairs = [
        (model, main)
        for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
        for model, main in zip(model_group, main_group)
    ]
    if any(is_dtensor(model) for model, _ in pairs):
        fall_back(
            "torch FSDP2 (--use-torch-fsdp2): its parameters are DTensor shards in storage FSDP2 all-gathers "
            "into and frees itself, which a shared bf16/fp32 buffer cannot replace"
        )
        return
    for model, _ in pairs:
        if model.dtype != torch.bfloat16:
            raise ConfigError(bf16_required_message(f"a {model.dtype} parameter reached the fp16 optimizer"))
        if not model.is_contiguous() or not _owns_its_storage(model):
            fall_back("a bf16 parameter is a view into a shared buffer")
            return
    with torch.no_grad():
        for model, main in pairs:
            buf = kernel.new_buffer(model.data)  # master == bf16 weight exactly: residuals 0
            model.data = kernel.bf16_view(buf, model.shape)
            main.data = kernel.fp32_view(buf, model.shape)
            state.entries.append(Shared(model, main, buf, kernel.new_ties(model.numel(), buf)))
    if state.entries:
        state.chunk = kernel.chunk_for(state.entries[0].buf)
        state.batch = kernel.batch_for(state.entries[0].buf)
    setattr(optimizer, STATE_ATTR, state)
