"""``transformer_engine.common`` as served to clients: only its ``recipe`` submodule (fp8 recipes,
refused when constructed)."""

__all__: list[str] = []
