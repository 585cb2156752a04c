"""Access to torch_npu's fused ops: the only place the project imports torch_npu.

Imported lazily, at the first call of an npu-backend op, so hosts without torch_npu never
import it. Tests put a contract-enforcing emulator in ``sys.modules["torch_npu"]``
(``mindspeed_like.testing.npu_emulator``), and this accessor then returns that.
"""

from __future__ import annotations

import importlib
import types


def torch_npu() -> types.ModuleType:
    try:
        return importlib.import_module("torch_npu")
    except ImportError as error:
        raise RuntimeError(
            "the npu backend needs torch_npu (pip install 'mindspeed_like[npu]' on an Ascend host with CANN); "
            "on other hosts the portable backend is used"
        ) from error
