"""pytest plugin: Megatron-LM's own tests/unit_tests on a CPU host, with the import line.

    MEGATRON_LM_PATH=/path/to/Megatron-LM python -m pytest -p mindspeed_like.testing.megatron_unit_tests \
        -o addopts= -p no:cacheprovider --megatron-level 1 $MEGATRON_LM_PATH/tests/unit_tests/transformer

(``make test-megatron-unit MEGATRON_LM_PATH=... [LEVEL=0|1|2] [DIRS=...]`` runs the directory set and
writes the record.) What it does, each in its own module of ``mindspeed_like/testing/megatron_unit``:

* ``checkout``: the checkout must be of the installed megatron-core's release and have
  ``megatron.training``; the tests' own dependencies must import. Otherwise a usage error says what
  to check out or install. The installed ``megatron.core`` is used, the checkout's
  ``megatron.training`` merged into the namespace.
* the import line: ``MINDSPEED_LIKE_ARGS="--device cpu --transfer-to-host --optimization-level N"``
  then ``import mindspeed_like.megatron_adaptor``, as a user's script would.
* ``host_device``: the tests' own CUDA calls answered by the host (harness only).
* ``ranks``: a test that asks for N ranks is relaunched under N gloo ranks (2 and 4 by default,
  ``--megatron-ranks 2,4,8`` for 8); a size not allowed is a skip that says how to allow it.
* ``reasons``: every test that does not pass gets one class; failures that no host can fix
  (megatron's GPU-only Triton kernels, FP8) become skips with the class as the reason.
* ``record``: ``--megatron-record PATH`` writes per directory and per test the outcome and class.

Downstream projects can run their own megatron-dependent tests with the same plugin (``-p
mindspeed_like.testing.megatron_unit_tests`` with ``MEGATRON_LM_PATH`` set): their tests get the
import line, the host device and the rank launches the same way (docs/megatron-tests.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mindspeed_like.testing.megatron_unit import checkout, host_device, ranks, reasons
from mindspeed_like.testing.megatron_unit.record import Outcomes, directory_of, write
from mindspeed_like.workloads.parallel import free_port

# GPU-sized tests: minutes or gigabytes each on a host; skipped with the reason, not run.
GPU_SIZED = {
    "transformer/test_transformer_block_custom_pgs.py": "hidden size 4096 blocks, ~130 s a test on a 2-core host",
    "transformer/moe/test_moe_layer_discrepancy.py": "compares MoE layers at > 9 GB of activations",
}
# Tests whose subject is CUDA memory (torch.cuda.max_memory_allocated, which the host answers 0): they
# measure nothing on a host and spend minutes each offloading a GPT model's activations to "the host".
MEASURES_CUDA_MEMORY = {
    "pipeline_parallel/test_fine_grained_activation_offloading.py": "activation offloading's CUDA memory saving",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("megatron-unit", "Megatron-LM's unit tests on a CPU host (mindspeed_like)")
    group.addoption(
        "--megatron-level",
        type=int,
        default=int(os.environ.get("MEGATRON_UNIT_LEVEL", "0")),
        help="the import line's --optimization-level (0, 1, 2)",
    )
    group.addoption(
        "--megatron-ranks",
        default=os.environ.get("MEGATRON_UNIT_RANKS", "2,4"),
        help="world sizes the plugin may launch for tests that ask for more ranks (default 2,4; add 8 to opt in)",
    )
    group.addoption(
        "--megatron-record", default=None, help="write the record (results/megatron-unit-<level>.json) here"
    )
    group.addoption(
        "--megatron-no-host-cuda",
        action="store_true",
        help="leave torch.cuda.is_available() False (the tests behind skipif(not cuda) then skip)",
    )
    group.addoption(
        "--megatron-stall-s",
        type=float,
        default=float(os.environ.get("MEGATRON_UNIT_STALL_S", "300")),
        help="a rank launch making no progress this long fails the test in progress",
    )
    group.addoption(
        "--megatron-extra-args",
        default=os.environ.get("MEGATRON_UNIT_EXTRA_ARGS", ""),
        help="more flags for the import line's MINDSPEED_LIKE_ARGS, e.g. '--no-use-flash-attn' to find which "
        "feature changes a test's result (ranks launched for a test get the same)",
    )
    group.addoption(
        "--megatron-launch-size",
        type=int,
        default=None,
        help="run every selected test straight under this many ranks, without the world-size-1 pass first "
        "(the tests an earlier record set aside for more ranks: `run.py --rank-skips-of RECORD`)",
    )
    group.addoption("--megatron-child", default=None, help=argparse_suppress())


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """Before megatron's conftest imports anything: the checkout, the import line, the host device."""
    options = early_config.known_args_namespace
    try:
        found = checkout.check(checkout.find_root(args))
    except checkout.CheckoutError as error:
        raise pytest.UsageError(f"megatron-unit: {error}") from None
    checkout.put_on_path(found)
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)  # as torchrun sets them for one process (tests use env://)
    if not options.megatron_child and "MASTER_PORT" not in os.environ:
        # megatron's Utils defaults to port 6000, which another job on the host may hold
        os.environ["MASTER_PORT"] = str(free_port())
    level = options.megatron_level
    os.environ["MINDSPEED_LIKE_ARGS"] = import_line_args(level, options.megatron_extra_args)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import mindspeed_like.megatron_adaptor  # noqa: F401 - the import line under test

    host_device.install(host_cuda=not options.megatron_no_host_cuda)
    early_config.stash[_STATE] = _State(found, level, options)


