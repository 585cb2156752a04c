"""The megatron-unit plugin's own logic, without a Megatron-LM checkout: reason classes, the world
sizes tests are grouped by, the rank reports merged, the checkout refusals and the record.

The opt-in test at the end runs the plugin on one small folder of a real checkout
(``MEGATRON_LM_PATH``), as `make test-megatron-unit` does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mindspeed_like.testing.megatron_unit import checkout, ranks, reasons
from mindspeed_like.testing.megatron_unit.record import Outcomes, directory_of, write


@pytest.mark.parametrize(
    ("text", "cls"),
    [
        ("E   RuntimeError: 0 active drivers ([]). There should only be one.", "triton-kernel-no-gpu"),
        ("E   AssertionError: libcuda.so cannot found!", "triton-kernel-no-gpu"),
        ("E   RuntimeError: world_size (1) is not divisible by 8", "needs-more-ranks"),
        ("E   AssertionError: Tried using cudagraphs with RNG, however not detected in pytorch!", "cuda-graphs"),
        ("E   assert False\nE    +  where False = torch.equal(a, b)", "numerics"),
        ("E   AssertionError: Torch not compiled with CUDA enabled", "cuda-only-api"),
        ("E   ModuleNotFoundError: No module named 'transformers'", "missing-package"),
        (
            "E   mindspeed_like...TransformerEngineFeatureUnsupported: mindspeed_like te-backend: "
            "TransformerEngine's fp8 is not available",
            "te-feature-refused",
        ),
        ("rank-timeout: no progress for 180 s at world size 4", "timeout"),
    ],
)
def test_failures_are_classified_from_their_exception_lines(text: str, cls: str) -> None:
    assert reasons.classify_failure(text) == cls


def test_the_exception_lines_win_over_the_traceback() -> None:
    """A traceback through megatron's `_get_cuda_rng_state` says nothing of why an assert failed."""
    text = (
        "    state = torch.cuda.get_rng_state()  # _cuda_ helper\nE   assert False\nE    +  where False = torch.equal"
    )
    assert reasons.classify_failure(text) == "numerics"


def test_skips_are_classified_and_unknown_is_never_a_default_for_skips() -> None:
    assert reasons.classify_skip("CUDA not available") == "cuda-not-available"
    assert reasons.classify_skip("Requires TransformerEngine >= 1.10.0") == "needs-transformer-engine"
    assert reasons.classify_skip("some reason of the test's own") == "megatron-skip"


def test_every_class_says_what_it_would_take() -> None:
    for rule in [*reasons.FAILURE_RULES, *reasons.SKIP_RULES]:
        assert reasons.what_it_would_take(rule.name), rule.name


MTP = "tests/unit_tests/transformer/test_multi_token_prediction.py::TestMultiTokenPrediction::test_forward_backward"
ALLCLOSE = "E   assert False\nE    +  where False = <built-in method allclose>(tensor([[11.3904]]), tensor([[11.34]]))"


def test_a_measured_router_near_tie_is_its_own_class_and_only_for_the_measured_tests() -> None:
    """The MTP TP=2 vs TP=1 failures were measured to be top-k flips at near-tied logits; the same
    test failing otherwise, or another parametrization, keeps the class its text gives."""
    assert reasons.classify_failure(ALLCLOSE, f"{MTP}[2-1-False]", 2) == "router-near-tie"
    assert reasons.classify_failure(ALLCLOSE, f"{MTP}[1-2-False]", 2) == "numerics"  # not measured
    assert reasons.classify_failure("E   KeyError: 'layer_7'", f"{MTP}[2-1-False]", 2) == "unknown"


def test_a_file_written_for_8_ranks_fails_as_such_below_8() -> None:
    node = "tests/unit_tests/dist_checkpointing/test_fully_parallel.py::T::test_save_distribution[True]"
    text = "E   AttributeError: 'NoneType' object has no attribute 'main_rank_for_shard'"
    assert reasons.classify_failure(text, node, 2) == "assumes-8-ranks"
    assert reasons.classify_failure(text, node, 8) == "unknown"  # at 8 ranks it is a failure of its own


@pytest.mark.parametrize(
    "text",
    [
        "E   FileExistsError: [Errno 17] File exists: '/tmp/megatron-unit-ws4-x/tmp_dist_ckpt/test_fp32_A'",
        "E   FileNotFoundError: [Errno 2] No such file or directory: '/tmp/megatron-unit-ws2-y/tmp_dist_ckpt/test_B'",
    ],
)
def test_a_shared_checkpoint_folder_without_a_barrier_is_named(text: str) -> None:
    assert reasons.classify_failure(text) == "checkpoint-folder-race"


