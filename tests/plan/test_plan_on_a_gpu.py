"""The plan against what one GPU measured (an H200, 2026-11-27; issue 38's "on a GPU,
``torch.cuda.max_memory_allocated``"). No GPU here: the records the GPU runs wrote are checked
against what the plan predicts now, so a change to the plan that breaks its device rows fails on
the CPU.

- results/test-cuda-plan.json: the CUDA lane's plan cases (tests/cuda/test_lane_plan.py), the bytes
  one forward of the real model saved on the device, per preset, level and dropout;
- results/compare-plan-*-cuda.json: compare's per-category meters and the allocator's peak;
- results/megatron-lm-memory-cuda.json: Megatron-LM's own ``pretrain_gpt.py`` runs, the
  ``max allocated`` it printed (plan/megatron_lm_device_check.py)."""

from __future__ import annotations

import re

import pytest

from mindspeed_like.plan import accuracy, megatron_code, megatron_lm_check, megatron_lm_device_check
from mindspeed_like.testing import models, plan_parity
from mindspeed_like.toolkit import records

LANE_RECORD = "test-cuda-plan"
CASE_ID = re.compile(
    r"test_plan_saved_bytes_on_the_device\[(?P<preset>[\w-]+?)-(?P<impl>local|transformer_engine)-"
    r"(?P<level>\d)-(?P<dropout>no-dropout|dropout)\]"
)

# The GPU records were measured on an H200 on 2026-11-27, when the te-backend's grouped GEMM (TE spec's
# experts) saved a stacked copy of the local experts' fc1 / fc2 weights for backward. Since gmm_experts
# (0529721) it saves the experts' own parameters and the plan counts no copy; the CPU records re-measured
# with it in one batch at 0529721 hold the plan (tests/plan/test_plan_accuracy.py). These records still
# carry the copies, so the plan under-predicts them by exactly those bytes. Not a plan error: re-measure
# them with `make bench-gpu` / the CUDA lane (tests/cuda/test_lane_plan.py) when a GPU is lent, then
# delete these entries (the tests below fail once a record meets its target again).
_STACKED_COPY = (
    "measured 2026-11-27 on an H200 with the grouped GEMM's stacked copy of the experts' weights, which the code "
    "no longer keeps (gmm_experts, 0529721); the CPU records re-measured at 0529721 hold; re-measure on a GPU"
)
# the CUDA lane's case -> the bytes one forward saved beyond the plan: the stacked fc1 / fc2 copies (the
# plan before gmm_experts counted them and met every one of these cases within the 1% below)
LANE_KNOWN_MISSES: dict[str, tuple[int, str]] = {
    **{f"moe-transformer_engine-0-{d}": (4_718_592, _STACKED_COPY) for d in ("no-dropout", "dropout")},
    **{f"qwen3-moe-transformer_engine-0-{d}": (589_824, _STACKED_COPY) for d in ("no-dropout", "dropout")},
    **{f"deepseek-transformer_engine-0-{d}": (393_216, _STACKED_COPY) for d in ("no-dropout", "dropout")},
}
# (record, arm, metric) -> (bound as a fraction, reason): compare's runs on the GPU (the plan before
# gmm_experts: -0.00% / +0.05% / -0.00% / -0.00% / +0.16% on these)
KNOWN_MISSES: dict[tuple[str, str, str], tuple[float, str]] = {
    ("compare-moe-level1-cuda", "megatron", "activations_bytes"): (0.19, _STACKED_COPY),  # -18.70%
    ("compare-moe-level1-cuda", "features", "activations_bytes"): (0.54, _STACKED_COPY),  # -53.82%
    ("compare-plan-deepseek-level1-cuda", "features", "activations_bytes"): (0.12, _STACKED_COPY),  # -11.97%
    ("compare-plan-moe-level2-cuda", "megatron", "activations_bytes"): (0.26, _STACKED_COPY),  # -25.87%
    ("compare-qwen3-moe-level1-cuda", "features", "activations_bytes"): (0.24, _STACKED_COPY),  # -23.16%
}


def _lane_rows() -> list[dict]:
    rows = records.read(records.results_dir() / f"{LANE_RECORD}.json")["rows"]
    return [row for row in rows if "measured_bytes" in row]


