"""Fused RMSNorm, RoPE and SwiGLU vs megatron's own eager path, forward+backward, same run.

Each op's cases live in benchmarks/fused_ops_<op>.py (its own `run(args, results)`); this
script runs them all into one table. CPU timings are a proxy for relative cost, not for
accelerator speed.
"""

from __future__ import annotations

import importlib

from common import Results, parser

OPS = ("rmsnorm", "rope", "swiglu")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="which ops to measure")
    args = p.parse_args()
    results = Results("fused ops: megatron eager vs mindspeed_like (fwd+bwd, median)")
    for op in args.ops:
        importlib.import_module(f"fused_ops_{op}").run(args, results)
    results.print_table()
    results.write_json(args.json)


if __name__ == "__main__":
    main()
