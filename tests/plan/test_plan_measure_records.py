"""The re-measuring batch's commands: each record's own compare command, with the counts asked for
in place of the record's (no training runs here)."""

from __future__ import annotations

from mindspeed_like.plan import measure_records
from mindspeed_like.toolkit import records


def test_the_command_is_the_records_own_with_the_counts_replaced(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(records.RESULTS_ENV, str(tmp_path))
    own = "mindspeed-like compare --preset llama --steps 3 --repeats 3 --record compare-plan-x".split()
    path = records.Record("compare-plan-x", command=own).write()
    as_recorded = measure_records.command_of(path)
    assert as_recorded[2:4] == ["mindspeed_like.cli", "compare"]
    assert as_recorded[4:] == "--preset llama --steps 3 --repeats 3 --record compare-plan-x --quiet".split()
    longer = measure_records.command_of(path, repeats=1, steps=8)[4:]
    assert longer == "--preset llama --repeats 1 --steps 8 --record compare-plan-x --quiet".split()
