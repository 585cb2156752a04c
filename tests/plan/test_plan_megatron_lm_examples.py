"""Opt-in (``MEGATRON_LM_PATH``): ``mindspeed-like plan`` on the command lines of Megatron-LM's own
example scripts, read out of the scripts as they are (a ``torchrun`` shim records the arguments the
script would launch pretrain_gpt.py with), the way a user copies them. Parameter counts are held
to the models' published ones: Llama 3 8B 8,030,261,248, Mixtral 8x7B 46,702,792,704."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_like.testing.megatron_lm import MEGATRON_LM, SKIP_REASON, available

pytestmark = pytest.mark.skipif(not available(), reason=SKIP_REASON)

# what `torchrun ... pretrain_gpt.py ARGS` receives, one argument a line
_SHIM = """
torchrun() {{ while [[ $# -gt 0 && "$1" != *.py ]]; do shift; done; shift; printf '%s\\n' "$@" > {out}; }}
cd {workdir} && source {script} {positional} > /dev/null 2>&1
"""


def example_arguments(script: str, tmp_path: Path, *positional_args: str) -> list[str]:
    out = tmp_path / "arguments.txt"
    (tmp_path / "pretrain_gpt.py").touch()  # the llama script checks that it runs from Megatron-LM's root
    names = positional_args or ("ckpt", "tb", "vocab.json", "merges.txt", "data")
    positional = " ".join(shlex.quote(name if name == "MOCK" else str(tmp_path / name)) for name in names)
    shim = _SHIM.format(
        out=shlex.quote(str(out)),
        workdir=shlex.quote(str(tmp_path)),
        script=shlex.quote(str(Path(MEGATRON_LM) / "examples" / script)),
        positional=positional,
    )
    subprocess.run(["bash", "-c", shim], check=False, timeout=60)
    assert out.exists(), f"{script} launched nothing"
    return out.read_text().splitlines()


def plan(arguments: list[str], *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([MEGATRON_LM, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "mindspeed_like.plan", *arguments, *extra]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def weights(done: subprocess.CompletedProcess) -> int:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)["per_rank"][0]["megatron"]["weights_bytes"]


def test_llama3_8b(tmp_path: Path) -> None:
    """The script's mock-data branch: NullTokenizer, --vocab-size 128256. Beyond Llama 3 8B's count the
    script's model has LayerNorm (it passes no --normalization: biases, 2 a layer and the final one)
    and NullTokenizer's EOD row (128,257 padded to 128,384 rows, embedding and output layer)."""
    arguments = example_arguments("llama/train_llama3_8b_h100_fp8.sh", tmp_path, "ckpt", "tb", "MOCK", "MOCK")
    done = plan(arguments, "--world-size", "8", "--json")
    biases = (2 * 32 + 1) * 4096
    eod_padding = 2 * (128_384 - 128_256) * 4096
    assert weights(done) == 2 * (8_030_261_248 + biases + eod_padding)  # bf16
    notes = json.loads(done.stdout)["notes"]
    assert any("--sequence-parallel at TP 1" in note for note in notes), notes


def test_mixtral_8x7b(tmp_path: Path) -> None:
    arguments = example_arguments("mixtral/train_mixtral_8x7b_distributed.sh", tmp_path)
    missing = plan(arguments, "--world-size", "32")
    assert missing.returncode == 2 and "give --vocab-size N" in missing.stderr  # its tokenizer is not here
    whole = plan(arguments, "--vocab-size", "32000", "--world-size", "1", "--json", "--parser", "builtin",
                 "--pipeline-model-parallel-size", "1", "--expert-model-parallel-size", "1")  # fmt: skip
    assert weights(whole) == 2 * 46_702_792_704
    done = plan(arguments, "--vocab-size", "32000", "--world-size", "32", "--json")
    assert len(json.loads(done.stdout)["per_rank"]) == 4  # PP 4 as the script sets


def test_gpt3_175b_is_refused_as_megatron_lm_refuses_it(tmp_path: Path) -> None:
    """The script passes --rampup-batch-size with --train-iters, which Megatron-LM 0.16's
    validate_args refuses; without the ramp-up (and with the tokenizer type it leaves out) it plans."""
    arguments = example_arguments("gpt3/train_gpt3_175b_distributed.sh", tmp_path)
    refused = plan(arguments, "--world-size", "128", "--parser", "megatron-lm")
    assert refused.returncode == 2 and "batch-size rampup" in refused.stderr
    at = arguments.index("--rampup-batch-size")
    fixed = [*arguments[:at], *arguments[at + 4 :], "--tokenizer-type", "GPT2BPETokenizer"]
    done = plan(fixed, "--world-size", "128", "--json")
    # 175B over TP 8 x PP 16, fp16; GPT-2's vocabulary taken (its vocab file is not here), said
    assert 2.5 * 2**30 < weights(done) < 3.0 * 2**30
    assert any("GPT-2's vocabulary" in note for note in json.loads(done.stdout)["notes"])