def test_the_lane_measured_every_case_of_the_lane() -> None:
    from pathlib import Path

    source = (Path(__file__).parents[1] / "cuda" / "test_lane_plan.py").read_text()
    cases = re.findall(r'\("([\w-]+)", "(local|transformer_engine)", (\d)\)', source)
    measured = {(m["preset"], m["impl"], m["level"]) for m in (CASE_ID.search(r["test"]) for r in _lane_rows())}
    assert len(cases) >= 13 and {tuple(c) for c in cases} <= measured


@pytest.mark.parametrize("row", _lane_rows(), ids=lambda row: CASE_ID.search(row["test"]).group(0)[35:-1])
def test_saved_bytes_on_the_gpu_are_the_plans(row: dict, monkeypatch) -> None:
    case = CASE_ID.search(row["test"])
    known = LANE_KNOWN_MISSES.get(f"{case['preset']}-{case['impl']}-{case['level']}-{case['dropout']}")
    dropout = 0.1 if case["dropout"] == "dropout" else 0.0
    monkeypatch.setitem(models.DEFAULTS, "hidden_dropout", dropout)
    monkeypatch.setitem(models.DEFAULTS, "attention_dropout", dropout)
    args = plan_parity.compare_options(case["preset"], case["impl"])
    with megatron_code.as_measured_in(LANE_RECORD):  # the lane ran another megatron-core than a version lane's
        _, saved = plan_parity.predicted(args, int(case["level"]), dropout, "cuda")
    if known is not None:
        assert row["measured_bytes"] - saved == known[0], (
            f"plan {saved} bytes, the GPU saved {row['measured_bytes']}: the known miss was {known[0]} bytes "
            f"({known[1]}); now {row['measured_bytes'] - saved}"
        )
        return
    assert saved / row["measured_bytes"] - 1 == pytest.approx(0, abs=0.01), (
        f"plan {saved} bytes, the GPU saved {row['measured_bytes']} ({100 * (saved / row['measured_bytes'] - 1):+.2f}%)"
    )


def test_compare_on_the_gpu_within_the_targets() -> None:
    cases = accuracy.all_cases(device="cuda")
    assert len(cases) >= 16
    failures = []
    for case in cases:
        for metric, target in accuracy.TARGETS.items():
            if not accuracy.held(case, metric):
                continue
            err = case.error(metric)
            known = KNOWN_MISSES.get((case.record, case.arm, metric))
            bound = known[0] if known else target
            at = f"{case.record} {case.arm} {metric}: {100 * err:+.2f}%"
            if known is not None and abs(err) <= target:
                failures.append(f"{at} now meets its target: {known[1]}")
            elif abs(err) > bound:
                failures.append(f"{at} (bound {100 * bound:.0f}%)")
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def megatron_lm_rows() -> list[dict]:
    path = records.results_dir() / f"{megatron_lm_device_check.MEASURED}.json"
    return megatron_lm_device_check.rows(records.read(path)["extra"]["measured"])


def test_every_megatron_lm_case_was_measured(megatron_lm_rows: list[dict]) -> None:
    assert [row["case"] for row in megatron_lm_rows] == [case[0] for case in megatron_lm_device_check.CASES]


def test_megatron_lm_on_the_gpu_within_the_target(megatron_lm_rows: list[dict]) -> None:
    missed = [
        f"{row['case']}: {row['error_pct']:+.1f}%"
        for row in megatron_lm_rows
        if abs(row["error_pct"]) > 100 * megatron_lm_check.TARGET
    ]
    assert not missed, "\n".join(missed)


def test_the_gpu_tables_are_the_plans_now(megatron_lm_rows: list[dict]) -> None:
    """The records docs/plan.md renders were written by the plan as it is (`make docs`)."""
    table = records.read(records.results_dir() / f"{megatron_lm_device_check.RECORD}.json")["rows"]
    assert [(r["case"], round(r["predicted_MiB"], 3)) for r in table] == [
        (r["case"], round(r["predicted_MiB"], 3)) for r in megatron_lm_rows
    ], "run `python -m mindspeed_like.plan.megatron_lm_device_check --record` (make docs)"
    now = {(row["record"], row["arm"]): row for row in map(accuracy.row_of, accuracy.all_cases(device="cuda"))}
    written = records.read(records.results_dir() / "plan-accuracy-cuda.json")["rows"]
    stale = [
        f"{row['record']} {row['arm']}"
        for row in written
        if row["error_process_peak_pct"] != pytest.approx(now[(row["record"], row["arm"])]["error_process_peak_pct"])
    ]
    assert not stale, f"run `python -m mindspeed_like.plan.accuracy --device cuda --record` (make docs): {stale}"
