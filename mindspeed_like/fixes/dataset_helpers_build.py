"""Fix: megatron's dataset helpers are compiled for the wrong Python inside a virtualenv.

``megatron.core.datasets.utils.compile_helpers`` runs ``make`` in megatron/core/datasets, whose
Makefile asks ``python3 -m pybind11 --includes`` and ``python3-config --extension-suffix``,
i.e. whatever ``python3`` / ``python3-config`` come first on PATH. A virtualenv has no
``python3-config``, so another interpreter's answers are used: measured here, a
``helpers_cpp.cpython-312-*.so`` built for a Python 3.11 run, which then fails to import
(``MockGPTDataset failed to build``). The wheel ships a prebuilt module, but a Megatron-LM
checkout on sys.path shadows the wheel and has only the source.

The replacement runs the same ``make`` with the two Makefile variables given for the running
interpreter (``LIBEXT`` from sysconfig, ``CPPFLAGS`` from this interpreter's pybind11), so make
rebuilds only what is missing for it. ``compile_helpers`` is the target because callers import
it at call time (``from megatron.core.datasets.utils import compile_helpers`` inside
``_compile_dependencies``), so the module attribute is what they get.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import sysconfig

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import DATASETS_UTILS as UTILS

logger = logging.getLogger("mindspeed_like")


def make_command(directory: str) -> list[str]:
    """``make`` in megatron's datasets folder, building for this interpreter."""
    try:
        import pybind11
    except ImportError as error:
        raise RuntimeError(
            "compiling megatron's dataset helpers needs pybind11 for this Python: pip install pybind11"
        ) from error
    includes = f"-I{sysconfig.get_paths()['include']} -I{pybind11.get_include()}"
    return ["make", "-C", directory, f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}", f"CPPFLAGS={includes}"]


def compile_helpers() -> None:
    """Compile megatron's C++ dataset helpers for the running interpreter (single process).

    The megatron-core wheel ships the module prebuilt and no Makefile (megatron's own
    compile_helpers then fails with "No targets specified"); a prebuilt module for this
    interpreter is used as it is.
    """
    directory = os.path.dirname(os.path.abspath(sys.modules[UTILS].__file__))
    if not os.path.exists(os.path.join(directory, "Makefile")):
        prebuilt = os.path.join(directory, "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
        if os.path.exists(prebuilt):
            logger.info("megatron dataset helpers: using the prebuilt %s", prebuilt)
            return
        logger.error("no Makefile and no prebuilt helpers_cpp for this Python in %s", directory)
        sys.exit(1)
    if subprocess.run(make_command(directory)).returncode != 0:
        logger.error("Failed to compile the C++ dataset helper functions in %s", directory)
        sys.exit(1)


PATCHES = [
    Patch(
        f"{UTILS}.compile_helpers",
        Kind.REPLACE,
        compile_helpers,
        why="make builds helpers_cpp for the running Python (venvs have no python3-config)",
    )
]

FEATURE = Feature(
    name="fix-dataset-helpers-build",
    summary="megatron's dataset C++ helpers compile for the running Python, also inside a virtualenv",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
