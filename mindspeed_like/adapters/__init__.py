"""Device bring-up: megatron's CUDA calls on a CPU host (cpu, cpu_training) or on an Ascend NPU
through torch_npu (npu); ``detect`` resolves ``--device``. Never imports an acceleration."""
