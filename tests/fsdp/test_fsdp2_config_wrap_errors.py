"""A YAML mistake found when megatron's FSDP2 wrapper is built prints as its message, not a traceback.

The entries of ``--fsdp2-config-path`` that need the model (a pattern matching no module, an index the
model lacks, an ignored module with trainable parameters, ``sharding_size`` not dividing the group) are
checked in ``TorchFullyShardedDataParallel.__init__``, inside Megatron-LM's ``get_model``. The
ConfigError was unmarked there: Megatron-LM's ``pretrain_gpt.py`` on 2 ranks printed 925 lines (the
60-frame stack through runpy, training.py and the patches, on each rank, twice with torch's
``[rankN]:`` copy) with the one line that matters in the middle. The errors the file alone shows
(parse time) already printed one line a rank (45 lines in all). Now both read the same.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.uncaught import TRACEBACK_ENV

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from mindspeed_like.features.fsdp2_config.sharding import ShardWithConfig

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
            self.final_layernorm = torch.nn.LayerNorm(4)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(8, 4)
            self.decoder = Decoder()

    def megatrons_init(config, ddp_config, module, sub_modules_to_wrap=frozenset(), process_group=None):
        raise AssertionError("megatron's body ran: the YAML was not checked first")

    ShardWithConfig(sys.argv[1], "cpu")(megatrons_init, None, (), dict(
        config=None, ddp_config=None, module=Model(), process_group=object()))
    """
)


def _run(tmp_path, yaml_text: str, **env: str) -> subprocess.CompletedProcess:
    path = tmp_path / "fsdp2.yaml"
    path.write_text(yaml_text)
    script = tmp_path / "build.py"
    script.write_text(SCRIPT)
    environment = {k: v for k, v in os.environ.items() if k not in ("MINDSPEED_LIKE_ARGS", TRACEBACK_ENV)}
    environment.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", **env)
    return subprocess.run(
        [sys.executable, str(script), str(path)],
        capture_output=True, text=True, timeout=300, env=environment, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    "yaml_text, says",
    [
        (
            'sub_modules_to_wrap: ["decoder.layerz.{*}"]\n',
            "sub_modules_to_wrap: 'decoder.layerz.{*}' matches no module: decoder has no 'layerz' "
            "(its children: layers, final_layernorm)",
        ),
        (
            'recompute_modules: ["decoder.layers.{0-3}"]\n',
            "recompute_modules: 'decoder.layers.{0-3}': decoder.layers has no 2, 3",
        ),
        ("ignored_modules: [embedding]\n", "ignored_modules: Embedding has trainable parameters (weight)"),
    ],
    ids=["no-match", "out-of-range", "trainable-ignored"],
)
def test_a_mistake_found_at_wrap_prints_one_line(tmp_path, yaml_text, says):
    result = _run(tmp_path, yaml_text)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith(f"mindspeed_like: ConfigError: --fsdp2-config-path {tmp_path / 'fsdp2.yaml'}: {says}")
    assert lines[1].endswith(f"{TRACEBACK_ENV}=1 prints the traceback)")


def test_the_debug_switch_still_shows_where(tmp_path):
    result = _run(tmp_path, 'sub_modules_to_wrap: ["decoder.layerz.{*}"]\n', **{TRACEBACK_ENV: "1"})
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert f"{ConfigError.__module__}.ConfigError" in result.stderr or "ConfigError:" in result.stderr
    assert "fsdp2_config/sharding.py" in result.stderr
