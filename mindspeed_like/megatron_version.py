"""The version of the megatron-core that `import megatron.core` would load, without importing it.

Read from megatron/core/package_info.py on the import path rather than from pip metadata:
a Megatron-LM checkout on sys.path shadows the installed wheel and carries its own version.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os
import re
import sys

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# The releases the whole suite passed on. SUPPORTED is the bound pyproject.toml declares on
# megatron-core (a test keeps the two equal): we patch megatron-core, so we never let pip pick
# a release we have not run. Raise both as a release passes the suite.
TESTED_VERSIONS = ("0.13.1", "0.14.0", "0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2")
TESTED_VERSION = Version(TESTED_VERSIONS[-1])
SUPPORTED = SpecifierSet(">=0.13,<0.20")


def _package_info_path() -> str | None:
    module = sys.modules.get("megatron.core")
    if module is not None and getattr(module, "__path__", None):
        locations = list(module.__path__)
    else:
        top = importlib.machinery.PathFinder.find_spec("megatron")
        if top is None or not top.submodule_search_locations:
            return None
        core = importlib.machinery.PathFinder.find_spec("megatron.core", list(top.submodule_search_locations))
        if core is None or not core.submodule_search_locations:
            return None
        locations = list(core.submodule_search_locations)
    for location in locations:
        path = os.path.join(location, "package_info.py")
        if os.path.exists(path):
            return path
    return None


def core_file(relative: str, core_dir: str | None = None) -> str | None:
    """The path of ``megatron/core/<relative>`` (``/``-separated) below ``core_dir`` (a megatron-core package
    directory, e.g. an unpacked wheel's), by default the one ``import megatron.core`` would load, found
    without importing megatron; None where megatron-core is not found."""
    if core_dir is None:
        info = _package_info_path()
        if info is None:
            return None
        core_dir = os.path.dirname(info)
    return os.path.join(core_dir, *relative.split("/"))


def package_info_version(path: str) -> Version | None:
    """The MAJOR.MINOR.PATCH a megatron/core/package_info.py file declares (read, not imported); None where
    the file is missing or does not declare the three."""
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    parts = {k: re.search(rf"^{k}\s*=\s*['\"]?([^'\"\n]*)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")}
    if not all(parts.values()):
        return None
    return Version(".".join(parts[k].group(1).strip() for k in ("MAJOR", "MINOR", "PATCH")))


def megatron_core_version() -> Version | None:
    """None when megatron-core cannot be found at all."""
    path = _package_info_path()
    found = package_info_version(path) if path is not None else None
    if found is not None:
        return found
    try:
        return Version(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError:
        return None


def release_in(specifier: str, version: Version | None) -> bool:
    """Whether megatron-core ``version`` is one of the releases ``specifier`` names (e.g. ``">=0.17,<0.18"``).

    The one spelling of this check. A pre-release counts as its release (a ``0.17.0rc1`` from an rc wheel's
    pip metadata is 0.17 code), where PEP 440 orders it before ``0.17``. ``version`` None (megatron-core not
    found) is in no range; callers decide what that means for them."""
    return version is not None and Version(version.base_version) in SpecifierSet(specifier)


def support_summary(version: Version | None = None) -> str:
    """One line for users: what is installed, what was tested, what the package allows."""
    version = megatron_core_version() if version is None else version
    installed = "not installed" if version is None else str(version)
    verdict = ""
    if version is not None and version not in SUPPORTED:
        verdict = " -- NOT SUPPORTED: install a supported release"
    return f"megatron-core {installed}; tested: {', '.join(TESTED_VERSIONS)}; supported: {SUPPORTED}{verdict}"


def version_of(target: str) -> tuple[str, Version | None]:
    """For the patch engine: the package and version a target belongs to. ``megatron.*`` targets
    (megatron.core, and megatron.training of a checkout or the wheel) are megatron-core's."""
    if target == "megatron" or target.startswith("megatron."):
        return "megatron-core", megatron_core_version()
    from mindspeed_like.engine import distribution_version

    return distribution_version(target)
