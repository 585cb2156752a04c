"""Megatron-FSDP's hybrid sharding (HSDP, ``num_distributed_optimizer_instances > 1``) with expert parallelism.

Whether the installed megatron-core supports it is read from its code (fixes/megatron_fsdp_hsdp_experts.py:
does ``_init_dist_index`` hand its hybrid ``FSDPDistributedIndex`` an expert device mesh?). megatron-core
0.16.1 builds none (refused at argument validation, at the wrapper's construction, by plan and compare);
0.19.2 builds one, and there the tiny MoE GPT at DP 4 in 2 instances x EP 2 trains the distributed
optimizer's losses with the same instances (which are one instance's, to the bit), with and without
``outer_dp_sharding_strategy='optim'`` (fix-megatron-fsdp-outer-grad-scaling: megatron's outer-DP helper
buffer summed the gradients unscaled, 4x). The 0.19 cases run in the version lane
(``.venv-mc0.19.2/bin/python -m pytest tests/fsdp/test_megatron_fsdp_hsdp_experts.py``)."""

from __future__ import annotations

import inspect
import textwrap
import types

import hsdp_expert_workers as workers
import megatron_fsdp_checkpoint_workers as checkpoint_workers
import pytest

from mindspeed_like.fixes import megatron_fsdp_hsdp_experts as experts_fix
from mindspeed_like.fixes import megatron_fsdp_outer_grad_scaling as scaling_fix
from mindspeed_like.plan.fsdp import hybrid_sharding_refusal
from mindspeed_like.testing import run_distributed
from mindspeed_like.toolkit.errors import ConfigError

MESH = experts_fix.expert_mesh_under_hsdp()
NO_MESH = pytest.mark.skipif(
    MESH is not False,
    reason="the installed megatron-core's _init_dist_index builds an expert mesh under hybrid sharding"
    if MESH
    else "the installed megatron-core has no Megatron-FSDP adapter (mcore_fsdp_adapter.py)",
)
WITH_MESH = pytest.mark.skipif(
    not MESH,
    reason="the installed megatron-core's _init_dist_index builds no expert mesh under hybrid sharding "
    "(fixes/megatron_fsdp_hsdp_experts.py refuses the layout)",
)

ADAPTER = """
class FullyShardedDataParallel:
    def _init_dist_index(self, pg_collection):
        if enable_hsdp:
            dist_index = FSDPDistributedIndex(device_mesh=mesh, dp_outer_dim="outer_fsdp_dp"{hybrid})
        else:
            dist_index = FSDPDistributedIndex(device_mesh=mesh, expt_device_mesh=expt_device_mesh)
        return dist_index
"""


@pytest.mark.parametrize(
    "hybrid, found", [(", expt_device_mesh=expt_device_mesh", True), ("", False), (None, None)], ids=str
)
def test_the_expert_mesh_is_read_from_the_adapters_hybrid_branch(tmp_path, hybrid, found):
    """Only the hybrid ``FSDPDistributedIndex`` call counts (the non-hybrid one passes an expert mesh in
    both releases); a file without a hybrid call is not a layout this reads (None)."""
    adapter = tmp_path / experts_fix.ADAPTER
    adapter.parent.mkdir(parents=True)
    text = ADAPTER.format(hybrid=hybrid or "") if hybrid is not None else "def _init_dist_index(self): pass\n"
    adapter.write_text(textwrap.dedent(text))
    assert experts_fix.expert_mesh_under_hsdp(str(tmp_path)) is found


def test_the_installed_answer_agrees_with_the_hybrid_mesh_signature():
    """The reading agrees with the installed code's other sign of an expert mesh under HSDP: the hybrid mesh
    builder takes the expert-parallel size (0.19: ``_get_hsdp_tp_mesh(..., ep_size=1)``; 0.16.1: no such
    parameter)."""
    if MESH is None:
        pytest.skip("the installed megatron-core has no Megatron-FSDP adapter")
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    mesh_builder = inspect.unwrap(mcore_fsdp_adapter._get_hsdp_tp_mesh)
    assert ("ep_size" in inspect.signature(mesh_builder).parameters) is MESH


