"""Backends of the fused ops. ``npu.py`` is the only module in the project that imports torch_npu."""