def test_a_fused_adam_shaped_state_given_to_torch_adam_is_not_excused() -> None:
    """dist_checkpointing's optimizer tests fill exp_avg / exp_avg_sq without a step (FusedAdam's layout);
    fix-adam-state-without-step makes torch's Adam take it, so torch's KeyError is a library defect again."""
    text = (
        '  File ".../torch/optim/adam.py", line 127, in __setstate__\n'
        '    if len(p_state) != 0 and not torch.is_tensor(p_state["step"]):\n'
        "E   KeyError: 'step'"
    )
    assert reasons.classify_failure(text) == "unknown"


def test_a_megatron_bug_fixed_in_a_later_release_is_named() -> None:
    text = "E   AttributeError: 'FileSystemWriter' object has no attribute 'metadata_path'"
    assert reasons.classify_failure(text) == "megatron-fixed-later"


# A DTensor over a view at a non-zero offset, deep-copied as megatron's test_dcp_checkpoint_save_and_load
# deep-copies a Megatron-FSDP model's state dict (one gloo rank, no megatron, no library)
_DTENSOR_DEEPCOPY = """
import copy, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
flat = torch.arange(8.0)
for start in (0, 4):
    try:
        copy.deepcopy(DTensor.from_local(flat[start : start + 4], mesh, [Replicate()]))
        print(start, "copied")
    except RuntimeError as error:
        print(start, error)
dist.destroy_process_group()
"""