def import_line_args(level: int, extra: str = "") -> str:
    """``MINDSPEED_LIKE_ARGS`` for the import line: the host, the level, then the user's extra flags."""
    return f"--device cpu --transfer-to-host --optimization-level {level}" + (f" {extra}" if extra else "")


class _State:
    def __init__(self, found: checkout.Checkout, level: int, options: Any) -> None:
        self.checkout = found
        self.level = level
        self.sizes = [int(s) for s in str(options.megatron_ranks).split(",") if s.strip()]
        self.child = options.megatron_child
        self.record = options.megatron_record
        self.stall_s = options.megatron_stall_s
        self.host_cuda = not options.megatron_no_host_cuda
        self.extra_args = options.megatron_extra_args
        self.launch_size = options.megatron_launch_size
        if self.launch_size is not None and self.launch_size not in self.sizes:
            raise pytest.UsageError(
                f"megatron-unit: --megatron-launch-size {self.launch_size} is not one of the allowed sizes "
                f"--megatron-ranks {options.megatron_ranks}; add it there"
            )
        self.outcomes = Outcomes()
        self.deferred: dict[int, list[str]] = {}
        self.items: dict[str, pytest.Item] = {}
        self.current_dir: str | None = None
        self.dir_started = time.monotonic()
        self.child_out = open(self.child, "a") if self.child else None  # noqa: SIM115 - closed at sessionfinish
        self.process_group_broken = False  # a rank: a test broke its gloo connections (it exits after it)


_STATE = pytest.StashKey[_State]()


def _state(config: pytest.Config) -> _State | None:
    return config.stash.get(_STATE, None)


def pytest_configure(config: pytest.Config) -> None:
    state = _state(config)
    if state is None:
        return
    _CONFIG.append(config)
    # a file that fails to import is one recorded failure with its class, not the end of the run
    config.option.continue_on_collection_errors = True
    if config.option.maxfail == 1 and "-x" in " ".join(config.getini("addopts")):
        config.option.maxfail = 0  # Megatron-LM's pyproject adds -x: the harness runs every test
    config.addinivalue_line("markers", "megatron_unit_gpu_sized: skipped by the megatron-unit harness")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = _state(config)
    if state is None:
        return
    for item in items:
        state.items[item.nodeid] = item
        path = item.nodeid.split("::")[0].split("unit_tests/", 1)[-1]
        if path in GPU_SIZED:
            item.add_marker(pytest.mark.skip(reason=f"megatron-unit harness: deselected, GPU-sized: {GPU_SIZED[path]}"))
        elif path in MEASURES_CUDA_MEMORY:
            item.add_marker(
                pytest.mark.skip(reason=f"megatron-unit harness: measures CUDA memory: {MEASURES_CUDA_MEMORY[path]}")
            )


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A test file that fails to import: one row (the file) with its class in the record."""
    if report.failed and _CONFIG and report.nodeid.endswith(".py"):
        state = _state(_CONFIG[-1])
        if state is not None and not state.child:
            text = str(report.longrepr or "")
            state.outcomes.settle(
                report.nodeid, "failed", 1, reasons.classify_failure(text), "collection error: " + _last_line(text)
            )


def _text(report: pytest.TestReport) -> str:
    if isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    return str(report.longrepr or "")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """A failure no host can fix (GPU-only Triton kernel, FP8) becomes a skip naming its class."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.failed and _state(item.config) is not None:
        text = _text(report)
        cls = reasons.classify_failure(text)
        if cls in reasons.HOST_SKIPS:
            crash = getattr(report.longrepr, "reprcrash", None)
            first = crash.message.splitlines()[0] if crash is not None and crash.message else text.splitlines()[-1:]
            path, lineno, _ = item.location
            report.outcome = "skipped"
            report.longrepr = (
                str(path),
                (lineno or 0) + 1,
                f"Skipped: megatron-unit {cls}: cannot run on a CPU host: {first}",
            )


