"""The output-discarding checkpoint recompute-activation-function uses, per megatron-core version.

megatron-core's ``tensor_parallel.CheckpointWithoutOutput`` on 0.16.x; on 0.13-0.15 and 0.17+ the
subclass :func:`hook_safe_checkpoint_class`: on 0.13-0.15 the inputs lose their gradients under
any saved-tensor hooks; 0.17's ``_recompute`` no longer copies the recomputed output into the
discarded storage but points that storage at the recomputed one through a C++ extension built
with ``torch.utils.cpp_extension.load_inline`` at the first backward (a compiler at training
time, tens of seconds on a CPU host), and when the activation returned a view of its input the
shared storage is the input's, so fc2's weight gradient is computed from the wrong values. The
subclass recomputes and copies, as 0.16 does. Its fp8 default is corrected by
``fixes/checkpoint_fp8_default.py``, which the feature requires (the subclass inherits the fixed ``__init__``).
"""

from __future__ import annotations

import torch

_hook_safe_class = None


def needs_hook_safe_checkpoint(ctx) -> bool:
    """Whether ``ctx``'s megatron-core needs our subclass (0.13-0.15 and 0.17+; see the module
    doc); megatron's own ``CheckpointWithoutOutput`` serves on 0.16.x only. One rule for the
    patches and the spec provider."""
    return not (ctx.megatron_at_least("0.16") and not ctx.megatron_at_least("0.17"))


def hook_safe_checkpoint_class() -> type:
    """``CheckpointWithoutOutput`` as megatron-core 0.16 fixed it, for 0.13-0.15.

    There ``_recompute`` runs on ``ctx.saved_tensors`` and the Function's backward unpacks
    ``ctx.saved_tensors`` again to read the inputs' ``.grad``. Under any saved-tensor hooks
    (``torch.autograd.graph.saved_tensors_hooks``, ``save_on_cpu``, memory meters, offloading)
    every unpack is a new tensor object, so the gradients accumulated during the recompute
    are not on the objects backward reads: the inputs get no gradient, silently. The
    subclass keeps megatron's RNG capture/restore and ``discard_output_and_register_recompute``
    and hands the recompute's own input objects to backward (0.16's protocol). fp8 is not
    handled here (the feature falls back for fp8).
    """
    global _hook_safe_class
    if _hook_safe_class is not None:
        return _hook_safe_class
    from megatron.core.tensor_parallel import random as mrandom
    from torch.utils.checkpoint import detach_variable

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, run_function, owner, *args):
            with torch.no_grad():
                outputs = run_function(*args)
            ctx.save_for_backward(*detach_variable(args))
            owner.ctx = ctx
            return outputs

        @staticmethod
        def backward(ctx, *grads):
            inputs, outputs = ctx.inputs, ctx.outputs
            torch.autograd.backward(outputs, grads)
            ctx.inputs = ctx.outputs = None
            return (None, None) + tuple(t.grad if isinstance(t, torch.Tensor) else t for t in inputs)

    def detach(tensor):
        if not isinstance(tensor, torch.Tensor):
            return tensor
        requires_grad = tensor.requires_grad
        return tensor.detach().requires_grad_(requires_grad)

    class HookSafeCheckpointWithoutOutput(mrandom.CheckpointWithoutOutput):
        def checkpoint(self, run_function, *args):
            self.run_function = run_function
            self.rng_states = mrandom._get_all_rng_states()
            outputs = Function.apply(run_function, self, *args)
            self.outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
            return outputs

        def _recompute(self, _):
            if self.ctx is None:
                return
            if not torch.autograd._is_checkpoint_valid():
                raise RuntimeError("Checkpointing is not compatible with .grad(), please use .backward() if possible")
            with mrandom._fork_rng():
                mrandom._set_all_rng_states(*self.rng_states)
                inputs = tuple(detach(t) for t in self.ctx.saved_tensors)
                with torch.enable_grad():
                    outputs = self.run_function(*inputs)
            self.run_function = self.rng_states = None
            if isinstance(outputs, torch.Tensor):
                outputs = (outputs,)
            with torch.no_grad():
                for output, recomputed in zip(self.outputs, outputs):
                    output.untyped_storage().resize_(recomputed.untyped_storage().size())
                    output.untyped_storage().copy_(recomputed.untyped_storage())
            self.ctx.outputs, self.ctx.inputs = outputs, inputs
            self.outputs = self.ctx = None

    _hook_safe_class = HookSafeCheckpointWithoutOutput
    return _hook_safe_class


def megatron_checkpoint_class() -> type:
    from megatron.core import tensor_parallel

    return tensor_parallel.CheckpointWithoutOutput


def saved_tensor_hooks_active() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
