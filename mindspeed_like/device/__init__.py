"""The device layer: which accelerator runs megatron, and how megatron's CUDA calls reach it.

* :func:`detect_device` resolves the ``--device`` flag (auto|cpu|cuda|npu) to the device in use.
* :mod:`mindspeed_like.device.host_view` runs megatron's own functions with their CUDA calls
  seen as host (CPU) calls, without changing torch itself (used by the cpu-adapter feature).

This package never imports megatron, and imports ``torch_npu`` only when it is installed.
"""

from mindspeed_like.device.detect import detect_device, npu_available

__all__ = ["detect_device", "npu_available"]
