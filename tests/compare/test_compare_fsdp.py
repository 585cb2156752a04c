"""`mindspeed-like compare` under megatron's two FSDP paths (Megatron-LM's flags, both arms under the
same wrapper): Megatron-LM's refusals before any process starts, the meter counting this rank's
shards (DTensor local shards, Megatron-FSDP's buffers by kind), and the per-rank model state of a
real run falling with the data-parallel size."""

from __future__ import annotations

import json
import os

import pytest
import torch

from mindspeed_like.cli import main

TINY = ["--steps", "2", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4"]
TINY += ["--seq-length", "16", "--micro-batch-size", "2", "--quiet", "--repeats", "1", "--fp32"]


def _compare(tmp_path, *args: str) -> dict:
    out = str(tmp_path / "out")
    assert main(["compare", *TINY, "--out", out, *args]) == 0
    with open(os.path.join(out, "compare.json")) as handle:
        return json.load(handle)["compare"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--use-torch-fsdp2", "--use-megatron-fsdp"], "two FSDP paths; choose one"),
        (["--torch-fsdp2-no-reshard-after-forward"], "acts with --use-torch-fsdp2"),
        (["--data-parallel-sharding-strategy", "optim"], "acts with --use-megatron-fsdp"),
        (
            ["--use-torch-fsdp2", "--pipeline-model-parallel-size", "2"],
            "'--use-torch-fsdp2 is not supported with pipeline parallelism'",
        ),
        (
            ["--use-torch-fsdp2", "--preset", "moe", "--data-parallel-size", "2", "--expert-model-parallel-size", "2"],
            "'--use-torch-fsdp2 is not supported with expert parallelism'",
        ),
        (["--use-torch-fsdp2", "--use-distributed-optimizer"], "not supported with MCore's distributed optimizer"),
        (["--use-torch-fsdp2", "--preset", "gpt"], "requires --untie-embeddings-and-output-weights"),
        # Megatron-FSDP's hybrid sharding (HSDP)
        (
            ["--data-parallel-size", "4", "--num-distributed-optimizer-instances", "2"],
            "runs here with --use-megatron-fsdp",
        ),
        (
            [*"--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params".split()]
            + ["--data-parallel-size", "4", "--num-distributed-optimizer-instances", "3"],
            "'Data parallel size should be divisible by partial DistOpt shard factor'",
        ),
        (
            ["--outer-dp-sharding-strategy", "optim", "--use-megatron-fsdp", "--data-parallel-size", "4"]
            + ["--data-parallel-sharding-strategy", "optim_grads_params"],
            "acts with --use-megatron-fsdp --num-distributed-optimizer-instances > 1",
        ),
        (
            [*"--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --data-parallel-size 4".split()]
            + ["--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy", "optim"],
            'only supported when --data-parallel-sharding-strategy is "optim_grads_params"',
        ),
        (
            [*"--use-megatron-fsdp --data-parallel-sharding-strategy optim --data-parallel-size 4".split()]
            + ["--num-distributed-optimizer-instances", "2"],
            "Add --overlap-grad-reduce",
        ),
        (
            [*"--preset moe --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params".split()]
            + ["--data-parallel-size", "4", "--expert-model-parallel-size", "2"]
            + ["--num-distributed-optimizer-instances", "2"],
            "builds no expert mesh under hybrid sharding",
        ),
    ],
)
def test_megatron_lms_refusals_before_any_process_starts(tmp_path, capsys, no_process, args, message):
    if "expert mesh" in message:
        from mindspeed_like.fixes.megatron_fsdp_hsdp_experts import expert_mesh_under_hsdp

        if expert_mesh_under_hsdp():  # megatron-core 0.17+: HSDP with experts trains there
            pytest.skip("the installed megatron-core builds the expert mesh under hybrid sharding")
    code = main(["compare", "--out", str(tmp_path), *args])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "compare.json")


def test_no_shard_is_refused_where_the_fix_refuses_it(tmp_path, capsys, no_process):
    from mindspeed_like.fixes.megatron_fsdp_no_shard import refusal

    if refusal() is None:  # megatron-core 0.19+: no_shard trains as DDP there
        pytest.skip("the installed megatron-core trains no_shard correctly")
    code = main(["compare", "--out", str(tmp_path), "--use-megatron-fsdp", "--data-parallel-size", "2"])
    assert code == 2
    assert "no_shard" in capsys.readouterr().err


