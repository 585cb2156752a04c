"""The small megatron-core runs the product makes: ``mindspeed-like demo``, ``compare`` and ``plan``'s
checks build and train these, and tests use the same ones.

    from mindspeed_like.workloads import init_parallel, tiny_gpt, train_steps, run_distributed

models.py (tiny GPT configs and models), parallel.py (process groups and seeds), training.py (a
few deterministic steps through megatron's DDP and optimizer), distributed.py (the gloo process
launcher), memory.py (exact byte meters), moe.py and checkpoint_keys.py (weights moved between
specs), megatron_lm.py (Megatron-LM's own ``pretrain_gpt.py`` under torchrun).

Nothing here imports ``mindspeed_like.testing``: that package (test-only helpers) sits above the
product and re-exports these names for tests written against it. Megatron is imported inside the helpers,
so importing this package does not import it. On a CPU host the helpers need the cpu-adapter
feature applied (``mindspeed_like.configure()`` or ``import mindspeed_like.megatron_adaptor``)
before a model is built.
"""

from mindspeed_like.workloads.distributed import run_distributed
from mindspeed_like.workloads.memory import SavedBytesMeter, param_bytes
from mindspeed_like.workloads.models import gpt_config, tiny_gpt
from mindspeed_like.workloads.parallel import destroy_parallel, init_parallel
from mindspeed_like.workloads.training import make_batches, train_steps

__all__ = [
    "init_parallel",
    "destroy_parallel",
    "tiny_gpt",
    "gpt_config",
    "run_distributed",
    "SavedBytesMeter",
    "param_bytes",
    "train_steps",
    "make_batches",
]