def rank_report(config: pytest.Config, data: dict) -> pytest.TestReport:
    """A rank's serialized report as this session's: a skip's ``(path, line, reason)`` comes back from JSON
    as a list, which pytest's short summary of skips asserts is a tuple (a rerun by node id with ``-rs``
    stopped in ``_folded_skips`` after the test had run)."""
    report = config.hook.pytest_report_from_serializable(config=config, data=data)
    if isinstance(report.longrepr, list):
        report.longrepr = tuple(report.longrepr)
    return report


def _final(reports: list[pytest.TestReport], world_size: int) -> tuple[str, str | None, str]:
    """A test's outcome, class and reason from its phase reports."""
    for report in reports:
        if report.failed:
            text = _text(report)
            return "failed", reasons.classify_failure(text, report.nodeid, world_size), _last_line(text)
    for report in reports:
        if report.skipped:
            reason = _text(report).removeprefix("Skipped: ")
            if hasattr(report, "wasxfail"):
                return "skipped", "megatron-xfail", f"xfail: {report.wasxfail}"
            if reason.startswith("megatron-unit ") and not reason.startswith("megatron-unit harness"):
                return "skipped", reason.split()[1].rstrip(":"), reason
            return "skipped", reasons.classify_skip(reason), reason
    return "passed", None, ""


def _last_line(text: str) -> str:
    """The exception's lines (the record keeps 500 characters: enough to re-read the class)."""
    errors = reasons.error_lines(text)
    if errors is text:
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""
    return " | ".join(errors.splitlines()[-6:])


def _wanted_size(reports: list[pytest.TestReport], state: _State, size: int = 1) -> int | None:
    """The world size a test asked for, when it failed or skipped for want of ranks at ``size``."""
    for report in reports:
        if report.failed or report.skipped:
            needed = reasons.ranks_needed(_text(report))
            if needed and needed > size:
                return needed
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """In a rank: the default process group exists before the test, as after any earlier test in megatron's CI."""
    state = _state(item.config)
    if state is not None and state.child:
        host_device.before_test()


@pytest.hookimpl(tryfirst=True)
@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """In a rank too: the groups a test left behind go after its teardown (threads stay flat)."""
    state = _state(item.config)
    if state is not None and state.child:
        _release_test_instance(item)
        host_device.after_test(module_ends=_module_ends(item, nextitem))


def _module_ends(item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    return nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None)


def _release_test_instance(item: pytest.Item) -> None:
    """Drop what a test class's instance holds (its models, optimizers and their process groups) once
    its teardown ran: pytest keeps every test's instance alive through its item until the session
    ends, so the groups the harness destroyed kept their threads (an L1 run of the transformer folder
    held 1,104 gloo groups, 3,300 threads and a load average of 170 on 2 cores). Each test gets a
    fresh instance, so nothing later reads it."""
    instance = getattr(item, "instance", None)
    if instance is not None and hasattr(instance, "__dict__"):
        vars(instance).clear()


