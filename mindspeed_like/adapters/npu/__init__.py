"""The npu-adapter feature: megatron-core on an Ascend NPU through torch_npu's own adaptation.

Switched on when the device resolves to npu (``--device npu``, or ``auto`` with torch_npu
installed and an NPU available). ``torch_npu.contrib.transfer_to_npu`` is torch_npu's
supported way to run CUDA-spelled code on an NPU: on import it redirects ``torch.cuda.*``,
``device='cuda'`` and friends to the NPU for the whole process. That is a global change by
nature, so it is declared as one: the patch below is ``global_change=True`` and its report
entry names ``torch_npu.contrib.transfer_to_npu``.

The engine patches attributes, and importing ``transfer_to_npu`` is not an attribute change;
the patch therefore WRAPs ``torch_npu.npu.is_available`` (a function torch_npu always has) as
the report's marker, and the feature's ``activate`` imports ``transfer_to_npu`` when it is applied. The
import cannot be undone (torch_npu gives no inverse); ``mindspeed_like.reset()`` removes our
wrapper only, and ``adapted()`` tells whether the import happened.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Context, Feature, on_device
from mindspeed_like.toolkit.errors import ConfigError

logger = logging.getLogger("mindspeed_like")

TRANSFER_MODULE = "torch_npu.contrib.transfer_to_npu"


def adapted() -> bool:
    """True once torch_npu's CUDA->NPU adaptation has been imported in this process."""
    return TRANSFER_MODULE in sys.modules


def _is_available(wrapped, instance, args, kwargs):
    # Marker wrapper: the report entry stands for the transfer_to_npu global change.
    return wrapped(*args, **kwargs)


PATCHES = [
    Patch(
        "torch_npu.npu.is_available",
        Kind.WRAP,
        _is_available,
        global_change=True,
        why=f"import {TRANSFER_MODULE}: torch.cuda.* and device='cuda' run on the NPU (process-wide)",
    ),
]


def _activate(ctx: Context) -> None:
    if importlib.util.find_spec("torch_npu") is None:
        raise ConfigError(
            "--device npu: torch_npu is not installed, so there is no NPU to run on. Install torch-npu "
            "matching your torch and Huawei's CANN on the Ascend host (pip install 'mindspeed_like[npu]'), "
            "or use --device auto / cpu / cuda"
        )
    importlib.import_module("torch_npu")
    if not adapted():
        importlib.import_module(TRANSFER_MODULE)
        logger.info("npu-adapter: imported %s (torch.cuda -> torch.npu for the whole process)", TRANSFER_MODULE)


FEATURE = Feature(
    name="npu-adapter",
    summary="megatron-core on Ascend NPU via torch_npu.contrib.transfer_to_npu (declared global change)",
    patches=PATCHES,
    activate=_activate,
    enabled=on_device("npu"),
    backend="npu",
    switched_by="--device npu (auto: torch_npu and an NPU)",
    kind="adapter",
)
