"""The comparison's table, compare.json and compare.png (matplotlib, an optional extra)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
from typing import Any

MIB = 2**20
MEMORY_KINDS = ("weights", "gradients", "optimizer", "model_state", "activations", "process_peak")
PLOT_HINT = "no plot: matplotlib is not installed (pip install 'mindspeed_like[plot]' for compare.png)"


def feature_kinds(names: list[str]) -> dict[str, str]:
    """Each feature's kind as its declaration says (``Feature.kind``: feature, adapter, fix,
    integration); a name the registry does not know counts as a feature."""
    from mindspeed_like.registry import feature_by_name

    kinds = {}
    for name in names:
        try:
            kinds[name] = feature_by_name(name).kind
        except KeyError:
            kinds[name] = "feature"
    return kinds


def describe_features(names: list[str]) -> str:
    """What a user switched on, in their words: the accelerations by name, then the device adapters
    and upstream fixes in one word each (``flash-attention, fused-rmsnorm (+ cpu adapter, 3 more
    adapters, 12 fixes)``); integrations (argument plumbing, model trackers) are not named: they
    are how the library works, not something to switch."""
    kinds = feature_kinds(names)
    features = [n for n in names if kinds[n] == "feature"]
    adapters = [n for n in names if kinds[n] == "adapter"]
    fixes = [n for n in names if kinds[n] == "fix"]
    extra = []
    devices = [n.removesuffix("-adapter") for n in adapters if n.endswith("-adapter")]
    extra += [f"{device} adapter" for device in devices]
    others = len(adapters) - len(devices)
    if others:
        more = "more " if devices else ""
        extra.append(f"{others} {more}adapter{'s' if others > 1 else ''}")
    if fixes:
        extra.append(f"{len(fixes)} fix{'es' if len(fixes) > 1 else ''}")
    text = ", ".join(features) or "none"
    return text + (f" (+ {', '.join(extra)})" if extra else "")


def merge_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One run of an arm from its ranks: rank 0's losses (every rank reports the DP-mean loss), the
    slowest rank's step times, each memory kind per rank and at its largest rank (the per-rank peak
    a device must hold), the features that fell back on any rank."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
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
    by_rank = {kind: [_memory(r)[kind] for r in ranks] for kind in MEMORY_KINDS}
    return {
        "device": first["device"],
        "processes": len(ranks),
        "places": [r.get("place", {}) for r in ranks],
        "features_on": first["features_on"],
        "fell_back": fell_back,
        "served": served,
        "calls": calls,
        "losses": first["losses"],
        "step_times_s": slowest["step_times_s"],
        "step_time": slowest["step_time"],
        "tokens_per_s": first["tokens_per_step"] / slowest["step_time"]["median_s"],
        "memory_by_rank": by_rank,
        "memory_per_rank": {kind: max(values) for kind, values in by_rank.items()},
    }


def _memory(rank: dict[str, Any]) -> dict[str, int]:
    memory = dict(rank["memory"])
    memory["model_state"] = memory["weights"] + memory["gradients"] + memory["optimizer"]
    return memory


def _arm(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """An arm over its repeats: repeat 1's features and losses (every repeat must have the same
    losses: same seed, same data), the median over repeats of each per-run figure (memory per rank
    included), every repeat's step times."""
    first = runs[0]
    fell_back: dict[str, list[str]] = {}
    for run in runs:
        for feature, reasons in run["fell_back"].items():
            fell_back.setdefault(feature, [])
            fell_back[feature] += [r for r in reasons if r not in fell_back[feature]]
    by_rank = {
        kind: [statistics.median_low(run["memory_by_rank"][kind][i] for run in runs) for i in range(first["processes"])]
        for kind in MEMORY_KINDS
    }
    medians = [run["step_time"]["median_s"] for run in runs]
    return {
        **{k: first[k] for k in ("device", "processes", "places", "features_on", "served", "calls", "losses")},
        "fell_back": fell_back,
        "step_times_s": first["step_times_s"],
        "step_time": dict(first["step_time"], median_s=statistics.median(medians)),
        "tokens_per_s": statistics.median(run["tokens_per_s"] for run in runs),
        "memory_by_rank": by_rank,
        "memory_per_rank": {kind: max(values) for kind, values in by_rank.items()},
        "losses_identical_across_repeats": all(run["losses"] == first["losses"] for run in runs),
        "repeats": [
            {
                "losses": run["losses"],
                "step_times_s": run["step_times_s"],
                "step_time_median_s": run["step_time"]["median_s"],
                "tokens_per_s": run["tokens_per_s"],
            }
            for run in runs
        ],
    }


