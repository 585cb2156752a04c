"""Moved to :mod:`mindspeed_like.workloads.megatron_lm` (product code: the demo, compare and plan run it).

Importing this path gives that same module object (this file puts it in its own place in
``sys.modules``), so tests written against ``mindspeed_like.testing.megatron_lm`` keep working: its
names, private ones too, and monkeypatching through it.
"""

import sys

from mindspeed_like.workloads import megatron_lm

sys.modules[__name__] = megatron_lm
