"""What a feature declares, read the way the runtime reads it (for version and target tests)."""

from __future__ import annotations

from typing import Any

from mindspeed_like.engine import Patch


def declared_patches(feature: str, *, installed_only: bool = True, **flags: Any) -> list[Patch]:
    """``feature``'s patches for ``flags`` (on top of the current sources), as ``configure()``
    would build them; ``installed_only``: only those whose declared versions include the
    installed megatron-core (what the engine applies)."""
    from mindspeed_like import registry, runtime

    ctx = runtime.context_for(runtime.resolve_config(code=flags, argv=[]))
    patches = registry.feature_by_name(feature).patches_for(ctx)
    return runtime.ENGINE.applicable(patches) if installed_only else patches
