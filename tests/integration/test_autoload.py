"""MINDSPEED_LIKE_AUTOLOAD=1: the adaptor in every process that imports megatron, mcore_bridge or
transformer_engine, through torch's ``torch.backends`` entry point, with no import line in the
client (docs/clients.md "Every process a client starts"). Each case is a fresh interpreter: the
entry point acts at ``import torch``, once per process.

The entry point is registered by the project's install (pyproject ``[project.entry-points.
"torch.backends"]``); a checkout whose install predates it has none, and these tests say so."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from mindspeed_like.testing.parallel import free_port
from mindspeed_like_autoload import ENV, requested

SCRIPT = os.path.join(os.path.dirname(__file__), "autoload_script.py")
LEVEL_1 = "--optimization-level 1"


def _registered() -> bool:
    return any(
        e.value == "mindspeed_like_autoload:load" for e in importlib.metadata.entry_points(group="torch.backends")
    )


needs_entry_point = pytest.mark.skipif(
    not _registered(),
    reason="the torch.backends entry point is not installed: reinstall the project (pip install -e .)",
)


@pytest.mark.parametrize(("value", "asked"), [(None, False), ("", False), ("0", False), (" 1 ", True), ("1", True)])
def test_the_variable_asks_with_1_only(value, asked):
    environ = {} if value is None else {ENV: value}
    assert requested(environ) is asked


@pytest.mark.parametrize("value", ["true", "yes", "2", "on"])
def test_any_other_value_is_an_error_naming_it(value):
    with pytest.raises(ValueError, match=rf"MINDSPEED_LIKE_AUTOLOAD={value!r}: expected 1 .* or 0"):
        requested({ENV: value})


def _env(autoload: str | None, args: str | None = LEVEL_1) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MINDSPEED_LIKE_AUTOLOAD", "MINDSPEED_LIKE_ARGS")}
    env.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    if autoload is not None:
        env["MINDSPEED_LIKE_AUTOLOAD"] = autoload
    if args is not None:
        env["MINDSPEED_LIKE_ARGS"] = args
    return env


def _run(order: str, env: dict[str, str], ok: bool = True) -> dict | subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, SCRIPT, order], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    if not ok:
        return done
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_entry_point
def test_without_the_variable_nothing_of_ours_is_imported():
    """Unset (``0`` and empty are the same to ``requested()``, tested above): at ``import torch`` and
    after megatron's import, no module of mindspeed_like, no finder."""
    out = _run("off", _env(None))
    assert out["after_torch"] == {"ours": [], "trigger_armed": False}
    assert out["ours"] == [] and not out["adaptor"] and not out["trigger_armed"]


@needs_entry_point
def test_torch_then_megatron_gets_the_adaptor_before_megatron():
    out = _run("torch-first", _env("1"))
    # at `import torch`: only the trigger, none of mindspeed_like
    assert out["after_torch"] == {"ours": [], "trigger_armed": True}
    # megatron's first look-up found the adaptor in (and so did its own probes of transformer_engine)
    assert out["adaptor_in_before"]["megatron"] is True and all(out["adaptor_in_before"].values())
    assert out["adaptor"] and not out["trigger_armed"]
    assert out["optimization_level"] == 1  # the flags still come from MINDSPEED_LIKE_ARGS
    assert out["patches_applied"] > 0


@needs_entry_point
def test_the_adaptor_imports_nothing_of_megatron():
    """What the trigger relies on: it runs the adaptor inside the import system's look-up of
    megatron's first module; were megatron imported there, the look-up would execute it again."""
    out = _run("adaptor-alone", _env(None))
    assert out["watched_loaded"] == []


@needs_entry_point
def test_transformer_engine_first_gets_our_client_module_and_megatron_sees_no_te():
    out = _run("te-first", _env("1", args=None))
    assert out["adaptor_in_before"]["transformer_engine"] is True
    assert out["te_served_by_us"]
    assert out["have_te_true"] == [] and out["fp8_utils_have_te"] is False


@needs_entry_point
@pytest.mark.slow
def test_megatron_imported_before_torch_gets_it_at_its_next_module():
    """``import megatron.core`` imports torch: the adaptor waits for megatron.core to finish (its
    modules half-executed then), and comes in at the next megatron module, before a model."""
    out = _run("megatron-first", _env("1"))
    assert not out["after_megatron_core"]["adaptor"] and out["after_megatron_core"]["trigger_armed"]
    after = out["after_gpt_model"]
    assert after["adaptor"] and not after["trigger_armed"] and after["optimization_level"] == 1
    assert out["te_served_by_us"] and out["have_te_true"] == []


@needs_entry_point
def test_a_bad_value_fails_import_torch_naming_the_variable():
    done = _run("off", _env("true"), ok=False)
    assert done.returncode != 0
    assert "MINDSPEED_LIKE_AUTOLOAD='true'" in done.stderr and "expected 1" in done.stderr


@needs_entry_point
def test_a_bad_flag_fails_the_megatron_import_with_its_message():
    done = _run("torch-first", _env("1", args="--use-flash-atn"), ok=False)
    assert done.returncode != 0
    assert "unknown flag '--use-flash-atn'" in done.stderr and "--use-flash-attn" in done.stderr


@needs_entry_point
@pytest.mark.slow
def test_torchrun_workers_get_it(tmp_path):
    env = {**_env("1"), "OUT_DIR": str(tmp_path)}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        SCRIPT,
        "torchrun",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["rank"] == rank and out["world_size"] == 2
        assert out["adaptor_in_before"]["megatron"] is True and all(out["adaptor_in_before"].values())
        assert out["adaptor"] and out["optimization_level"] == 1
        assert out["ranks_with_adaptor"] == 2