def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    state = _state(item.config)
    if state is None or state.child:
        if state is not None and state.child_out:
            state.child_out.write(json.dumps({"event": "start", "nodeid": item.nodeid}) + "\n")
            state.child_out.flush()
        return None  # a rank: pytest's own protocol; its reports go out in pytest_runtest_logreport
    from _pytest.runner import runtestprotocol

    _progress(item, state)
    if state.launch_size is not None:  # known to want ranks: no world-size-1 pass first
        state.deferred.setdefault(state.launch_size, []).append(item.nodeid)
        return True
    with _time_limit(TEST_TIMEOUT_S):
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
    _release_test_instance(item)
    host_device.after_test(module_ends=_module_ends(item, nextitem))
    needed = _wanted_size(reports, state)
    if needed:
        size = reasons.launch_size(needed, state.sizes)
        if size is not None:
            state.deferred.setdefault(size, []).append(item.nodeid)
            return True
        _as_rank_skip(item, reports, needed, state)
    _log(item, reports, state, 1)
    return True


TEST_TIMEOUT_S = int(os.environ.get("MEGATRON_UNIT_TEST_TIMEOUT_S", "600"))


class TestTimeout(Exception):
    """A test ran past MEGATRON_UNIT_TEST_TIMEOUT_S in the world-size-1 process (class ``timeout``)."""


