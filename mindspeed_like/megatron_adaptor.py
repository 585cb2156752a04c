"""The one import: ``import mindspeed_like.megatron_adaptor``.

Reads the flags (defaults < MINDSPEED_LIKE_ARGS < command line < configure()) and applies
the enabled features. Megatron need not be imported yet: patches of modules not yet
imported are applied when they are. Importing this module again does nothing more.
"""

from mindspeed_like import runtime

config = runtime.apply()
