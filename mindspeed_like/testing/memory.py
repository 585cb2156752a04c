"""Moved to :mod:`mindspeed_like.workloads.memory` (product code: the demo, compare and plan run it).

Importing this path gives that same module object (this file puts it in its own place in
``sys.modules``), so tests written against ``mindspeed_like.testing.memory`` keep working: its
names, private ones too, and monkeypatching through it.
"""

import sys

from mindspeed_like.workloads import memory

sys.modules[__name__] = memory
