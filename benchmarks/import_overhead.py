"""What the one import line costs: `import megatron.core` alone vs with the adaptor, both orders.

Each case runs in a fresh interpreter (import costs only show once per process); the median
of --repeats runs is reported with its ratio to megatron's own import measured in this run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from common import Results, parser

CASES = {
    "megatron.core alone": "import megatron.core",
    "adaptor, then megatron.core": "import mindspeed_like.megatron_adaptor; import megatron.core",
    "megatron.core, then adaptor": "import megatron.core; import mindspeed_like.megatron_adaptor",
}


def _time_once(code: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_LIKE_ARGS"}
    env["PYTHONWARNINGS"] = "ignore"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    args = parser(__doc__).parse_args()
    _time_once("import megatron.core")  # warm the file cache so the first case is not penalised
    medians = {}
    samples: dict[str, list[float]] = {}
    for name, code in CASES.items():
        samples[name] = [_time_once(code) for _ in range(args.repeats)]
        times = sorted(samples[name])
        medians[name] = times[len(times) // 2]
    results = Results("import overhead (wall time of a fresh interpreter)")
    base = medians["megatron.core alone"]
    for name, seconds in medians.items():
        results.add(
            samples={"seconds": samples[name]},
            case=name,
            seconds=seconds,
            ratio_vs_megatron=seconds / base,
            extra_ms=(seconds - base) * 1000,
        )
    results.print_table()
    results.write_json(args.json)


if __name__ == "__main__":
    main()
