"""The accuracy lane: every CPU compare record in results/ predicted from its own options and held
to issue 38's targets (model state within 2%, activations and process peak within 10%), and the
rendered record (results/plan-accuracy.json, docs/plan.md's table) equal to what the plan predicts
now. No training runs here: the measurements are the records."""

from __future__ import annotations

import pytest

from mindspeed_like import megatron_version
from mindspeed_like.plan import accuracy
from mindspeed_like.toolkit import records

# Targets this lane misses, each with the error it measured and why; the bound keeps it from
# getting worse unnoticed (record, arm, metric) -> (bound as a fraction, reason)
_HEAP = (
    "glibc's heap grows from step to step beyond what the plan counts (its adaptive mmap threshold moves the "
    "blocks that step 1 mapped into the heap for step 2 on, and freed blocks stay between live ones); an RSS "
    "probe around megatron's calls in compare's workers: llama TP2 SP megatron's arm peaked at 621 MiB in step 1 "
    "(the plan: 636), 704-711 by step 3, 736-741 from step 6 on (8 steps run); DP2 distopt's rose 46 + 34 MiB "
    "after step 1 beyond the Adam moments; the plan does not simulate the allocator (the order in which blocks "
    "of every size are allocated and freed decides it); under-predicted"
)
_LAZY = (
    "Megatron-FSDP releases a TransformerLayer's gathered bucket lazily, and whether a features-arm rank still holds "
    "it when the probed forward ends varies from run to run: llama DP2 optim_grads_params held both layers' buckets "
    "(12,360,192 bytes saved) on one rank of two at b9ef63b and one layer's (10,940,928, 1,419,264 less) on both ranks "
    "at 0529721 (level 2: 10,395,648 on both ranks at 287f4bc, 8,976,384 at 0529721); the DP4 record held both on one "
    "rank of four at b9ef63b and on all four at 0529721; megatron's arm held both on every rank each time. The plan "
    "counts the largest rank holding every layer's; over-predicted"
)
KNOWN_MISSES: dict[tuple[str, str, str], tuple[float, str]] = {
    # the whole lane measured in one batch at 0529721 (2026-12-03, measure_records' commands); each bound is the
    # error measured there rounded up, plus one point
    ("compare-plan-llama-dp2-distopt-level1", "features", "process_peak_bytes"): (0.14, _HEAP),  # -12.32%
    ("compare-plan-llama-dp2-distopt-level2", "megatron", "process_peak_bytes"): (0.12, _HEAP),  # -10.93%
    ("compare-plan-llama-dp2-distopt-level2", "features", "process_peak_bytes"): (0.15, _HEAP),  # -13.61%
    ("compare-plan-llama-tp2-sp-level1", "megatron", "process_peak_bytes"): (0.13, _HEAP),  # -11.15%
    ("compare-plan-llama-local-level2", "features", "process_peak_bytes"): (0.13, _HEAP),  # -11.04%
    ("compare-plan-moe-ep2-dp2-level2", "features", "process_peak_bytes"): (0.13, _HEAP),  # -11.96%
    # moe 2L h512 s1024, one rank: against the batch of 2026-11-27 (891d7b3, the stacked copies) the level-1 record
    # saves 66.0 MiB less in both arms and peaks 42.7 / 37.5 MiB higher; the level-2 features arm saves the same
    # (22.07 MiB: moe-zero-memory keeps no expert weight either way) and peaks 86.3 MiB higher (medians of 3 runs).
    # The rise is not in the tensors the plan counts (cause not isolated: the heap, as above); megatron's arms stay
    # within (-8.90% / -7.35%)
    ("compare-plan-moe-level1", "features", "process_peak_bytes"): (0.14, _HEAP),  # -12.64%
    ("compare-plan-moe-level2", "features", "process_peak_bytes"): (0.20, _HEAP),  # -18.75% (-13.27% at 891d7b3)
    # MoE EP2 x DP2 under Megatron-FSDP (issue 54 item 5, 2026-12-02, with the stacked copies): the same runs for
    # 1 step peaked at 586.8 / 602.0 MiB (level 1, the plan 610.5 / 599.3) and 585.5 / 557.2 (level 2, the plan
    # 610.5 / 522.8), within 6.2%; steps 2-3 added 68-119 MiB
    ("compare-plan-moe-ep2-dp2-mfsdp-level1", "megatron", "process_peak_bytes"): (0.14, _HEAP),  # -12.20%
    ("compare-plan-moe-ep2-dp2-mfsdp-level1", "features", "process_peak_bytes"): (0.19, _HEAP),  # -17.61%
    ("compare-plan-moe-ep2-dp2-mfsdp-level2", "megatron", "process_peak_bytes"): (0.13, _HEAP),  # -11.57%
    ("compare-plan-moe-ep2-dp2-mfsdp-level2", "features", "process_peak_bytes"): (0.19, _HEAP),  # -17.40%
    # measured 2026-11-26 (c44466f) with the grouped GEMM's stacked copies, which the code no longer keeps: the plan
    # counts none. Measured again at 0529721 (its own command, torch.compile on) it saved 203.2 MiB in megatron's
    # arm (the plan's figure), but its features arm's last loss was 4.0101 against megatron's 3.5901 (max diff 0.44;
    # 0.063 in this record, 0.045 in compare-plan-moe-level2, the same run with torch.compile off): the record is
    # kept until that divergence is explained (the new one is in helper-23's report)
    ("compare-moe-level2", "megatron", "activations_bytes"): (0.25, "measured with the stacked copies"),  # -24.53%
    ("compare-plan-llama-dp2-mfsdp-level1", "features", "activations_bytes"): (0.14, _LAZY),  # +12.80%
    ("compare-plan-llama-dp2-mfsdp-level2", "features", "activations_bytes"): (0.17, _LAZY),  # +15.61%
}


