"""Every feature's patch targets exist in the INSTALLED megatron-core (fast, no model built).

Features declare ``megatron_versions=">=0.13"``; the suite is run under each supported version
(0.13.1, 0.14.0, 0.15.3, 0.16.1), and this file is what catches a target missing or moved in
one of them before any model test trips over it. A non-optional megatron target must resolve
(module imported, dotted attribute path walked, the final attribute found without triggering
descriptors); an optional one may be absent (the engine then reports it "skipped").
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import pytest
from packaging.specifiers import SpecifierSet

from mindspeed_like import registry
from mindspeed_like.engine import Kind, split_target
from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.testing.declarations import declared_patches

VERSION = megatron_core_version()


def _patch_list(feature):
    """The feature's declared patches for the installed version (read from its declaration)."""
    return declared_patches(feature.name)


def _resolve(target: str):
    module_name, attrs = split_target(target)
    owner = importlib.import_module(module_name)
    for name in attrs[:-1]:
        owner = getattr(owner, name)
    return inspect.getattr_static(owner, attrs[-1])


def _supported(feature) -> bool:
    return feature.megatron_versions is None or VERSION in SpecifierSet(feature.megatron_versions, prereleases=True)


def _megatron_patches(optional: bool):
    return [
        pytest.param(patch, id=f"{feature.name}:{patch.target}")
        for feature in registry.all_features()
        if _supported(feature)
        for patch in _patch_list(feature)
        if patch.target.startswith("megatron.core.") and patch.optional is optional
    ]


def test_installed_version_is_supported():
    assert VERSION is not None, "megatron-core is not installed"
    unsupported = [f.name for f in registry.all_features() if not _supported(f)]
    assert not unsupported, f"megatron-core {VERSION} is outside the declared range of {unsupported}"


def _bound_in_source(target: str) -> bool:
    """A PROVIDE target is a module-level name megatron binds only in some branch (``if HAVE_TE:``,
    ``try: import transformer_engine``): it exists when the module's source binds it anywhere."""
    from mindspeed_like.te_backend.megatron_names import bound_in

    module_name, attrs = split_target(target)
    spec = importlib.util.find_spec(module_name)
    return spec is not None and spec.origin is not None and attrs[-1] in bound_in(spec.origin)


@pytest.mark.parametrize("patch", _megatron_patches(optional=False))
def test_required_target_exists(patch):
    if patch.kind is Kind.PROVIDE:
        assert _bound_in_source(patch.target), f"{patch.target} is bound nowhere in megatron-core {VERSION}'s source"
        return
    try:
        found = _resolve(patch.target)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{patch.target} is missing in megatron-core {VERSION}: {exc}")
    if patch.kind is Kind.WRAP:
        func = getattr(found, "__func__", found)  # staticmethod / classmethod
        assert callable(func), f"{patch.target} is not callable in megatron-core {VERSION}"


def test_optional_targets_absent_only_where_expected():
    """Optional targets may be absent; the list below records which are absent in which version
    (so a target that disappears from a version where it existed is noticed). A target that some
    releases lack declares the releases that have it (``versions``, e.g. the cpu-adapter's
    ``get_sliding_window_causal_mask``, 0.15+) and is checked by ``test_required_target_exists``
    there; none of the optional ones is absent from a tested release today."""
    absent = set()
    for param in _megatron_patches(optional=True):
        (patch,) = param.values
        try:
            _resolve(patch.target)
        except (ImportError, AttributeError):
            absent.add(patch.target)
    expected: set[str] = set()
    assert absent == expected
