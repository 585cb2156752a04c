"""megatron's classes that exist only with TE: defined under ``if HAVE_TE:`` on TE's wrapper classes.

``megatron.core.transformer.heterogeneous.linear_replacements`` defines
``TELayerNormColumnParallelLinearGathered(TELayerNormColumnParallelLinear)`` only when TE imported;
without it the class is absent and ``heterogeneous_layer_specs`` binds None, so a heterogeneous
GPT on the TE spec failed in ``build_module`` ("cannot unpack non-iterable NoneType object").
Here each such class is built from megatron's own class body, read from the installed source
(``megatron_names.te_guarded_class_node``), with the TE names it uses bound to the te-backend's
classes, in a copy of its module's globals (its helpers, e.g. ``_gather_from_tensor_parallel_region``).
Attribute ``"<module>:<Class>"`` of this module is that class (built once), for ``Deferred``.
"""

from __future__ import annotations

import ast
import functools
import importlib

from mindspeed_like.te_backend import classes, megatron_names


@functools.cache
def build(module: str, name: str) -> type:
    """megatron's ``module.name`` (a class it defines under ``if HAVE_TE:``) on the te-backend's classes."""
    megatron_module = importlib.import_module(module)
    node = megatron_names.te_guarded_class_node(module, name)
    namespace = dict(vars(megatron_module))
    namespace.update({ours: getattr(classes, ours) for ours in classes.__all__})
    code = compile(ast.Module(body=[node], type_ignores=[]), megatron_module.__file__, "exec")
    exec(code, namespace)  # noqa: S102 - megatron's own class body, from the installed file
    built = namespace[name]
    built.__module__ = module
    return built


def __getattr__(attr: str) -> type:
    module, sep, name = attr.partition(":")
    if not sep:
        raise AttributeError(attr)
    return build(module, name)
