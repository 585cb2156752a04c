"""The CPU-ISA lane: the kernel and parity tests again with torch and oneDNN held below the host's ISA.

Why: a CPU result (a bf16 GEMM's rounding, a compiled kernel's vector width, which GEMM path is
fast) can depend on the instructions the host has. CI runs on one host; holding torch and oneDNN
to a lower ISA there makes a host-dependent result fail CI on any machine, not only on a user's
AVX2 laptop. ``make test-isa`` runs, for each held ISA:

* a header, printed from a process with the lane's environment, that shows the variables really
  change the kernels taken: ATen's capability (``ATEN_CPU_CAPABILITY``), the ISA oneDNN reports
  and the implementation it picks for an fp32 inner product (``ONEDNN_MAX_CPU_ISA``, from
  ``ONEDNN_VERBOSE``), the vector ISA Inductor generates for, and the bf16-vs-fp32 GEMM probe
  (kernels/host_gemm.py) that upcast-cpu-gemm and the grouped GEMM decide by. The lane fails if
  the capability is not the one asked for;
* ``pytest`` over :data:`TESTS` in that environment, with its own Inductor cache directory;
* the cross-ISA cache check: :data:`CROSS_ISA_TESTS` (megatron's ``jit_fuser`` graphs, torch.compile
  on) run once natively into one Inductor cache directory, then in each held lane reading that
  same directory, as a cache shared by two CPU kinds is read. torch 2.13's FX graph cache key
  leaves the ISA out, and a graph written for AVX-512 read at AVX2 computes half of each output
  (issue 56); on a CPU device the adaptor's ``cpu-compile-cache`` keys graphs by the ISA
  (adapters/compile_cache.py), and kernels/compiled.py names the width for our own kernels.

Lanes: ``avx2`` (``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``: an AVX2-only host) and
``default`` (no vector ISA: ATen's scalar kernels, oneDNN at SSE4.1, its lowest x86 level).
On a non-x86 host the lane says so and exits 0 (the variables name x86 ISAs).

    python -m mindspeed_like.testing.isa_lane [--lanes avx2 default] [--tests PATHS...]
        [--cross-isa-tests [NODE_IDS...]] [-- PYTEST_ARGS...]

``--cross-isa-tests`` with no ids leaves the cross-ISA cache check out; ``PYTEST_ARGS`` go to the
main run of each lane only.

``--exec LANE PYTHON_ARGS...`` runs one Python command in a lane's environment instead (how
`make bench` measures the AVX2 records: ``--exec avx2 benchmarks/upcast_cpu_gemm.py ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

LANES: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}
EXPECTED_CAPABILITY = {"avx2": "AVX2", "default": "DEFAULT"}
TESTS = ["tests/kernels", "tests/features", "tests/adapters/test_parity_baseline.py"]
CROSS_ISA_TESTS = [
    # grouped GEMM + fused SwiGLU + moe-permute: megatron's GroupedMLP activation_func_with_probs is
    # a jit_fuser graph, the one issue 56 saw reused across ISAs (a NaN loss)
    "tests/features/moe_permute/test_moe_permute.py::test_with_grouped_gemm_and_fused_swiglu_still_bitwise",
]
HELD_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MINDSPEED_LIKE_CPU_GEMM")

HEADER = r"""
import json, os, subprocess, sys, torch
from mindspeed_like.kernels import host_gemm
out = {"aten_cpu_capability": torch.backends.cpu.get_cpu_capability()}
probe = subprocess.run([sys.executable, "-c", '''
import torch
x = torch.randn(4, 16).to_mkldnn()
torch._C._nn.mkldnn_linear(x, torch.randn(8, 16).to_mkldnn(), None)
'''], capture_output=True, text=True, env={**os.environ, "ONEDNN_VERBOSE": "1"})
lines = (probe.stdout + probe.stderr).splitlines()
out["onednn_isa"] = next((l.split("isa:", 1)[1] for l in lines if ",isa:" in l), "not reported")
out["onednn_fp32_inner_product"] = next((l.split(",")[6] for l in lines if ",inner_product," in l), "not run")
try:
    from torch._inductor import cpu_vec_isa
    out["inductor_vec_isa"] = str(cpu_vec_isa.pick_vec_isa()) or "none (scalar code)"
except Exception as error:
    out["inductor_vec_isa"] = f"unavailable ({error})"
out["bf16_gemm_probe"] = host_gemm.probe().describe()
out["bf16_gemm_in_fp32"] = host_gemm.probe().fp32_faster
print("ISA-HEADER " + json.dumps(out))
"""


def native_env(inductor_cache: str) -> dict[str, str]:
    """The host's own ISA (nothing held), one thread, torch.compile on, reading and writing
    ``inductor_cache``: the process that fills the cache the held lanes then read."""
    env = {k: v for k, v in os.environ.items() if k not in HELD_VARIABLES}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(TORCHDYNAMO_DISABLE="0", TORCHINDUCTOR_CACHE_DIR=inductor_cache)
    return env


def lane_env(lane: str, cache_root: str) -> dict[str, str]:
    """The environment of one lane: the held ISA, one thread, its own Inductor cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("MINDSPEED_LIKE_CPU_GEMM", "DNNL_MAX_CPU_ISA")}
    env.update(LANES[lane])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root, f"inductor-{lane}")
    return env


