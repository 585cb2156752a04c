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


def hccl_comm_name(group) -> str:
    """The HCCL communicator name of ``group`` (what torch_npu's MC2 kernels take as ``hcom``).

    The one place this lookup lives. On an NPU it is the backend's ``get_hccl_comm_name``;
    the test emulator (``mindspeed_like.testing.npu_emulator``) instead names a gloo group via
    its ``emulator_hccl_comm_name`` and resolves the name back to the group inside its ops.
    """
    import torch
    import torch.distributed as dist

    module = torch_npu()
    naming = getattr(module, "emulator_hccl_comm_name", None)
    if naming is not None:
        return naming(group)
    rank = dist.get_rank(group)
    return group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)