@pytest.fixture(scope="module")
def cases() -> list[accuracy.Case]:
    return accuracy.all_cases()


def test_the_lane_covers_the_presets_and_layouts(cases: list[accuracy.Case]) -> None:
    presets = {case.layout.split()[0] for case in cases}
    assert {"llama", "moe", "qwen3-moe", "deepseek", "gpt"} <= presets
    layouts = " ".join(case.layout for case in cases)
    for layout in ("TP2 SP", "PP2", "VPP", "CP2", "EP2", "distopt", "local spec", "level 1", "level 2"):
        assert layout in layouts, layout
    # megatron's FSDP paths (issue 54 item 5): both, FSDP2 without resharding, every strategy that trains
    for layout in (
        "DP2 FSDP2,",
        "DP2 FSDP2 no-reshard",
        "DP4 FSDP2",
        "DP2 Megatron-FSDP optim,",
        "DP2 Megatron-FSDP optim_grads,",
        "DP2 Megatron-FSDP optim_grads_params",
        "DP4 Megatron-FSDP optim_grads_params",
        "DP4 FSDP2, level 1, fsdp2-config sharding_size",  # HSDP
        "DP2 FSDP2, level 1, fsdp2-config reshard_after_forward",
        "DP4 Megatron-FSDP optim_grads_params HSDP2,",  # Megatron-FSDP's HSDP: 2 instances of 2 ranks
        "DP4 Megatron-FSDP optim_grads_params HSDP2 outer optim,",  # its masters and moments across them
        "TP2 DP2 Megatron-FSDP optim_grads_params",  # TP under each path
        "TP2 DP2 FSDP2,",
        "CP2 DP2 Megatron-FSDP optim_grads_params",
        "DP2 EP2 Megatron-FSDP optim_grads_params",  # MoE: the experts over their expert data-parallel group
    ):
        assert layout in layouts, layout


def test_the_largest_expert_parallel_rank_is_within_the_plans_bound(cases: list[accuracy.Case]) -> None:
    """Under expert parallelism the plan's activations are the mean rank's (balanced routing); a user
    sizes for the largest rank, which must not exceed the plan's bound for it (dropless routing's
    worst case). compare-plan-moe-ep2-dp2-level2: megatron's mean 109.7 MiB, the largest rank 127.0 MiB,
    the bound 144.8 MiB."""
    ep = [case for case in cases if case.largest_rank is not None]
    assert {case.record for case in ep} >= {
        "compare-plan-moe-ep2-dp2-level2",
        "compare-plan-moe-ep2-dp2-mfsdp-level1",
        "compare-plan-moe-ep2-dp2-mfsdp-level2",
    }
    for case in ep:
        assert case.largest_rank_bound is not None
        assert case.largest_rank_bound >= case.measured["activations_bytes"] * 1.01, case  # above the mean
        assert case.within_bound, f"{case.record} {case.arm}: {case.largest_rank} over {case.largest_rank_bound}"


def test_fsdp_model_state_falls_as_one_over_dp(cases: list[accuracy.Case]) -> None:
    """Per-rank model state from DP 2 to DP 4 under both FSDP paths, measured and predicted: every
    kind halves (within the step counters and Megatron-FSDP's buffer padding)."""
    by = {(case.record, case.arm): case for case in cases}
    for path in ("fsdp2", "mfsdp"):
        two, four = (
            by[(f"compare-plan-llama-dp2-{path}-level1", "megatron")],
            by[(f"compare-plan-llama-dp4-{path}-level1", "megatron")],
        )
        for side in ("measured", "predicted"):
            for metric in accuracy.STATE_METRICS:
                ratio = getattr(four, side)[metric] / getattr(two, side)[metric]
                assert ratio == pytest.approx(0.5, abs=0.005), (path, side, metric, ratio)