def test_record_names_tag_the_fsdp_path():
    import argparse

    from mindspeed_like.compare import add_compare_arguments
    from mindspeed_like.compare.report import record_name

    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    args = parser.parse_args("--data-parallel-size 2 --use-torch-fsdp2 --torch-fsdp2-no-reshard-after-forward".split())
    assert record_name(args, {}) == "compare-llama-dp2-fsdp2-noreshard"
    args = parser.parse_args(
        "--data-parallel-size 2 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params".split()
    )
    assert record_name(args, {"optimization_level": 1}) == "compare-llama-dp2-mfsdp-optim_grads_params-level1"
    args = parser.parse_args(
        "--data-parallel-size 4 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
        "--num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim".split()
    )
    assert record_name(args, {}) == "compare-llama-dp4-mfsdp-optim_grads_params-instances2-outer-optim"


def test_hsdp_reaches_megatrons_parallel_state_and_the_wrapper():
    """--num-distributed-optimizer-instances goes to both places megatron reads it: the parallel state
    (the worker's initialize_model_parallel builds the intra- and inter-instance groups) and the
    wrapper's DistributedDataParallelConfig (the adapter's HSDP mesh), with the outer strategy."""
    import argparse

    from mindspeed_like.compare import _spec_layout, add_compare_arguments, data_parallel_path

    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    args = parser.parse_args(
        "--data-parallel-size 4 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
        "--num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim".split()
    )
    assert data_parallel_path(args) == (
        "megatron_fsdp",
        {
            "data_parallel_sharding_strategy": "optim_grads_params",
            "num_distributed_optimizer_instances": 2,
            "outer_dp_sharding_strategy": "optim",
        },
    )
    assert _spec_layout(args)["instances"] == 2
    args = parser.parse_args("--data-parallel-size 4 --use-megatron-fsdp".split())
    assert "num_distributed_optimizer_instances" not in data_parallel_path(args)[1]


def test_megatron_fsdp_buffer_roles_cover_the_installed_release():
    """Every DataParallelBuffer field of the installed ParameterGroup has a kind, and the master
    weights and gradients are not counted as weights."""
    from mindspeed_like.compare.measure import _megatron_fsdp_buffer_roles

    roles = _megatron_fsdp_buffer_roles()
    assert roles["model_weight_buffer"] == "weights"
    assert roles["main_weight_buffer"] == "optimizer"
    assert roles["main_grad_buffer"] == "gradients"
    # HSDP's gradient buffers (0.16: hsdp_gbuf; 0.19: hfsdp_helper_gbuf, hsdp_comm_gbuf), where the release has them
    for name in ("hsdp_gbuf", "hfsdp_helper_gbuf", "hsdp_comm_gbuf"):
        assert roles.get(name, "gradients") == "gradients", name


def test_the_meter_counts_a_dtensors_local_shard_and_skips_a_freed_storage():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from mindspeed_like.compare.measure import _storages
    from mindspeed_like.workloads.parallel import free_port

    created = not dist.is_initialized()  # the single-process tests before this one may have left theirs
    if created:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        mesh = init_device_mesh("cpu", (1,))
        shard = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
        freed = torch.ones(16)
        freed.untyped_storage().resize_(0)  # what FSDP does to a resharded parameter's storage
        assert sum(_storages([shard, freed]).values()) == 8 * 4 * 4
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.slow  # four 2-process arms, ~1-2 min; tests/fsdp trains FSDP2 in the default lane
def test_torch_fsdp2_model_state_falls_with_data_parallel_size(tmp_path):
    """Both arms under FSDP2 train the same losses as each other; the per-rank weights, gradients
    and optimizer state at DP=2 are half the DP=1 run's (the shards), within one row of padding."""
    one = _compare(tmp_path / "dp1", "--use-torch-fsdp2")
    two = _compare(tmp_path / "dp2", "--use-torch-fsdp2", "--data-parallel-size", "2")
    assert two["parallel"]["data_parallel"] == {"wrapper": "torch_fsdp2", "reshard_after_forward": True}
    assert two["loss"]["max_abs_diff"] < 1e-4
    for kind in ("weights", "gradients", "optimizer"):
        whole, shard = one["megatron"]["memory_per_rank"][kind], two["megatron"]["memory_per_rank"][kind]
        assert whole > 0 and abs(shard - whole / 2) <= 0.02 * whole, (kind, whole, shard)


@pytest.mark.slow
def test_megatron_fsdp_trains_both_arms_and_shards_the_optimizer(tmp_path):
    result = _compare(
        tmp_path,
        "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy",
        "optim_grads_params",
        "--data-parallel-size",
        "2",
    )
    assert result["parallel"]["data_parallel"]["data_parallel_sharding_strategy"] == "optim_grads_params"
    assert result["loss"]["max_abs_diff"] < 1e-4
    assert all(v > 0 for v in result["megatron"]["memory_per_rank"].values())


