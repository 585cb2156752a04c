"""The cpu-training-loop feature: Megatron-LM's own training loop (megatron.training,
``pretrain_gpt.py``) on a CPU-only host.

megatron.training exists in Megatron-LM checkouts (and in the megatron-core wheel from 0.17);
every target is optional and waits for its module's import; one missing from an imported module
is a logged fallback (an error under --strict). With the cpu-adapter (megatron.core)
these patches let ``pretrain_gpt.py`` train unmodified. ``patches.py`` holds the targets and why
each is the right one; ``arguments.py`` the portable defaults set before Megatron-LM validates
its arguments; ``host_training.py`` the host view of torch those modules see. The research
behind each (what breaks, where, why) is summarized in docs/megatron-lm.md.
"""

from __future__ import annotations

from mindspeed_like.adapters.cpu_training.arguments import portable_defaults
from mindspeed_like.adapters.cpu_training.patches import patches
from mindspeed_like.toolkit.declaration import Feature, on_device

FEATURE = Feature(
    name="cpu-training-loop",
    summary="Megatron-LM's megatron.training loop (pretrain_gpt.py) runs on a CPU-only host",
    patches=patches,
    requires=("cpu-adapter",),
    enabled=on_device("cpu"),
    backend="cpu",
    switched_by="--device cpu (auto: no NPU, no CUDA)",
    validate_args_hook=portable_defaults,
    kind="adapter",
)
