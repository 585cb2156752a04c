"""te-backend through Megatron-LM's own pretrain_gpt.py (issue 29, item 2; opt-in).

Megatron-LM's default ``--transformer-impl transformer_engine`` is kept (not switched to
``local``) while the te-backend is on, so ``pretrain_gpt.py`` builds the TE-spec model on our
classes:

* every flag trains on it: ``--optimization-level 2`` and our individual flags, in one process,
  at TP=2 with sequence parallel and at DP=2 with the distributed optimizer (torchrun, 2
  processes), and an MoE model with TE's grouped linears (``--moe-grouped-gemm``);
* ``--attention-backend``: ``flash`` / ``unfused`` train, ``local`` is refused at validation;
* checkpoints convert between the implementations: saved by the TE impl after 3 iterations
  (torch_dist), loaded by ``--transformer-impl local`` and trained to 6, iterations 4-6 print the
  uninterrupted TE-impl run's loss and grad norm; and the reverse;
* the TE-impl and local-impl runs from one seed print the same losses (the same initial weights:
  both specs draw the same weights in the same order; the fused norms draw nothing).
* ``--no-te-backend`` switches to ``local`` with the logged reason, as before the backend.

Runs only when MEGATRON_LM_PATH points at a Megatron-LM checkout whose tag matches megatron-core
(core_v0.16.1 for 0.16.1); see docs/megatron-lm.md. Each run takes 1-3 minutes on a 2-core CPU.
"""

from __future__ import annotations

import functools
import glob
import math
import os

import pytest

from mindspeed_like.testing import megatron_lm

pytestmark = pytest.mark.skipif(not megatron_lm.available(), reason=megatron_lm.SKIP_REASON)

ITERS, SAVE_AT = 6, 3
RESUMED = list(range(SAVE_AT + 1, ITERS + 1))
TE_IMPL_KEPT = "transformer_impl ................................ transformer_engine"
SWITCHED = "args.transformer_impl: 'transformer_engine' -> 'local'"

LEVEL_2 = ["--optimization-level", "2", "--bf16"]  # reuse-fp32-param (level 2) needs --bf16
FLAGS = [
    "--use-flash-attn", "--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb",
    "--use-fused-linear-cross-entropy", "--recompute-activation-function",
]  # fmt: skip
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
DP2_DISTOPT = ["--use-distributed-optimizer"]
# megatron's TEGroupedMLP asserts bias_dropout_fusion is off with biases: its MoE examples pass --disable-bias-linear
MOE = ["--num-experts", "4", "--moe-grouped-gemm", "--moe-router-topk", "2", "--disable-bias-linear"]

RUNS = {
    # name: (processes, flags)
    "single-level-2": (1, LEVEL_2),
    "single-flags": (1, FLAGS),
    "tp2sp-level-2": (2, [*TP2_SP, *LEVEL_2]),
    "tp2sp-flags": (2, [*TP2_SP, *FLAGS, "--use-tiled-tp-overlap"]),
    "dp2-distopt-level-2": (2, [*DP2_DISTOPT, *LEVEL_2]),
    "dp2-distopt-flags": (2, [*DP2_DISTOPT, *FLAGS, "--bf16", "--reuse-fp32-param"]),
    "moe-level-2": (1, [*MOE, *LEVEL_2]),
    "moe-flags": (1, [*MOE, *FLAGS]),
}


def run(nproc: int, extra: list[str], iters: int, expect_failure: bool = False) -> str:
    """Megatron-LM's pretrain_gpt.py (the TINY model, ``python -m mindspeed_like.run``) under
    torchrun; everything it printed. Fails with the output's tail unless ``expect_failure``."""
    return megatron_lm.torchrun_output(
        nproc, megatron_lm.launcher(), [*extra, "--train-iters", str(iters)], expect_failure=expect_failure
    )


def iterations(output: str) -> dict[int, tuple[str, str]]:
    """Each iteration's ``lm loss`` and ``grad norm`` as printed (strings: compared digit for digit)."""
    values = {}
    for line in output.splitlines():
        match = megatron_lm.ITERATION.search(line)
        if match:
            grad_norm = line.split("grad norm:", 1)[1].split("|", 1)[0].strip()
            values[int(match.group(1))] = (match.group(4), grad_norm)
    return values


