"""Device-level ops with autograd. Never imports megatron."""
