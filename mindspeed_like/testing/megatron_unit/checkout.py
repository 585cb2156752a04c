"""The Megatron-LM checkout whose tests/unit_tests run: located, checked, put on the path.

Megatron-LM's unit tests import ``megatron.training`` (and ``tests.*`` of the checkout), which the
megatron-core wheel does not ship. Rather than running from the checkout (its own ``megatron/core``
would then shadow the installed one, so the tests would not test the megatron-core our patches
target), the installed ``megatron.core`` is imported first and the checkout's root is appended to
``sys.path``: ``megatron`` is a namespace package in the wheel, so the checkout's
``megatron/{training,legacy,post_training,rl}`` merge into it while ``megatron.core`` stays the
installed one. A checkout of another release is refused (its tests assert another release's
behaviour, so every difference would read as our failure), as is one without ``megatron.training``
or an environment without the tests' own dependencies: each refusal names what to do.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from mindspeed_like.megatron_version import megatron_core_version

# import name -> pip name: what tests/unit_tests import beyond megatron-core's own requirements
TEST_DEPENDENCIES = {
    "click": "click",
    "requests": "requests",
    "pytest_mock": "pytest-mock",
    "mock": "mock",
    "six": "six",
    "regex": "regex",
    "yaml": "pyyaml",
    "pydantic": "pydantic",
}
ENV = "MEGATRON_LM_PATH"


class CheckoutError(RuntimeError):
    """The checkout or the environment cannot run Megatron-LM's unit tests; the message says why."""


@dataclass(frozen=True)
class Checkout:
    root: Path
    version: str  # megatron/core/package_info.py of the checkout

    @property
    def unit_tests(self) -> Path:
        return self.root / "tests" / "unit_tests"

    @property
    def tag(self) -> str:
        return f"core_v{self.version}"


def find_root(args: list[str], env: dict[str, str] | None = None) -> Path | None:
    """``$MEGATRON_LM_PATH``, else the checkout above the first argument under ``tests/unit_tests``."""
    env = os.environ if env is None else env
    if env.get(ENV):
        return Path(env[ENV]).resolve()
    for arg in args:
        path = Path(arg.split("::")[0]).resolve()
        for parent in [path, *path.parents]:
            if (parent / "tests" / "unit_tests" / "conftest.py").is_file() and (parent / "megatron").is_dir():
                return parent
    return None


def checkout_version(root: Path) -> str:
    """The release a checkout is of, read from its megatron/core/package_info.py (no git needed)."""
    text = (root / "megatron" / "core" / "package_info.py").read_text()
    parts = {k: re.search(rf"^{k}\s*=\s*['\"]?([\w.]*)['\"]?", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")}
    if not all(parts.values()):
        raise CheckoutError(f"{root}: cannot read the release from megatron/core/package_info.py")
    pre = re.search(r"^PRE_RELEASE\s*=\s*['\"]([^'\"]*)['\"]", text, re.M)
    return ".".join(m.group(1) for m in parts.values()) + (pre.group(1) if pre else "")  # type: ignore[union-attr]


def installed_version() -> str | None:
    version = megatron_core_version()
    return str(version) if version is not None else None


def missing_dependencies() -> list[str]:
    """pip names of the tests' own dependencies that do not import here."""
    return [pip for module, pip in TEST_DEPENDENCIES.items() if importlib.util.find_spec(module) is None]


def check(root: Path | None) -> Checkout:
    """The checkout, or a :class:`CheckoutError` naming what is wrong and what to install or pass."""
    if root is None:
        raise CheckoutError(
            f"no Megatron-LM checkout: set {ENV}=/path/to/Megatron-LM (tag core_v{installed_version()}) "
            "or pass its tests/unit_tests/<dir> as the test path"
        )
    if not (root / "tests" / "unit_tests" / "conftest.py").is_file():
        raise CheckoutError(f"{root} has no tests/unit_tests/conftest.py: not a Megatron-LM checkout")
    if not (root / "megatron" / "training" / "__init__.py").is_file():
        raise CheckoutError(
            f"{root} has no megatron/training: the unit tests import megatron.training, which only a full "
            "Megatron-LM checkout has (not the megatron-core wheel nor a megatron/core-only copy)"
        )
    version, installed = checkout_version(root), installed_version()
    if installed is not None and version != installed:
        raise CheckoutError(
            f"{root} is Megatron-LM {version} (core_v{version}) but megatron-core {installed} is installed: its tests "
            f"check another release's behaviour. Check out tag core_v{installed} "
            f"(git archive core_v{installed}) or install megatron-core=={version}"
        )
    missing = missing_dependencies()
    if missing:
        raise CheckoutError(
            f"Megatron-LM's unit tests import {', '.join(missing)}, not installed here: "
            f"{sys.executable} -m pip install {' '.join(missing)} (`make test-megatron-unit` installs them)"
        )
    return Checkout(root, version)


def put_on_path(checkout: Checkout) -> None:
    """The installed megatron.core first, then the checkout's root at the end of ``sys.path``.

    Order matters: importing ``megatron.core`` before the checkout is on the path fixes it to the
    installed package; the namespace ``megatron`` then also finds ``megatron.training`` and the rest
    in the checkout (its ``__path__`` follows ``sys.path``). ``tests.unit_tests`` resolves to the
    checkout's since nothing else on the path has a ``tests`` package with ``unit_tests``.
    """
    import megatron
    import megatron.core  # noqa: F401 - the installed one, before the checkout joins the path

    root = str(checkout.root)
    if root not in sys.path:
        sys.path.append(root)
    portion = str(checkout.root / "megatron")
    path = megatron.__path__
    if portion not in list(path) and not hasattr(path, "_recalculate"):  # a regular package: merge by hand
        path.append(portion)  # type: ignore[union-attr]
