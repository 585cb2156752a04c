"""Run in a fresh interpreter by test_client_module.py: one import order, then what megatron and
the probing libraries see, as JSON on the last line of stdout."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import json
import sys
import types

GPT_SPECS = "megatron.core.models.gpt.gpt_layer_specs"


def _ours(value: object) -> bool:
    spec = getattr(value, "__spec__", None)
    return isinstance(value, types.ModuleType) and type(getattr(spec, "loader", None)).__name__ == "ClientModuleFinder"


def _module(spec: object) -> type:
    """A spec's module: a ModuleSpec's ``module``, or (megatron-core 0.19) a ``functools.partial``'s class."""
    return spec.func if isinstance(spec, functools.partial) else spec.module


def _submodules(spec: object) -> object:
    return spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules


def megatron_view() -> dict:
    """Every megatron-core module's HAVE_TE* flags that are True, and every global holding our module."""
    from mindspeed_like.te_shim import probers

    flags, holders = [], []
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.core") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if attr.startswith("HAVE_TE") and value is True:
                flags.append(f"{name}.{attr}")
            if _ours(value):
                holders.append(f"{name}.{attr}")
    probing = probers.megatron_probers()
    return {
        "probers": len(probing),
        "probers_imported": sum(name in sys.modules for name in probing),
        "have_te_true": flags,
        "holding_ours": holders,
    }


def main(order: str) -> dict:
    out: dict = {}
    if order == "megatron-first":
        importlib.import_module(GPT_SPECS)
    import mindspeed_like
    import mindspeed_like.megatron_adaptor  # noqa: F401

    mindspeed_like.configure(device="cpu")
    if order == "adaptor-megatron-client":
        importlib.import_module(GPT_SPECS)
    import transformer_engine.pytorch as te

    out["served"] = _ours(te)
    from transformer_engine.pytorch.fp8 import check_fp8_support  # megatron's tests and trainers probe it first

    out["fp8_supported"] = check_fp8_support()[0]
    if order == "client-first":
        importlib.import_module(GPT_SPECS)
        import megatron.core.extensions.transformer_engine as extension

        out["extension_te_is_mock"] = type(extension.te).__name__ == "MagicMock"
    import megatron.core.utils as utils

    out["megatron_utils_te_version"] = str(utils.get_te_version())
    out.update(megatron_view())
    # the TE spec's experts: TEGroupedMLP whichever came first (the spec provider imported before the import line
    # took TE's grouped linears as None, and megatron built its legacy GroupedMLP instead)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    moe = get_gpt_layer_with_transformer_engine_spec(num_experts=4, moe_grouped_gemm=True)
    out["te_moe_experts"] = _module(_submodules(_submodules(moe).mlp).experts).__name__
    out["report"] = [
        (r.feature, r.target, r.status, r.global_change)
        for r in mindspeed_like.report()
        if r.feature == "te-client-module"
    ]
    out["find_spec"] = importlib.util.find_spec("transformer_engine") is not None
    try:
        importlib.metadata.version("transformer-engine")
        out["metadata"] = True
    except importlib.metadata.PackageNotFoundError:
        out["metadata"] = False
    try:
        from accelerate.utils import is_transformer_engine_available

        out["accelerate"] = is_transformer_engine_available()
    except ImportError:
        out["accelerate"] = None
    try:
        from transformers.utils import import_utils

        out["transformers"] = import_utils._is_package_available("transformer_engine")
    except ImportError:
        out["transformers"] = None

    mindspeed_like.reset()
    out["after_reset_modules"] = sorted(n for n in sys.modules if n.split(".")[0] == "transformer_engine")
    out["after_reset_finders"] = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "ClientModuleFinder"]
    try:
        importlib.import_module("transformer_engine")
        out["after_reset_importable"] = True
    except ImportError:
        out["after_reset_importable"] = False
    mindspeed_like.configure(device="cpu")  # on again: served again
    out["reapplied_served"] = _ours(importlib.import_module("transformer_engine"))
    return out


def fake_te(order: str) -> dict:
    """A real TransformerEngine stand-in is on sys.path (PYTHONPATH): never shadowed."""
    import mindspeed_like
    import mindspeed_like.megatron_adaptor  # noqa: F401

    mindspeed_like.configure(device="cpu")
    import transformer_engine

    return {
        "module_file": transformer_engine.__file__,
        "finders": [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "ClientModuleFinder"],
        "report": [r.target for r in mindspeed_like.report() if r.feature == "te-client-module"],
    }


if __name__ == "__main__":
    which = sys.argv[1]
    result = fake_te(which) if which == "fake-te" else main(which)
    print(json.dumps(result))