def _args(**overrides) -> types.SimpleNamespace:
    values = dict(use_megatron_fsdp=True, num_distributed_optimizer_instances=2, expert_model_parallel_size=2)
    return types.SimpleNamespace(**{**values, **overrides})


def _refusal(instances: int = 2, ep: int = 2, outer: str = "no_shard") -> str | None:
    return hybrid_sharding_refusal(
        megatron_fsdp=True,
        instances=instances,
        outer=outer,
        strategy="optim_grads_params",
        dp_cp=4,
        ep=ep,
        overlap_grad_reduce=False,
        expert_dp=4 // ep,
    )


@NO_MESH
def test_refused_where_the_installed_release_builds_no_expert_mesh():
    """Megatron-LM's argument validation, plan and compare: the words name the release that lacks the mesh
    and the one that has it."""
    from mindspeed_like.megatron_version import megatron_core_version

    with pytest.raises(ConfigError, match="builds no expert mesh under hybrid sharding") as refused:
        with experts_fix.refuse_on_the_command_line(_args()):
            pass
    assert f"megatron-core {megatron_core_version()}'s" in str(refused.value)
    assert f"megatron-core {experts_fix.HAS_IT} builds one" in str(refused.value)
    assert _refusal() == str(refused.value)
    assert _refusal(outer="optim") == str(refused.value)
    for args in (_args(expert_model_parallel_size=1), _args(num_distributed_optimizer_instances=1)):
        with experts_fix.refuse_on_the_command_line(args):  # EP 1, or one instance: nothing to refuse
            pass
    assert _refusal(ep=1) is None and _refusal(instances=1) is None


@NO_MESH
def test_refused_at_the_wrappers_construction(cpu_config):
    """megatron-core API users: ``FullyShardedDataParallel`` refuses before it builds anything (the expert-
    parallel size read from ``pg_collection`` where one is given, else from megatron's parallel state)."""
    cpu_config()
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        use_distributed_optimizer=True,
        num_distributed_optimizer_instances=2,
        data_parallel_sharding_strategy="optim_grads_params",
    )
    groups = types.SimpleNamespace(ep=types.SimpleNamespace(size=lambda: 2))
    with pytest.raises(ConfigError, match="builds no expert mesh under hybrid sharding"):
        FullyShardedDataParallel(None, ddp_config, None, pg_collection=groups)


@pytest.mark.slow
@NO_MESH
def test_without_the_refusal_the_layout_trains_silently_wrong():
    """What the refusal keeps from running (megatron-core 0.16.1): the experts' collectives over the whole
    world under HSDP. Measured: grad norm 0.810438 at step 1 against the distributed optimizer's 0.808926 with
    the same instances, loss 5.543507 at step 2 against 5.543381; no error."""
    runs = _train([DISTOPT, HSDP], without=(experts_fix.NAME,))
    assert runs["hsdp"]["losses"][0] == runs["distopt"]["losses"][0]  # the same model's first forward
    assert runs["hsdp"]["grad_norms"][0] != pytest.approx(runs["distopt"]["grad_norms"][0], rel=1e-4)
    assert runs["hsdp"]["losses"][1] != runs["distopt"]["losses"][1]


def test_compare_refuses_the_instances_that_do_not_divide_the_expert_data_parallel_size():
    """megatron-core's initialize_model_parallel asserts it ('Expert data parallel size should be divisible by
    partial DistOpt shard factor'); plan and compare say so before any process starts."""
    refused = hybrid_sharding_refusal(
        megatron_fsdp=True,
        instances=4,
        outer="no_shard",
        strategy="optim_grads_params",
        dp_cp=4,
        ep=2,
        overlap_grad_reduce=False,
        expert_dp=2,
    )
    assert "does not divide the expert data-parallel size (2" in refused


@WITH_MESH
def test_not_refused_where_the_installed_release_builds_the_expert_mesh():
    with experts_fix.refuse_on_the_command_line(_args()):
        pass
    assert _refusal() is None and _refusal(outer="optim") is None


