"""``transformer_engine`` as served to clients where no TransformerEngine is installed: the
framework package (``transformer_engine.pytorch`` is imported with it, as TE's own ``__init__``
does). ``__version__`` is the TE layer API the te-backend implements."""

from __future__ import annotations

from mindspeed_like.te_backend.versions import TE_LAYERS_API

__version__ = str(TE_LAYERS_API)

__all__ = ["__version__"]
