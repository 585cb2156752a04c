"""``transformer_engine.pytorch.fp8`` as served to clients: the probes answer "no FP8 here".

Clients ask this module whether they may take their fp8 paths before they build anything:
megatron's own tests import ``check_fp8_support`` at module level to decide their skips (without
the submodule 11 of its test files failed to import), Megatron-Bridge and NeMo-style trainers call
it to pick a recipe. TE on a GPU without FP8 answers ``(False, reason)``; so does this module, on
every host, because the te-client-module has no fp8 kernels. ``fp8_autocast(enabled=False)`` and
``fp8_model_init(enabled=False)`` do nothing (as from ``transformer_engine.pytorch``); enabled, and
any other fp8 name, are refused by name with the alternative.
"""

from __future__ import annotations

from mindspeed_like.te_shim.modules import fp8_autocast, fp8_model_init
from mindspeed_like.te_shim.refusals import FP8, refused_module_getattr

NO_FP8 = (
    "FP8 is not available: mindspeed_like's TransformerEngine client module runs without TransformerEngine "
    "and has no fp8 kernels (train in bf16, or install TransformerEngine on an FP8-capable GPU)"
)


def check_fp8_support() -> tuple[bool, str]:
    """TE's probe: (supported, reason). Never supported here (module docstring)."""
    return False, NO_FP8


def check_mxfp8_support() -> tuple[bool, str]:
    return False, NO_FP8


def check_fp8_block_scaling_support() -> tuple[bool, str]:
    return False, NO_FP8


def check_nvfp4_support() -> tuple[bool, str]:
    return False, NO_FP8


class FP8GlobalStateManager:
    """TE's fp8 state, read by clients to learn whether an fp8 region is active: never."""

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return False

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return False

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return False

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        return False


__getattr__ = refused_module_getattr(
    "transformer_engine.pytorch.fp8", {"get_fp8_recipe": FP8, "fp8_model_init_ctx": FP8}
)

__all__ = [
    "FP8GlobalStateManager",
    "check_fp8_block_scaling_support",
    "check_fp8_support",
    "check_mxfp8_support",
    "check_nvfp4_support",
    "fp8_autocast",
    "fp8_model_init",
]
