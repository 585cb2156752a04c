"""Activation-function recompute (``--recompute-activation-function``): the MLP activation
output (tokens x ffn, held by fc2 for its weight gradient) is computed without autograd
history, consumed by fc2, its storage freed, and recomputed from fc1's output just before
fc2's backward needs it (a hook on fc2's output), with the RNG states of the forward.

The mechanism is megatron-core's own ``tensor_parallel.CheckpointWithoutOutput`` (0.13+,
used upstream for ``recompute_modules`` ``moe_act``/``layernorm``); we construct it so that
its no-TransformerEngine default-argument bug (``fp8=False`` taken as "fp8 on") cannot bite.
On 0.13-0.15 a subclass is used instead (``hook_safe_checkpoint_class``): there, under any
saved-tensor hooks, the recompute's input gradients land on tensor objects that backward
never reads, and fc1 silently gets no gradient (fixed upstream in 0.16).

Targets, and why each is the right symbol:

- ``megatron.core.transformer.mlp.MLP.forward`` (WRAP): the dense MLP, ``SequentialMLP``'s
  experts (they are ``MLP`` instances called with ``per_token_scale``) and
  ``SharedExpertMLP`` (calls ``MLP.forward``). The activation is inline code in ``forward``
  (gelu, swiglu/geglu with or without ``bias_activation_fusion``, bias add, per-token scale,
  clamp/offset), so nothing on the module can be swapped. The wrapper runs fc1 and fc2
  itself and, as the checkpointed function, calls megatron's own ``forward`` with the two
  linears shadowed on the instance by pass-throughs: fc1 returns the given fc1 output and
  bias, fc2 returns its input. What runs between them is exactly megatron's activation code
  of the installed version (and any wrapper stacked on ``MLP.forward``, e.g. fused-swiglu,
  whose fused kernel then runs inside the recompute). The config object seen at forward is
  put back for the recompute, so a wrapper that swaps ``instance.config`` recomputes the same
  math whatever the wrap order.
- ``megatron.core.transformer.moe.experts.GroupedMLP.forward`` (WRAP): megatron already
  recomputes the grouped experts' activation when ``recompute_modules`` has ``moe_act``
  (``self.activation_recompute``, read in ``forward``); the wrapper switches that attribute on
  for the call, so megatron's code does the work. Already on -> untouched (no double recompute).
- ``megatron.core.transformer.transformer_layer.TransformerLayer.__init__`` (WRAP): the
  ``layer_number`` argument is the layer's 1-based number within its model chunk (the
  block passes ``i + 1``; the global number adds the pipeline offset). It is recorded on the
  layer's MLPs/GroupedMLPs for ``--recompute-activation-function-num-layers N``: only the
  first N layers of each pipeline stage (each model chunk with virtual pipelining).

Not recomputed (by design, silently): calls without autograd (``no_grad``, the forward of
megatron's full/selective ``mlp`` recompute) and calls made *inside* a backward pass (the
re-forward of megatron's recompute: its activations live only until that layer's backward,
so a second recompute would cost time and save nothing). Fallbacks (logged once, an error
under ``strict``): fp8/fp4 (TransformerEngine keeps its own quantized copy of fc2's input),
megatron's CPU activation offloading, a per-token scale together with an fc2 bias (megatron
adds that bias in place, differently by version), and a layer selection asked for an MLP
whose layer number is unknown (built outside a TransformerLayer or before the feature was
switched on). ``TEGroupedMLP`` (TransformerEngine) is not covered.
"""

from __future__ import annotations

import logging

import torch

from mindspeed_like.config import Config, ConfigError
from mindspeed_like.features.base import Feature, Flag
from mindspeed_like.features.fallback import Fallback
from mindspeed_like.patching import Kind, Patch

logger = logging.getLogger(__name__)

MLP_FORWARD = "megatron.core.transformer.mlp.MLP.forward"
GROUPED_MLP_FORWARD = "megatron.core.transformer.moe.experts.GroupedMLP.forward"
LAYER_INIT = "megatron.core.transformer.transformer_layer.TransformerLayer.__init__"
RANDOM_MODULE = "megatron.core.tensor_parallel.random"

