"""CPU adapter, optimizers: ``device='cuda'`` scalars and ``'torch.cuda.*Tensor'`` type checks.

megatron's optimizers keep their scalars (found-inf flag, loss scale, grad-norm buffers) in
``device='cuda'`` tensors and accept parameters by comparing ``param.type()`` with
``'torch.cuda.FloatTensor'``/``'torch.cuda.HalfTensor'``/``'torch.cuda.BFloat16Tensor'``; a CPU
parameter's type is ``'torch.FloatTensor'`` and so it is rejected ("Wrapped parameters must be
one of ..."). Each target runs as its host twin (``mindspeed_like.adapters.cpu.host_view``), whose
constants read ``'cpu'`` and ``'torch.FloatTensor'`` etc.: the check still rejects what megatron
rejects (e.g. float64), only the device changes. Targets are the functions holding the
literals (0.13-0.16):

* ``optimizer.optimizer``: ``MixedPrecisionOptimizer.__init__``,
  ``Float16OptimizerWithFloat16Params.__init__``, ``FP32Optimizer.__init__``,
  ``ChainedOptimizer.get_loss_scale``;
* ``optimizer.distrib_optimizer.DistributedOptimizer``: ``_build_model_and_main_param_groups``
  (a classmethod) and ``__init__``;
* ``optimizer.clip_grads``: ``get_grad_norm_fp32``, ``clip_grad_by_total_norm_fp32``,
  ``count_zeros_fp32``;
* ``optimizer.grad_scaler``: ``MegatronGradScaler.__init__``, ``DynamicGradScaler.__init__``, and
  ``DynamicGradScaler.load_state_dict`` (``--fp16`` resume: the loaded scale is moved with
  ``.cuda(torch.cuda.current_device())``; issue 37 item 1);
* ``optimizer.optimizer.MegatronOptimizer.offload_to_cpu`` / ``restore_from_cpu`` (0.15+: RL
  clients, e.g. verl, park the optimizer state between rollouts): ``torch.cuda.empty_cache()`` and
  ``.cuda()`` back; on a host both leave the state where it is;
* ``utils.local_multi_tensor_l2_norm``: megatron's fallback l2 norm (no apex/TE) puts its
  result on ``'cuda'``;
* ``optimizer.optimizer.MegatronOptimizer.has_grad_norm_group`` (0.19+): all-reduces a
  ``device='cuda'`` flag the first time a clipped step asks about a gradient-norm group.
"""

from __future__ import annotations

from mindspeed_like.adapters.cpu.devices import on_host

PATCHES = [
    on_host("optimizer.optimizer.MixedPrecisionOptimizer.__init__", "found_inf/scale tensors on device='cuda'"),
    on_host("optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__", "'torch.cuda.*Tensor' checks"),
    on_host("optimizer.optimizer.FP32Optimizer.__init__", "scale tensor on device='cuda'"),
    on_host("optimizer.optimizer.ChainedOptimizer.get_loss_scale", "scale on torch.cuda.current_device()"),
    on_host(
        "optimizer.distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups",
        "'torch.cuda.*Tensor' checks",
    ),
    on_host("optimizer.distrib_optimizer.DistributedOptimizer.__init__", "'torch.cuda.*Tensor' checks"),
    on_host("optimizer.clip_grads.get_grad_norm_fp32", "norm tensors on device='cuda'"),
    on_host("optimizer.clip_grads.clip_grad_by_total_norm_fp32", "'torch.cuda.FloatTensor' check, device='cuda'"),
    on_host("optimizer.clip_grads.count_zeros_fp32", "zero-count tensor on device='cuda'"),
    on_host("optimizer.grad_scaler.MegatronGradScaler.__init__", "scale on device='cuda'"),
    on_host("optimizer.grad_scaler.DynamicGradScaler.__init__", "scaler constants on device='cuda'"),
    on_host(
        "optimizer.grad_scaler.DynamicGradScaler.load_state_dict",
        "--fp16 resume: scale moved with .cuda(torch.cuda.current_device())",
    ),
    # megatron-core 0.15+ (RL clients)
    on_host("optimizer.optimizer.MegatronOptimizer.offload_to_cpu", "torch.cuda.empty_cache()", versions=">=0.15"),
    on_host(
        "optimizer.optimizer.MegatronOptimizer.restore_from_cpu", "state moved back with .cuda()", versions=">=0.15"
    ),
    on_host("utils.local_multi_tensor_l2_norm", "l2 norm result on device='cuda'"),
    # megatron-core 0.19: asked on every clipped step (cached per group after the first)
    on_host(
        "optimizer.optimizer.MegatronOptimizer.has_grad_norm_group",
        "all-reduced flag on device='cuda'",
        versions=">=0.19",
    ),
]
