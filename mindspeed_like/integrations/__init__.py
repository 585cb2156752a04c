"""Where mindspeed_like meets Megatron-LM's own entry points (its argument parsing and validation)."""