def _spread(ours: list[float], theirs: list[float]) -> dict[str, float | None]:
    """The median of the per-repeat ratios (features / megatron, repeat i against repeat i) and their
    min and max: how much the ratio moved between repeats on this host."""
    ratios = [_ratio(a, b) for a, b in zip(ours, theirs)]
    known = [r for r in ratios if r is not None]
    if not known:
        return {"ratio": None, "ratio_min": None, "ratio_max": None}
    return {"ratio": statistics.median(known), "ratio_min": min(known), "ratio_max": max(known)}


def flops_result(
    plan: dict[str, Any] | None, megatron: dict[str, Any], features: dict[str, Any]
) -> dict[str, Any] | None:
    """Achieved model FLOP/s of each arm (model FLOPs a step / its median step time, over all its
    devices) and, with a measured peak, model FLOP utilisation per device: achieved / (devices x peak)."""
    if plan is None:
        return None
    out = dict(plan)
    peak = (plan.get("peak") or {}).get("flops_per_s")
    for name, arm in (("megatron", megatron), ("features", features)):
        achieved = plan["model_flops_per_step"] / arm["step_time"]["median_s"]
        out[name] = {
            "achieved_flops_per_s": achieved,
            "mfu": achieved / (plan["devices"] * peak) if peak else None,
        }
    return out


def build(
    args: argparse.Namespace,
    flags: dict[str, Any],
    runs: dict[str, list[dict[str, Any]]],
    flops: dict[str, Any] | None = None,
) -> dict[str, Any]:
    megatron, features = _arm(runs["megatron"]), _arm(runs["features"])
    diffs = [abs(a - b) for a, b in zip(features["losses"], megatron["losses"])]
    baseline_features = set(megatron["features_on"])
    kinds = feature_kinds(features["features_on"])
    # what the features arm adds to megatron's: the accelerations (adapters, fixes and integrations
    # are the same in both arms, and are not what is compared)
    accelerations = [
        name for name in features["features_on"] if name not in baseline_features and kinds[name] == "feature"
    ]
    calls = features["calls"]
    ran = [name for name in accelerations if calls.get(name) and name not in features["fell_back"]]
    served = features.get("served", {})
    idle = [
        name
        for name in accelerations
        if not calls.get(name) and name not in features["fell_back"] and name not in served
    ]
    per_repeat = {
        "tokens_per_s": _spread(
            [r["tokens_per_s"] for r in runs["features"]], [r["tokens_per_s"] for r in runs["megatron"]]
        ),
        "step_time_s": _spread(
            [r["step_time"]["median_s"] for r in runs["features"]],
            [r["step_time"]["median_s"] for r in runs["megatron"]],
        ),
    }
    for kind in MEMORY_KINDS:
        per_repeat[f"{kind}_bytes"] = _spread(
            [r["memory_per_rank"][kind] for r in runs["features"]],
            [r["memory_per_rank"][kind] for r in runs["megatron"]],
        )
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
            "world_size": megatron["processes"],
            "tensor_model_parallel_size": args.tensor_model_parallel_size,
            "sequence_parallel": args.sequence_parallel,
            "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
            "num_layers_per_virtual_pipeline_stage": args.num_layers_per_virtual_pipeline_stage,
            "context_parallel_size": args.context_parallel_size,
            "context_parallel_algo": flags.get("context_parallel_algo"),
            "ulysses_degree_in_cp": flags.get("ulysses_degree_in_cp"),
            "data_parallel_size": args.data_parallel_size,
            "expert_model_parallel_size": args.expert_model_parallel_size,
            "use_distributed_optimizer": args.use_distributed_optimizer,
            "data_parallel": _data_parallel(args),
            "microbatches_per_step": args.pipeline_model_parallel_size,
        },
        "steps": args.steps,
        "seed": args.seed,
        "repeats": args.repeats,
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
        "flops": flops_result(flops, megatron, features),
        "ratios": {name: spread["ratio"] for name, spread in per_repeat.items()},
        "ratio_spread": per_repeat,
        "loss": {
            "max_abs_diff": max(diffs),
            "max_rel_diff": max((d / abs(m) for d, m in zip(diffs, megatron["losses"]) if m), default=0.0),
            "first_step_equal": features["losses"][0] == megatron["losses"][0],
            "final_megatron": megatron["losses"][-1],
            "final_features": features["losses"][-1],
            "identical_across_repeats": {
                "megatron": megatron["losses_identical_across_repeats"],
                "features": features["losses_identical_across_repeats"],
            },
        },
    }