def test_torchs_deepcopy_of_a_dtensor_over_an_offset_view_is_its_own_class() -> None:
    """The torch behaviour the class names, measured on the installed torch: the DTensor over the buffer's
    start copies, the one past it fails with the message the class is read from. When torch copies both,
    this fails: the class no longer describes the installed torch and the tests should be run again."""
    done = subprocess.run([sys.executable, "-c", _DTENSOR_DEEPCOPY], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "0 copied"
    message = lines[1].removeprefix("4 ")
    assert message == "Attempted to call copy_() on an invalid python storage."
    assert reasons.classify_failure(f"E   RuntimeError: {message}") == "torch-dtensor-deepcopy"
    assert (
        reasons.classify_failure("E   RuntimeError: Attempted to access the data pointer on an invalid python storage.")
        == "unknown"
    )


def test_merging_reclassifies_with_the_rows_world_size(tmp_path: Path) -> None:
    from mindspeed_like.testing.megatron_unit.record import merge

    outcomes = Outcomes()
    outcomes.settle(f"{MTP}[4-1-True]", "failed", 4, "numerics", ALLCLOSE)
    part = write(outcomes, tmp_path / "p.json", level=1, options={}, command=["pytest"])
    record = json.loads(merge(tmp_path / "m.json", [part], level=1, reclassify=True).read_text())
    assert record["extra"]["failure_classes"] == {"router-near-tie": 1}


def test_merging_reclassifies_a_config_skip_recorded_as_a_missing_package(tmp_path: Path) -> None:
    from mindspeed_like.testing.megatron_unit.record import merge

    outcomes = Outcomes()
    reason = "dp_outer sharding strategy optim requires zero_dp_strategy to be full-sharded ('optim_grads_params', 3)."
    outcomes.settle("tests/unit_tests/distributed/test_m.py::t", "skipped", 8, "missing-package", reason)
    outcomes.settle(
        "tests/unit_tests/distributed/test_m.py::u", "skipped", 8, "missing-package", "Deep EP is not available"
    )
    part = write(outcomes, tmp_path / "p.json", level=0, options={}, command=["pytest"])
    record = json.loads(merge(tmp_path / "m.json", [part], level=0, reclassify=True).read_text())
    assert record["extra"]["skip_classes"] == {"megatron-skip": 1, "missing-package": 1}


def test_extra_import_line_flags_reach_the_ranks(tmp_path: Path) -> None:
    """`--megatron-extra-args` (MEGATRON_UNIT_EXTRA_ARGS) bisects which feature changes a test: the
    import line gets the flags after the level, and every rank launch gets the option again."""
    import argparse

    from mindspeed_like.testing import megatron_unit_tests as plugin

    assert plugin.import_line_args(1, "--no-use-flash-attn") == (
        "--device cpu --transfer-to-host --optimization-level 1 --no-use-flash-attn"
    )
    assert plugin.import_line_args(0) == "--device cpu --transfer-to-host --optimization-level 0"
    options = argparse.Namespace(
        megatron_ranks="2,4", megatron_child=None, megatron_record=None, megatron_stall_s=300.0,
        megatron_no_host_cuda=False, megatron_extra_args="--no-use-flash-attn", megatron_launch_size=None,
    )  # fmt: skip
    state = plugin._State(None, 1, options)
    args = plugin.rank_pytest_args(str(tmp_path), state)
    assert "--megatron-extra-args=--no-use-flash-attn" in args and "--megatron-level=1" in args
    # a launch size the sizes do not allow is refused at the start, naming the option to add it to
    options.megatron_launch_size = 8
    with pytest.raises(pytest.UsageError, match="--megatron-launch-size 8 is not one of the allowed sizes"):
        plugin._State(None, 1, options)


@pytest.mark.parametrize(
    ("needed", "sizes", "launch"),
    [(2, [2, 4], 2), (4, [2, 4], 4), (8, [2, 4], None), (8, [2, 4, 8], 8), (3, [2, 4], None)],
)
def test_launch_size_is_the_smallest_allowed_multiple(needed: int, sizes: list[int], launch: int | None) -> None:
    assert reasons.launch_size(needed, sizes) == launch


def test_ranks_needed_reads_megatrons_messages() -> None:
    assert reasons.ranks_needed("world_size (1) is not divisible by 8") == 8
    assert (
        reasons.ranks_needed("world_size (2) is not divisible by expert_tensor_model_pipeline_parallel size (4)") == 4
    )
    assert (
        reasons.ranks_needed("AssertionError: world size (1) is not divisible by total_model_size (total_model_size=4)")
        == 4
    )  # Megatron-LM's validate_args
    assert (
        reasons.ranks_needed("RuntimeError: Mesh should not be bigger than default world size 1, but found 8 ranks!")
        == 8
    )  # torch's init_device_mesh, as megatron_fsdp's tests call it
    text = "AssertionError: Expert data parallel size should be divisible by partial DistOpt shard factor"
    assert reasons.ranks_needed(text) == 8  # names no size: the tests pick instances for megatron's CI size
    assert reasons.classify_failure(text) == "needs-more-ranks"
    assert reasons.ranks_needed("AssertionError: nope") is None


def test_tests_are_grouped_by_world_size_one_launch_each_in_order() -> None:
    groups = ranks.group_by_size([("a", 4), ("b", 2), ("c", 4), ("d", 8)])
    assert list(groups) == [2, 4, 8]
    assert groups[4] == ["a", "c"]


def test_rank_reports_merge_to_the_worst_rank() -> None:
    result = ranks.RankResult("t")
    result.phases["call"] = [
        {"outcome": "passed", "_rank": 0, "when": "call"},
        {"outcome": "failed", "_rank": 1, "when": "call"},
    ]
    result.phases["setup"] = [{"outcome": "passed", "_rank": r, "when": "setup"} for r in (0, 1)]
    merged = result.merged()
    assert [r["when"] for r in merged] == ["setup", "call"]
    assert merged[1]["_rank"] == 1 and merged[1]["outcome"] == "failed"
    assert merged[0]["_rank"] == 0  # a tie keeps rank 0's report


def test_directory_of_a_node_id() -> None:
    assert directory_of("tests/unit_tests/transformer/moe/test_x.py::T::t[1]") == "transformer/moe"
    assert directory_of("tests/unit_tests/test_optimizer.py::t") == "test_optimizer"


def _fake_checkout(root: Path, version: str = "0.16.1", training: bool = True) -> Path:
    (root / "tests" / "unit_tests").mkdir(parents=True)
    (root / "tests" / "unit_tests" / "conftest.py").write_text("")
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    major, minor, patch = version.split(".")
    (core / "package_info.py").write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ''\n")
    if training:
        (root / "megatron" / "training").mkdir()
        (root / "megatron" / "training" / "__init__.py").write_text("")
    return root


def test_a_checkout_of_another_release_is_refused_naming_the_tag(tmp_path: Path) -> None:
    root = _fake_checkout(tmp_path / "mlm", version="0.15.3")
    installed = checkout.installed_version()
    if installed == "0.15.3":
        pytest.skip("megatron-core 0.15.3 is installed here")
    with pytest.raises(checkout.CheckoutError, match=rf"core_v{installed}"):
        checkout.check(root)


def test_a_checkout_without_megatron_training_is_refused(tmp_path: Path) -> None:
    root = _fake_checkout(tmp_path / "mlm", version=checkout.installed_version() or "0.16.1", training=False)
    with pytest.raises(checkout.CheckoutError, match="megatron/training"):
        checkout.check(root)


def test_missing_test_dependencies_are_named_with_the_pip_command(tmp_path: Path, monkeypatch) -> None:
    root = _fake_checkout(tmp_path / "mlm", version=checkout.installed_version() or "0.16.1")
    monkeypatch.setitem(checkout.TEST_DEPENDENCIES, "surely_not_installed_mod", "surely-not-installed")
    with pytest.raises(checkout.CheckoutError) as refused:
        checkout.check(root)
    # Other test dependencies may be missing too on a fresh venv (CI has none of them): the
    # message must name this one and give a pip command that installs it, whatever else it lists.
    message = str(refused.value)
    named, _, _ = message.partition("not installed here")
    assert "surely-not-installed" in named, message
    pip_command = re.search(r"-m pip install ([^(`]+)", message)
    assert pip_command is not None, message
    assert "surely-not-installed" in pip_command.group(1).split(), message


def test_the_root_is_found_from_the_test_path(tmp_path: Path) -> None:
    root = _fake_checkout(tmp_path / "mlm")
    (root / "tests" / "unit_tests" / "fusions").mkdir()
    assert checkout.find_root([str(root / "tests" / "unit_tests" / "fusions")], env={}) == root.resolve()
    assert checkout.find_root([], env={"MEGATRON_LM_PATH": str(root)}) == root.resolve()
    assert checkout.find_root([str(tmp_path)], env={}) is None


def test_the_record_has_directories_tests_classes_and_wall_time(tmp_path: Path) -> None:
    outcomes = Outcomes()
    outcomes.settle("tests/unit_tests/fusions/test_a.py::t1", "passed", 1, None)
    outcomes.settle("tests/unit_tests/fusions/test_a.py::t2", "failed", 2, "numerics", "E assert False")
    outcomes.settle("tests/unit_tests/fusions/test_b.py::t3", "skipped", 1, "triton-kernel-no-gpu", "no GPU")
    outcomes.size_wall_s[2] = 1.5
    path = write(outcomes, tmp_path / "megatron-unit-0.json", level=0, options={}, command=["pytest"])
    record = json.loads(path.read_text())
    dirs = [r for r in record["rows"] if r["table"] == "dirs"]
    assert dirs == [
        {
            "table": "dirs",
            "dir": "fusions",
            "collected": 3,
            "passed": 1,
            "failed": 1,
            "skipped": 1,
            "passed_pct": 33.3,
            "classes": {"numerics": 1, "triton-kernel-no-gpu": 1},
        }
    ]
    assert record["extra"]["failure_classes"] == {"numerics": 1}
    assert record["extra"]["wall_s_per_world_size"] == {"2": 1.5}
    assert "wall_s" in record["extra"]
    tests = {r["test"]: r for r in record["rows"] if r["table"] == "tests"}
    assert tests["tests/unit_tests/fusions/test_a.py::t1"]["class"] is None


MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH", "")


@pytest.mark.slow
@pytest.mark.skipif(
    not os.path.isfile(os.path.join(MEGATRON_LM, "tests", "unit_tests", "conftest.py")),
    reason="set MEGATRON_LM_PATH to a Megatron-LM checkout of the installed megatron-core's tag to run",
)
def test_the_plugin_runs_megatrons_fusions_tests(tmp_path: Path) -> None:
    """Megatron-LM's tests/unit_tests/fusions under the plugin: it writes a record with every test."""
    record_path = tmp_path / "megatron-unit-0.json"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "mindspeed_like.testing.megatron_unit_tests", "-p", "no:cacheprovider",
         "-o", "addopts=", "-q", "-W", "ignore", "--megatron-record", str(record_path),
         os.path.join(MEGATRON_LM, "tests", "unit_tests", "fusions")],
        capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert record_path.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(record_path.read_text())
    assert record["extra"]["collected"] >= 20
    assert record["extra"]["passed"] >= 20
    assert "unknown" not in record["extra"]["failure_classes"]
    assert "[megatron-unit L0] fusions:" in done.stdout