def assert_te_impl(output: str) -> None:
    """The run built the TE-spec model: Megatron's printed args keep transformer_engine."""
    assert TE_IMPL_KEPT in output and SWITCHED not in output, output[-4000:]
    features = [line for line in output.splitlines() if "> mindspeed_like features on:" in line]
    assert features and "te-backend" in features[-1]


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[] if n == "single-level-2" else pytest.mark.slow) for n in RUNS]
)
def test_default_transformer_impl_trains_with_every_flag(name):
    nproc, extra = RUNS[name]
    output = run(nproc, extra, iters=4)
    assert_te_impl(output)
    values = iterations(output)
    assert sorted(values) == [1, 2, 3, 4], output[-4000:]
    assert all(math.isfinite(float(loss)) and math.isfinite(float(norm)) for loss, norm in values.values())


def test_no_te_backend_switches_to_local_with_the_reason():
    output = run(1, ["--no-te-backend"], iters=2)
    assert SWITCHED in output and "--no-te-backend" in output
    assert "transformer_impl ................................ local" in output


def test_attention_backend_local_is_refused_at_validation():
    output = run(1, ["--attention-backend", "local"], iters=2, expect_failure=True)
    assert "--attention-backend local" in output and "--transformer-impl local" in output, output[-4000:]
    assert not iterations(output)


def test_attention_backend_unfused_with_flash_attention_by_name_is_refused():
    output = run(1, ["--attention-backend", "unfused", "--use-flash-attn"], iters=2, expect_failure=True)
    assert "drop one" in output, output[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["flash", "unfused", "fused"])
def test_attention_backends_train(backend):
    """flash: our flash kernel (flash-attention off here); unfused: megatron's math; fused: ours.
    --optimization-level 2 with unfused: the level's flash-attention steps aside (one log line)."""
    output = run(1, ["--attention-backend", backend, *LEVEL_2], iters=3)
    assert_te_impl(output)
    assert sorted(iterations(output)) == [1, 2, 3]
    stepped_aside = "flash-attention (from --optimization-level 2) stepped aside: --attention-backend unfused"
    assert (stepped_aside in output) == (backend == "unfused"), output[-4000:]


@functools.cache
def straight(impl: str) -> dict[int, tuple[str, str]]:
    output = run(1, ["--transformer-impl", impl], iters=ITERS)
    values = iterations(output)
    assert sorted(values) == list(range(1, ITERS + 1)), output[-4000:]
    return values


def _checkpoint_keys(checkpoint: str) -> list[str]:
    import torch.distributed.checkpoint as dcp

    (iteration,) = glob.glob(os.path.join(checkpoint, "iter_*"))
    return sorted(dcp.FileSystemReader(iteration).read_metadata().state_dict_metadata)


@pytest.mark.slow
@pytest.mark.parametrize("saved, loaded", [("transformer_engine", "local"), ("local", "transformer_engine")])
def test_checkpoint_converts_between_implementations(saved, loaded, tmp_path):
    """Saved by one implementation after 3 iterations (torch_dist), loaded by the other and trained
    to 6: iterations 4-6 are the uninterrupted run's of the saving implementation, as printed."""
    checkpoint = str(tmp_path / "checkpoint")
    first = run(
        1,
        ["--transformer-impl", saved, "--save", checkpoint, "--save-interval", str(SAVE_AT)]
        + ["--exit-interval", str(SAVE_AT)],
        iters=ITERS,
    )
    assert iterations(first) == {i: straight(saved)[i] for i in range(1, SAVE_AT + 1)}
    assert (TE_IMPL_KEPT in first) == (saved == "transformer_engine")
    # one set of keys for both: the local spec's input norm is saved under TE's name
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in _checkpoint_keys(checkpoint)
    resumed = run(1, ["--transformer-impl", loaded, "--load", checkpoint], iters=ITERS)
    assert (TE_IMPL_KEPT in resumed) == (loaded == "transformer_engine")
    values = iterations(resumed)
    assert sorted(values) == RESUMED, resumed[-4000:]
    for iteration in RESUMED:
        assert values[iteration] == straight(saved)[iteration], (
            f"{saved} -> {loaded}: iteration {iteration} straight {straight(saved)[iteration]} converted "
            f"{values[iteration]}"
        )


@pytest.mark.slow
def test_te_impl_and_local_impl_from_one_seed_print_the_same_losses():
    """Both specs initialise identically (same weights drawn in the same order; the TE spec's norms
    fused into linear_qkv / linear_fc1 draw nothing), and compute the same math."""
    assert straight("transformer_engine") == straight("local")
