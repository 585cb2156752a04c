"""Moved to :mod:`mindspeed_like.workloads.moe` (product code: the demo, compare and plan run it).

Importing this path gives that same module object (this file puts it in its own place in
``sys.modules``), so tests written against ``mindspeed_like.testing.moe`` keep working: its
names, private ones too, and monkeypatching through it.
"""

import sys

from mindspeed_like.workloads import moe

sys.modules[__name__] = moe
