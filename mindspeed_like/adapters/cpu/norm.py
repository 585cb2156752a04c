"""CPU adapter, norms: torch's LayerNorm/RMSNorm under sequence parallelism.

Target: ``megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__`` (0.13-0.16), the
factory behind the local spec's ``LNImpl`` (and the final norm's ``LayerNormImpl``). Without
TransformerEngine/apex it is the only norm, and it asserts ``not config.sequence_parallel``.
The torch norm itself is fine under SP (it is elementwise over the hidden dim); what SP really
requires is that the norm's parameters carry ``sequence_parallel = True``, so that megatron's
DDP/finalize step all-reduces their gradients over the tensor-parallel group (each rank saw only
its sequence shard). The wrapper builds the norm with SP hidden from the assertion (a shallow
copy of the config) and marks its parameters. Patching ``__new__`` on the class reaches every
alias of the class.
"""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.overrides import with_fields
from mindspeed_like.toolkit.targets import TORCH_NORM


def _new_with_sequence_parallel(wrapped, instance, args, kwargs):
    call = Call(wrapped, args, kwargs)
    config = call["config"]
    if not getattr(config, "sequence_parallel", False):
        return wrapped(*args, **kwargs)
    norm = call(config=with_fields(config, sequence_parallel=False))
    for param in norm.parameters():
        param.sequence_parallel = True
    return norm


PATCHES = [
    Patch(
        f"{TORCH_NORM}.WrappedTorchNorm.__new__",
        Kind.WRAP,
        _new_with_sequence_parallel,
        why="torch norms work under sequence parallel once their weights are marked sequence_parallel",
    ),
]
