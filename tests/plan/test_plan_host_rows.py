"""Rows of the plan that only a CPU host has, where the process peak is glibc's resident set:
gloo's copy of the gradient bucket it reduce-scatters for the distributed optimizer, and the loss's
temporaries counted whole only where glibc's heap keeps them (host-allocator, or blocks below its
mmap ceiling). Measured side: tests/plan/test_plan_megatron_lm_runs.py and test_plan_accuracy.py."""

from __future__ import annotations

import pytest

from mindspeed_like.plan import cli, peak
from mindspeed_like.plan.activations import FP32

ARGS = (
    "--num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
    "--micro-batch-size 1 --normalization RMSNorm --swiglu --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --disable-bias-linear --bf16 --transformer-impl local --parser builtin"
).split()


def _stages(*extra: str, device: str = "cpu"):
    prediction = cli.predict_argv([*ARGS, *extra, "--target-device", device])
    return prediction.run, prediction.megatron.stages[-1], prediction.features.stages[-1]


def _grad_buffer(stage) -> int:
    return sum(line.bytes for line in stage.state if line.kind == "gradients")


def test_the_distributed_optimizers_reduce_scatter_copies_the_bucket_on_a_cpu_host() -> None:
    vocab = ("--vocab-size", "32000", "--world-size", "2")
    run, megatron, _ = _stages(*vocab, "--use-distributed-optimizer")
    assert megatron.peak.grad_sync == _grad_buffer(megatron) > 0  # one bucket: the whole fp32 buffer
    assert "reduce-scatter" in megatron.peak.phase
    # --overlap-grad-reduce: megatron's buckets of max(40M, 1M x DP) elements
    big = ("--hidden-size", "4096", "--num-attention-heads", "32")
    _, bucketed, _ = _stages(*vocab, "--use-distributed-optimizer", "--overlap-grad-reduce", *big)
    assert bucketed.peak.grad_sync == FP32 * 40_000_000 < _grad_buffer(bucketed)
    # the all-reduce without it works in place; NCCL reduce-scatters in place; one rank syncs nothing
    for extra, device in (((), "cpu"), (("--use-distributed-optimizer",), "cuda")):
        assert _stages(*vocab, *extra, device=device)[1].peak.grad_sync == 0, (extra, device)
    assert _stages("--vocab-size", "32000", "--use-distributed-optimizer")[1].peak.grad_sync == 0


def _loss(run, enabled: tuple[str, ...] = ()) -> tuple[int, str | None]:
    from mindspeed_like.plan.paths import feature_paths

    (loss,) = [t for t in peak.transients(run, feature_paths(run, enabled, {}), True) if t[3] == "loss"]
    return loss[0], loss[2]


@pytest.mark.parametrize("vocab, retained", [("32000", False), ("2000", True)])
def test_the_loss_temporaries_count_whole_where_glibcs_heap_keeps_them(vocab: str, retained: bool) -> None:
    """glibc maps a block of 32 MiB or more on its own and unmaps it when freed: the 1024 x 32k fp32
    logits (128 MiB) are live-only, the 1024 x 2k (8 MiB) stay in the heap; host-allocator keeps both."""
    run = _stages("--vocab-size", vocab)[0]
    logits = run.model.seq_length * run.model.vocab_size
    whole = (2 + 2 * FP32) * logits
    assert _loss(run) == ((whole, None) if retained else (2 * logits, None))
    # host-allocator keeps them: where glibc alone would not, the feature is what costs the memory
    assert _loss(run, ("host-allocator",)) == (whole, None if retained else "host-allocator")
    # on a device the logits' gradient alone (the fp32 softmax is a saved row)
    device_run = _stages("--vocab-size", vocab, device="cuda")[0]
    assert _loss(device_run, ("host-allocator",)) == (2 * logits, None)