def test_pieces_name_their_paths(tmp_path: Path) -> None:
    """`optimizer` is test_optimizer*.py plus optimizer/; `transformer` leaves moe to its own piece."""
    from mindspeed_like.testing.megatron_unit.run import piece_args

    unit = tmp_path / "unit_tests"
    (unit / "optimizer").mkdir(parents=True)
    for name in ("test_optimizer.py", "test_optimizer_cpu_offloading.py", "test_other.py"):
        (unit / name).write_text("")
    assert piece_args(unit, "optimizer", ["optimizer"]) == [
        str(unit / "test_optimizer.py"),
        str(unit / "test_optimizer_cpu_offloading.py"),
        str(unit / "optimizer"),
    ]
    assert piece_args(unit, "transformer", ["transformer", "transformer/moe"])[1] == (
        f"--ignore={unit / 'transformer' / 'moe'}"
    )
    assert piece_args(unit, "transformer", ["transformer"]) == [str(unit / "transformer")]


def test_pieces_merge_into_one_level_record(tmp_path: Path) -> None:
    from mindspeed_like.testing.megatron_unit.record import merge

    parts = []
    for i, directory in enumerate(("fusions", "models")):
        outcomes = Outcomes()
        outcomes.settle(f"tests/unit_tests/{directory}/test_a.py::t", "passed", 1, None)
        outcomes.size_wall_s[2] = 1.0
        parts.append(write(outcomes, tmp_path / f"p{i}.json", level=1, options={"ranks": [2]}, command=["pytest"]))
    record = json.loads(merge(tmp_path / "megatron-unit-1.json", parts, level=1).read_text())
    assert record["extra"]["collected"] == 2 and record["extra"]["passed"] == 2
    assert record["extra"]["wall_s_per_world_size"] == {"2": 2.0}
    assert len(record["options"]["pieces"]) == 2 and record["options"]["level"] == 1


