"""Run Megatron-LM's own ``pretrain_gpt.py`` as a user does (torchrun, the one import line) and read
its losses: plan's Megatron-LM checks and the opt-in Megatron-LM tests of every feature use these.

``MEGATRON_LM_PATH`` points at a Megatron-LM checkout whose tag matches the installed
megatron-core (``core_v0.16.1`` for 0.16.1); nothing of Megatron-LM is in this repository.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections.abc import Sequence

from packaging.version import Version

from mindspeed_like import megatron_version
from mindspeed_like.workloads.parallel import free_port

MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH", "")
PRETRAIN_GPT = os.path.join(MEGATRON_LM, "pretrain_gpt.py")


def checkout_mismatch(root: str | None = None, installed: Version | None = None) -> str | None:
    """Why the Megatron-LM checkout at ``root`` (by default MEGATRON_LM_PATH's) cannot stand for the
    installed megatron-core (``installed``: by default the one ``import megatron.core`` loads), or
    None where its megatron/core is that release, or either version is unknown. The checkout's
    script puts its own folder first on sys.path, so its megatron/core is what runs: a core_v0.16.1
    checkout under megatron-core 0.17.1 would test 0.16.1 code in 0.17.1's environment."""
    root = MEGATRON_LM if root is None else root
    if not root:
        return None
    checkout = megatron_version.package_info_version(os.path.join(root, "megatron", "core", "package_info.py"))
    installed = megatron_version.megatron_core_version() if installed is None else installed
    if checkout is None or installed is None or checkout == installed:
        return None
    return (
        f"MEGATRON_LM_PATH={root} is a Megatron-LM checkout of core_v{checkout}, but megatron-core {installed} "
        f"is installed (its pretrain_gpt.py would run the checkout's megatron/core {checkout}): point "
        f"MEGATRON_LM_PATH at a core_v{installed} checkout, or `make megatron-lm-smoke-versions MEGATRON_LM_GIT=...`"
    )


SKIP_REASON = checkout_mismatch() or (
    "set MEGATRON_LM_PATH to a Megatron-LM checkout whose tag matches megatron-core (core_v0.16.1 for 0.16.1) "
    "to run, or `make megatron-lm-smoke-versions MEGATRON_LM_GIT=...`; see docs/megatron-lm.md"
)

# Only what a CPU user chooses: data, tokenizer, model size, schedule. No CPU-specific flags:
# the adaptor switches TE/NCCL/apex defaults itself and logs it.
# the data and the schedule alone, for runs that give the whole model themselves (plan's checks)
TINY_SCHEDULE = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 255 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 10 --lr 1e-3 --log-interval 1 "
    "--eval-iters 0 --eval-interval 1000 --seed 1234"
).split()
TINY = [
    *TINY_SCHEDULE,
    *(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
        "--normalization RMSNorm --swiglu --position-embedding-type rope --attention-dropout 0 --hidden-dropout 0"
    ).split(),
]
ITERATION = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([0-9.]+).*?lm loss: ([0-9.E+-]+)"
)


def available() -> bool:
    """A checkout's pretrain_gpt.py at MEGATRON_LM_PATH, of the installed megatron-core's tag
    (:func:`checkout_mismatch`; else SKIP_REASON says which tags differ)."""
    return os.path.isfile(PRETRAIN_GPT) and checkout_mismatch() is None


def launcher() -> list[str]:
    """``python -m mindspeed_like.run pretrain_gpt.py``: the script with the import line first."""
    return ["-m", "mindspeed_like.run", PRETRAIN_GPT]