OGP = dict(data_parallel_sharding_strategy="optim_grads_params")
DISTOPT = dict(name="distopt", data_parallel="ddp", use_distributed_optimizer=True)
HSDP = dict(name="hsdp", data_parallel="megatron_fsdp", ddp_options=OGP)
OUTER = dict(
    name="outer-optim", data_parallel="megatron_fsdp", ddp_options=dict(OGP, outer_dp_sharding_strategy="optim")
)
HSDP_EP2 = dict(ep=2, instances=2)  # DP 4 in 2 instances; expert DP 2: one rank an instance, 2 across them
TIMEOUT = 1500  # three 4-rank runs of 3 steps took 110-190 s on the loaded 2-core host


def _train(cases: list[dict], layout: dict = HSDP_EP2, without: tuple[str, ...] = ()) -> dict:
    return run_distributed(workers.train, 4, layout, cases, None, without, timeout=TIMEOUT)[0]


def _assert_same_run(run: dict, baseline: dict) -> None:
    """The losses to the bit; the grad norms to 2e-7 relative (megatron sums the squares of other shards in
    another order: measured 6.5e-8 at step 3)."""
    assert run["losses"] == baseline["losses"]
    assert run["grad_norms"] == pytest.approx(baseline["grad_norms"], rel=2e-7, abs=0)


@WITH_MESH
def test_hybrid_sharding_at_ep2_trains_as_the_distributed_optimizer():
    """DP 4 in 2 instances x EP 2 (4 experts, top-2, dropout 0.1), 3 steps, fp32: Megatron-FSDP
    ``optim_grads_params`` with and without outer-DP sharding against the distributed optimizer with the
    same instances."""
    runs = _train([DISTOPT, HSDP, OUTER])
    for name in ("hsdp", "outer-optim"):
        _assert_same_run(runs[name], runs["distopt"])
    assert runs["distopt"]["losses"][-1] != runs["distopt"]["losses"][0]


@pytest.mark.slow
@WITH_MESH
def test_hybrid_sharding_at_ep2_trains_as_one_instance():
    """The same model at one instance (Megatron-FSDP and the distributed optimizer over all 4 data-parallel
    ranks): the losses of the hybrid runs to the bit."""
    one = _train([dict(DISTOPT, name="distopt-1"), dict(HSDP, name="mfsdp-1")], dict(ep=2))
    hybrid = _train([HSDP])
    _assert_same_run(one["mfsdp-1"], one["distopt-1"])
    _assert_same_run(hybrid["hsdp"], one["mfsdp-1"])


@pytest.mark.slow
@pytest.mark.skipif(not scaling_fix.has_helper_buffers(), reason="no outer-DP helper buffers in this megatron-core")
@pytest.mark.parametrize("moe", [True, False], ids=["moe-ep2", "dense"])
def test_outer_sharding_sums_unscaled_gradients_without_the_fix(moe):
    """megatron-core 0.19.2's outer-DP helper gradient buffer has no scaling factor: without the fix every
    gradient is DP (4) times the average, and so is the grad norm (the first step's, of the same model); with
    megatron's clip (1.0) acting on it the losses part from step 2 or 3."""
    layout, model = (HSDP_EP2, None) if moe else (dict(instances=2), dict(num_moe_experts=None))
    runs = run_distributed(workers.train, 4, layout, [DISTOPT, OUTER], model, (scaling_fix.NAME,), timeout=TIMEOUT)[0]
    first, distopt = runs["outer-optim"]["grad_norms"][0], runs["distopt"]["grad_norms"][0]
    assert first == pytest.approx(4 * distopt, rel=1e-6)  # the same model: measured 3.235705 against 0.808926
    assert runs["outer-optim"]["losses"][0] == runs["distopt"]["losses"][0]
    assert runs["outer-optim"]["losses"] != runs["distopt"]["losses"]