def test_rank_skips_of_a_record_are_chunked_per_directory(tmp_path: Path) -> None:
    """`run.py --rank-skips-of`: only the tests the record set aside for more ranks, by directory."""
    from mindspeed_like.testing.megatron_unit.run import rank_skips

    outcomes = Outcomes()
    skip = "megatron-unit needs-more-ranks: written for 8 ranks; the harness launches [2, 4]"
    for i in range(5):
        outcomes.settle(f"tests/unit_tests/models/test_a.py::t{i}", "skipped", 1, "needs-more-ranks", skip)
    outcomes.settle("tests/unit_tests/fusions/test_b.py::t", "skipped", 1, "needs-more-ranks", skip)
    outcomes.settle("tests/unit_tests/fusions/test_b.py::u", "skipped", 1, "megatron-skip", "flaky")
    outcomes.settle("tests/unit_tests/fusions/test_b.py::v", "passed", 1, None)
    record = write(outcomes, tmp_path / "r.json", level=0, options={"ranks": [2, 4]}, command=["pytest"])
    assert rank_skips(record, None, chunk=2) == [
        ("fusions-1", ["tests/unit_tests/fusions/test_b.py::t"]),
        ("models-1", ["tests/unit_tests/models/test_a.py::t0", "tests/unit_tests/models/test_a.py::t1"]),
        ("models-2", ["tests/unit_tests/models/test_a.py::t2", "tests/unit_tests/models/test_a.py::t3"]),
        ("models-3", ["tests/unit_tests/models/test_a.py::t4"]),
    ]
    assert [name for name, _ in rank_skips(record, ["fusions"], chunk=40)] == ["fusions-1"]
    only = {"tests/unit_tests/models/test_a.py::t3", "tests/unit_tests/fusions/test_b.py::v"}
    assert rank_skips(record, None, chunk=40, only=only) == [("models-1", ["tests/unit_tests/models/test_a.py::t3"])]


def test_passed_tests_of_a_record_are_its_passes_only(tmp_path: Path) -> None:
    """`run.py --passed-in`: the tests a level-0 record saw pass (what levels 1 and 2 can regress)."""
    from mindspeed_like.testing.megatron_unit.run import passed_tests

    outcomes = Outcomes()
    outcomes.settle("tests/unit_tests/a.py::p", "passed", 8, None)
    outcomes.settle("tests/unit_tests/a.py::f", "failed", 8, "numerics", "assert False")
    outcomes.settle("tests/unit_tests/a.py::s", "skipped", 1, "megatron-skip", "flaky")
    record = write(outcomes, tmp_path / "r.json", level=0, options={"ranks": [2, 4, 8]}, command=["pytest"])
    assert passed_tests(record) == {"tests/unit_tests/a.py::p"}


def test_a_later_piece_settles_a_test_over_a_merged_record(tmp_path: Path) -> None:
    """The 8-rank pieces merged over a level's record: their outcomes win, the record's pieces and
    sizes carry over flat, and the wall time adds up."""
    from mindspeed_like.testing.megatron_unit.record import merge

    test = "tests/unit_tests/models/test_a.py::t"
    base = Outcomes()
    base.settle(test, "skipped", 1, "needs-more-ranks", "written for 8 ranks")
    base.settle("tests/unit_tests/models/test_a.py::u", "passed", 2, None)
    first = write(base, tmp_path / "p0.json", level=0, options={"ranks": [2, 4]}, command=["pytest", "first"])
    level = merge(tmp_path / "level.json", [first], level=0)
    eight = Outcomes()
    eight.settle(test, "passed", 8, None)
    eight.size_wall_s[8] = 5.0
    part = write(eight, tmp_path / "p8.json", level=0, options={"ranks": [2, 4, 8]}, command=["pytest", "eight"])
    record = json.loads(merge(tmp_path / "level.json", [level, part], level=0).read_text())
    assert record["extra"]["passed"] == 2 and record["extra"]["skipped"] == 0
    assert record["extra"]["world_sizes"] == {"2": 1, "8": 1}
    assert record["options"]["ranks"] == [2, 4, 8]
    assert [p["command"][-1] for p in record["options"]["pieces"]] == ["first", "eight"]
    assert record["extra"]["wall_s_per_world_size"]["8"] == 5.0