def _ratio(ours: float, baseline: float) -> float | None:
    """The features arm over megatron's (every ratio in the result); None where megatron's is 0."""
    return ours / baseline if baseline else None


def _mib(value: int) -> str:
    return f"{value / MIB:,.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _spread_text(spread: dict[str, float | None], repeats: int) -> str:
    if spread["ratio"] is None:
        return "-"
    if repeats == 1:
        return _x(spread["ratio"])
    return f"{_x(spread['ratio'])} ({spread['ratio_min']:.2f}-{spread['ratio_max']:.2f})"


def table(result: dict[str, Any]) -> str:
    m, f = result["megatron"], result["with_features"]
    spread, repeats = result["ratio_spread"], result["repeats"]
    ratio_header = "features / megatron" + (f" (median, min-max of {repeats})" if repeats > 1 else "")
    rows = [
        (
            "tokens/s",
            f"{m['tokens_per_s']:,.0f}",
            f"{f['tokens_per_s']:,.0f}",
            _spread_text(spread["tokens_per_s"], repeats),
        ),
        (
            "step time (median)",
            f"{m['step_time']['median_s'] * 1000:,.0f} ms",
            f"{f['step_time']['median_s'] * 1000:,.0f} ms",
            _spread_text(spread["step_time_s"], repeats),
        ),
    ]
    labels = {
        "weights": "weights MiB",
        "gradients": "gradients MiB",
        "optimizer": "optimizer state MiB",
        "activations": "activations MiB (saved for bwd"
        + (", per microbatch)" if result["parallel"]["pipeline_model_parallel_size"] > 1 else ")"),
        "model_state": "  weights + gradients + optimizer",
        "process_peak": "process peak MiB" + (" (RSS)" if m["device"] == "cpu" else ""),
    }
    for kind, label in labels.items():
        rows.append(
            (
                label,
                _mib(m["memory_per_rank"][kind]),
                _mib(f["memory_per_rank"][kind]),
                _spread_text(spread[f"{kind}_bytes"], repeats),
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
    header = ("max over ranks" if m["processes"] > 1 else "per rank", "megatron", "with features", ratio_header)
    lines = _columns(header, rows)
    if m["processes"] > 1:
        lines += ["", "per rank MiB (megatron / with features):"]
        rank_header = ("rank", *[_place(p) for p in m["places"]])
        rank_rows = []
        for kind in ("weights", "gradients", "optimizer", "activations", "process_peak"):
            rank_rows.append(
                (
                    kind.replace("_", " "),
                    *[f"{_mib(a)} / {_mib(b)}" for a, b in zip(m["memory_by_rank"][kind], f["memory_by_rank"][kind])],
                )
            )
        lines += _columns(rank_header, rank_rows)
    for arm_name, arm in (("megatron", m), ("features", f)):
        if not arm["losses_identical_across_repeats"]:
            lines.append(
                f"WARNING: the {arm_name} arm's losses differ between repeats (same seed and data): its runs are "
                "not deterministic, so the two arms' losses cannot be compared step for step"
            )
    lines += flops_lines(result.get("flops"))
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


def flops_lines(flops: dict[str, Any] | None) -> list[str]:
    """Model FLOPs a step, each arm's achieved model FLOP/s and, with a measured peak, its model
    FLOP utilisation (the formula: compare/flops.py, docs/index.md)."""
    if not flops:
        return []
    m, f = flops["megatron"], flops["features"]
    devices = flops["devices"]
    lines = [
        f"model FLOPs a step: {_flop(flops['model_flops_per_step'])} ({flops['sequences_per_step']} sequence(s); "
        "3 x forward: matmul weights x 2 x tokens + causal attention; compare/flops.py)",
        f"achieved model FLOP/s{' over ' + str(devices) + ' devices' if devices > 1 else ''}: megatron "
        f"{_flop(m['achieved_flops_per_s'])}/s, with features {_flop(f['achieved_flops_per_s'])}/s",
    ]
    peak = flops.get("peak")
    if peak and m["mfu"] is not None:
        lines.append(
            f"model FLOP utilisation (per device, of the bf16 matmul peak measured in this run, "
            f"{peak['flops_per_s'] / 1e12:,.0f} TFLOP/s: {peak['how']}): megatron {m['mfu']:.1%}, "
            f"with features {f['mfu']:.1%}"
        )
    elif flops.get("peak_skipped"):
        lines.append(f"model FLOP utilisation: not computed ({flops['peak_skipped']})")
    return lines


def _flop(value: float) -> str:
    """FLOPs with a unit that keeps three digits: 23.1 TFLOP, 530 GFLOP, 53.5 MFLOP."""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:,.3g} {unit}FLOP"
    return f"{value:,.0f} FLOP"


def _columns(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in (header, *rows)]


def _place(place: dict[str, int]) -> str:
    """A rank's coordinates, only the parallel dimensions in use (e.g. ``pp1 dp0``)."""
    return " ".join(f"{k}{v}" for k, v in place.items()) or "rank"


def summary_line(result: dict[str, Any]) -> str:
    r, loss = result["ratios"], result["loss"]
    fell = result["features"]["fell_back"]
    spread = result["ratio_spread"]["tokens_per_s"]
    tokens = _x(r["tokens_per_s"])
    if result["repeats"] > 1 and spread["ratio"] is not None:
        tokens += f" (median of {result['repeats']}, {spread['ratio_min']:.2f}-{spread['ratio_max']:.2f})"
    flops = result.get("flops") or {}
    mfu = ""
    if (flops.get("features") or {}).get("mfu") is not None:
        mfu = f"MFU {flops['megatron']['mfu']:.1%} -> {flops['features']['mfu']:.1%}, "
    return (
        f"{result['model']['preset']}: {tokens} megatron's tokens/s, {mfu}"
        f"activations {_x(r['activations_bytes'])}, model state {_x(r['model_state_bytes'])}, "
        f"process peak {_x(r['process_peak_bytes'])} of megatron's; max loss diff {loss['max_abs_diff']:.1e} "
        f"over {result['steps']} steps; features reached: {', '.join(result['features']['ran']) or 'none'}"
        + (f"; fell back: {', '.join(fell)}" if fell else "")
    )


# options that name no measurement of their own (where files go, how much is printed)
_NOT_OPTIONS = ("handler", "verbose", "out", "record", "quiet", "timeout", "command")
_CP_ALGO_TAGS = {
    "megatron_cp_algo": "",
    "ulysses_cp_algo": "ulysses",
    "hybrid_cp_algo": "hybrid",
    "kvallgather_cp_algo": "kvallgather",
}


def _data_parallel(args: argparse.Namespace) -> dict[str, Any]:
    """megatron's data-parallel wrapper both arms trained under, and its options."""
    from mindspeed_like.compare.arguments import data_parallel_path

    path, options = data_parallel_path(args)
    return {"wrapper": path, **options}


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """compare's own options (the feature flags, parsed into the same namespace, are kept apart)."""
    from mindspeed_like import runtime

    flags = {flag.name for flag in runtime.flags()}
    return {k: v for k, v in vars(args).items() if k not in _NOT_OPTIONS and k not in flags and not callable(v)}


def _defaults() -> dict[str, Any]:
    from mindspeed_like.compare.arguments import add_compare_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_compare_arguments(parser)
    return vars(parser.parse_args([]))


def record_name(args: argparse.Namespace, flag_values: dict[str, Any]) -> str:
    """``compare-<preset>`` and a tag of every option not at its default, in a fixed order (e.g.
    ``compare-llama-pp2-vpp1``, ``compare-moe-dp2-ep2-distopt-local``, ``compare-llama-cp2-ulysses``):
    the same run always gets the same name, so its record is replaced, not duplicated."""
    defaults = _defaults()
    options = _options(args)
    short = {
        "tensor_model_parallel_size": "tp",
        "sequence_parallel": "sp",
        "pipeline_model_parallel_size": "pp",
        "num_layers_per_virtual_pipeline_stage": "vpp",
        "context_parallel_size": "cp",
        "data_parallel_size": "dp",
        "expert_model_parallel_size": "ep",
        "use_distributed_optimizer": "distopt",
        "use_torch_fsdp2": "fsdp2",
        "torch_fsdp2_no_reshard_after_forward": "noreshard",
        "use_megatron_fsdp": "mfsdp",
        "data_parallel_sharding_strategy": "",
        "num_distributed_optimizer_instances": "instances",
        "outer_dp_sharding_strategy": "outer-",
        "megatron_fsdp_main_params_dtype": "main-params-",
        "megatron_fsdp_main_grads_dtype": "main-grads-",
        "fp32": "fp32",
        "num_layers": "layers",
        "hidden_size": "hidden",
        "num_attention_heads": "heads",
        "seq_length": "seq",
        "micro_batch_size": "mbs",
        "steps": "steps",
        "lr": "lr",
        "clip_grad": "clip",
        "use_precision_aware_optimizer": "precision-aware",
        "main_grads_dtype": "pa-main-grads-",
        "main_params_dtype": "pa-main-params-",
        "exp_avg_dtype": "exp-avg-",
        "exp_avg_sq_dtype": "exp-avg-sq-",
        "seed": "seed",
    }
    parts = [args.preset]
    for name, tag in short.items():
        value = options.get(name)
        if value == defaults.get(name):
            continue
        parts.append(tag if value is True else f"{tag}{value}")
        if name == "context_parallel_size":
            algo = _CP_ALGO_TAGS.get(flag_values.get("context_parallel_algo") or "megatron_cp_algo", "")
            if algo:
                parts.append(algo + str(flag_values.get("ulysses_degree_in_cp") or ""))
    if args.transformer_impl != defaults["transformer_impl"]:
        parts.append("local" if args.transformer_impl == "local" else args.transformer_impl)
    for name, value in sorted(flag_values.items()):
        if name in ("device", "strict", "context_parallel_algo", "ulysses_degree_in_cp"):
            continue
        flag = "level" if name == "optimization_level" else name.replace("_", "-")
        parts.append(flag if value is True else f"no-{flag}" if value is False else f"{flag}{value}")
    return "compare-" + "-".join(str(p).replace("/", "_").replace(" ", "") for p in parts)


def command(args: argparse.Namespace, flag_values: dict[str, Any]) -> list[str]:
    """The command line that repeats this run: every option not at its default, and the flags."""
    defaults = _defaults()
    line = ["mindspeed-like", "compare", "--preset", args.preset]
    for name, value in _options(args).items():
        if name == "preset" or value == defaults.get(name):
            continue
        option = "--" + name.replace("_", "-")
        line += [option] if value is True else [option, str(value)]
    for name, value in flag_values.items():
        option = "--" + name.replace("_", "-")
        if value is True:
            line.append(option)
        elif value is False:
            line.append("--no-" + name.replace("_", "-"))
        else:
            line += [option, str(value)]
    return line


def start_record(args: argparse.Namespace, flag_values: dict[str, Any]):
    """The run's record, created before any process starts (its load average is the host's then)."""
    from mindspeed_like.kernels.grouped_gemm import cpu_has_bf16_gemm
    from mindspeed_like.toolkit.records import Record

    record = Record(record_name(args, flag_values), command=command(args, flag_values))
    record.options.update(_options(args), flags=dict(flag_values))
    # whether this host's CPU runs bf16 GEMMs natively (oneDNN, a kernel kept per shape): the plan
    # predicts a CPU record's peak for the host that measured it. Decided by the GEMM speed probe, as
    # in the workers (same environment: ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY reach both);
    # host.cpu_isa (Record) says the capabilities and the probe's figures
    record.host["cpu_bf16_gemm"] = cpu_has_bf16_gemm()
    return record


_UNITS = {
    "tokens_per_s": "tokens/s",
    "step_time_s": "s",
    **{f"{kind}_bytes": "bytes" for kind in MEMORY_KINDS},
}


def fill_record(record, result: dict[str, Any]) -> None:
    """Rows (one per metric: both paths' values and the ratio features / megatron as the median of
    the per-repeat ratios with their min and max) and samples (each repeat's per-step times and
    losses of both arms)."""
    m, f = result["megatron"], result["with_features"]
    record.set_device(m["device"])
    record.options["resolved_flags"] = result["flags"]
    record.options["world_size"] = result["parallel"]["world_size"]
    values = {
        "tokens_per_s": (m["tokens_per_s"], f["tokens_per_s"]),
        "step_time_s": (m["step_time"]["median_s"], f["step_time"]["median_s"]),
        **{f"{k}_bytes": (m["memory_per_rank"][k], f["memory_per_rank"][k]) for k in MEMORY_KINDS},
    }
    for metric, (theirs, ours) in values.items():
        row: dict[str, Any] = {
            "metric": metric,
            "unit": _UNITS[metric],
            "megatron": theirs,
            "features": ours,
            **result["ratio_spread"][metric],
            "repeats": result["repeats"],
        }
        if metric.endswith("_bytes"):
            kind = metric[: -len("_bytes")]
            row["scope"] = "max over ranks"
            row["megatron_per_rank"] = m["memory_by_rank"][kind]
            row["features_per_rank"] = f["memory_by_rank"][kind]
        record.add_row(**row)
    loss = result["loss"]
    for metric, theirs, ours in (
        ("loss_first", m["losses"][0], f["losses"][0]),
        ("loss_final", m["losses"][-1], f["losses"][-1]),
    ):
        record.add_row(metric=metric, unit="nats", megatron=theirs, features=ours, ratio=_ratio(ours, theirs))
    record.add_row(metric="loss_max_abs_diff", unit="nats", value=loss["max_abs_diff"])
    record.add_row(
        metric="losses_identical_across_repeats",
        unit="bool",
        megatron=loss["identical_across_repeats"]["megatron"],
        features=loss["identical_across_repeats"]["features"],
    )
    record.add_row(metric="features_reached", unit="names", value=list(result["features"]["ran"]))
    flops = result.get("flops")
    if flops:
        theirs, ours = flops["megatron"], flops["features"]
        record.add_row(
            metric="model_flops_per_s",
            unit="FLOP/s",
            megatron=theirs["achieved_flops_per_s"],
            features=ours["achieved_flops_per_s"],
            ratio=_ratio(ours["achieved_flops_per_s"], theirs["achieved_flops_per_s"]),
        )
        # None where no peak was measured (a CPU, fp32, a failed measurement): the row is there either way
        record.add_row(metric="mfu", unit="fraction of the measured peak", megatron=theirs["mfu"], features=ours["mfu"])
        record.extra["model_flops_per_step"] = flops["model_flops_per_step"]
        record.extra["flops_formula"] = flops["formula"]
        record.extra["peak_flops_per_s"] = (flops.get("peak") or {}).get("flops_per_s")
        record.extra["peak_how"] = (flops.get("peak") or {}).get("how") or flops.get("peak_skipped")
    for arm_name, arm in (("megatron", m), ("features", f)):
        for index, run in enumerate(arm["repeats"]):
            record.add_samples(f"{arm_name}/repeat{index + 1}/step_times_s", run["step_times_s"])
            record.add_samples(f"{arm_name}/repeat{index + 1}/losses", run["losses"])


def write(result: dict[str, Any], out: str, record=None, to_results: str | None = None) -> list[str]:
    """compare.json (the record, with the full comparison under ``"compare"``), and compare.png
    when matplotlib is installed; with ``to_results`` (a record name, "" for the default one) the
    same record in results/ too. Returns the files written."""
    if record is None:
        from mindspeed_like.toolkit.records import Record

        record = Record("compare-" + result["model"]["preset"])
    fill_record(record, result)
    fields = record.to_dict()
    document = {**fields, "compare": result}
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "compare.json")
    with open(path, "w") as handle:
        json.dump(document, handle, indent=1, default=str)
        handle.write("\n")
    written = [path]
    if to_results is not None:
        from mindspeed_like.toolkit.records import results_dir

        target = results_dir() / f"{to_results or record.name}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "w") as handle:
            json.dump(document, handle, indent=1, default=str)
            handle.write("\n")
        written.append(str(target))
    result["record"] = fields
    if importlib.util.find_spec("matplotlib") is not None:
        written.append(plot(result, os.path.join(out, "compare.png")))
    return written