STAGE_LAYER_ATTR = "_mindspeed_like_stage_layer"  # 1-based layer number within the model chunk


class RecomputeActivationUnsupported(RuntimeError):
    """``strict`` is on and an MLP call cannot recompute its activation."""


_fall_back = Fallback(
    "recompute-activation-function", RecomputeActivationUnsupported, "keeping the activation output", logger
)
_logged = _fall_back.logged  # reasons already logged


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (a recompute)."""
    return torch._C._current_graph_task_id() != -1


def _layer_selected(module) -> bool:
    import mindspeed_like

    limit = mindspeed_like.current_config()["recompute_activation_function_num_layers"]
    if limit is None:
        return True
    layer = getattr(module, STAGE_LAYER_ATTR, None)
    if layer is None:
        _fall_back(
            "--recompute-activation-function-num-layers is set but this MLP's layer number is unknown "
            "(built outside a TransformerLayer or before the feature was switched on)"
        )
        return False
    return layer <= limit


def _wants_recompute(module) -> bool:
    """Grad mode on, not inside a backward pass (a recompute), layer selected."""
    return torch.is_grad_enabled() and not in_backward() and _layer_selected(module)


def _unsupported(config) -> str | None:
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        return "fp8/fp4: TransformerEngine keeps its own quantized copy of fc2's input"
    if getattr(config, "cpu_offloading", False) and getattr(config, "cpu_offloading_activations", False):
        return "megatron's CPU activation offloading is on"
    return None


def new_checkpoint():
    """megatron's ``CheckpointWithoutOutput`` (on 0.13-0.15 the hook-safe subclass below), with
    its fp8 switch off where TE is absent.

    Upstream ``__init__`` sets ``fp8 = fp8 is not None`` (True for the default), which takes
    TransformerEngine's FP8 path and dies with ``NameError`` without TE.
    """
    import sys

    checkpoint = checkpoint_class()()
    if not getattr(sys.modules[RANDOM_MODULE], "HAVE_TE", False):
        checkpoint.fp8 = False
    return checkpoint


_hook_safe_class = None


def checkpoint_class() -> type:
    """megatron's class where it keeps input gradients under saved-tensor hooks (0.16+), else
    :func:`hook_safe_checkpoint_class`."""
    from megatron.core import tensor_parallel
    from packaging.version import Version

    from mindspeed_like.megatron_version import megatron_core_version

    version = megatron_core_version()
    if version is None or version >= Version("0.16"):
        return tensor_parallel.CheckpointWithoutOutput
    return hook_safe_checkpoint_class()


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


def _megatron_checkpoint_class() -> type:
    from megatron.core import tensor_parallel

    return tensor_parallel.CheckpointWithoutOutput


def saved_tensor_hooks_active() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _megatron_activation(wrapped, instance, config):
    """``fn(fc1_output, fc1_bias, per_token_scale) -> activation output`` running megatron's
    own ``MLP.forward`` between its two linears (shadowed by pass-throughs on the instance)."""

    def activation(fc1_output, fc1_bias, per_token_scale):
        fed: list[torch.Tensor] = []

        def fc1(_hidden_states):
            return fc1_output, fc1_bias

        def fc2(intermediate):
            fed.append(intermediate)
            return intermediate, None

        shadow = instance.__dict__  # found before nn.Module.__getattr__ looks in _modules
        saved_config = instance.config
        shadow["linear_fc1"], shadow["linear_fc2"] = fc1, fc2
        instance.config = config
        try:
            output, _ = wrapped(fc1_output, per_token_scale=per_token_scale)
        finally:
            del shadow["linear_fc1"], shadow["linear_fc2"]
            instance.config = saved_config
        if len(fed) != 1 or output is not fed[0]:
            raise RuntimeError(
                "recompute-activation-function: megatron's MLP.forward no longer runs "
                "linear_fc1 -> activation -> linear_fc2 once each; switch the feature off"
            )
        return output

    return activation


def _bind_mlp(hidden_states, per_token_scale=None, **_):
    return hidden_states, per_token_scale


def _mlp_forward(wrapped, instance, args, kwargs):
    if instance is None or not _wants_recompute(instance):
        return wrapped(*args, **kwargs)
    hidden_states, per_token_scale = _bind_mlp(*args, **kwargs)
    reason = _unsupported(instance.config)
    if reason is None and per_token_scale is not None and getattr(instance.linear_fc2, "bias", None) is not None:
        reason = "per-token scale together with an fc2 bias"
    if reason is not None:
        _fall_back(reason)
        return wrapped(*args, **kwargs)

    fc1_output, fc1_bias = instance.linear_fc1(hidden_states)
    checkpoint = new_checkpoint()
    activation = _megatron_activation(wrapped, instance, instance.config)
    intermediate = checkpoint.checkpoint(activation, fc1_output, fc1_bias, per_token_scale)
    output, output_bias = instance.linear_fc2(intermediate)
    if intermediate.untyped_storage().data_ptr() == fc1_output.untyped_storage().data_ptr():
        # the activation returned (a view of) its input: freeing it would free fc1's output,
        # which the recompute needs. Nothing to save; still recompute so backward can run.
        _fall_back("the activation output shares storage with fc1's output")
        output.register_hook(checkpoint._recompute)
    else:
        checkpoint.discard_output_and_register_recompute(output)
    return output, output_bias


def _grouped_mlp_forward(wrapped, instance, args, kwargs):
    if instance is None or instance.activation_recompute or not _wants_recompute(instance):
        return wrapped(*args, **kwargs)  # megatron's moe_act already recomputes: no double
    reason = _unsupported(instance.config)
    if reason is None and saved_tensor_hooks_active() and checkpoint_class() is not _megatron_checkpoint_class():
        reason = "saved-tensor hooks are active and this megatron-core's moe_act recompute loses gradients under them"
    if reason is not None:
        _fall_back(reason)
        return wrapped(*args, **kwargs)
    instance.activation_recompute = True
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.activation_recompute = False


def _layer_number_of(config, submodules, layer_number=1, *args, **kwargs) -> int:
    return layer_number


def _layer_init(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import GroupedMLP

    number = _layer_number_of(*args, **kwargs)
    mlp = getattr(instance, "mlp", None)
    if isinstance(mlp, torch.nn.Module):
        for module in mlp.modules():
            if isinstance(module, (MLP, GroupedMLP)):
                setattr(module, STAGE_LAYER_ATTR, number)


PATCHES = [
    Patch(
        MLP_FORWARD,
        Kind.WRAP,
        _mlp_forward,
        why="dense MLP, SequentialMLP experts and shared experts: activation inline in forward",
    ),
    Patch(
        GROUPED_MLP_FORWARD,
        Kind.WRAP,
        _grouped_mlp_forward,
        why="grouped experts: switch on megatron's own moe_act recompute for the call",
    ),
    Patch(
        LAYER_INIT,
        Kind.WRAP,
        _layer_init,
        why="records each MLP's layer number within its pipeline stage (num-layers selection)",
    ),
]


def _enabled(feature: Feature, config: Config) -> bool:
    on = bool(config["recompute_activation_function"])
    if config["recompute_activation_function_num_layers"] is not None and not on:
        raise ConfigError(
            "--recompute-activation-function-num-layers is set but --recompute-activation-function is not; "
            "pass both (or drop the layer count)"
        )
    return on


def _validate(config: Config) -> None:
    limit = config["recompute_activation_function_num_layers"]
    if limit is not None and limit < 0:
        raise ConfigError(
            f"--recompute-activation-function-num-layers must be >= 0 (layers per pipeline stage), got {limit}"
        )


FEATURE = Feature(
    name="recompute-activation-function",
    summary="free the MLP activation output after fc2 and recompute it in backward (dense and MoE experts)",
    patches=PATCHES,
    flags=(
        Flag(
            "recompute_activation_function",
            bool,
            False,
            "do not keep the MLP activation output for fc2's backward: free it and recompute it "
            "from fc1's output when fc2's backward needs it (dense MLPs, SequentialMLP and GroupedMLP experts)",
        ),
        Flag(
            "recompute_activation_function_num_layers",
            int,
            None,
            "recompute the activation only in the first N layers of each pipeline stage (default: all layers)",
        ),
    ),
    requires=("fix-checkpoint-without-output-fp8",),
    enabled=_enabled,
    validate=_validate,
    backend=lambda config: "any",
)
