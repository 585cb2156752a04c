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
