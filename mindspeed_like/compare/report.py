"""The comparison's table, compare.json and compare.png (matplotlib, an optional extra)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from typing import Any

MIB = 2**20
MEMORY_KINDS = ("weights", "gradients", "optimizer", "model_state", "activations", "process_peak")
PLOT_HINT = "no plot: matplotlib is not installed (pip install 'mindspeed_like[plot]' for compare.png)"


def merge_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm from its ranks: rank 0's losses (every rank reports the DP-mean loss), the slowest
    rank's step times, each memory kind at its largest rank (the per-rank peak a device must
    hold), the features that fell back on any rank."""
    first = ranks[0]
    slowest = max(ranks, key=lambda r: r["step_time"]["median_s"])
    fell_back: dict[str, list[str]] = {}
    served: dict[str, str] = {}
    calls: dict[str, int] = {}
    for rank in ranks:
        for feature, count in rank["calls"].items():
            calls[feature] = calls.get(feature, 0) + count
        served.update(rank.get("served", {}))
        for feature, reasons in rank["fell_back"].items():
            fell_back.setdefault(feature, [])
            fell_back[feature] += [r for r in reasons if r not in fell_back[feature]]
    return {
        "device": first["device"],
        "processes": len(ranks),
        "features_on": first["features_on"],
        "fell_back": fell_back,
        "served": served,
        "calls": calls,
        "losses": first["losses"],
        "step_times_s": slowest["step_times_s"],
        "step_time": slowest["step_time"],
        "tokens_per_s": first["tokens_per_step"] / slowest["step_time"]["median_s"],
        "memory_per_rank": {kind: max(_memory(r)[kind] for r in ranks) for kind in MEMORY_KINDS},
    }


def _memory(rank: dict[str, Any]) -> dict[str, int]:
    memory = dict(rank["memory"])
    memory["model_state"] = memory["weights"] + memory["gradients"] + memory["optimizer"]
    return memory


def build(args: argparse.Namespace, flags: dict[str, Any], arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    megatron, features = arms["megatron"], arms["features"]
    diffs = [abs(a - b) for a, b in zip(features["losses"], megatron["losses"])]
    baseline_features = set(megatron["features_on"])
    accelerations = [name for name in features["features_on"] if name not in baseline_features]
    calls = features["calls"]
    ran = [name for name in accelerations if calls.get(name) and name not in features["fell_back"]]
    served = features.get("served", {})
    idle = [
        name
        for name in accelerations
        if not calls.get(name) and name not in features["fell_back"] and name not in served
    ]
    return {
        "model": {
            "preset": args.preset,
            "num_layers": args.num_layers,
            "hidden_size": args.hidden_size,
            "num_attention_heads": args.num_attention_heads,
            "seq_length": args.seq_length,
            "micro_batch_size": args.micro_batch_size,
            "precision": "fp32" if args.fp32 else "bf16",
            "transformer_impl": args.transformer_impl,
        },
        "parallel": {
            "tensor_model_parallel_size": args.tensor_model_parallel_size,
            "sequence_parallel": args.sequence_parallel,
            "data_parallel_size": args.data_parallel_size,
            "expert_model_parallel_size": args.expert_model_parallel_size,
            "use_distributed_optimizer": args.use_distributed_optimizer,
        },
        "steps": args.steps,
        "seed": args.seed,
        "flags": flags,
        "features": {
            "on": accelerations,
            "ran": ran,
            "idle": idle,
            "fell_back": features["fell_back"],
            "served_by": served,
            "calls": calls,
        },
        "megatron": megatron,
        "with_features": features,
        "ratios": {
            "tokens_per_s": features["tokens_per_s"] / megatron["tokens_per_s"],
            **{
                f"{kind}_bytes": _ratio(features["memory_per_rank"][kind], megatron["memory_per_rank"][kind])
                for kind in MEMORY_KINDS
            },
        },
        "loss": {
            "max_abs_diff": max(diffs),
            "max_rel_diff": max(d / abs(m) for d, m in zip(diffs, megatron["losses"]) if m),
            "first_step_equal": features["losses"][0] == megatron["losses"][0],
            "final_megatron": megatron["losses"][-1],
            "final_features": features["losses"][-1],
        },
    }


def _ratio(ours: float, baseline: float) -> float | None:
    """The features arm over megatron's (every ratio in the result); None where megatron's is 0."""
    return ours / baseline if baseline else None


def _mib(value: int) -> str:
    return f"{value / MIB:,.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(result: dict[str, Any]) -> str:
    m, f = result["megatron"], result["with_features"]
    rows = [
        ("tokens/s", f"{m['tokens_per_s']:,.0f}", f"{f['tokens_per_s']:,.0f}", _x(result["ratios"]["tokens_per_s"])),
    ]
    for arm_name, arm in (("megatron", m), ("features", f)):
        st = arm["step_time"]
        rows.append(
            (
                f"step time ({arm_name})",
                f"median {st['median_s'] * 1000:,.0f} ms",
                f"min {st['min_s'] * 1000:,.0f} / max {st['max_s'] * 1000:,.0f}",
                f"{st['steps_timed']} steps",
            )
        )
    labels = {
        "weights": "weights MiB",
        "gradients": "gradients MiB",
        "optimizer": "optimizer state MiB",
        "activations": "activations MiB (saved for bwd)",
        "model_state": "  weights + gradients + optimizer",
        "process_peak": "process peak MiB" + (" (RSS)" if m["device"] == "cpu" else ""),
    }
    for kind, label in labels.items():
        rows.append(
            (
                label,
                _mib(m["memory_per_rank"][kind]),
                _mib(f["memory_per_rank"][kind]),
                _x(result["ratios"][f"{kind}_bytes"]),
            )
        )
    loss = result["loss"]
    rows.append(
        (
            "loss first / last",
            f"{m['losses'][0]:.4f} / {m['losses'][-1]:.4f}",
            f"{f['losses'][0]:.4f} / {f['losses'][-1]:.4f}",
            f"max |diff| {loss['max_abs_diff']:.2e}",
        )
    )
    header = ("per rank", "megatron", "with features", "features / megatron")
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(4)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in (header, *rows)]
    features = result["features"]
    lines.append(
        "features reached (megatron called their patched code; each acts where it applies): "
        + (", ".join(features["ran"]) or "none")
    )
    if features["idle"]:
        lines.append("on but never reached (nothing in this model calls them): " + ", ".join(features["idle"]))
    for name, by in features.get("served_by", {}).items():
        lines.append(f"computed by {by} instead (the same kind of kernel, where {name}'s own is not called): {name}")
    for name, reasons in features["fell_back"].items():
        lines.append(f"did NOT run (fell back to megatron's path): {name}: {'; '.join(reasons)}")
    return "\n".join(lines)


