"""Helpers for patch-level regression tests of megatron-core (CPU, gloo): the npu emulator, parity
(seeds, tolerances, float64 and loss-curve comparisons, the backend fixture), the Megatron-LM
unit-test plugin, fake_cuda, the ISA lane, simulated links.

    from mindspeed_like.testing import init_parallel, tiny_gpt, train_steps, run_distributed

The tiny models, the training loop, parallel init, the process launcher, the byte meters and
the Megatron-LM launch helpers are product code now (the demo, compare and plan run them):
they live in :mod:`mindspeed_like.workloads`. Their names are re-exported here, and
``mindspeed_like.testing.<module>`` for each moved module is that same module object, so tests
written against this package keep working. This package may import the product; the product
never imports it (tests/engine/test_import_cycles.py). Megatron is imported inside the helpers,
so importing this package does not import it.
"""

from mindspeed_like import workloads
from mindspeed_like.workloads import *  # noqa: F403 (the names tests import from here)

__all__ = list(workloads.__all__)
