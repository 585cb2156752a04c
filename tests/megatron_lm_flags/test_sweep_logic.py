"""The flag sweep's batching, bisection and outcomes on a fake pretrain_gpt.py (no Megatron-LM needed)."""

from __future__ import annotations

import tempfile

from mindspeed_like.testing import megatron_lm_sweep as sweep
from mindspeed_like.testing.megatron_lm_flags import Case

LOSSES = {1: {"lm loss": "5.5", "grad norm": "1.0"}, 2: {"lm loss": "5.4", "grad norm": "1.0"}}


def fake_run(extra: list[str]) -> sweep.Run:
    """--math changes the losses, --cuda crashes mid-run, --a with --b never ends; the rest log."""
    if "--a" in extra and "--b" in extra:
        return sweep.Run(extra, None, "", 1.0)
    if "--cuda" in extra:
        return sweep.Run(extra, 1, "after dataloaders are built\nAssertionError: Torch not compiled with CUDA", 1.0)
    printed = {i: dict(v) for i, v in LOSSES.items()}
    if "--math" in extra:
        printed[2]["lm loss"] = "5.3"
    return sweep.Run(extra, 0, "", 1.0, printed)


def test_a_failing_batch_is_bisected_to_the_flag_and_interactions_are_named():
    names = ["--log-x", "--math", "--cuda", "--a", "--b", "--log-y"]
    cases = [Case(name, name[2:].replace("-", "_"), "logging") for name in names]
    results, stats = sweep.sweep(cases, runner=fake_run, jobs=1, log=lambda line: None)
    outcomes = {r.case.option: r.outcome for r in results}
    assert outcomes == {
        "--log-x": sweep.SAME,
        "--math": sweep.CHANGED,
        "--cuda": sweep.CRASHED_MID,
        "--a": sweep.SAME,
        "--b": sweep.SAME,
        "--log-y": sweep.SAME,
    }
    # the smallest failed batch that holds them (bisection split it as --a | --b --log-y)
    assert [item["flags"] for item in stats["interactions"]] == ["--a --b --log-y"]


def test_cases_that_changed_last_time_run_alone():
    cases = [Case(f"--f{i}", f"f{i}", "logging") for i in range(3)]
    batches = sweep._batches(cases, {"--f1": sweep.CHANGED})
    assert [[c.option for c in b] for b in batches] == [["--f1"], ["--f0", "--f2"]]


def test_a_case_that_is_another_groups_reference_takes_its_run():
    """``--fp16`` alone is the reference run of the cases that need it beside them: run once."""
    commands: list[list[str]] = []

    def counting_run(extra: list[str]) -> sweep.Run:
        commands.append(extra)
        return fake_run(extra)

    cases = [
        Case("--fp16", "fp16", "mixed precision"),
        Case("--loss-scale", "loss_scale", "mixed precision", ("8",), ("--fp16",)),
        Case("--math", "math", "logging"),
    ]
    results, stats = sweep.sweep(cases, runner=counting_run, jobs=2, log=lambda line: None)
    assert {r.case.option: r.outcome for r in results} == {
        "--fp16": sweep.SAME,
        "--loss-scale": sweep.SAME,
        "--math": sweep.CHANGED,
    }
    # the references of () and of ("--fp16",), then one batch per group; "--fp16" alone is not run again
    assert sorted(map(tuple, commands)) == [(), ("--fp16",), ("--fp16", "--loss-scale", "8"), ("--math",)]
    assert stats["runs"] == 4


def test_the_sweep_leaves_no_folder_behind(monkeypatch, tmp_path):
    """The runs' --save folders live in one temporary folder, removed when the sweep ends (issue 49
    item 6: every `make test` left a megatron-lm-flags-* folder in /tmp)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cases = [Case("--log-x", "log_x", "logging"), Case("--math", "math", "logging")]
    sweep.sweep(cases, runner=fake_run, jobs=1, log=lambda line: None)
    assert list(tmp_path.iterdir()) == []