@pytest.mark.slow
@WITH_MESH
@pytest.mark.parametrize("instances", [2, 1])
def test_fsdp_dtensor_resume_at_ep2_equals_the_uninterrupted_run(tmp_path, instances):
    """DP 4 x EP 2 (expert DP 2), in 2 instances and in one: the tiny MoE GPT (without dropout) saved after step 3
    through megatron-core's fsdp_dtensor state dicts and resumed in new processes trains the straight run's last 3
    losses and grad norms to the bit. Before ``workloads.fsdp_dtensor_state`` renamed the experts to their global
    index (as Megatron-LM does) the resume printed 5.643063 (2 instances) and 5.632145 (one) against 5.637125."""
    ckpt, layout = str(tmp_path / "ckpt"), dict(ep=2, instances=instances)
    args = (False, ckpt, (), checkpoint_workers.MOE, layout)
    straight = run_distributed(checkpoint_workers.save_midway, 4, *args, timeout=TIMEOUT)[0]
    resumed = run_distributed(checkpoint_workers.resume, 4, *args, timeout=TIMEOUT)[0]
    assert resumed == {name: values[checkpoint_workers.SAVE_AFTER :] for name, values in straight.items()}


PLAN_MODEL = (
    "--num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
    "--vocab-size 1000 --bf16 --swiglu --normalization RMSNorm --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 --parser builtin "
    "--target-device cuda --num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 "
    "--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy optim_grads_params"
).split()


def _plan_state(extra: list[str], world: int, capsys) -> dict[str, int]:
    import json

    from mindspeed_like.plan import cli

    argv = [*PLAN_MODEL, *extra, "--world-size", str(world), "--global-batch-size", str(world), "--json"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    arm = json.loads(capsys.readouterr().out)["per_rank"][0]["megatron"]
    return {k: arm[f"{k}_bytes"] for k in ("weights", "gradients", "optimizer")}


def test_plan_shards_the_experts_over_the_intra_instance_expert_group(capsys):
    """megatron-core 0.19's expert mesh under HSDP (predicted on any install as a 0.19.2 record is): at DP 4 in 2
    instances x EP 2 every buffer is sharded within an instance, the experts' over the intra-instance expert
    data-parallel group (expert DP 2 / 2 instances: one rank), so a rank holds what DP 2 x EP 2 holds; with
    ``--outer-dp-sharding-strategy optim`` the masters and moments are sharded over the whole (expert) data-
    parallel group, as at DP 4 x EP 2, the weights and the main-grad buffers staying DP 2's. The fp32 copy of
    the gradient shard that ``update_main_grads`` hands the optimizer follows the masters (DP 4's): there the
    model gradient buffer is a DP-wide view of the intra-instance ``hfsdp_helper_gbuf`` (param_and_grad_buffer.py,
    0.19.2) and ``get_item(only_shard=True)`` its DP-wide shard."""
    from mindspeed_like.plan import megatron_code

    hsdp = ["--num-distributed-optimizer-instances", "2"]
    with megatron_code.as_measured_on("0.19.2"):
        two, four = _plan_state([], 2, capsys), _plan_state([], 4, capsys)
        assert _plan_state(hsdp, 4, capsys) == two
        outer = _plan_state([*hsdp, "--outer-dp-sharding-strategy", "optim"], 4, capsys)

    def fp32_copy(state: dict[str, int]) -> int:  # 0.19: the bf16 main-grad buffer has the weights' bytes
        return state["gradients"] - state["weights"]

    assert outer["weights"] == two["weights"]
    assert fp32_copy(outer) == fp32_copy(four) < fp32_copy(two)
    assert outer["optimizer"] == four["optimizer"] < two["optimizer"]


@NO_MESH
def test_plan_refuses_where_the_installed_release_builds_no_expert_mesh(capsys):
    from mindspeed_like.plan import cli

    argv = [*PLAN_MODEL, "--num-distributed-optimizer-instances", "2", "--world-size", "4", "--global-batch-size", "4"]
    assert cli.main(argv) == 2
    assert "builds no expert mesh under hybrid sharding" in capsys.readouterr().err
