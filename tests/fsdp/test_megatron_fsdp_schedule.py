"""Megatron-FSDP through megatron's schedule with ``config.no_sync_func`` set (a megatron-core script's way).

fix-megatron-fsdp-sync-grad-reduce: without ``overlap_grad_reduce`` the ``optim`` strategy's gradients were
reduced by the backward hooks (``no_sync`` leaves ``is_last_microbatch`` set) and again by ``finish_grad_sync``:
grad norm 1/DP of the distributed optimizer's (0.391085 against 0.782171 at DP 2). 2 gloo ranks, 2 microbatches
a step."""

from __future__ import annotations

import fsdp_schedule_workers as workers
import pytest

from mindspeed_like.fixes import megatron_fsdp_sync_grad_reduce as fix
from mindspeed_like.megatron_version import megatron_core_version, release_in
from mindspeed_like.testing import run_distributed

pytestmark = pytest.mark.skipif(
    not release_in(fix.VERSIONS, megatron_core_version()),
    reason=f"{fix.NAME} applies to megatron-core {fix.VERSIONS} (Megatron-FSDP not built here before)",
)

CASES = [
    dict(name="distopt", wrapper="ddp"),
    dict(name="optim", wrapper="megatron_fsdp", strategy="optim"),
    dict(name="optim_grads_params", wrapper="megatron_fsdp", strategy="optim_grads_params"),
]


def test_optim_without_overlap_reduces_once_as_the_distributed_optimizer():
    runs = run_distributed(workers.train_with_the_schedule, 2, CASES, timeout=300)[0]
    reference = [value for step in runs["distopt"] for value in step]  # (loss, grad norm) a step
    for name in ("optim", "optim_grads_params"):
        assert [value for step in runs[name] for value in step] == pytest.approx(reference, rel=1e-6), name


def test_without_the_fix_optim_averages_twice():
    runs = run_distributed(workers.train_with_the_schedule, 2, CASES[:2], without=(fix.NAME,), timeout=300)[0]
    (_, norm), (_, reference) = runs["optim"][0], runs["distopt"][0]
    assert norm == pytest.approx(reference / 2, rel=1e-5)  # scaled by 1/DP twice


def test_fsdp2_local_spec_without_transformer_impl_local_trains_as_with_it():
    # fix-fsdp2-local-spec-units on every release: TransformerConfig's default transformer_impl
    # ("transformer_engine") kept ColumnParallelLinear among the units of a local-spec model
    from mindspeed_like.fixes import fsdp2_local_spec_units

    runs = run_distributed(workers.fsdp2_local_spec_default_impl, 2, timeout=600)[0]
    assert runs["transformer_engine"]["error"] is None, runs["transformer_engine"]["error"]
    assert runs["transformer_engine"] == runs["local"]
    assert "decoder.layers.0" in runs["local"]["units"]
    broken = run_distributed(
        workers.fsdp2_local_spec_default_impl, 2, without=(fsdp2_local_spec_units.NAME,), timeout=600
    )[0]
    assert broken["local"] == runs["local"]  # megatron's own filter, on the config's word
    assert "Invariant encountered" in broken["transformer_engine"]["error"]
