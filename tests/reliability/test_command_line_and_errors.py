"""Issue 15, items 3, 4 (misspelt flags), 5 and 6, as a user hits them: a script with its own
flags, a torchrun launch, the error texts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from mindspeed_like import runtime
from mindspeed_like.testing import run_distributed
from mindspeed_like.testing.distributed import DistributedError
from mindspeed_like.toolkit.errors import ConfigError

SCRIPT = textwrap.dedent(
    """
    import argparse, warnings
    warnings.simplefilter("always")
    import mindspeed_like.megatron_adaptor as adaptor
    parser = argparse.ArgumentParser()
    parser.add_argument("--device")
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--lr", type=float)
    args, _ = parser.parse_known_args()
    c = adaptor.config
    print("OURS", c["device"], c["strict"], c["use_flash_attn"], c["grouped_gemm"])
    print("THEIRS", args.device, args.strict, args.lr)
    """
)


def _script(tmp_path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    environ = {k: v for k, v in os.environ.items() if k != "MINDSPEED_LIKE_ARGS"}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, str(path), *argv], capture_output=True, text=True, env=environ, timeout=120, check=False
    )


def _line(out: str, tag: str) -> list[str]:
    return next(line.split()[1:] for line in out.splitlines() if line.startswith(tag))


def test_script_flags_device_and_strict_stay_the_scripts(tmp_path):
    result = _script(tmp_path, "--device", "cuda:0", "--strict", "--lr", "0.1")
    assert result.returncode == 0, result.stderr
    assert _line(result.stdout, "OURS")[:2] == ["auto", "False"]
    assert _line(result.stdout, "THEIRS") == ["cuda:0", "True", "0.1"]


def test_namespaced_spellings_are_ours_on_the_command_line(tmp_path):
    result = _script(tmp_path, "--mindspeed-device", "cpu", "--mindspeed-strict", "--device", "cuda:1")
    assert result.returncode == 0, result.stderr
    assert _line(result.stdout, "OURS")[:2] == ["cpu", "True"]
    assert _line(result.stdout, "THEIRS")[0] == "cuda:1"


def test_a_bad_value_for_our_flag_is_a_warning_not_an_import_error(tmp_path):
    result = _script(tmp_path, "--grouped-gemm", "bogus", "--use-flash-attn")
    assert result.returncode == 0, result.stderr
    assert _line(result.stdout, "OURS")[2:] == ["True", "auto"]
    assert "ignoring --grouped-gemm (argument --grouped-gemm: invalid choice: 'bogus'" in result.stderr


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [
        ("--use-flash-atn", "--use-flash-attn"),
        ("--use_flash_attn", "--use-flash-attn"),
        ("--reuse-fp32-params", "--reuse-fp32-param"),
    ],
)
def test_misspelt_flags_are_warned_once_with_the_suggestion(typo, suggestion):
    with pytest.warns(
        UserWarning, match=f"{typo} on the command line is not one of our flags.*did you mean {suggestion}"
    ):
        config = runtime.resolve_config(argv=[typo, "--num-layers", "2"], code={})
    assert config["use_flash_attn"] is False and config["reuse_fp32_param"] is False


def test_megatron_lm_and_script_options_are_not_called_typos(recwarn):
    runtime.resolve_config(argv=["--use-distributed-optimizer", "--num-layers", "2", "--epochs", "3"], code={})
    assert not [w for w in recwarn if "did you mean" in str(w.message)]


def test_env_and_configure_keep_the_short_spellings(monkeypatch):
    monkeypatch.setenv("MINDSPEED_LIKE_ARGS", "--device cpu --strict")
    config = runtime.resolve_config(argv=[], code={})
    assert config["device"] == "cpu" and config["strict"] is True


def test_unbalanced_quote_in_the_env_names_the_variable(monkeypatch):
    monkeypatch.setenv("MINDSPEED_LIKE_ARGS", '--device "cpu')
    with pytest.raises(ConfigError, match="MINDSPEED_LIKE_ARGS=.*cannot be split into flags.*balance its quotes"):
        runtime.resolve_config(argv=[], code={})


def test_configure_values_numpy_scalars_and_none_for_the_default():
    np = pytest.importorskip("numpy")
    config = runtime.resolve_config(
        argv=[], code=dict(use_flash_attn=np.bool_(True), recompute_activation_function_num_layers=None)
    )
    assert config["use_flash_attn"] is True and config["recompute_activation_function_num_layers"] is None
    with pytest.raises(ConfigError, match=r"e\.g\. recompute_activation_function_num_layers=2, or None"):
        runtime.resolve_config(argv=[], code=dict(recompute_activation_function_num_layers="3"))


def test_device_npu_without_torch_npu_says_what_to_install():
    import mindspeed_like

    try:
        with pytest.raises(ConfigError, match="torch_npu is not installed.*Install torch-npu"):
            mindspeed_like.configure(device="npu")
    finally:
        mindspeed_like.reset()


def _init_parallel_under_launcher():
    """Stands for a torchrun rank: the env a launcher sets, no process group yet."""
    import torch.distributed as dist

    import mindspeed_like
    from mindspeed_like.testing import destroy_parallel, init_parallel

    mindspeed_like.configure(device="cpu")
    dist.destroy_process_group()  # run_distributed's own group: start as a launched script does
    init_parallel()
    size = dist.get_world_size()
    destroy_parallel(process_group=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # for the runner to destroy
    return size


@pytest.mark.slow
def test_init_parallel_joins_the_launchers_world():
    assert run_distributed(_init_parallel_under_launcher, 2, timeout=120) == [2, 2]


def test_init_parallel_with_an_incomplete_launcher_env_raises(monkeypatch):
    from mindspeed_like.testing.parallel import LauncherEnvironmentError, _init_default_group

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(LauncherEnvironmentError, match="WORLD_SIZE=2 .* Start it with torchrun"):
        _init_default_group()


def _one_rank_dies_hard():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(7)
    dist.barrier()  # rank 0 then fails on the dead peer
    return "unreachable"


def test_run_distributed_names_the_rank_that_died_and_its_exit_code():
    with pytest.raises(DistributedError) as info:
        run_distributed(_one_rank_dies_hard, 2, timeout=120)
    text = str(info.value)
    assert "rank 1 died first (process exited with code 7 without a result)" in text
    assert "--- rank 0 ---" in text


# ---------------------------------------------------------------- issue 28 item 4: one process without torchrun

WORLD_SCRIPT = textwrap.dedent(
    """
    import os
    import torch.distributed as dist
    dist.init_process_group("gloo")  # env://, as Megatron-LM's initialize does
    print("WORLD", dist.get_rank(), dist.get_world_size(), os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"])
    dist.destroy_process_group()
    """
)
LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _runner_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER and k != "MINDSPEED_LIKE_ARGS"}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


@pytest.mark.parametrize("entry", [["-m", "mindspeed_like.run"], ["-m", "mindspeed_like.cli", "run"]])
def test_run_without_a_launcher_is_a_one_process_world(tmp_path, entry):
    script = tmp_path / "train.py"
    script.write_text(WORLD_SCRIPT)
    result = subprocess.run(
        [sys.executable, *entry, str(script)], capture_output=True, text=True, env=_runner_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WORLD 0 1 0 1" in result.stdout
    notes = [line for line in result.stderr.splitlines() if "mindspeed_like.run: no launcher" in line]
    assert len(notes) == 1 and "MASTER_ADDR=127.0.0.1" in notes[0] and "MASTER_PORT=" in notes[0]


def test_a_launchers_variables_are_never_overridden():
    from mindspeed_like.run import one_process_world

    launched = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    env = dict(launched)
    assert one_process_world(env) == {} and env == launched
    env = {"MASTER_PORT": "29555"}  # the user's own port, no launcher
    added = one_process_world(env)
    assert env["MASTER_PORT"] == "29555" and "MASTER_PORT" not in added
    assert env == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}  # fmt: skip
    env = {}
    assert set(one_process_world(env)) == set(LAUNCHER) and int(env["MASTER_PORT"]) > 0


@pytest.mark.slow
def test_megatron_lm_pretrain_gpt_trains_as_one_process_without_torchrun():
    """``mindspeed-like run pretrain_gpt.py ...`` with no launcher variables (opt-in: MEGATRON_LM_PATH)."""
    from mindspeed_like.testing import megatron_lm

    if not megatron_lm.available():
        pytest.skip(megatron_lm.SKIP_REASON)
    bin_dir = os.path.dirname(sys.executable)
    env = _runner_env(PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), TORCHDYNAMO_DISABLE="1")
    command = [os.path.join(bin_dir, "mindspeed-like"), "run", megatron_lm.PRETRAIN_GPT, *megatron_lm.TINY]
    command += ["--train-iters", "3"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    iterations = [line for line in output.splitlines() if megatron_lm.ITERATION.search(line)]
    assert len(iterations) == 3, output[-4000:]
    assert "mindspeed_like.run: no launcher, one process" in output
