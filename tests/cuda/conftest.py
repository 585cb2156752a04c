"""The CUDA lane (``make test-cuda``): every feature's kernels and GPT parity on a CUDA device.

Which device: ``MINDSPEED_LIKE_TEST_DEVICE`` (``cuda``, the default; ``cpu`` runs the very same tests
on the CPU, the self-check of the lane's logic before its one GPU run). Where no CUDA device is
present every test asking for ``lane_device`` is skipped with the reason, so ``make test`` collects
the lane and reports its skips at no cost; the lane's coverage check needs no device and always runs.

Numerics, set for the lane's session and restored after it (on both devices, so the self-check
runs what the GPU runs):
- TF32 off (``torch.backends.cuda.matmul.allow_tf32`` and ``cudnn.allow_tf32``): the float64
  references and the fp32 bounds are about fp32 arithmetic; TF32 GEMMs round inputs to 10 mantissa
  bits (1e-3 relative), which would hide a wrong fused kernel behind the GEMM's own error.
- Deterministic algorithms (``warn_only``: an op without a deterministic CUDA kernel warns instead of
  failing) and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (set before cuBLAS starts): "bitwise where the
  math is identical" needs megatron's own path to give the same bits twice, and CUDA's atomics-based
  scatter/index_add (megatron's MoE unpermute, embedding backward) do not. megatron's MoE code reads
  the same switch (``torch.are_deterministic_algorithms_enabled()``), so both arms take its
  deterministic branch. Uninitialised memory from ``torch.empty`` is then filled with NaN, which
  makes a read of it fail loudly in every case.

Process group: one rank; on CUDA NCCL (gloo moves only all_reduce and broadcast of CUDA tensors;
megatron's distributed optimizer needs reduce-scatter and all-gather), on the CPU gloo.

Record: with ``MINDSPEED_LIKE_LANE_RECORD=PATH`` the lane writes a results/-style record (device name,
versions, every test's outcome and duration, each parity case's measured difference) to PATH.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before any cuBLAS handle exists

import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from cuda_lane import MEASURED, RECORD_ENV, lane_device_name  # noqa: E402

LANE_NODEID_PREFIX = "tests/cuda/"
_outcomes: list[dict] = []
_state: dict = {"device": None, "started": time.time()}


def _no_cuda_reason() -> str:
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (
        f"no CUDA device here (torch {torch.__version__}, {build}); the lane runs on one GPU "
        "(`make test-cuda`), or on this CPU with MINDSPEED_LIKE_TEST_DEVICE=cpu (its self-check)"
    )


def _numerics() -> dict:
    return dict(
        matmul_tf32=torch.backends.cuda.matmul.allow_tf32,
        cudnn_tf32=torch.backends.cudnn.allow_tf32,
        deterministic=torch.are_deterministic_algorithms_enabled(),
        warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def _set_numerics(values: dict) -> None:
    torch.backends.cuda.matmul.allow_tf32 = values["matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = values["cudnn_tf32"]
    torch.use_deterministic_algorithms(values["deterministic"], warn_only=values["warn_only"])


def _default_group(device: torch.device) -> bool:
    """A one-rank default process group for the device: NCCL on CUDA (replacing a gloo one a test
    before the lane left), gloo on the CPU; True if the lane created it (and destroys it after)."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        if dist.get_backend() == backend:
            return False
        from mindspeed_like.testing import destroy_parallel

        destroy_parallel(process_group=True)
    # no device_id: bound, every megatron group would start its NCCL communicator eagerly; unbound,
    # only the groups a collective runs on do
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


@pytest.fixture(scope="session")
def lane_device():
    """The lane's device (skips without a CUDA device unless the self-check asks for the CPU), with
    the lane's numerics and process group set for the session."""
    name = lane_device_name()
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip(_no_cuda_reason())
    device = torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "megatron.core.parallel_state" in sys.modules:  # a test before the lane may have left its layout
        from mindspeed_like.testing import destroy_parallel

        destroy_parallel()
    before = _numerics()
    _set_numerics(dict(matmul_tf32=False, cudnn_tf32=False, deterministic=True, warn_only=True))
    created = _default_group(device)
    _state["device"] = device.type
    try:
        yield device
    finally:
        import mindspeed_like
        from mindspeed_like.testing import destroy_parallel

        mindspeed_like.reset()
        destroy_parallel(process_group=created)
        _set_numerics(before)


# ---------------------------------------------------------------- the record


def pytest_runtest_logreport(report):
    if not report.nodeid.startswith(LANE_NODEID_PREFIX):
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        entry = dict(test=report.nodeid.split("::", 1)[-1], outcome=report.outcome, seconds=round(report.duration, 3))
        if report.skipped and isinstance(report.longrepr, tuple):
            entry["reason"] = report.longrepr[2]
        elif report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            entry["error"] = (getattr(crash, "message", None) or str(report.longrepr).strip().splitlines()[-1])[:2000]
        _outcomes.append(entry)
        _write_record()  # after every test: a run cut short by its time limit still leaves what it did


def _write_record() -> Path | None:
    """The lane's record at ``MINDSPEED_LIKE_LANE_RECORD`` (none without it, or before the device is known)."""
    path = os.environ.get(RECORD_ENV)
    if not path or _state["device"] is None:
        return None
    from mindspeed_like.toolkit.records import Record

    record = _state.get("record")
    if record is None:
        record = _state["record"] = Record(Path(path).stem, command=sys.argv, device=_state["device"])
    record.options.update(
        lane_device=_state["device"],
        numerics=dict(matmul_tf32=False, cudnn_tf32=False, deterministic="warn_only"),
        cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        wall_seconds=round(time.time() - _state["started"], 1),
        compiled_graphs=_compiled_graphs(),
    )
    record.rows = [dict(entry, **MEASURED.get(entry["test"], {})) for entry in _outcomes]
    return record.write(path)


def _compiled_graphs() -> int | None:
    """How many graphs torch.compile made in this run (the lane's compile budget)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return None if utils is None else int(utils.counters["stats"]["unique_graphs"])


def pytest_terminal_summary(terminalreporter):
    if not _outcomes:
        return
    counts: dict[str, int] = {}
    for entry in _outcomes:
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    line = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    graphs = _compiled_graphs()
    terminalreporter.write_line(
        f"cuda lane on {_state['device'] or 'no device'}: {line} in {time.time() - _state['started']:.0f} s"
        + (f", {graphs} graphs compiled" if graphs is not None else "")
    )
    written = _write_record()
    if written is not None:
        terminalreporter.write_line(f"cuda lane record: {written}")