@pytest.mark.parametrize(
    "text",
    [  # what the ranks of one dist_checkpointing launch reported when rank 0 failed mid-collective
        "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
        "peer [127.0.0.1]:5331. This is typically caused by a remote worker crashing.",
        "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
        "waiting 120000ms for recv operation to complete",
        "RuntimeError: Application timeout caused pair closure",
    ],
)
def test_a_broken_gloo_group_is_recognised(text: str) -> None:
    assert ranks.broke_the_process_group(text)


def test_ordinary_failures_do_not_end_a_rank() -> None:
    assert not ranks.broke_the_process_group("RuntimeError: world_size (4) is not divisible by 8")
    assert not ranks.broke_the_process_group("AssertionError: assert tensor(False)")


class _Exited:
    def __init__(self, code: int | None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


def test_a_rank_with_too_many_threads_is_recycled() -> None:
    """A rank ends after a test once its threads outgrow the limit (the launcher relaunches the rest)."""
    import threading

    from mindspeed_like.testing.megatron_unit import ranks as launcher

    now = len(os.listdir("/proc/self/task"))
    assert not launcher.too_many_threads(now + 5)
    stop = threading.Event()
    extra = [threading.Thread(target=stop.wait) for _ in range(10)]
    for thread in extra:
        thread.start()
    try:
        assert launcher.too_many_threads(now + 5)
    finally:
        stop.set()
        for thread in extra:
            thread.join()


def test_after_a_broken_group_only_the_breaking_test_is_charged() -> None:
    """Rank 1 exits after test a broke its group; rank 0 had started b: b is relaunched, not failed."""
    procs = [_Exited(None), _Exited(ranks.BROKEN_GROUP_EXIT)]
    assert ranks._relaunch_after(procs, {0: "b", 1: "a"}) == "a"
    assert ranks._relaunch_after([_Exited(None), _Exited(1)], {0: "b", 1: "a"}) is None  # a crash: as before


def test_a_launchs_ranks_share_a_checkpoint_folder_no_other_launch_has(monkeypatch) -> None:
    """megatron's tmp_path_dist_ckpt is ``basetemp/ignored``'s grandparent / "tmp_dist_ckpt": the ranks
    of one launch must share it, and two launches (or sessions) must not (rank 0 removes it at its end)."""
    commands: list[list[str]] = []

    class _Done:
        returncode = 0

        def __init__(self, cmd, **kwargs) -> None:
            commands.append(cmd)

        def poll(self) -> int:
            return 0

        def wait(self) -> int:
            return 0

    monkeypatch.setattr(ranks.subprocess, "Popen", _Done)
    for _ in range(2):
        ranks._launch_once(["t"], 2, [], cwd=".", stall_s=1, on_result=lambda result: None, env=None)
    folders = [Path(next(a for a in cmd if a.startswith("--basetemp=")).split("=", 1)[1]) for cmd in commands]
    shared = [(folder / "ignored").parent.parent / "tmp_dist_ckpt" for folder in folders]
    assert len(set(folders)) == 4
    assert shared[0] == shared[1] and shared[2] == shared[3] and shared[0] != shared[2]


def test_a_finished_tests_instance_lets_go_of_what_it_built() -> None:
    """pytest keeps each test's class instance (and the models and process groups on it) alive until
    the session ends; the harness empties it after the test's teardown."""
    import gc
    import weakref

    from mindspeed_like.testing import megatron_unit_tests as plugin

    class Model:
        pass

    class TestSomething:
        pass

    class Item:
        instance = TestSomething()

    item = Item()
    item.instance.model = Model()
    alive = weakref.ref(item.instance.model)
    plugin._release_test_instance(item)
    gc.collect()
    assert alive() is None and vars(item.instance) == {}


@pytest.mark.parametrize("rank_0_moved_on", [False, True])
def test_ranks_that_diverge_after_a_failure_end_the_launch_soon(monkeypatch, rank_0_moved_on: bool) -> None:
    """Rank 0's call failed; rank 1 waits in a collective that rank 0 left. The test is charged with
    rank 0's failure after DIVERGED_S (not the 300 s stall limit), and the launch ends for a relaunch.
    Rank 0 may have started the next test by then: the harness killed its ranks, so that test is
    relaunched, not charged "ranks exited [-9, -9]" (3 of level 1's Megatron-FSDP tests at 8 ranks were)."""
    import json as _json

    def lines(rank: int) -> str:
        events = [{"event": "start", "nodeid": "t"}, {"nodeid": "t", "when": "setup", "outcome": "passed"}]
        if rank == 0:
            events.append({"nodeid": "t", "when": "call", "outcome": "failed", "longrepr": "AssertionError"})
            if rank_0_moved_on:
                events += [{"nodeid": "t", "when": "teardown", "outcome": "passed"}, {"event": "start", "nodeid": "u"}]
        return "".join(_json.dumps(e) + "\n" for e in events)

    class _Waiting:
        def __init__(self, cmd, **kwargs) -> None:
            out = next(a for a in cmd if a.startswith("--megatron-child=")).split("=", 1)[1]
            rank = int(kwargs["env"]["RANK"])
            Path(out).write_text(lines(rank))
            self.returncode = None

        def poll(self) -> int | None:
            return self.returncode

        def kill(self) -> None:
            self.returncode = -9

        def wait(self) -> int:
            return self.returncode

    monkeypatch.setattr(ranks.subprocess, "Popen", _Waiting)
    monkeypatch.setattr(ranks, "DIVERGED_S", 0.2)
    charged = []
    done = ranks._launch_once(["t", "u"], 2, [], cwd=".", stall_s=300, on_result=charged.append, env=None)
    assert done == {"t"}
    [result] = charged
    assert [r["outcome"] for r in result.merged()][:2] == ["passed", "failed"]  # setup, call (then teardown)


_MESH_CACHE: list = []  # a module's cache of a mesh across tests, as torch's and Megatron-FSDP's are


def _groups_after_cleanup() -> dict[str, bool]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from mindspeed_like.testing.megatron_unit import host_device

    held, dropped = dist.new_group([0, 1]), dist.new_group([0, 1])
    _MESH_CACHE.append(DeviceMesh.from_group(held, "cpu"))
    names = {"held": held.group_name, "dropped": dropped.group_name}
    del held, dropped
    host_device.destroy_leftover_groups()
    alive = {}
    for which, name in names.items():
        try:
            dist.distributed_c10d._resolve_process_group(name)
            alive[which] = True
        except (RuntimeError, ValueError):
            alive[which] = False
    mesh = _MESH_CACHE.pop()
    dist.all_reduce(torch.ones(1), group=mesh.get_group())  # the cached mesh still communicates
    return alive


def test_a_group_a_cached_device_mesh_holds_outlives_the_between_test_cleanup() -> None:
    """Megatron-FSDP's fully_shard tests at 8 ranks failed "Could not resolve the process group registered
    under the name N" after the harness destroyed a group that a cached DeviceMesh still named."""
    from mindspeed_like.testing import run_distributed

    for rank in run_distributed(_groups_after_cleanup, 2, timeout=300):
        assert rank == {"held": True, "dropped": False}


@pytest.mark.parametrize("second_launch_runs", [False, True])
def test_a_launch_whose_ranks_ran_no_test_is_tried_once_more(monkeypatch, second_launch_runs: bool) -> None:
    """Ranks that exit before any test (a rendezvous or import failure) charge nothing the first time:
    the launch is tried again, and only a second empty launch charges every test "ran no test"."""
    import json as _json

    launches: list[int] = []

    class _Rank:
        def __init__(self, cmd, **kwargs) -> None:
            rank = int(kwargs["env"]["RANK"])
            if rank == 0:
                launches.append(1)
            out = Path(next(a for a in cmd if a.startswith("--megatron-child=")).split("=", 1)[1])
            if second_launch_runs and len(launches) == 2:
                events = []
                for nodeid in ("t", "u"):
                    events += [{"event": "start", "nodeid": nodeid}]
                    phases = ("setup", "call", "teardown")
                    events += [{"nodeid": nodeid, "when": w, "outcome": "passed"} for w in phases]
                out.write_text("".join(_json.dumps(e) + "\n" for e in events))
                self.returncode = 0
            else:
                self.returncode = 1  # exited before its first test

        def poll(self) -> int:
            return self.returncode

        def kill(self) -> None:
            pass

        def wait(self) -> int:
            return self.returncode

    monkeypatch.setattr(ranks.subprocess, "Popen", _Rank)
    charged = []
    ranks.launch(["t", "u"], 2, [], cwd=".", stall_s=300, on_result=charged.append)
    assert len(launches) == 2
    outcomes = {r.nodeid: [e["outcome"] for e in r.merged()] for r in charged}
    if second_launch_runs:
        assert outcomes == {"t": ["passed"] * 3, "u": ["passed"] * 3}
    else:
        assert sorted(outcomes) == ["t", "u"] and all(o == ["failed"] for o in outcomes.values())


def _default_group_before_a_test(megatron_lm: str) -> int:
    """A rank whose launch starts with a test that makes no default group: the harness makes it."""
    import torch.distributed as dist

    import mindspeed_like
    from mindspeed_like.testing.megatron_unit import host_device

    dist.destroy_process_group()  # run_distributed's own; a harness rank starts without one
    sys.path.insert(0, megatron_lm)
    mindspeed_like.configure(device="cpu", transfer_to_host=True)  # a rank runs under the import line
    host_device.install()
    try:
        host_device.before_test()
        size = dist.get_world_size()
        dist.all_reduce(torch.ones(1))
        host_device.before_test()  # made once: a second call keeps the group
        return size
    finally:
        host_device.uninstall()
        mindspeed_like.reset()


@pytest.mark.skipif(not os.path.isdir(os.path.join(MEGATRON_LM, "tests", "unit_tests")), reason="no Megatron-LM")
def test_a_rank_has_the_default_group_before_its_first_test() -> None:
    """models/test_gpt_model.py's TestGPTModelWithCustomPG, the first test of its 8-rank launch, failed
    "Default process group has not been initialized": in megatron's CI an earlier test had made it."""
    from mindspeed_like.testing import run_distributed

    assert run_distributed(_default_group_before_a_test, 2, MEGATRON_LM, timeout=300) == [2, 2]


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (
            "dp_outer sharding strategy optim requires zero_dp_strategy to be full-sharded ('optim_grads_params', 3).",
            "megatron-skip",
        ),
        ("Multiple distributed optimizer instances requires distributed optimizer to be enabled", "megatron-skip"),
        ("Kitchen required for using kitchen backend.", "missing-package"),
        ("Deep EP and Hybrid EP are not available", "missing-package"),
        ("need latest flash attn for dynamic batching", "missing-package"),
    ],
)
def test_a_config_skip_that_says_requires_is_megatrons_own(reason: str, expected: str) -> None:
    """A skip naming a config combination megatron does not cover is not a missing package."""
    from mindspeed_like.testing.megatron_unit.reasons import classify_skip

    assert classify_skip(reason) == expected


