"""megatron's torch-FSDP2 wrapper (``--use-torch-fsdp2``) on a CPU host, 2 gloo ranks.

Four stops stood between megatron-core 0.16.1 and a training step here (issue 54): the wrapper's mesh
on "cuda" (cpu adapter: host twin), the TE-spec linears sharded inside their already-sharded layer
(te-backend: ``fsdp2.py``), ``finish_grad_sync(force_all_reduce=)`` (fix-fsdp2-finish-grad-sync), and
Megatron-LM's NCCL stream priorities (tests/adapters). Then checkpoints: torch 2.13's ``to_local()``
identity (fix-dtensor-local-identity) and the optimizer's states loaded as plain local shards
(fix-fsdp2-optimizer-state-load). Each run here goes through megatron's ``finalize_model_grads``, as
its schedules do."""

from __future__ import annotations

import fsdp_workers as workers
import pytest

from mindspeed_like.testing import run_distributed
from mindspeed_like.testing.distributed import DistributedError


def _cases(impl: str, bf16: bool) -> list[dict]:
    base = dict(impl=impl, bf16=bf16)
    return [
        dict(base, name="ddp", data_parallel="ddp"),
        dict(base, name="fsdp2", data_parallel="torch_fsdp2"),
        dict(base, name="fsdp2-keep", data_parallel="torch_fsdp2", ddp_options=dict(reshard_after_forward=False)),
    ]


@pytest.mark.parametrize("impl", ["transformer_engine", pytest.param("local", marks=pytest.mark.slow)])
def test_fsdp2_trains_as_ddp_fp32(impl):
    losses = run_distributed(workers.train_cases, 2, _cases(impl, bf16=False), timeout=240)[0]
    # the same gradients, reduced as a reduce-scatter (AVG) instead of DDP's all-reduce: equal to
    # fp32 rounding, and keeping the unsharded parameters between forward and backward changes nothing
    assert losses["fsdp2"] == pytest.approx(losses["ddp"], rel=1e-6, abs=0)
    assert losses["fsdp2-keep"] == losses["fsdp2"]
    assert losses["ddp"][-1] < losses["ddp"][0]


@pytest.mark.slow
def test_fsdp2_trains_as_ddp_bf16():
    losses = run_distributed(workers.train_cases, 2, _cases("transformer_engine", bf16=True), timeout=240)[0]
    assert losses["fsdp2"] == pytest.approx(losses["ddp"], rel=2e-3)


@pytest.mark.slow  # every FSDP2 run here goes through finalize_model_grads, i.e. the fix
def test_finish_grad_sync_takes_force_all_reduce_only_with_the_fix():
    case = dict(name="fsdp2", impl="local", bf16=False, data_parallel="torch_fsdp2")
    with pytest.raises(DistributedError, match="unexpected keyword argument 'force_all_reduce'"):
        run_distributed(workers.train_cases, 2, [case], None, ("fix-fsdp2-finish-grad-sync",), timeout=240)


def test_checkpoint_resumes_exactly(tmp_path):
    result = run_distributed(workers.save_resume, 2, "transformer_engine", str(tmp_path / "ckpt"), timeout=240)[0]
    assert result["state_types"] == ["DTensor", "Tensor"]  # moments as their parameters; the step a scalar
    assert result["resumed"] == result["straight"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "fix, failure",
    [
        ("fix-dtensor-local-identity", "save_error"),
        ("fix-fsdp2-optimizer-state-load", "step_error"),
    ],
)
def test_each_checkpoint_fix_is_needed(tmp_path, fix, failure):
    from mindspeed_like.fixes.dtensor_local_identity import to_local_loses_identity

    if fix == "fix-dtensor-local-identity" and not to_local_loses_identity():
        pytest.skip("this torch's DTensor.to_local() keeps the local tensor's identity: nothing to fix")
    result = run_distributed(workers.save_resume, 2, "local", str(tmp_path / "ckpt"), (fix,), timeout=240)[0]
    assert failure in result, result
