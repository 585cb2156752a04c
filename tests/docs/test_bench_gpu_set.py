"""`make bench-gpu`'s set (benchmarks/bench_gpu.py) and the docs agree: every GPU record a doc renders
is written by an item of the set, and every item's command names a script that exists and its record."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mindspeed_like.toolkit import doc_tables, records

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench_gpu():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_gpu

        yield bench_gpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _gpu_records_in_docs() -> set[str]:
    names: set[str] = set()
    for path in doc_tables.doc_files():
        for kind, arg in doc_tables.regions(path.read_text()):
            if kind == "records":
                named = arg.split()
            elif kind == "value":
                named = [doc_tables._QUERY.match(arg)["record"]]
            else:  # compare.NAME, printed.NAME or a TABLES id
                named = [arg.split(".", 1)[1] if arg.startswith(("compare.", "printed.")) else arg]
            names |= {name for name in named if records.is_accelerator_record(name)}
    return names


def test_every_gpu_record_the_docs_render_is_written_by_the_set(bench_gpu) -> None:
    written = {item.record_name("cuda", smoke=False) for item in bench_gpu.ITEMS}
    rendered = _gpu_records_in_docs()
    assert rendered, "the docs render no GPU record: the check would pass vacuously"
    assert rendered <= written, f"rendered but written by no bench-gpu item: {sorted(rendered - written)}"


def test_every_item_runs_an_existing_script_with_its_record_on_the_device(bench_gpu, tmp_path) -> None:
    for item in bench_gpu.ITEMS:
        command = item.command("cuda", smoke=False, out=tmp_path)
        assert "--device" in command and command[command.index("--device") + 1] == "cuda", item.name
        assert command[command.index("--record") + 1] == f"{item.record}-cuda", item.name
        if command[0] != "-m":
            assert (ROOT / command[0]).is_file(), command[0]
        smoke = item.command("cpu", smoke=True, out=tmp_path)
        assert smoke[smoke.index("--record") + 1].endswith("-smoke"), "a smoke run never writes a device's record"