def plot(result: dict[str, Any], path: str) -> str:
    """Three panels: the loss curves, the memory by kind (max over ranks) and the per-step time of
    every repeat, for both arms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, f = result["megatron"], result["with_features"]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4))
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
    middle.bar(
        [x - width / 2 for x in xs], [m["memory_per_rank"][k] / MIB for k in kinds], width, label="megatron-core"
    )
    middle.bar(
        [x + width / 2 for x in xs], [f["memory_per_rank"][k] / MIB for k in kinds], width, label="with features"
    )
    middle.set_xticks(list(xs), [k.replace("_", " ") for k in kinds], rotation=15)
    middle.set_ylabel("MiB (max over ranks)")
    middle.set_title("memory")
    middle.legend()
    for arm, label, color in ((m, "megatron-core", "C0"), (f, "with features", "C1")):
        for index, run in enumerate(arm["repeats"]):
            right.plot(
                range(1, len(run["step_times_s"]) + 1),
                [t * 1000 for t in run["step_times_s"]],
                color=color,
                alpha=0.9 if index == 0 else 0.45,
                marker="o" if label.startswith("megatron") else "x",
                markersize=3,
                label=label if index == 0 else None,
            )
    right.set_xlabel("step")
    right.set_ylabel("ms (slowest rank)")
    right.set_title(f"step time, {result['repeats']} repeat(s) each")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