def summary_line(result: dict[str, Any]) -> str:
    r, loss = result["ratios"], result["loss"]
    fell = result["features"]["fell_back"]
    return (
        f"{result['model']['preset']}: {_x(r['tokens_per_s'])} megatron's tokens/s, "
        f"activations {_x(r['activations_bytes'])}, model state {_x(r['model_state_bytes'])}, "
        f"process peak {_x(r['process_peak_bytes'])} of megatron's; max loss diff {loss['max_abs_diff']:.1e} "
        f"over {result['steps']} steps; features reached: {', '.join(result['features']['ran']) or 'none'}"
        + (f"; fell back: {', '.join(fell)}" if fell else "")
    )


def write(result: dict[str, Any], out: str) -> list[str]:
    """compare.json, and compare.png when matplotlib is installed; returns the files written."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "compare.json")
    with open(path, "w") as handle:
        json.dump(result, handle, indent=2, default=str)
    written = [path]
    if importlib.util.find_spec("matplotlib") is not None:
        written.append(plot(result, os.path.join(out, "compare.png")))
    return written


def plot(result: dict[str, Any], path: str) -> str:
    """Two panels: the loss curves, and the per-rank memory by kind for both arms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, f = result["megatron"], result["with_features"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = range(1, len(m["losses"]) + 1)
    left.plot(steps, m["losses"], label="megatron-core", marker="o", markersize=3)
    left.plot(steps, f["losses"], label="with features", marker="x", markersize=3, linestyle="--")
    left.set_xlabel("step")
    left.set_ylabel("loss")
    left.set_title(f"{result['model']['preset']}: loss")
    left.legend()
    kinds = [k for k in MEMORY_KINDS if k != "model_state"]
    xs = range(len(kinds))
    width = 0.38
    right.bar([x - width / 2 for x in xs], [m["memory_per_rank"][k] / MIB for k in kinds], width, label="megatron-core")
    right.bar([x + width / 2 for x in xs], [f["memory_per_rank"][k] / MIB for k in kinds], width, label="with features")
    right.set_xticks(list(xs), [k.replace("_", " ") for k in kinds], rotation=15)
    right.set_ylabel("MiB per rank")
    right.set_title("memory")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
