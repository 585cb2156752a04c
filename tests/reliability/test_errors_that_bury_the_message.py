"""Issue 37 item 6: errors that buried their message or lost work, each stopped where it is found.

* A bad ``MINDSPEED_LIKE_ARGS`` value failed ``import mindspeed_like.megatron_adaptor`` with a
  ConfigError printed as a traceback through importlib and the runtime (45 lines from
  pretrain_gpt.py): now its message and where the user's code raised it, the traceback only with
  ``MINDSPEED_LIKE_TRACEBACK=1``; a caller that catches ConfigError still gets it.
* ``mindspeed-like compare --out FILE`` (an existing file) trained both arms and then died in
  ``os.makedirs``, losing the result; ``--lr nan`` ended in torch's optimizer traceback;
  ``--record ../x`` wrote outside results/. The same class in the demo and the benchmarks
  (``--record``, ``--json``, sizes and counts): refused by argparse, before anything runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from mindspeed_like.cli import main
from mindspeed_like.toolkit import cli_values
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.uncaught import TRACEBACK_ENV, message_only, short_report

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def _python(code_or_script: list[str], **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("MINDSPEED_LIKE_ARGS", TRACEBACK_ENV)}
    environment.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", **env)
    return subprocess.run(
        [sys.executable, *code_or_script], capture_output=True, text=True, timeout=300, env=environment, check=False
    )


def test_a_bad_env_flag_prints_its_message_and_the_users_line_not_a_traceback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os\nimport mindspeed_like.megatron_adaptor\nprint('not reached')\n")
    result = _python([str(script)], MINDSPEED_LIKE_ARGS="--use-flash-atn")
    assert result.returncode == 1
    assert "not reached" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "mindspeed_like: ConfigError: MINDSPEED_LIKE_ARGS: unknown flag '--use-flash-atn'. "
        "Did you mean '--use-flash-attn'?",
        f"  (raised at {script}:2; {TRACEBACK_ENV}=1 prints the traceback)",
    ], result.stderr


def test_the_debug_switch_prints_the_traceback(tmp_path):
    result = _python(
        ["-c", "import mindspeed_like.megatron_adaptor"], MINDSPEED_LIKE_ARGS="--devcie cpu", **{TRACEBACK_ENV: "1"}
    )
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "mindspeed_like/config.py" in result.stderr  # the frame that raised it
    assert "unknown flag '--devcie'" in result.stderr


def test_a_caught_error_is_the_same_config_error_and_other_errors_keep_their_traceback():
    code = (
        "import mindspeed_like.toolkit.errors as e\n"
        "try:\n    import mindspeed_like.megatron_adaptor\n"
        "except e.ConfigError as error:\n    print('caught', type(error).__name__)\n"
        "raise KeyError('other')\n"
    )
    result = _python(["-c", code], MINDSPEED_LIKE_ARGS="--devcie cpu")
    assert result.stdout.strip() == "caught ConfigError"
    assert "Traceback (most recent call last)" in result.stderr and "KeyError: 'other'" in result.stderr


def test_the_short_report_names_the_error_and_the_switch():
    error = message_only(ConfigError("--x: bad"))
    assert isinstance(error, ConfigError)
    report = short_report(error, None)
    assert report == f"mindspeed_like: ConfigError: --x: bad\n  ({TRACEBACK_ENV}=1 prints the traceback)\n"


def test_a_refusal_at_megatron_lm_validate_args_is_marked_short():
    """The same path for errors raised in Megatron-LM's argument hooks (integrations/megatron_lm.py)."""
    from mindspeed_like.integrations.megatron_lm import ValidateArgs

    def refuse(namespace):
        raise ConfigError("--record-memory-history: needs CUDA")

    wrapper = ValidateArgs(hooks=(("cpu-training-loop", refuse),))
    with pytest.raises(ConfigError, match="needs CUDA") as caught:
        wrapper(lambda args: args, None, (argparse.Namespace(rank=0),), {})
    assert getattr(caught.value, "_mindspeed_like_message_only", False)


# --- compare: paths and numbers refused before anything runs -----------------------------------------


@pytest.fixture
def existing_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("the user's file\n")
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--out", "{file}"], "argument --out: '{file}' exists and is not a directory"),
        (["--out", "{file}/sub"], "argument --out: cannot create '{file}/sub': '{file}' is a file"),
        (["--lr", "nan"], "argument --lr: must be a finite number >= 0, got 'nan'"),
        (["--lr=-1e-3"], "argument --lr: must be a finite number >= 0, got '-1e-3'"),
        (["--record", "../x"], "argument --record: a record name is a file name under results/"),
        (["--record", "/tmp/x"], "argument --record: a record name is a file name under results/"),
        (["--record", "x.json"], "argument --record: give the record's name without .json"),
        (["--timeout", "0"], "argument --timeout: must be a finite number > 0, got '0'"),
        (["--timeout", "inf"], "argument --timeout: must be a finite number > 0, got 'inf'"),
        (["--threads", "-2"], "argument --threads: must be a finite number >= 0, got '-2'"),
    ],
)
def test_compare_refuses_bad_paths_and_numbers_at_parsing(tmp_path, capsys, existing_file, args, message):
    args = [a.format(file=existing_file) for a in args]
    with pytest.raises(SystemExit) as exit:
        main(["compare", *(["--out", str(tmp_path / "out")] if not args[0].startswith("--out") else []), *args])
    assert exit.value.code == 2
    assert message.format(file=existing_file) in capsys.readouterr().err
    assert existing_file.read_text() == "the user's file\n"
    assert not (tmp_path / "out").exists()


def test_record_names_stay_under_results():
    assert cli_values.record_name("compare-llama-dp2") == "compare-llama-dp2"
    assert cli_values.record_name("") == ""  # compare's `--record` alone: the default name
    for bad in ("../x", "a/b", ".hidden", "-x", "a b", "a\\b"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli_values.record_name(bad)


def test_output_paths(tmp_path, existing_file):
    assert cli_values.output_directory(str(tmp_path / "new" / "dir")) == str(tmp_path / "new" / "dir")
    assert cli_values.output_file(str(tmp_path / "new" / "r.json")) == str(tmp_path / "new" / "r.json")
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory; give the path of a file"):
        cli_values.output_file(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="is a file, not a directory"):
        cli_values.output_file(str(existing_file / "r.json"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--record", "../x"], "argument --record: a record name is a file name under results/"),
        (["--json", "{tmp}"], "argument --json: '{tmp}' is a directory"),
        (["--repeats", "0"], "argument --repeats: must be a finite number > 0, got '0'"),
    ],
)
def test_benchmarks_refuse_bad_records_and_counts_before_running(tmp_path, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    result = _python([os.path.join(BENCHMARKS, "fused_ops_swiglu.py"), "--quick", *args])
    assert result.returncode == 2, result.stdout + result.stderr
    assert message.format(tmp=tmp_path) in result.stderr
    assert not (tmp_path.parent / "x.json").exists()