def torchrun_output(
    nproc: int,
    script_args: list[str],
    extra: list[str],
    env_extra: dict | None = None,
    expect_failure: bool = False,
    base: Sequence[str] = tuple(TINY),
    timeout: float = 900,
) -> str:
    """Train the TINY model with ``extra`` flags in ``nproc`` processes; returns everything the
    processes printed (stdout, then stderr). Fails with the output's tail, unless ``expect_failure``
    (then it fails if the run succeeded: a refusal under test). ``base``: the arguments ``extra``
    overrides (TINY_SCHEDULE where ``extra`` gives the whole model). ``timeout``: seconds before the
    launch is killed (``subprocess.TimeoutExpired``): a run that can hang fails sooner."""
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_LIKE_ARGS"}
    bin_dir = os.path.dirname(sys.executable)  # megatron compiles helpers with the python3 on PATH
    env.update(PATH=bin_dir + os.pathsep + env.get("PATH", ""), OMP_NUM_THREADS=str(max(1, 2 // nproc)))
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env.update(env_extra or {})
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        *script_args, *base, *extra,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    output = result.stdout + result.stderr
    if result.returncode != 0 and "cannot import name 'override' from 'typing'" in output:
        raise AssertionError(
            f"this Megatron-LM checkout needs Python >= 3.12 (megatron.training imports typing.override; "
            f"core_v0.18+), this is {sys.version.split()[0]}:\n{output[-2000:]}"
        )
    assert (result.returncode != 0) == expect_failure, output[-6000:]
    return output


def torchrun(
    nproc: int, script_args: list[str], extra: list[str], env_extra: dict | None = None, timeout: float = 900
) -> list[str]:
    """Train the TINY model with ``extra`` flags in ``nproc`` processes; returns the
    "features on" line of rank 0, then every iteration line. Fails with the output's tail."""
    return lines_of(torchrun_output(nproc, script_args, extra, env_extra, timeout=timeout))


def lines_of(output: str) -> list[str]:
    """The "features on" line of rank 0 (exactly one), then every iteration line, of a run's output."""
    features = [line for line in output.splitlines() if "> mindspeed_like features on:" in line]
    assert len(features) == 1, "rank 0 prints the features once"
    return [features[0], *[line for line in output.splitlines() if ITERATION.search(line)]]


def losses(lines: list[str], iterations: int = 10) -> list[float]:
    """The ``lm loss`` of each iteration line (all finite, ``iterations`` of them)."""
    values = [float(ITERATION.search(line).group(4)) for line in lines[1:]]
    assert len(values) == iterations, lines
    assert all(math.isfinite(x) for x in values)
    return values


PRINTED = re.compile(r"\| (lm loss|grad norm): ([^ |]+)")


def printed(lines: list[str]) -> dict[int, dict[str, str]]:
    """Each iteration line's ``lm loss`` and ``grad norm`` exactly as Megatron printed them (strings:
    a resumed run is compared with a straight one digit for digit), by iteration number."""
    values = {}
    for line in lines[1:]:
        iteration = int(ITERATION.search(line).group(1))
        assert iteration not in values, f"iteration {iteration} printed twice: {lines}"
        values[iteration] = dict(PRINTED.findall(line))
    return values


def grad_norms(lines: list[str], iterations: int = 10) -> list[float]:
    """The ``grad norm`` of each iteration line (all finite, ``iterations`` of them)."""
    values = [float(entry["grad norm"]) for entry in printed(lines).values()]
    assert len(values) == iterations, lines
    assert all(math.isfinite(x) for x in values)
    return values


DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
"""Megatron-LM's default dropout (TINY switches it off): a run with it draws from the device RNG."""
MEGATRON_FSDP = [
    "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy",
    "optim_grads_params",
    "--use-distributed-optimizer",
    "--ckpt-format",
    "fsdp_dtensor",
]
"""Megatron-FSDP as Megatron-LM's docs run it (ZeRO-3 sharding, its checkpoint format)."""


def straight_and_resumed(
    nproc: int, extra: list[str], checkpoint: str, iters: int = 6, save_at: int = 3, timeout: float = 900
) -> tuple[dict[int, dict[str, str]], dict[int, dict[str, str]], str]:
    """A run trained straight to ``iters``; one that saves and exits at ``save_at`` (same
    ``--train-iters``: the learning-rate schedule is the straight run's); a new launch that loads
    it and trains to ``iters``. Returns the printed ``lm loss`` / ``grad norm`` of iterations
    ``save_at+1..iters`` of the straight and of the resumed run, and the resumed run's output.
    The saving run's first iterations are checked to be the straight run's. ``timeout``: seconds each
    of the three launches may take."""
    extra = [*extra, "--train-iters", str(iters)]
    straight = printed(torchrun(nproc, launcher(), extra, timeout=timeout))
    assert sorted(straight) == list(range(1, iters + 1))
    interval = ["--save-interval", str(save_at), "--exit-interval", str(save_at)]
    first = printed(torchrun(nproc, launcher(), [*extra, "--save", checkpoint, *interval], timeout=timeout))
    assert sorted(first) == list(range(1, save_at + 1))
    assert first == {i: straight[i] for i in first}, "the saving run's first iterations are the straight run's"
    output = torchrun_output(nproc, launcher(), [*extra, "--load", checkpoint], timeout=timeout)
    resumed = printed(lines_of(output))
    after = list(range(save_at + 1, iters + 1))
    assert sorted(resumed) == after, "the new processes start after the checkpoint's iteration"
    return {i: straight[i] for i in after}, resumed, output
