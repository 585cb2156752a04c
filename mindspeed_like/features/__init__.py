"""The accelerations users switch on: one package per feature.

Each package's ``__init__`` is its declaration (flags, relations, validation, the patch table
with versions and stacking order); the modules beside it hold the mechanism. Packages are found
by the registry (no list to edit); they import kernels and the toolkit, never the runtime.
"""
