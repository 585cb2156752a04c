"""The one import: ``import mindspeed_like.megatron_adaptor``.

Reads the flags (defaults < MINDSPEED_LIKE_ARGS < command line < configure()) and applies
the enabled features. Megatron need not be imported yet: patches of modules not yet
imported are applied when they are. Importing this module again does nothing more.

A bad flag fails the import with a ``ConfigError``; if nothing catches it, the process prints
its message, not a traceback (``MINDSPEED_LIKE_TRACEBACK=1`` prints the traceback too; see
``mindspeed_like/toolkit/uncaught.py``).

``repatch(args)``: MindSpeed's client API under its name and place, for clients that build
megatron's arguments in code (ms-swift, verl): re-applies the features those arguments switch on
(``mindspeed_like/repatching.py``; docs/clients.md "MindSpeed's client API").
"""

from mindspeed_like import runtime
from mindspeed_like.repatching import Repatched, repatch
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.uncaught import message_only

try:
    config = runtime.apply()
except ConfigError as error:
    raise message_only(error) from None

__all__ = ["Repatched", "config", "repatch"]
