"""`plan` under megatron's two FSDP paths (plan/fsdp.py), from Megatron-LM's flags and from compare's:
each rank's sharded state by path and strategy, the unsharded units in flight as their own line,
Megatron-LM's (and compare's) refusals, and the largest expert-parallel rank's bound under dropless
routing. The measured side is the accuracy lane's (compare's FSDP records, tests/plan/test_plan_accuracy.py)."""

from __future__ import annotations

import json

import pytest

from mindspeed_like.features.megatron_fsdp_lean_state import acts_with_installed_megatron
from mindspeed_like.plan import cli, megatron_code
from mindspeed_like.plan.predict import routed_rows_bound
from mindspeed_like.plan.spec import Layout, Model, Run

# untied embeddings: FSDP2 requires them (Megatron-LM asserts it)
MODEL = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
    "--vocab-size 1000 --bf16 --swiglu --normalization RMSNorm --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 --parser builtin "
    "--target-device cuda"
).split()
MEGATRON_FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
FSDP2 = ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]


def _plan(extra: list[str], world: int, capsys) -> dict:
    if "--use-torch-fsdp2" in extra:
        extra = [*extra, "--no-gradient-accumulation-fusion"]  # Megatron-LM refuses FSDP2 with it (its default)
    argv = [*MODEL, *extra, "--world-size", str(world), "--global-batch-size", str(world), "--json"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _state(extra: list[str], world: int, capsys) -> dict[str, int]:
    arm = _plan(extra, world, capsys)["per_rank"][0]["megatron"]
    return {k: arm[f"{k}_bytes"] for k in ("weights", "gradients", "optimizer")}


def test_torch_fsdp2_shards_weights_gradients_and_optimizer_as_one_over_dp(capsys) -> None:
    """FSDP2: bf16 shard, bf16 sharded gradients, fp32 master + two fp32 moments of the shard; every
    kind halves from DP 2 to DP 4 (up to the step counters, one fp32 a tensor, not sharded)."""
    ddp = _state([], 1, capsys)
    params = ddp["weights"] // 2
    two, four = _state(["--use-torch-fsdp2"], 2, capsys), _state(["--use-torch-fsdp2"], 4, capsys)
    assert two["weights"] == two["gradients"] == params  # 2 bytes / 2 ranks
    assert 0 < two["optimizer"] - 6 * params <= 4 * 64
    assert four["weights"] == two["weights"] // 2 and four["gradients"] == two["gradients"] // 2
    steps = two["optimizer"] - 6 * params
    assert four["optimizer"] - steps == (two["optimizer"] - steps) // 2


@pytest.mark.parametrize("release", ["0.16.1", "0.19.2"])
@pytest.mark.parametrize(
    ("strategy", "sharded"),
    [
        ("optim", {"optimizer"}),
        ("optim_grads", {"optimizer", "gradients"}),
        ("optim_grads_params", {"optimizer", "gradients", "weights"}),
    ],
)
def test_megatron_fsdp_shards_what_its_strategy_names(strategy: str, sharded: set[str], release: str, capsys) -> None:
    """The fp32 masters and Adam's moments are sharded by every strategy (optimizer state, as compare's
    meter counts the main-weight buffer); the main-grad buffer by optim_grads and optim_grads_params; the
    bf16 model-weight buffer by optim_grads_params only, so only there does every kind fall as 1/DP. The
    main-grad buffer is the layout read from the release's code (megatron_code): fp32 where it follows
    ``grad_reduce_in_fp32`` (0.16-0.18), else bf16 plus the fp32 copy of the rank's gradient shard that
    ``update_main_grads`` casts for the fp32 masters (0.19: compare measured 2 + 4 bytes an element of the
    shard, results/mc0.19.2-compare-plan-llama-dp2-mfsdp-level1.json)."""
    params = _state([], 1, capsys)["weights"] // 2
    extra = [*MEGATRON_FSDP, "--data-parallel-sharding-strategy", strategy]
    with megatron_code.as_measured_on(release):
        two, four = _state(extra, 2, capsys), _state(extra, 4, capsys)
        fp32_buffer = megatron_code.megatron_fsdp_grads_follow_grad_reduce_in_fp32()
        assert megatron_code.megatron_fsdp_casts_grads_to_the_masters_dtype()
    assert fp32_buffer == (release != "0.19.2")
    buffer, copy = (4, 0) if fp32_buffer else (2, 4)  # bytes an element of the buffer / of the shard's fp32 copy
    steps = 4 * 64  # Adam's step counters: one fp32 a parameter tensor, on every rank
    assert 0 < two["optimizer"] - 12 * params // 2 <= steps
    assert abs(four["optimizer"] - two["optimizer"] / 2) <= steps
    grads_whole = "gradients" not in sharded
    for dp, state in ((2, two), (4, four)):
        assert state["gradients"] == buffer * params // (1 if grads_whole else dp) + copy * params // dp
    if "weights" in sharded:
        assert two["weights"] == params and four["weights"] == params // 2  # the bf16 shard
    else:
        assert two["weights"] == four["weights"] == 2 * params  # the bf16 buffer, whole


def test_megatron_fsdp_keeps_fp32_masters_of_fp32_parameters(capsys) -> None:
    """Megatron-FSDP's main-weight buffer is made whatever the parameters' dtype (megatron_code: the default
    of ``megatron_fsdp_main_params_dtype`` / ``preserve_fp32_weights``): at fp32 a rank holds its fp32 weight
    shard, an fp32 gradient shard (no copy: the buffer is the masters' dtype), and 12 bytes an element of the
    shard of optimizer state, as at bf16. Measured by compare (llama DP 2 optim_grads_params --fp32, optimizer
    9,276,496 bytes on 0.16.1 and 9,276,488 on 0.19.2, weights 3,101,696: 12 / 4 bytes an element)."""
    fp32 = [a for a in MODEL if a != "--bf16"]
    argv = [*fp32, *MEGATRON_FSDP, "--data-parallel-sharding-strategy", "optim_grads_params"]
    assert cli.main([*argv, "--world-size", "2", "--global-batch-size", "2", "--json"]) == 0
    two = json.loads(capsys.readouterr().out)["per_rank"][0]["megatron"]
    shard = two["weights_bytes"] // 4  # elements of the rank's shard
    assert two["gradients_bytes"] == 4 * shard
    assert 0 < two["optimizer_bytes"] - 12 * shard <= 4 * 64


def test_the_unsharded_units_in_flight_are_a_line_of_their_own(capsys) -> None:
    argv = [*MODEL, *FSDP2, "--world-size", "2", "--global-batch-size", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "FSDP: unsharded units in flight (below)" in out
    assert (
        "FSDP: unsharded units in flight: FSDP2: the gathered parameters of the largest unit (layer 0) and of 1 "
        "prefetched unit(s), and its unsharded gradients (backward)"
    ) in out
    assert "torch FSDP2 (reshard after forward)" in out


def test_without_reshard_after_forward_every_unit_is_held_from_forward_to_backward(capsys) -> None:
    """ZeRO-2: each unit's gathered parameters stay from its forward to its backward; the ones autograd
    saves count in one microbatch's activations (as compare's probe measures them), by unit."""
    resharded = _plan(["--use-torch-fsdp2"], 2, capsys)["per_rank"][0]["megatron"]
    held = _plan(["--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"], 2, capsys)
    arm = held["per_rank"][0]["megatron"]
    kept = arm["activations_per_group_bytes"]["FSDP"]
    # every unit but the embedding's: all parameters less the embedding table, in bf16
    ddp = _state([], 1, capsys)
    assert kept == ddp["weights"] - 2 * 1024 * 256  # the vocabulary padded to 1024 rows
    assert arm["activations_bytes"] == resharded["activations_bytes"] + kept
    assert "FSDP" not in resharded["activations_per_group_bytes"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("--use-torch-fsdp2 --use-megatron-fsdp", "two FSDP paths; choose one"),
        ("--torch-fsdp2-no-reshard-after-forward", "acts with --use-torch-fsdp2; give both"),
        ("--data-parallel-sharding-strategy optim", "acts with --use-megatron-fsdp; give both"),
        ("--use-torch-fsdp2 --use-distributed-optimizer", "not supported with MCore's distributed optimizer"),
        (
            "--use-torch-fsdp2 --pipeline-model-parallel-size 2",
            "'--use-torch-fsdp2 is not supported with pipeline parallelism'",
        ),
        ("--use-torch-fsdp2 --no-gradient-accumulation-fusion --fp16", "not supported with fp16"),
        ("--use-torch-fsdp2", "not supported with gradient accumulation fusion' (Megatron-LM's default: add"),
        ("--use-megatron-fsdp --data-parallel-sharding-strategy optim", "--ckpt-format fsdp_dtensor"),
    ],
)
def test_megatron_lms_refusals_of_the_fsdp_paths(extra: str, message: str, capsys) -> None:
    argv = [*MODEL, *extra.split(), "--world-size", "4", "--global-batch-size", "4"]
    if "--fp16" in extra:
        argv.remove("--bf16")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert any(part in err for part in message.split("|")), err


def test_fsdp2_refuses_tied_embeddings(capsys) -> None:
    argv = [*MODEL, *FSDP2, "--world-size", "2", "--global-batch-size", "2"]
    argv.remove("--untie-embeddings-and-output-weights")
    assert cli.main(argv) == 2
    assert "'--use-torch-fsdp2 requires --untie-embeddings-and-output-weights'" in capsys.readouterr().err


def test_no_shard_is_refused_where_megatron_core_does_not_train_it(capsys) -> None:
    from mindspeed_like.fixes.megatron_fsdp_no_shard import refusal

    argv = [*MODEL, *MEGATRON_FSDP, "--world-size", "2", "--global-batch-size", "2"]
    if refusal() is None:
        pytest.skip("the installed megatron-core trains no_shard")
    assert cli.main(argv) == 2
    assert "--data-parallel-sharding-strategy no_shard" in capsys.readouterr().err


def test_compares_options_predict_the_same_fsdp_state(capsys) -> None:
    """compare's --use-torch-fsdp2 reads into the same layout as Megatron-LM's flag."""
    argv = "--preset llama --num-layers 2 --hidden-size 256 --seq-length 256 --micro-batch-size 2".split()
    assert cli.main([*argv, "--data-parallel-size", "2", "--use-torch-fsdp2", "--json"]) == 0
    fsdp2 = json.loads(capsys.readouterr().out)["per_rank"][0]["megatron"]
    assert cli.main([*argv, "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)["per_rank"][0]["megatron"]
    assert fsdp2["weights_bytes"] == whole["weights_bytes"] // 2
    assert cli.main([*argv, "--torch-fsdp2-no-reshard-after-forward"]) == 2
    assert "acts with --use-torch-fsdp2" in capsys.readouterr().err


def _moe_run(experts: int, topk: int, ep: int) -> Run:
    model = Model(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        vocab_size=128,
        seq_length=32,
        kv_channels=16,
        num_query_groups=4,
        num_experts=experts,
        moe_ffn_hidden_size=64,
        moe_router_topk=topk,
        moe_layer_pattern=(1,),
    )
    return Run(model=model, layout=Layout(ep=ep, dp=ep))


@pytest.mark.parametrize(
    ("experts", "topk", "ep", "bound"),
    [
        (8, 2, 1, None),  # one rank holds every expert: it receives every row, the plan's own figure
        (8, 2, 2, 2.0),  # 4 local experts take both of a token's picks: all EP x t tokens, twice
        (8, 2, 8, 4.0),  # one local expert: a token sends it one row at most (8 x 1 / 2)
        (64, 8, 8, 8.0),  # 8 local experts >= top-8: EP x
        (16, 6, 4, 4 * 4 / 6),  # 4 local experts < top-6: a token sends it 4 rows at most
    ],
)
def test_the_largest_ranks_routed_rows_are_bounded_by_dropless_routings_worst_case(
    experts: int, topk: int, ep: int, bound: float | None
) -> None:
    assert routed_rows_bound(_moe_run(experts, topk, ep)) == bound


def test_the_plan_gives_the_mean_and_the_largest_ranks_bound_under_expert_parallelism(capsys) -> None:
    argv = "--preset moe --num-layers 2 --seq-length 512 --micro-batch-size 2 --data-parallel-size 2".split()
    assert cli.main([*argv, "--expert-model-parallel-size", "2", "--json"]) == 0
    arm = json.loads(capsys.readouterr().out)["per_rank"][0]["megatron"]
    assert arm["activations_largest_rank_bound_bytes"] > arm["activations_bytes"]
    assert cli.main([*argv, "--json"]) == 0
    assert (
        json.loads(capsys.readouterr().out)["per_rank"][0]["megatron"]["activations_largest_rank_bound_bytes"] is None
    )


def test_fsdp2_configs_hsdp_shards_over_its_sharding_size(tmp_path, capsys) -> None:
    """fsdp2-config's sharding_size (the features arm's HSDP): each parameter sharded over that many
    ranks and replicated across the groups, so the features arm holds DP / sharding_size times
    megatron's plain FSDP2 shards; its other keys are said to be outside the plan."""
    config = tmp_path / "hsdp.yaml"
    config.write_text("sharding_size: 2\n")
    argv = "--preset llama --num-layers 2 --hidden-size 256 --seq-length 256 --micro-batch-size 2".split()
    argv += ["--data-parallel-size", "4", "--use-torch-fsdp2", "--optimization-level", "1"]
    assert cli.main([*argv, "--fsdp2-config-path", str(config), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["per_rank"][0]
    for kind in ("weights", "gradients"):
        assert out["features"][f"{kind}_bytes"] == 2 * out["megatron"][f"{kind}_bytes"], kind
    steps = 4 * 64
    assert abs(out["features"]["optimizer_bytes"] - 2 * out["megatron"]["optimizer_bytes"]) <= steps
    config.write_text("sharding_size: 2\nparam_dtype: fp32\n")
    assert cli.main([*argv, "--fsdp2-config-path", str(config)]) == 0
    assert "fsdp2-config: the plan models its sharding_size (HSDP); not its param_dtype" in capsys.readouterr().out


def test_fit_keeps_to_what_megatron_runs_under_fsdp2(capsys) -> None:
    """--fit under --use-torch-fsdp2 tries no pipeline split and adds no distributed optimizer (Megatron-LM
    refuses both with FSDP2); its command line is one Megatron-LM takes."""
    argv = [*MODEL, *FSDP2, "--world-size", "8", "--global-batch-size", "8", "--fit", "--device-memory", "1GiB"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    line = next(text for text in out.splitlines() if text.startswith("recommended:"))
    assert "--use-torch-fsdp2" in line and "--use-distributed-optimizer" not in line
    assert "--pipeline-model-parallel-size 1" in line
    assert "  PP 1 (" not in out  # no other pipeline split was tried


def test_fsdp2_configs_resharding_and_prefetch_are_the_features_arms(tmp_path, capsys) -> None:
    """fsdp2-config's reshard_after_forward: false keeps every unit's gathered parameters from forward
    to backward in the features arm (as --torch-fsdp2-no-reshard-after-forward does for both arms), and
    its explicit prefetch counts set how many units are gathered at once."""
    config = tmp_path / "fsdp2.yaml"
    argv = "--preset llama --num-layers 2 --hidden-size 256 --seq-length 256 --micro-batch-size 2".split()
    argv += ["--data-parallel-size", "2", "--use-torch-fsdp2", "--optimization-level", "1", "--json"]
    config.write_text("reshard_after_forward: false\nnum_to_backward_prefetch: 2\n")
    assert cli.main([*argv, "--fsdp2-config-path", str(config)]) == 0
    out = json.loads(capsys.readouterr().out)["per_rank"][0]
    assert "FSDP" in out["features"]["activations_per_group_bytes"]
    assert "FSDP" not in out["megatron"]["activations_per_group_bytes"]
    # backward: the unit, two prefetched and the unit's gradients, against FSDP2's own one prefetched
    assert out["features"]["fsdp_in_flight_bytes"] * 3 == out["megatron"]["fsdp_in_flight_bytes"] * 4


def test_megatron_fsdp_shards_an_experts_parameters_over_its_expert_data_parallel_group(capsys) -> None:
    """Under EP an expert's parameters are sharded over the expert data-parallel group (TP x CP x DP /
    (expert TP x EP): 1 at DP 2, EP 2, so whole on each rank), the dense ones over DP. Measured by compare
    (moe 2L h256 s256 mbs2, DP 2, EP 2, optim_grads_params): gradients 18,230,272 bytes, the plan 18,229,760."""
    from mindspeed_like.plan.params import stage

    argv = "--preset moe --num-layers 2 --hidden-size 256 --seq-length 256 --micro-batch-size 2".split()
    argv += "--data-parallel-size 2 --expert-model-parallel-size 2 --use-megatron-fsdp".split()
    argv += ["--data-parallel-sharding-strategy", "optim_grads_params", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)["per_rank"][0]["megatron"]
    grads = out["gradients_bytes"]
    run = cli.predict_argv(argv[:-1]).run
    params = [p for chunk in stage(run, 0) for p in chunk]
    dense = sum(-(-p.numel // 2) for p in params if not p.expert)
    experts = sum(p.numel for p in params if p.expert)
    # an fp32 main-grad buffer (0.16-0.18), or a bf16 one and the fp32 copy of the shard for the masters (0.19)
    per_element = 4 if megatron_code.megatron_fsdp_grads_follow_grad_reduce_in_fp32() else 2 + 4
    assert experts and grads == per_element * (dense + experts)


@pytest.mark.skipif(
    not acts_with_installed_megatron(), reason="megatron-fsdp-lean-state acts on megatron-core 0.16 only"
)
def test_megatron_fsdp_lean_state_is_the_features_arms_layout_at_level_2(capsys) -> None:
    """megatron-fsdp-lean-state (level 2, bf16, Megatron-FSDP): the features arm keeps the bf16 weight
    shard, a bf16 main-grad shard, and int16 remainders + bf16 moments (no fp32 main-weight buffer, no
    step tensors): 10/DP bytes a parameter where megatron's arm holds 18/DP; level 1 leaves it as megatron's."""
    argv = "--preset llama --num-layers 2 --hidden-size 256 --seq-length 256 --micro-batch-size 2".split()
    argv += [
        "--data-parallel-size",
        "2",
        "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy",
        "optim_grads_params",
    ]
    assert cli.main([*argv, "--optimization-level", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["per_rank"][0]
    megatron, lean = out["megatron"], out["features"]
    shard = megatron["weights_bytes"]  # bf16 shard: one byte a parameter at DP 2
    assert lean["weights_bytes"] == shard
    # megatron's: an fp32 main-grad shard (0.16-0.18), or a bf16 one and its fp32 copy for the masters (0.19)
    grads = 2 if megatron_code.megatron_fsdp_grads_follow_grad_reduce_in_fp32() else 1 + 2
    assert megatron["gradients_bytes"] == grads * shard and lean["gradients_bytes"] == shard
    assert lean["optimizer_bytes"] == 3 * shard
    assert 6 * shard < megatron["optimizer_bytes"] <= 6 * shard + 4 * 64
    assert cli.main([*argv, "--optimization-level", "1"]) == 0
    text = capsys.readouterr().out
    assert cli.main([*argv, "--optimization-level", "2"]) == 0
    assert "megatron-fsdp-lean-state" in capsys.readouterr().out and "megatron-fsdp-lean-state" not in text


def test_megatron_fsdp_hsdp_shards_within_an_instance_and_optim_shards_the_masters_across(capsys) -> None:
    """Megatron-FSDP's hybrid sharding (megatron-core 0.16.1's mcore_fsdp_adapter._init_dist_index):
    with --num-distributed-optimizer-instances 2 at DP 4 every buffer is sharded over the instance's 2
    ranks (the state of DP 2, replicated across the instances); --outer-dp-sharding-strategy optim puts
    the fp32 masters and Adam's moments on the whole DP group (the state of DP 4) and leaves the weights
    and gradients in the instance's hsdp buffers (those of DP 2). Measured: the accuracy lane's
    compare-plan-llama-dp4-mfsdp-hsdp2*-level1 records."""
    extra = [*MEGATRON_FSDP, "--data-parallel-sharding-strategy", "optim_grads_params"]
    two, four = _state(extra, 2, capsys), _state(extra, 4, capsys)
    hsdp = [*extra, "--num-distributed-optimizer-instances", "2"]
    assert _state(hsdp, 4, capsys) == two
    outer = _state([*hsdp, "--outer-dp-sharding-strategy", "optim"], 4, capsys)
    assert outer["weights"] == two["weights"] and outer["optimizer"] == four["optimizer"]
    if megatron_code.megatron_fsdp_grads_follow_grad_reduce_in_fp32():
        assert outer["gradients"] == two["gradients"]  # the instance's fp32 main-grad shard
    else:
        # 0.19: the instance's bf16 main-grad shard (the size of DP 2's bf16 weight shard) and the fp32 copy
        # update_main_grads casts of the main-grad buffer's shard over the whole DP group (DP 4's copy)
        assert outer["gradients"] == two["weights"] + (four["gradients"] - four["weights"])
    text = _plan(hsdp, 4, capsys)
    assert "HSDP: 2 instances of 2 ranks" in json.dumps(text)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("--num-distributed-optimizer-instances 3", "'Data parallel size should be divisible by partial DistOpt"),
        (
            "--num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim "
            "--data-parallel-sharding-strategy optim_grads",
            'only supported when --data-parallel-sharding-strategy is "optim_grads_params"',
        ),
        ("--outer-dp-sharding-strategy optim", "acts with --use-megatron-fsdp --num-distributed-optimizer-instances"),
        (
            "--num-distributed-optimizer-instances 2 --data-parallel-sharding-strategy optim",
            "Add --overlap-grad-reduce",
        ),
    ],
)
def test_megatron_fsdp_hsdp_refusals(extra: str, message: str, capsys) -> None:
    argv = [*MODEL, *MEGATRON_FSDP, *extra.split(), "--world-size", "4", "--global-batch-size", "4"]
    if "--data-parallel-sharding-strategy" not in extra:
        argv += ["--data-parallel-sharding-strategy", "optim_grads_params"]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_distributed_optimizers_instances_under_ddp_are_said_not_modeled(capsys) -> None:
    argv = [*MODEL, "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
    out = _plan(argv[len(MODEL) :], 4, capsys)
    assert "--num-distributed-optimizer-instances" in out["not_modeled"]
    out = _plan([*MEGATRON_FSDP, "--data-parallel-sharding-strategy", "optim_grads_params"], 4, capsys)
    assert "--num-distributed-optimizer-instances" not in out["not_modeled"]


def test_compares_hsdp_options_predict_megatron_lms_state(capsys) -> None:
    """compare's --num-distributed-optimizer-instances / --outer-dp-sharding-strategy read into the same
    layout as Megatron-LM's flags; compare refuses them without Megatron-FSDP."""
    argv = "--preset llama --num-layers 2 --hidden-size 256 --seq-length 256 --micro-batch-size 2".split()
    argv += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    states = {}
    for name, extra in (
        ("dp2", ["--data-parallel-size", "2"]),
        ("hsdp", ["--data-parallel-size", "4", "--num-distributed-optimizer-instances", "2"]),
    ):
        assert cli.main([*argv, *extra, "--json"]) == 0
        arm = json.loads(capsys.readouterr().out)["per_rank"][0]["megatron"]
        states[name] = [arm[f"{k}_bytes"] for k in ("weights", "gradients", "optimizer")]
    assert states["hsdp"] == states["dp2"]
    plain = "--preset llama --num-layers 2 --data-parallel-size 4 --num-distributed-optimizer-instances 2".split()
    assert cli.main(plain) == 2
    assert "runs here with --use-megatron-fsdp" in capsys.readouterr().err


def _moe_fsdp(extra: str, capsys) -> tuple[dict, list]:
    from mindspeed_like.plan.params import stage

    argv = "--preset moe --num-layers 2 --hidden-size 256 --seq-length 256 --micro-batch-size 2".split()
    argv += [*extra.split(), "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["per_rank"][0]["megatron"]
    run = cli.predict_argv(argv).run
    return out, [p for chunk in stage(run, 0) for p in chunk]


@pytest.mark.parametrize(
    ("extra", "experts_gathered", "experts_saved"),
    [
        # expert DP 1: the experts' buffer is not sharded, never gathered (their weights are saved as they are,
        # counted as weights)
        ("--data-parallel-size 2 --expert-model-parallel-size 2", False, False),
        # expert DP 2: gathered, and the grouped GEMM keeps the weights themselves (the TE spec's te-backend, as
        # the local spec's experts): the gathered bucket is kept to backward
        ("--data-parallel-size 4 --expert-model-parallel-size 2", True, True),
        ("--data-parallel-size 4 --expert-model-parallel-size 2 --transformer-impl local", True, True),
    ],
)
def test_megatron_fsdp_keeps_an_experts_bucket_only_where_gathered_and_saved(
    extra: str, experts_gathered: bool, experts_saved: bool, capsys
) -> None:
    """compare, moe EP2 x DP2 (expert DP 1) optim_grads_params, saved tensors by storage: each layer's dense
    bucket (332,800 bytes) kept from forward to backward, no expert bucket (measured when the te-backend's
    grouped GEMM still saved stacked [4, 1408, 256] / [4, 256, 704] copies of the expert weights). Counting
    the experts there put megatron's arm 18% over. Measured on 0.16.1, predicted as 0.16.1 (0.18 and later keep
    no layer's bucket to backward: test_megatron_fsdp_keeps_the_layers_gathered_buckets_to_backward_...)."""
    with megatron_code.as_measured_on("0.16.1"):
        out, params = _moe_fsdp(extra, capsys)
    layer = [p for p in params if p.name.startswith("decoder.layers.0.")]
    dense = 2 * sum(p.numel for p in layer if not p.expert)
    experts = 2 * sum(p.numel for p in layer if p.expert)
    assert dense and experts
    assert out["activations_per_group_bytes"]["FSDP"] == 2 * (dense + (experts if experts_saved else 0))
    rest = 2 * sum(p.numel for p in params if not p.name.startswith("decoder.layers."))
    assert out["fsdp_in_flight_bytes"] == rest + dense + (experts if experts_gathered else 0)


def test_grouped_experts_keep_no_stacked_copy_of_their_weights() -> None:
    """The te-backend's grouped GEMM keeps the experts' own weights for backward (kernels/grouped_gemm.py's
    gmm_experts): no stacked-weights row on either arm, with moe-alltoall-overlap's per-local-expert calls
    (EP 2) or without (EP 1). Before, each call saved a stacked copy (compare, moe EP2 x DP2 level 1: four
    [4, 1408, 256] and four [4, 256, 704] a layer); the experts' rows are the same on both arms."""
    argv = "--preset moe --num-layers 2 --hidden-size 256 --seq-length 256 --micro-batch-size 2".split()
    argv += ["--data-parallel-size", "2", "--optimization-level", "1"]
    for ep in (1, 2):
        pred = cli.predict_argv([*argv, "--expert-model-parallel-size", str(ep)])
        for arm in ("features", "megatron"):
            rows = getattr(pred, arm).stages[0].chunk_rows[0]["layer 0"]
            assert [r.what for r in rows if "stacked" in r.what] == [], (ep, arm)


# compare's records of Megatron-FSDP outside the accuracy lane (which holds megatron-core 0.16.1's), each
# predicted as the release it ran on (megatron_code.as_measured_by): 0.19.2's bf16 main-grad buffer and the fp32
# copy of its shard (the plan was 33% under on the gradients before it modeled them), fp32 masters of fp32 weights
RELEASE_RECORDS = (
    "mc0.19.2-compare-plan-llama-dp2-mfsdp-level1",
    "mc0.19.2-compare-plan-llama-dp2-mfsdp-optim-level1",
    "mc0.19.2-compare-plan-llama-dp2-mfsdp-fp32-level1",
    "mc0.16.1-compare-plan-llama-dp2-mfsdp-fp32-level1",
    "mc0.19.2-compare-plan-llama-dp4-mfsdp-hsdp2-level1",
    "mc0.19.2-compare-plan-llama-dp4-mfsdp-hsdp2-outer-optim-level1",
    "mc0.19.2-compare-plan-moe-ep2-dp2-mfsdp-level1",
    "hsdp-experts-moe-ep2-dp4-mfsdp-hsdp2-level1-mc0.19.2",
    # no_shard: the weights are the module's own parameters (no weight buffer); compare's meter read 0 bytes
    "mc0.19.2-compare-plan-llama-dp2-mfsdp-no-shard-level1",
    # Megatron-FSDP's buffer dtypes (--megatron-fsdp-main-params-dtype / --megatron-fsdp-main-grads-dtype): fp32
    # gradients and no copy; no main-weight buffer and bf16 moments; bf16 masters and moments (the plan counted the
    # defaults before: gradients +49.1%, +198.2%, +198.2%; optimizer -0.3%, +199.6%, +99.4%)
    "mc0.19.2-compare-plan-llama-dp2-mfsdp-main-grads-fp32-level1",
    "mc0.19.2-compare-plan-llama-dp2-mfsdp-main-params-auto-clip0-level1",
    "mc0.19.2-compare-plan-llama-dp2-mfsdp-main-params-bf16-clip0-level1",
    # the precision-aware optimizer's decoupled gradients (no fp32 copy) and bf16 moments beside the fp32 masters (the
    # plan counted Megatron-FSDP's defaults before: gradients +198.2%, optimizer +49.4%)
    "mc0.19.2-compare-plan-llama-dp2-mfsdp-precision-aware-bf16-moments-level1",
    # the precision-aware Adam over a bf16 / no main-weight buffer keeps no masters of its own, as TE's (megatron 0.18+
    # clears master_weights there): the int16 remainders our Adam kept before: optimizer +20.3% over the plan (bf16)
    "mc0.19.2-compare-plan-llama-dp2-mfsdp-precision-aware-main-params-bf16-clip0-level1",
    "mc0.19.2-compare-plan-llama-dp2-mfsdp-precision-aware-main-params-auto-clip0-level1",
)


@pytest.mark.parametrize("name", RELEASE_RECORDS)
def test_megatron_fsdp_state_is_what_compare_measured_on_its_release(name: str) -> None:
    """Weights, gradients and optimizer state, each within 1% of compare's meter (every byte of the live
    objects; the largest rank), and the activations (compare's probe of the last step's forward; the mean rank
    under EP), both arms, on whichever megatron-core is installed."""
    from mindspeed_like.plan import accuracy
    from mindspeed_like.toolkit import records

    for case in accuracy.cases_of(records.results_dir() / f"{name}.json"):
        for metric in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes"):
            assert abs(case.error(metric)) <= 0.01, (
                f"{name} {case.arm} {metric}: measured {case.measured[metric]:,.0f}, "
                f"plan {case.predicted[metric]:,.0f} ({100 * case.error(metric):+.2f}%)"
            )


@pytest.mark.parametrize(("release", "regathers"), [("0.16.1", True), ("0.19.2", False)])
def test_megatron_fsdp_keeps_the_layers_gathered_buckets_to_backward_where_the_release_regathers_them(
    release: str, regathers: bool, capsys
) -> None:
    """optim_grads_params: 0.16 and 0.17 gather every layer's bucket again when the forward ends (the output
    layer's all-gather prefetches them; megatron_code), so the saved tensors hold them to backward: the
    activations are optim's (which gathers nothing) plus every layer's bucket; 0.18 and 0.19 prefetch nothing
    there from the second step on: optim's. Measured: compare's llama DP 2, megatron's arm, 32,086,528 bytes on
    0.16.1 (compare-plan-llama-dp2-mfsdp-level1) and 29,248,000 on 0.19.2
    (mc0.19.2-compare-plan-llama-dp2-mfsdp-level1), optim's 29,248,000 on both."""
    argv = "--preset llama --num-layers 2 --hidden-size 256 --seq-length 256 --micro-batch-size 2".split()
    argv += ["--data-parallel-size", "2", "--use-megatron-fsdp", "--optimization-level", "1"]
    with megatron_code.as_measured_on(release):
        arms = {}
        for strategy in ("optim", "optim_grads_params"):
            assert cli.main([*argv, "--data-parallel-sharding-strategy", strategy, "--json"]) == 0
            arms[strategy] = json.loads(capsys.readouterr().out)["per_rank"][0]["megatron"]
        assert megatron_code.megatron_fsdp_regathers_the_units_at_the_forward_end() == regathers
    kept = arms["optim_grads_params"]["activations_bytes"] - arms["optim"]["activations_bytes"]
    whole = arms["optim"]["weights_bytes"]  # optim's bf16 weights, whole: the layers' buckets and the rest
    if regathers:
        assert 0.5 * whole < kept < whole
    else:
        assert kept == 0


# Megatron-FSDP's buffer dtypes (Megatron-LM 0.17+'s --megatron-fsdp-main-params-dtype and
# --megatron-fsdp-main-grads-dtype), predicted as megatron-core 0.19.2 lays them out: (main params, main grads) ->
# bytes an element of the rank's shard of (gradients, optimizer state without the step counters); bf16 parameters,
# optim_grads_params at DP 2
MAIN_DTYPES = {
    ("fp32", "auto"): (2 + 4, 4 + 8),  # bf16 buffer and the fp32 copy for the fp32 masters; fp32 masters and moments
    ("fp32", "bf16"): (2 + 4, 4 + 8),  # bf16 is auto's dtype for bf16 parameters
    ("fp32", "fp32"): (4, 4 + 8),  # the buffer in the masters' dtype: no copy
    ("bf16", "auto"): (2, 2 + 4),  # bf16 masters (their own buffer), torch's Adam moments in their dtype
    ("auto", "auto"): (2, 4),  # no main-weight buffer: the optimizer steps the bf16 weight shard, bf16 moments
    ("fp16", "fp32"): (4 + 2, 2 + 4),  # fp32 buffer and the fp16 copy for the fp16 masters; fp16 moments
}


@pytest.mark.parametrize(("main_params", "main_grads"), sorted(MAIN_DTYPES))
def test_megatron_fsdp_buffer_dtypes_decide_the_gradients_and_the_optimizer_state(
    main_params: str, main_grads: str, capsys
) -> None:
    params = _state([], 1, capsys)["weights"] // 2
    extra = [*MEGATRON_FSDP, "--data-parallel-sharding-strategy", "optim_grads_params", "--clip-grad", "0"]
    extra += ["--megatron-fsdp-main-params-dtype", main_params, "--megatron-fsdp-main-grads-dtype", main_grads]
    with megatron_code.as_measured_on("0.19.2"):
        state = _state(extra, 2, capsys)
    grads, optimizer = MAIN_DTYPES[(main_params, main_grads)]
    shard = params // 2
    assert state["weights"] == 2 * shard
    assert state["gradients"] == grads * shard
    assert 0 < state["optimizer"] - optimizer * shard <= 4 * 64  # Adam's step counters, one fp32 a tensor


def test_megatron_fsdp_buffer_dtypes_follow_grad_reduce_in_fp32_on_0_17(capsys) -> None:
    """0.17 and 0.18 still make the gradients fp32 under --accumulate-allreduce-grads-in-fp32 (Megatron-LM's bf16
    default), whatever --megatron-fsdp-main-grads-dtype says; without it (--grad-reduce-in-bf16) the option acts."""
    params = _state([], 1, capsys)["weights"] // 2
    extra = [*MEGATRON_FSDP, "--data-parallel-sharding-strategy", "optim_grads_params"]
    extra += ["--megatron-fsdp-main-grads-dtype", "bf16"]
    with megatron_code.as_measured_on("0.17.1"):
        fp32 = _state(extra, 2, capsys)
        bf16 = _state([*extra, "--grad-reduce-in-bf16"], 2, capsys)
    assert fp32["gradients"] == 4 * (params // 2)
    assert bf16["gradients"] == (2 + 4) * (params // 2)  # the bf16 buffer and its fp32 copy for the masters


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        # megatron's clipping asserts fp32 .grad: a bf16 main-weight buffer, or none over bf16 gradients, stops step 1
        (["--megatron-fsdp-main-params-dtype", "bf16"], "asserts fp32 ones at the first step"),
        (["--megatron-fsdp-main-params-dtype", "auto"], "asserts fp32 ones at the first step"),
        (["--megatron-fsdp-main-params-dtype", "fp16", "--megatron-fsdp-main-grads-dtype", "fp32"], "asserts fp32"),
        # no main-weight buffer: torch refuses a gradient of another dtype than its (bf16) parameter
        (
            [
                "--megatron-fsdp-main-params-dtype",
                "auto",
                "--megatron-fsdp-main-grads-dtype",
                "fp32",
                "--clip-grad",
                "0",
            ],
            "a gradient of another dtype",
        ),
    ],
)
def test_megatron_fsdp_buffer_dtypes_megatron_stops_at_are_refused(extra: list[str], words: str, capsys) -> None:
    argv = [*MODEL, *MEGATRON_FSDP, "--data-parallel-sharding-strategy", "optim_grads_params", *extra]
    with megatron_code.as_measured_on("0.19.2"):
        assert cli.main([*argv, "--world-size", "2", "--global-batch-size", "2"]) != 0
    assert words in capsys.readouterr().err


def test_megatron_fsdp_buffer_dtypes_are_refused_without_megatron_fsdp_and_before_0_17(capsys) -> None:
    given = ["--megatron-fsdp-main-grads-dtype", "fp32"]
    with megatron_code.as_measured_on("0.19.2"):
        assert cli.main([*MODEL, *given, "--world-size", "2", "--global-batch-size", "2"]) != 0
    assert "act(s) with --use-megatron-fsdp" in capsys.readouterr().err
    argv = [*MODEL, *MEGATRON_FSDP, "--data-parallel-sharding-strategy", "optim", *given]
    with megatron_code.as_measured_on("0.16.1"):  # 0.16's DistributedDataParallelConfig has no such field
        assert cli.main([*argv, "--world-size", "2", "--global-batch-size", "2"]) != 0
    assert "has no megatron_fsdp_main_params_dtype" in capsys.readouterr().err
    # an unknown value: Megatron-LM's choices, refused when the arguments are read
    assert cli.main([*MODEL, *MEGATRON_FSDP, "--megatron-fsdp-main-params-dtype", "fp64"]) != 0
    assert "invalid choice: 'fp64'" in capsys.readouterr().err


def test_the_main_dtype_fields_are_read_from_the_installed_release() -> None:
    from mindspeed_like.megatron_version import megatron_core_version

    installed = megatron_core_version()
    assert megatron_code.megatron_fsdp_has_main_dtype_fields() == (installed.release >= (0, 17))
    assert megatron_code.megatron_fsdp_has_decoupled_grad_field() == (installed.release >= (0, 18))
    assert megatron_code.clip_asserts_fp32_grads()


def test_the_precision_aware_optimizer_under_megatron_fsdp_takes_decoupled_gradients(capsys) -> None:
    """megatron-core 0.18+ (``megatron_fsdp_use_decoupled_grad``, which Megatron-LM sets to the flag): the bf16
    main-grad buffer's shard is the optimizer's ``.decoupled_grad`` as it is (no fp32 copy for the masters), the
    fp32 main-weight buffer stays the masters (megatron turns the Adam's own off there), and the moments take the
    dtypes asked for."""
    params = _state([], 1, capsys)["weights"] // 2
    shard = params // 2
    extra = [
        *MEGATRON_FSDP,
        "--data-parallel-sharding-strategy",
        "optim_grads_params",
        "--use-precision-aware-optimizer",
    ]
    with megatron_code.as_measured_on("0.19.2"):
        fp32 = _state(extra, 2, capsys)
        bf16 = _state([*extra, "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"], 2, capsys)
    assert fp32["gradients"] == bf16["gradients"] == 2 * shard
    assert 0 < fp32["optimizer"] - (4 + 8) * shard <= 4 * 64
    assert 0 < bf16["optimizer"] - (4 + 4) * shard <= 4 * 64


@pytest.mark.parametrize("release", ["0.16.1", "0.17.1"])
def test_the_precision_aware_optimizer_under_megatron_fsdp_is_refused_where_it_gets_no_gradient(
    release: str, capsys
) -> None:
    argv = [*MODEL, *MEGATRON_FSDP, "--data-parallel-sharding-strategy", "optim_grads_params"]
    argv += ["--use-precision-aware-optimizer", "--world-size", "2", "--global-batch-size", "2"]
    with megatron_code.as_measured_on(release):
        assert cli.main(argv) != 0
    assert "so no weight is updated" in capsys.readouterr().err
