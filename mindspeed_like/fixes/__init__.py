"""Upstream megatron bugs, each a small always-on feature where it applies (one module each)."""
