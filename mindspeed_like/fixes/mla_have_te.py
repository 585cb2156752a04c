"""Fix: multi-latent attention believes TransformerEngine is installed when it is not.

``megatron.core.transformer.multi_latent_attention`` (0.14-0.16) sets its module flag ``HAVE_TE``
to True when ``from megatron.core.extensions.transformer_engine import TELinear, ...`` succeeds.
That import succeeds WITHOUT TransformerEngine: the extension module replaces the missing package
with a ``MagicMock`` and its classes (``class TELinear(te.pytorch.Linear)``) become mock objects.
``MultiLatentAttention.__init__`` then evaluates ``HAVE_TE and isinstance(self.linear_proj,
TELinear)``; in 0.16 the ``isinstance`` comes first in that condition and raises ``TypeError:
isinstance() arg 2 must be a type`` for every MLA layer built without TE (0.14/0.15 test
``config.fp8`` first, so only FP8 runs reach it). megatron-core 0.17 imports the extension's own
``HAVE_TE`` instead, which is the fix applied here.

Target: the module global ``multi_latent_attention.HAVE_TE`` (REPLACE, module-local: no alias
swap), set to ``megatron.core.extensions.transformer_engine.HAVE_TE`` read when the patch is
installed: False without TransformerEngine, and unchanged (True) where it is installed.
"""

from __future__ import annotations

from mindspeed_like.engine import Deferred, Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import CORE

PATCHES = [
    Patch(
        f"{CORE}.transformer.multi_latent_attention.HAVE_TE",
        Kind.REPLACE,
        Deferred(f"{CORE}.extensions.transformer_engine", "HAVE_TE"),
        update_aliases=False,
        versions=">=0.14,<0.17",
        why="True without TransformerEngine (its mock classes imported): isinstance(x, TELinear) raises",
    )
]

FEATURE = Feature(
    name="fix-mla-have-te",
    summary="multi-latent attention's HAVE_TE is the TransformerEngine extension's own (upstream 0.14-0.16 bug)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