@contextlib.contextmanager
def _time_limit(seconds: int) -> Any:
    """SIGALRM raises in the test (a test stuck inside C code is only caught when it returns)."""

    def expire(signum: int, frame: Any) -> None:
        raise TestTimeout(f"megatron-unit: Timeout: the test ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def rank_pytest_args(rootpath: str, state: _State) -> list[str]:
    """The plugin's options a rank launch's pytest gets: the same level, sizes, host device and extra flags."""
    # `--option=value` in one token (pytest finds the rootdir before it knows the plugin's options)
    args = [
        "-p", "mindspeed_like.testing.megatron_unit_tests", "-p", "no:cacheprovider", "-q", "-o", "addopts=",
        f"--rootdir={rootpath}", f"--megatron-level={state.level}",
        f"--megatron-ranks={','.join(map(str, state.sizes))}",
    ]  # fmt: skip
    if not state.host_cuda:
        args.append("--megatron-no-host-cuda")
    if state.extra_args:
        args.append(f"--megatron-extra-args={state.extra_args}")
    return args


def _as_rank_skip(item: pytest.Item, reports: list[pytest.TestReport], needed: int, state: _State) -> None:
    """A test asking for a world size the harness may not launch: a skip saying how to allow it."""
    for report in reports:
        if report.failed:
            report.outcome = "skipped"
            path, lineno, _ = item.location
            report.longrepr = (
                str(path),
                (lineno or 0) + 1,
                f"Skipped: megatron-unit needs-more-ranks: written for {needed} ranks; the harness launches "
                f"{state.sizes} (--megatron-ranks {','.join(map(str, sorted({*state.sizes, needed})))} to run it)",
            )


def _log(item: pytest.Item, reports: list[pytest.TestReport], state: _State, world_size: int) -> None:
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    outcome, cls, reason = _final(reports, world_size)
    state.outcomes.settle(item.nodeid, outcome, world_size, cls, reason)


def _say(config: pytest.Config, line: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(line)
    else:
        print(line, file=sys.stderr)


def _progress(item: pytest.Item, state: _State) -> None:
    directory = directory_of(item.nodeid)
    if directory != state.current_dir:
        _dir_done(item.config, state)
        state.current_dir, state.dir_started = directory, time.monotonic()


def _dir_done(config: pytest.Config, state: _State) -> None:
    if state.current_dir is not None:
        waiting = sum(directory_of(n) == state.current_dir for ids in state.deferred.values() for n in ids)
        _say(
            config,
            f"[megatron-unit L{state.level}] {state.outcomes.summary_line(state.current_dir)}"
            f" at world size 1, {waiting} set aside for more ranks ({time.monotonic() - state.dir_started:.0f} s)",
        )


_CONFIG: list[pytest.Config] = []  # the session's config, for the rank reports below


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In a rank: every phase report as one JSON line for the launching process.

    A test whose collective broke the rank's gloo connections (a peer failed mid-collective: "Connection
    closed by peer", "Timed out waiting ... for recv", "pair closure") leaves the default group dead for
    every later test of the launch (each then fails in its teardown's barrier). The rank reports the
    test, then exits; the launcher relaunches the rest of the group on fresh ranks. So does a rank whose
    threads outgrew ``MEGATRON_UNIT_MAX_THREADS`` (``ranks.too_many_threads``)."""
    state = _state(_CONFIG[-1]) if _CONFIG else None
    if state is not None and state.child_out is not None:
        data = _CONFIG[-1].hook.pytest_report_to_serializable(config=_CONFIG[-1], report=report)
        state.child_out.write(json.dumps(data, default=str) + "\n")
        state.child_out.flush()
        if report.failed and ranks.broke_the_process_group(str(report.longrepr)):
            state.process_group_broken = True
        if report.when == "teardown" and (state.process_group_broken or ranks.too_many_threads()):
            state.child_out.close()
            os._exit(ranks.BROKEN_GROUP_EXIT)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session: pytest.Session) -> Any:
    yield
    state = _state(session.config)
    if state is None or state.child:
        return
    _dir_done(session.config, state)
    config = session.config
    child_args = rank_pytest_args(str(config.rootpath), state)
    launched: set[int] = set()
    while True:
        # smallest size first; a test that asks a launch for still more ranks joins a later size
        pending = {size: ids for size, ids in ranks.group_by_size(_pairs(state)).items() if size not in launched}
        if not pending:
            break
        size = min(pending)
        nodeids = pending[size]
        launched.add(size)
        _say(
            config,
            f"[megatron-unit L{state.level}] {len(nodeids)} tests at world size {size} "
            f"({', '.join(sorted({directory_of(n) for n in nodeids}))})",
        )
        started = time.monotonic()

        def on_result(result: ranks.RankResult, size: int = size) -> None:
            item = state.items[result.nodeid]
            reports = []
            for data in result.merged():
                data = {
                    "$report_type": "TestReport",
                    "location": item.location,
                    "keywords": {},
                    "sections": [],
                    "user_properties": [],
                    **data,
                }
                data["location"] = item.location
                data.pop("_rank", None)
                data.pop("_harness", None)
                reports.append(rank_report(config, data))
            needed = _wanted_size(reports, state, size)
            if needed:
                bigger = reasons.launch_size(needed, state.sizes)
                if bigger is not None and bigger > size and bigger not in launched:
                    state.deferred.setdefault(bigger, []).append(item.nodeid)
                    return
                _as_rank_skip(item, reports, needed, state)
            _log(item, reports, state, size)

        ranks.launch(
            nodeids,
            size,
            child_args,
            cwd=str(config.rootpath),
            stall_s=state.stall_s,
            on_result=on_result,
            env={"MEGATRON_LM_PATH": str(state.checkout.root)},
        )
        state.outcomes.size_wall_s[size] = time.monotonic() - started
        for directory in sorted({directory_of(n) for n in nodeids}):
            _say(
                config,
                f"[megatron-unit L{state.level}] {state.outcomes.summary_line(directory)} (after world size {size})",
            )


def _pairs(state: _State) -> list[tuple[str, int]]:
    return [(nodeid, size) for size, ids in state.deferred.items() for nodeid in ids]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = _state(config)
    if state is None or state.child:
        return
    rows = state.outcomes.tests.values()
    classes: dict[str, int] = {}
    for row in rows:
        if row["outcome"] != "passed":
            key = f"{row['outcome']}: {row['class']}"
            classes[key] = classes.get(key, 0) + 1
    terminalreporter.section(f"megatron-unit level {state.level}: reason classes")
    for key, count in sorted(classes.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{count:6d}  {key}")
    if state.record:
        path = write(
            state.outcomes,
            Path(state.record),
            level=state.level,
            options={"ranks": state.sizes, "host_cuda": state.host_cuda, "megatron_lm": state.checkout.tag},
            command=["pytest", *config.invocation_params.args],
        )
        terminalreporter.write_line(f"megatron-unit: record written to {path}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = _state(session.config)
    if state is not None and state.child_out is not None:
        state.child_out.close()