def header(lane: str, env: dict[str, str]) -> dict[str, str]:
    """What a process of this lane runs at (see the module docstring); raises if not held."""
    done = subprocess.run([sys.executable, "-c", HEADER], capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ISA-HEADER ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the {lane} lane's header process failed:\n{done.stderr[-3000:]}")
    facts = json.loads(lines[0].removeprefix("ISA-HEADER "))
    if facts["aten_cpu_capability"] != EXPECTED_CAPABILITY[lane]:
        raise RuntimeError(
            f"the {lane} lane asked ATEN_CPU_CAPABILITY={LANES[lane]['ATEN_CPU_CAPABILITY']} but torch runs at "
            f"{facts['aten_cpu_capability']}: the lane would test the host's own ISA"
        )
    return facts


def inductor_vec_isa(env: dict[str, str]) -> str:
    """The vector ISA Inductor generates for in a process with ``env``."""
    code = "from torch._inductor import cpu_vec_isa; print('VEC-ISA', cpu_vec_isa.pick_vec_isa())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("VEC-ISA")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"asking Inductor for its vector ISA failed:\n{done.stderr[-3000:]}")
    return lines[0].removeprefix("VEC-ISA").strip()


def pytest_run(tests: Sequence[str], env: dict[str, str], what: str, extra: Sequence[str] = ()) -> bool:
    """``pytest -q tests`` in ``env``; prints ``what`` with its exit status and time; True if it passed."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, *extra], env=env)
    print(f"== {what}: pytest exit {done.returncode} in {time.monotonic() - start:.0f} s", flush=True)
    return done.returncode == 0


def fill_natively(tests: list[str], inductor_cache: str) -> tuple[bool, str]:
    """Run ``tests`` at the host's own ISA with torch.compile on, filling ``inductor_cache``;
    returns whether they passed and the vector ISA Inductor generated for."""
    env = native_env(inductor_cache)
    isa = inductor_vec_isa(env)
    print(f"== cross-ISA cache: filling {inductor_cache} natively (Inductor vector ISA: {isa})", flush=True)
    return pytest_run(tests, env, "cross-ISA cache, native fill"), isa


def read_held(lane: str, tests: list[str], inductor_cache: str, native_isa: str, lane_isa: str) -> bool:
    """Run ``tests`` held to ``lane`` with torch.compile on, reading the cache a native process
    filled (:func:`fill_natively`): passes only if no graph of the native ISA is taken."""
    env = lane_env(lane, os.path.dirname(inductor_cache))
    env.update(TORCHDYNAMO_DISABLE="0", TORCHINDUCTOR_CACHE_DIR=inductor_cache)  # the native process's cache
    if lane_isa == native_isa:
        print(f"== cross-ISA cache at {lane}: Inductor generates {lane_isa!r} natively too; the check shows nothing")
    print(f"== cross-ISA cache at {lane}: reading {inductor_cache} (filled at {native_isa!r}, read at {lane_isa!r})")
    return pytest_run(tests, env, f"cross-ISA cache at {lane}")


def run_held(lane: str, python_args: list[str]) -> int:
    """``python PYTHON_ARGS`` with torch and oneDNN held to ``lane``'s ISA (its Inductor cache kept
    beside the default one, per lane); the header's capability is checked first."""
    if lane not in LANES:
        raise SystemExit(f"isa_lane --exec: unknown lane {lane!r}; choose one of {', '.join(sorted(LANES))}")
    if not python_args:
        raise SystemExit("isa_lane --exec LANE needs the Python arguments to run (a script or -m module)")
    env = lane_env(lane, tempfile.gettempdir())
    facts = header(lane, env)
    print(f"== held to {lane}: {json.dumps(facts)}", flush=True)
    return subprocess.run([sys.executable, *python_args], env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--exec"]:
        return run_held(argv[1], argv[2:])
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(prog="isa_lane", description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", nargs="+", choices=sorted(LANES), default=list(LANES))
    parser.add_argument("--tests", nargs="+", default=TESTS, help="test paths (default: %(default)s)")
    parser.add_argument(
        "--cross-isa-tests",
        nargs="*",
        default=CROSS_ISA_TESTS,
        help="run natively into one Inductor cache, then held reading it (none: skip; default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if platform.machine() not in ("x86_64", "AMD64"):
        print(f"SKIPPED: the CPU-ISA lane holds x86 ISAs; this host is {platform.machine()}")
        return 0
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="isa-lane-") as cache_root:
        shared_cache = os.path.join(cache_root, "inductor-shared")
        native_isa = ""
        if args.cross_isa_tests:
            passed, native_isa = fill_natively(args.cross_isa_tests, shared_cache)
            if not passed:
                failed.append("native (cross-ISA cache fill)")
        for lane in args.lanes:
            env = lane_env(lane, cache_root)
            facts = header(lane, env)
            held = " ".join(f"{k}={v}" for k, v in LANES[lane].items())
            print(f"== CPU-ISA lane {lane} ({held})", flush=True)
            for key, value in facts.items():
                print(f"   {key}: {value}", flush=True)
            if not pytest_run(args.tests, env, f"CPU-ISA lane {lane}", extra):
                failed.append(lane)
            if args.cross_isa_tests and native_isa:
                lane_isa = str(facts["inductor_vec_isa"])
                if not read_held(lane, args.cross_isa_tests, shared_cache, native_isa, lane_isa):
                    failed.append(f"{lane} (cross-ISA cache)")
    if failed:
        print(f"CPU-ISA lane failed at: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