def test_megatron_fsdp_buffers_count_by_kind_even_where_a_parameter_views_them():
    """During a step Megatron-FSDP's module parameters are views of its fp32 master shard: they
    count once, as optimizer state; the bf16 shard as weights, the main-gradient shard as gradients."""
    from types import SimpleNamespace

    from mindspeed_like.compare.measure import state_bytes

    def buffer(numel: int, dtype: torch.dtype) -> SimpleNamespace:
        return SimpleNamespace(data=torch.zeros(numel, dtype=dtype))

    group = SimpleNamespace(
        model_weight_buffer=buffer(10, torch.bfloat16),
        main_weight_buffer=buffer(10, torch.float32),
        main_grad_buffer=buffer(10, torch.float32),
    )
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(group.main_weight_buffer.data[:10].view(2, 5))  # a master view
    model.param_and_grad_buffer = SimpleNamespace(parameter_groups=[group])
    moments = torch.optim.Adam(model.parameters())
    moments.state[model.weight] = {"exp_avg": torch.zeros(10), "exp_avg_sq": torch.zeros(10)}
    assert state_bytes(model, moments) == {"weights": 20, "gradients": 40, "optimizer": 40 + 80}


def test_megatron_fsdp_gathered_unit_is_no_state():
    """megatron-core 0.19 keeps the unit outside Megatron-FSDP's units gathered between steps; the
    optimizer's parameters reach its bucket through ``orig_param``. It is the plan's unsharded unit in
    flight, not optimizer state (counted there it made megatron's optimizer 6.59 B/param at DP=2, not 6.0);
    a module parameter that views a buffer keeps that buffer's kind."""
    from types import SimpleNamespace

    from mindspeed_like.compare.measure import state_bytes

    group = SimpleNamespace(model_weight_buffer=SimpleNamespace(data=torch.zeros(10, dtype=torch.bfloat16)))
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(group.model_weight_buffer.data[:5].clone())  # a shard's own storage
    model.weight.orig_param = torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))  # the gathered bucket
    model.param_and_grad_buffer = SimpleNamespace(parameter_groups=[group])
    adam = torch.optim.Adam(model.parameters())
    adam.state[model.weight] = {"exp_avg": torch.zeros(5)}
    assert state_bytes(model, adam) == {"weights": 20 + 10, "gradients": 0, "optimizer": 20}
    model.weight.orig_param = torch.nn.Parameter(group.model_weight_buffer.data)  # unsharded: the buffer itself
    assert state_bytes(model, adam) == {"weights": 20 + 10, "gradients": 0, "optimizer": 20}


def test_megatron_fsdp_no_shard_weights_are_the_modules_own_parameters():
    """``no_shard`` builds no model-weight buffer: the bf16 training weights are the module's own parameters
    (the group's ``params``), reached during a step only through ``orig_param`` of the DTensors that view the
    fp32 main-weight buffer. They are weights, not a gathered unit: compare read them as 0 bytes on 0.19.2
    (llama DP 2: 3,082,752, what the plan says) before the meter counted a group's parameters where no buffer
    holds its weights."""
    from types import SimpleNamespace

    from mindspeed_like.compare.measure import state_bytes

    raw = torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))  # the module's parameter, its own storage
    group = SimpleNamespace(
        params=[raw],
        model_weight_buffer=None,
        main_weight_buffer=SimpleNamespace(data=torch.zeros(10, dtype=torch.float32)),
        main_grad_buffer=SimpleNamespace(data=torch.zeros(10, dtype=torch.bfloat16)),
    )
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(group.main_weight_buffer.data.view(2, 5))  # the step's view of the master
    model.weight.orig_param = raw
    model.param_and_grad_buffer = SimpleNamespace(parameter_groups=[group])
    adam = torch.optim.Adam(model.parameters())
    adam.state[model.weight] = {"exp_avg": torch.zeros(10), "exp_avg_sq": torch.zeros(10)}
    assert state_bytes(model, adam) == {"weights": 20, "gradients": 20, "optimizer": 40 + 80}


MFSDP = [*"--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --data-parallel-size 2".split()]


def _refusal(tmp_path, capsys, *args: str) -> str:
    assert main(["compare", "--out", str(tmp_path), *args]) == 2
    assert not os.path.exists(tmp_path / "compare.json")
    return capsys.readouterr().err


