"""The one import works before or after megatron.core and reports the same patches.

Each case runs in a fresh interpreter: import order is about what a process has imported
so far, which a test sharing pytest's process cannot control.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPORT = (
    "import json, mindspeed_like; "
    "print(json.dumps([[r.feature, r.target, r.kind, r.status, sorted(r.aliases)] for r in mindspeed_like.report()]))"
)


def _run(code: str, **env: str) -> list:
    environment = {k: v for k, v in os.environ.items() if k != "MINDSPEED_LIKE_ARGS"}
    environment.update(PYTHONWARNINGS="ignore", **env)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=environment, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def both_orders():
    after = _run("import megatron.core; import mindspeed_like.megatron_adaptor; " + REPORT)
    before = _run("import mindspeed_like.megatron_adaptor; import megatron.core; " + REPORT)
    return before, after


def test_both_import_orders_report_the_same_patches(both_orders):
    before, after = both_orders
    assert before == after
    assert any(status == "applied" for _, _, _, status, _ in after)


@pytest.mark.slow
def test_importing_twice_is_harmless():
    report = _run(
        "import importlib, megatron.core, mindspeed_like.megatron_adaptor as a, mindspeed_like.runtime as r; "
        "first = [(x.target, x.status) for x in r.report()]; r.apply(); importlib.import_module("
        "'mindspeed_like.megatron_adaptor'); assert first == [(x.target, x.status) for x in r.report()]; " + REPORT
    )
    # Two features may stack on one target; one feature must never hold a target twice.
    patches = [(feature, target) for feature, target, _, _, _ in report]
    assert len(patches) == len(set(patches))


def test_bad_env_flag_fails_the_import_with_a_suggestion():
    environment = {**os.environ, "MINDSPEED_LIKE_ARGS": "--devcie cpu"}
    result = subprocess.run(
        [sys.executable, "-c", "import mindspeed_like.megatron_adaptor"],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
        check=False,
    )
    assert result.returncode != 0
    assert "unknown flag '--devcie'" in result.stderr and "Did you mean '--device'" in result.stderr