def test_megatron_fsdp_hsdp_holds_one_instances_shards(cases: list[accuracy.Case]) -> None:
    """Megatron-FSDP's HSDP at DP 4 with 2 instances holds, measured and predicted, what DP 2 holds
    (each buffer sharded over an instance's 2 ranks); with --outer-dp-sharding-strategy optim its
    optimizer state is DP 4's (the masters and moments over all 4 ranks) and its weights and
    gradients stay DP 2's (within the buffers' padding and the step counters)."""
    by = {(case.record, case.arm): case for case in cases}
    two, four = (
        by[("compare-plan-llama-dp2-mfsdp-level1", "megatron")],
        by[("compare-plan-llama-dp4-mfsdp-level1", "megatron")],
    )
    hsdp = by[("compare-plan-llama-dp4-mfsdp-hsdp2-level1", "megatron")]
    outer = by[("compare-plan-llama-dp4-mfsdp-hsdp2-outer-optim-level1", "megatron")]
    for side in ("measured", "predicted"):
        for metric in accuracy.STATE_METRICS:
            assert getattr(hsdp, side)[metric] == pytest.approx(getattr(two, side)[metric], rel=0.005), (side, metric)
        for metric in ("weights_bytes", "gradients_bytes"):
            assert getattr(outer, side)[metric] == pytest.approx(getattr(two, side)[metric], rel=0.005), (side, metric)
        optimizer = getattr(outer, side)["optimizer_bytes"]
        assert optimizer == pytest.approx(getattr(four, side)["optimizer_bytes"], rel=0.005), side
        assert optimizer == pytest.approx(getattr(hsdp, side)["optimizer_bytes"] / 2, rel=0.005), side


def test_every_case_is_within_its_target(cases: list[accuracy.Case]) -> None:
    failures = []
    for case in cases:
        for metric, bound in accuracy.TARGETS.items():
            if not accuracy.held(case, metric):
                continue  # torch.compile on: another process runtime than the eager baselines
            known = KNOWN_MISSES.get((case.record, case.arm, metric))
            limit = known[0] if known else bound
            err = case.error(metric)
            if abs(err) > limit:
                failures.append(f"{case.record} {case.arm} {metric}: {100 * err:+.2f}% (bound {100 * limit:.0f}%)")
        for metric in ("weights_bytes", "gradients_bytes", "optimizer_bytes"):
            if abs(case.error(metric)) > accuracy.TARGETS["model_state_bytes"]:
                failures.append(f"{case.record} {case.arm} {metric}: {100 * case.error(metric):+.2f}%")
    assert not failures, "\n".join(failures)


def test_known_misses_are_still_misses(cases: list[accuracy.Case]) -> None:
    """A miss that the plan now meets leaves the list (the docs' claims follow the lane)."""
    by_key = {(c.record, c.arm): c for c in cases}
    for (record, arm, metric), (_, why) in KNOWN_MISSES.items():
        case = by_key[(record, arm)]
        assert abs(case.error(metric)) > accuracy.TARGETS[metric], (
            f"{record} {arm} {metric} now meets its target: {why}"
        )


def test_the_rendered_record_is_what_the_plan_predicts_now(cases: list[accuracy.Case]) -> None:
    path = records.results_dir() / f"{accuracy.RECORD}.json"
    rows = [r for r in records.read(path)["rows"] if r.get("table") == accuracy.TABLE]
    fresh = [accuracy.row_of(case) for case in cases]
    assert [(r["record"], r["arm"]) for r in rows] == [(r["record"], r["arm"]) for r in fresh], (
        "results/plan-accuracy.json is stale: `make docs`"
    )
    # the theory column is Megatron-LM's file of the record's megatron version (core_v0.16.1's); another
    # megatron-core's wheel ships its own file (0.19's counts the same model a little differently)
    same_megatron = records.read(path)["versions"]["megatron_core"] == str(megatron_version.megatron_core_version())
    for old, new in zip(rows, fresh):
        for key, value in new.items():
            if key.startswith("theory_") and (value is None or not same_megatron):
                continue  # Megatron-LM's file not at hand here, or another version's: the record keeps its figures
            expected = pytest.approx(value, rel=1e-9) if isinstance(value, float) else value
            assert old[key] == expected, (
                f"{new['record']} {new['arm']} {key}: recorded {old[key]}, now {value}: `make docs`"
            )