def test_megatron_fsdp_buffer_dtypes_megatron_stops_at_are_refused_before_any_process_starts(
    tmp_path, capsys, no_process
):
    """Megatron-LM's --megatron-fsdp-main-params-dtype / --megatron-fsdp-main-grads-dtype, refused as plan refuses
    them: without --use-megatron-fsdp, on a release without the fields (0.16), and where megatron stops at the
    first step (a non-fp32 .grad under clipping; a gradient of another dtype than its parameter)."""
    from mindspeed_like.plan import megatron_code

    err = _refusal(tmp_path, capsys, "--megatron-fsdp-main-grads-dtype", "fp32")
    assert "act(s) with --use-megatron-fsdp" in err
    err = _refusal(tmp_path, capsys, *MFSDP, "--megatron-fsdp-main-params-dtype", "auto")
    if not megatron_code.megatron_fsdp_has_main_dtype_fields():
        assert "has no megatron_fsdp_main_params_dtype" in err
        return
    assert "asserts fp32 ones at the first step" in err
    auto_fp32 = ["--megatron-fsdp-main-params-dtype", "auto", "--megatron-fsdp-main-grads-dtype", "fp32"]
    err = _refusal(tmp_path, capsys, *MFSDP, *auto_fp32, "--clip-grad", "0")
    assert "a gradient of another dtype" in err


def test_the_precision_aware_optimizer_under_megatron_fsdp_is_refused_where_no_weight_would_move(
    tmp_path, capsys, no_process
):
    from mindspeed_like.plan import megatron_code

    if megatron_code.megatron_fsdp_has_decoupled_grad_field():
        pytest.skip("megatron-core 0.18+ hands the precision-aware optimizer its gradients (decoupled)")
    err = _refusal(tmp_path, capsys, *MFSDP, "--use-precision-aware-optimizer")
    assert "so no weight is updated" in err


def test_megatron_fsdp_dtypes_and_the_precision_aware_optimizer_reach_megatrons_configs():
    """As Megatron-LM's validate_args maps them (auto: None) and get_megatron_ddp_config / the optimizer config
    take them; at their defaults nothing is passed, so the config is the same on every release."""
    import argparse

    from mindspeed_like.compare import add_compare_arguments, data_parallel_path, grad_reduce_in_fp32
    from mindspeed_like.compare.arguments import optimizer_options
    from mindspeed_like.plan import megatron_code

    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    args = parser.parse_args(MFSDP)
    assert data_parallel_path(args)[1] == {"data_parallel_sharding_strategy": "optim_grads_params"}
    assert optimizer_options(args) == {"optimizer": "adam", "clip_grad": 1.0}
    args = parser.parse_args(
        [*MFSDP, "--megatron-fsdp-main-params-dtype", "auto", "--megatron-fsdp-main-grads-dtype", "fp16"]
    )
    options = data_parallel_path(args)[1]
    assert options["megatron_fsdp_main_params_dtype"] is None
    assert options["megatron_fsdp_main_grads_dtype"] is torch.float16
    args = parser.parse_args(
        [*MFSDP, "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16", "--exp-avg-dtype", "fp8"]
    )
    fields = optimizer_options(args)
    assert fields["use_precision_aware_optimizer"] is True
    assert fields["main_grads_dtype"] is torch.bfloat16 and fields["exp_avg_dtype"] is torch.uint8
    assert fields["exp_avg_sq_dtype"] is torch.float32 and fields["main_params_dtype"] is torch.float32
    assert grad_reduce_in_fp32(args) is False  # --main-grads-dtype bf16: Megatron-LM's validate_args leaves it off
    decoupled = data_parallel_path(args)[1].get("megatron_fsdp_use_decoupled_grad", False)
    assert decoupled == megatron_code.megatron_fsdp_has_decoupled_grad_field()


def test_record_names_tag_the_buffer_dtypes_and_the_precision_aware_optimizer():
    import argparse

    from mindspeed_like.compare import add_compare_arguments
    from mindspeed_like.compare.report import record_name

    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    args = parser.parse_args([*MFSDP, "--megatron-fsdp-main-params-dtype", "auto", "--clip-grad", "0"])
    assert record_name(args, {}) == "compare-llama-dp2-mfsdp-optim_grads_params-main-params-auto-clip0.0"
    args = parser.parse_args([*MFSDP, "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"])
    assert record_name(args, {}) == "compare-llama-dp2-mfsdp-optim_grads_params-precision-aware-exp-avg-bf16"
