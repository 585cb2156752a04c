"""What every feature, adapter, fix and integration is built with: the declaration types, the
fallback helper, argument binding by signature, scoped config views and megatron's target paths.

Imports only the engine: never the runtime, never megatron.
"""