def test_a_module_boundary_unsets_megatrons_microbatch_calculator() -> None:
    """A test that set megatron's num-microbatches calculator and never unset it failed the next module's
    fixture ("already initialized"); the calculator stays within a module and goes at its end."""
    from megatron.core import num_microbatches_calculator as calculator

    from mindspeed_like.testing.megatron_unit import host_device

    calculator.init_num_microbatches_calculator(0, None, 1, 1, 1)
    try:
        host_device.after_test(module_ends=False)
        assert calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None
        host_device.after_test(module_ends=True)
        assert calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None
    finally:
        if calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
            calculator.unset_num_microbatches_calculator()


def test_passed_in_keeps_each_pieces_own_node_ids(tmp_path: Path) -> None:
    """`run.py --passed-in` without --rank-skips-of: a piece runs the node ids its paths would collect."""
    from mindspeed_like.testing.megatron_unit.run import passed_in_piece

    ids = [
        "tests/unit_tests/transformer/test_a.py::t",
        "tests/unit_tests/transformer/moe/test_b.py::t[1-2]",
        "tests/unit_tests/test_optimizer.py::t",
        "tests/unit_tests/test_optimizer_param_scheduler.py::t",
        "tests/unit_tests/optimizer/test_c.py::t",
        "tests/unit_tests/dist_checkpointing/test_layer_wise_optimizer.py::T::t[1-1]",
        "tests/unit_tests/dist_checkpointing/models/test_d.py::t",
    ]
    for node_id in ids:  # piece_args globs the checkout's test_optimizer*.py
        (tmp_path / node_id.split("::")[0]).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / node_id.split("::")[0]).touch()
    pieces = ["transformer", "transformer/moe", "optimizer"]
    assert passed_in_piece(tmp_path, ids, "transformer", pieces) == [ids[0]]
    assert passed_in_piece(tmp_path, ids, "transformer", ["transformer"]) == ids[:2]
    assert passed_in_piece(tmp_path, ids, "transformer/moe", pieces) == [ids[1]]
    assert passed_in_piece(tmp_path, ids, "optimizer", pieces) == ids[2:5]
    assert passed_in_piece(tmp_path, ids, "dist_checkpointing/test_layer_wise_optimizer.py", pieces) == [ids[5]]
    assert passed_in_piece(tmp_path, ids, "dist_checkpointing", pieces) == ids[5:]


def test_a_ranks_skip_comes_back_as_pytests_own_skip(pytestconfig) -> None:
    """A skip's longrepr crosses JSON as a list; pytest's short summary of skips (``-rs``) asserts a tuple."""
    from _pytest.terminal import _folded_skips

    from mindspeed_like.testing.megatron_unit_tests import rank_report

    data = {
        "$report_type": "TestReport", "nodeid": "t.py::test", "location": ("t.py", 3, "test"), "keywords": {},
        "outcome": "skipped", "longrepr": ["t.py", 4, "Skipped: megatron-unit triton-kernel-no-gpu: ..."],
        "when": "call", "sections": [], "duration": 0.0, "user_properties": [],
    }  # fmt: skip
    report = rank_report(pytestconfig, json.loads(json.dumps(data)))
    assert report.skipped and report.longrepr == ("t.py", 4, "Skipped: megatron-unit triton-kernel-no-gpu: ...")
    assert _folded_skips(Path.cwd(), [report]) == [(1, "t.py", 4, "Skipped: megatron-unit triton-kernel-no-gpu: ...")]
