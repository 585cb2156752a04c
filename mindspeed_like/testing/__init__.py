"""Public helpers for patch-level regression tests of megatron-core (CPU, gloo).

    from mindspeed_like.testing import init_parallel, tiny_gpt, train_steps, run_distributed

Megatron is imported inside the helpers, so importing this package does not import it.
On a CPU host the helpers need the cpu-adapter feature applied (``mindspeed_like.configure()``
or ``import mindspeed_like.megatron_adaptor``) before a model is built.
"""

from mindspeed_like.testing.distributed import run_distributed
from mindspeed_like.testing.memory import SavedBytesMeter, param_bytes
from mindspeed_like.testing.models import gpt_config, tiny_gpt
from mindspeed_like.testing.parallel import destroy_parallel, init_parallel
from mindspeed_like.testing.training import make_batches, train_steps

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
