"""Accelerator detection: npu if torch_npu imports and has a device, else cuda, else cpu."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging

logger = logging.getLogger("mindspeed_like")

DEVICES = ("cpu", "cuda", "npu")


@functools.cache
def npu_available() -> bool:
    """True when ``torch_npu`` is installed, imports, and reports an available NPU.

    ``torch_npu`` is looked up with ``find_spec`` first, so it is never imported (nor its
    absence turned into an import error) on hosts without it.
    """
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")
        import torch

        return bool(torch.npu.is_available())
    except Exception as exc:  # a broken torch_npu install is "no NPU", said once
        logger.warning("torch_npu is installed but unusable (%s); not using an NPU", exc)
        return False


def detect_device(requested: str = "auto") -> str:
    """The device megatron runs on: ``"cpu"``, ``"cuda"`` or ``"npu"``.

    ``requested`` is the ``--device`` flag: ``auto`` picks npu (torch_npu imports and
    ``torch.npu.is_available()``), else cuda (``torch.cuda.is_available()``), else cpu;
    ``cpu``/``cuda``/``npu`` force that device (forcing one that is absent is the caller's
    decision: the matching adapter is applied regardless).
    """
    if requested in DEVICES:
        return requested
    if requested != "auto":
        raise ValueError(f"unknown device {requested!r}; expected one of auto, {', '.join(DEVICES)}")
    if npu_available():
        return "npu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "cpu"
