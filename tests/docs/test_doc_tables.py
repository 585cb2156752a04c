"""The docs' measured numbers are what results/ renders (``make docs``); a hand edit fails here,
naming the file, the line and the row. No benchmark runs: the records are read from results/."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from mindspeed_like.toolkit import doc_tables, records


def test_every_generated_region_matches_the_records() -> None:
    differences = doc_tables.run(doc_tables.doc_files(), check=True)
    assert not differences, "\n".join(str(d) for d in differences)


def test_the_docs_have_generated_regions() -> None:
    """The check above must not pass vacuously: the docs carry tables rendered from records."""
    kinds = [kind for path in doc_tables.doc_files() for kind, _ in doc_tables.regions(path.read_text())]
    assert kinds.count("table") >= 3 and "value" in kinds


def test_a_hand_edited_number_is_caught_with_file_and_row(tmp_path: Path) -> None:
    """A digit changed in the first data row of a rendered markdown table (a temp copy of the doc)."""
    source, match = next(
        (path, m)
        for path in doc_tables.doc_files()
        for m in doc_tables._REGION.finditer(path.read_text())
        if m["kind"] == "table" and "\n|---" in m["body"]
    )
    copy = tmp_path / source.name
    shutil.copy(source, copy)
    text = copy.read_text()
    first_row = text.index("\n", text.index("\n|---", match.start("body")) + 1) + 1
    digit = re.compile(r"\d").search(text, first_row)
    assert digit is not None
    edited = text[: digit.start()] + str((int(digit.group()) + 1) % 10) + text[digit.end() :]
    copy.write_text(edited)
    differences = doc_tables.run([copy], check=True)
    assert len(differences) == 1
    message = str(differences[0])
    row = edited.splitlines()[differences[0].line - 1]
    assert f"{copy}:{differences[0].line}:" in message or f"{copy.name}:{differences[0].line}:" in message
    assert f"in the doc: {row}" in message and row != differences[0].expected
    # and `make docs` (check=False) puts the rendered row back
    assert doc_tables.run([copy], check=False) and copy.read_text() == text


def _record(folder: Path, name: str, rows: list[dict], **extra: object) -> None:
    rec = records.Record(name, command=["benchmarks/x.py", "--repeats", "3"])
    rec.rows = rows
    rec.extra.update(extra)
    rec.write(folder / f"{name}.json")


def test_value_queries(tmp_path: Path) -> None:
    _record(
        tmp_path,
        "bench",
        [
            {"table": "t", "dtype": "float32", "s": 4096, "speedup": 4.234},
            {"table": "t", "dtype": "bfloat16", "s": 4096, "speedup": 3.731},
            {"table": "u", "dtype": "float32", "s": 1024, "speedup": 1.5},
        ],
        verdict="met",
    )
    recs = doc_tables.Records(tmp_path)
    assert doc_tables.value(recs, "bench[dtype=float32,s=4096].speedup .1f") == "4.2"
    assert doc_tables.value(recs, "bench[table=t].speedup range .2f") == "3.73-4.23"
    assert doc_tables.value(recs, "bench.speedup max .1f") == "4.2"
    assert doc_tables.value(recs, "bench.extra.verdict") == "met"
    with pytest.raises(doc_tables.RecordError, match="2 rows match"):
        doc_tables.value(recs, "bench[s=4096].speedup")
    with pytest.raises(doc_tables.RecordError, match="no record 'missing'"):
        doc_tables.value(recs, "missing.speedup")


def test_render_names_the_region_and_the_record_it_lacks(tmp_path: Path) -> None:
    _record(tmp_path, "bench", [{"dtype": "float32", "speedup": 2.0}])
    text = "x <!-- value: bench[dtype=float32].speedup .1f -->9.9<!-- /value --> y\n"
    rendered, differences = doc_tables.render(text, doc_tables.Records(tmp_path), tmp_path / "doc.md")
    assert rendered == text.replace("9.9", "2.0")
    assert [d.found for d in differences] == ["9.9"] and differences[0].line == 1
    table = "<!-- table: nope (make docs) -->\n<!-- /table -->\n"
    with pytest.raises(doc_tables.RecordError, match=r"doc.md:1: .*no table 'nope'"):
        doc_tables.render(table, doc_tables.Records(tmp_path), tmp_path / "doc.md")


def test_records_folder_is_complete() -> None:
    """Every record a doc names exists in results/ and is readable (a fresh clone renders)."""
    recs = doc_tables.Records()
    for path in doc_tables.doc_files():
        doc_tables.render(path.read_text(), recs, path)
    assert recs.read
    for name in recs.read:
        assert records.read(recs.folder / f"{name}.json")["rows"], name


def _gpu_record(folder: Path, name: str, rows: list[dict]) -> None:
    rec = records.Record(name, command=["benchmarks/x.py", "--device", "cuda"])
    rec.host.update(device="cuda", device_name="NVIDIA H100 80GB HBM3", cuda="13.0")
    rec.versions["triton"] = "3.6.0"
    rec.rows = rows
    rec.write(folder / f"{name}.json")


def test_an_absent_gpu_record_renders_not_measured_yet_and_an_absent_cpu_record_fails(tmp_path: Path) -> None:
    text = (
        "speed <!-- value: bench-cuda[s=1].speedup .1f x -->x<!-- /value -->\n"
        "<!-- table: compare.compare-llama-cuda (make docs) -->\n<!-- /table -->\n"
        "<!-- records: bench-cuda (make docs) -->\n<!-- /records -->\n"
    )
    rendered, _ = doc_tables.render(text, doc_tables.Records(tmp_path))
    assert rendered.count(doc_tables.NOT_MEASURED) == 3
    assert (
        "speed <!-- value: bench-cuda[s=1].speedup .1f x -->not measured yet (needs a GPU: make bench-gpu)<" in rendered
    )
    assert "(record `compare-llama-cuda`)" in rendered and "<sub>`bench-cuda`: not measured yet" in rendered
    with pytest.raises(doc_tables.RecordError, match="no record 'bench'"):
        doc_tables.render(text.replace("bench-cuda", "bench"), doc_tables.Records(tmp_path))
    # a present GPU record without the row asked for is an error, not a placeholder
    _gpu_record(tmp_path, "bench-cuda", [{"table": "t", "s": 2, "speedup": 1.0}])
    with pytest.raises(doc_tables.RecordError, match="no row"):
        doc_tables.render(text, doc_tables.Records(tmp_path))


def test_a_gpu_record_names_its_device_in_values_and_provenance(tmp_path: Path) -> None:
    _gpu_record(tmp_path, "bench-cuda", [{"table": "t", "s": 1, "speedup": 2.345}])
    recs = doc_tables.Records(tmp_path)
    assert doc_tables.value(recs, "bench-cuda[s=1].speedup .1f") == "2.3"
    assert doc_tables.value(recs, "bench-cuda[s=1].speedup .1f x") == "2.3x"  # a unit after the number
    assert doc_tables.value(recs, "bench-cuda.host.device_name") == "NVIDIA H100 80GB HBM3"
    line = doc_tables.provenance(recs["bench-cuda"])
    assert "on NVIDIA H100 80GB HBM3, host " in line and "CUDA 13.0, Triton 3.6.0" in line


def test_gpu_records_get_their_own_names() -> None:
    assert records.device_record_name("attention", "cuda") == "attention-cuda"
    assert records.device_record_name("attention-cuda", "cuda") == "attention-cuda"
    assert records.device_record_name("attention", "cpu") == "attention"
    assert records.is_accelerator_record("compare-llama-level1-cuda") and not records.is_accelerator_record("moe")


def test_a_cpu_record_says_the_isa_it_ran_at(tmp_path: Path, monkeypatch) -> None:
    """A CPU record carries the capability torch and oneDNN ran at and the bf16 GEMM probe's
    decision (issue 49: a figure from an AVX-512-BF16 host is not one from an AVX2 host); the line
    under a rendered table says it."""
    from mindspeed_like.kernels import host_gemm

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv(host_gemm.ENV, "fp32")
    host_gemm.probe.cache_clear()
    try:
        rec = records.Record("bench", command=["benchmarks/x.py"], device="cpu")
    finally:
        host_gemm.probe.cache_clear()
    isa = rec.host["cpu_isa"]
    assert isa["onednn_max_cpu_isa"] == "AVX2" and isa["bf16_gemm"]["fp32_faster"] is True
    assert isa["aten_cpu_capability"] == __import__("torch").backends.cpu.get_cpu_capability()
    rec.rows = [{"s": 1}]
    rec.write(tmp_path / "bench.json")
    line = doc_tables.provenance(doc_tables.Records(tmp_path)["bench"])
    assert f"ISA {isa['aten_cpu_capability']} (oneDNN AVX2, bf16 GEMMs in fp32)" in line
    gpu = records.Record("bench-cuda", command=["benchmarks/x.py"], device="cpu")
    gpu.set_device("cuda")
    assert "cpu_isa" not in gpu.host  # an accelerator's figures are not the host CPU's
