"""Fix: MoE experts with biases (``add_bias_linear=True``, megatron's default) die without expert
parallelism, at every TP (megatron-core 0.15 and later).

megatron-core 0.15 enabled biases on expert MLPs (commit a329dd6, "Enable bias in expert mlp"):
``MLP.forward``, given the router's ``per_token_scale``, adds the fc2 bias scaled per token IN
PLACE, ``output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)``. ``output`` is what
the expert's ``RowParallelLinear`` returned. An expert linear leaves the communication to the
token dispatcher (``explicit_expert_comm``: ``output_ = output_parallel``, the matmul's fresh
result) only when ``is_expert and (world_size > 1 or expert_parallel)``, ``world_size`` being the
expert-TP size, which megatron requires to be 1 with expert biases ("Bias in Moe is only supported
when ETP==1"). So without expert parallelism the rule is False, at TP=1 and TP>1 alike, and the
linear runs ``reduce_from_tensor_model_parallel_region`` (under sequence parallelism
``reduce_scatter_to_sequence_parallel_region``) over its expert-TP group of one. Those are custom
autograd Functions whose forward returns its input as-is at size 1, and autograd hands such an
output out as a view created in a custom Function, which may not be modified in place:
``RuntimeError: Output 0 of _ReduceFromModelParallelRegion is a view and is being modified
inplace``. At EP>1 the flag is True, the output is fresh, and the same line works.

Measured on 0.16.1 and 0.19.2 with ``SequentialMLP`` experts (megatron's own path, no feature of
ours on) at TP=1 and at TP=2 with SP (megatron trains MoE at TP>1 only with SP); ``TEGroupedMLP``
adds its biases out of place (``_apply_bias``) and trains. 0.13/0.14 refuse biases on MoE layers
("Bias is not supported for MoE" in ``TransformerConfig``); every release from 0.15.0 to 0.19.x,
and upstream main as of August 2026, has the in-place add and the rule.

The fix: such an expert row-parallel linear is built with ``explicit_expert_comm = True``, the path
megatron itself takes for every expert linear at EP>1 with expert-TP 1 (the same group of one) and
sets by hand on its shared experts' legacy linears (``shared_experts.py``,
``moe_shared_expert_overlap``). Over a group of one both branches are identities forward and
backward (the reduce Function returns its input and passes the gradient through), so the numbers
are bitwise megatron's intended ``output + bias * scale``: only the view, and with it the error,
is gone. Nothing is copied (a ``clone()`` of the output, PyTorch's suggestion, would cost a copy
of every expert's output).

Why ``RowParallelLinear.__init__`` is the target: it is where megatron decides the flag, and the
flag is read in one place only, ``RowParallelLinear.forward``'s choice of reduction (checked in
0.15-0.19 and main). Every expert fc2 goes through it: megatron's local spec builds
``RowParallelLinear`` and the te-backend's ``TERowParallelLinear`` calls
``RowParallelLinear.__init__``. Patching ``MLP.forward`` would mean restating megatron's body
(and it is wrapped by fused-swiglu and recompute-activation-function); patching the reduce
Functions would touch every TP=1 linear of the model. The flag is changed only where the bug can
happen: an expert linear (``is_expert``) whose bias megatron returns for ``MLP.forward`` to add
(``skip_bias_add`` with a bias) and which would reduce over its group of one.

Stacking: above the cpu-adapter's host twin of the constructor (the flag is set on the built
module).
"""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import TP_LAYERS

ROW_PARALLEL_LINEAR = f"{TP_LAYERS}.RowParallelLinear"
VERSIONS = ">=0.15"  # expert biases since 0.15.0 (a329dd6); upstream main (Aug 2026) still has the in-place add


def returns_view_to_add_bias_into(linear) -> bool:
    """True when megatron's ``RowParallelLinear.forward`` would hand ``MLP.forward`` the output of a
    reduction over a group of one (a view it may not add the bias into) together with the bias."""
    return (
        bool(getattr(linear, "is_expert", False))
        and getattr(linear, "explicit_expert_comm", True) is False
        and bool(getattr(linear, "skip_bias_add", False))
        and getattr(linear, "bias", None) is not None
    )


def _construct_expert_linear(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if returns_view_to_add_bias_into(instance):
        # megatron's flag is False only at expert-TP size 1 without EP: its reduction is then an identity
        instance.explicit_expert_comm = True
    return result


PATCHES = [
    Patch(
        f"{ROW_PARALLEL_LINEAR}.__init__",
        Kind.WRAP,
        _construct_expert_linear,
        versions=VERSIONS,
        after=("cpu-adapter",),
        why="an expert fc2 at TP=1 without EP returns a view (reduce over a group of one); "
        "MLP.forward adds its bias into it in place",
    )
]

FEATURE = Feature(
    name="fix-moe-expert-bias-inplace",
    summary="MoE experts with biases train at TP=1 without EP: the expert fc2 output is no longer a view "
    "that MLP.forward adds the bias into in place",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
