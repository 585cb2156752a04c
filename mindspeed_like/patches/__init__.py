"""Megatron-facing patches, one module per feature. Megatron is imported lazily, inside the
replacement functions, so that importing these modules never imports megatron."""
