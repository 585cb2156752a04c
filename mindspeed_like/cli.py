"""The `mindspeed-like` command: list features, show the patch report, run the demo, audit a release."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mindspeed_like.config import add_flag, add_negation, negatable
from mindspeed_like.toolkit.errors import ConfigError


def _feature_rows(ctx) -> list[tuple[str, ...]]:
    from mindspeed_like import registry
    from mindspeed_like.megatron_version import SUPPORTED, release_in

    version = ctx.megatron_version
    rows = []
    for feature in registry.all_features():
        flags = ", ".join(" / ".join(f.option_strings) for f in feature.flags) or f"({feature.switched_by})"
        state = "on" if feature in ctx.features else "off"
        declared = feature.megatron_versions or str(SUPPORTED)
        if version is None:
            support = f"{declared} (megatron-core not found)"
        else:
            ok = release_in(declared, version)
            support = f"{declared} ({version}: {'supported' if ok else 'NOT supported'})"
        level = "-" if feature.optimization_level is None else str(feature.optimization_level)
        rows.append((feature.name, feature.kind, state, level, feature.backend_for(ctx), support, flags))
    return rows


def _print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]
    for row in (header, ["-" * w for w in widths], *rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def cmd_features(args: argparse.Namespace, flag_values: dict) -> int:
    from mindspeed_like import runtime

    ctx = runtime.context_for(runtime.resolve_config(code=flag_values, argv=[]))
    config = ctx.config
    _print_table(("feature", "kind", "state", "level", "backend here", "megatron-core", "flags"), _feature_rows(ctx))
    from mindspeed_like import registry
    from mindspeed_like.config import GLOBAL_FLAGS

    print("global flags: " + ", ".join(f"{f.option} ({config[f.name]!r})" for f in GLOBAL_FLAGS))
    _print_levels(config, registry.all_features())
    from mindspeed_like.megatron_version import support_summary

    print(support_summary())

    if args.verbose:
        print()
        for feature in registry.all_features():
            print(f"{feature.name}: {feature.summary}")
            for flag in feature.flags:
                spelling = " / ".join(flag.option_strings)
                print(f"    {spelling} ({flag.type.__name__}, default {flag.default!r}): {flag.help}")
    return 0


def _print_levels(config, features) -> None:
    """The --optimization-level rule, each level's members, and the level in effect."""
    from mindspeed_like import levels

    print(f"optimization levels ({levels.RULE}):")
    for level, meaning in levels.LEVELS.items():
        names = [f.name for f in features if f.optimization_level == level]
        print(f"  {level}: {meaning}" + (f": {', '.join(names)}" if names else ""))
    level = config["optimization_level"]
    if level is None:
        print("no --optimization-level given: each feature follows its own flags")
        return
    explicit = [
        name
        for name, source in config.sources.items()
        if source not in ("default", "optimization-level") and name != "optimization_level"
    ]
    print(
        f"optimization level {level} in effect"
        + (f"; set explicitly (overriding it): {', '.join(explicit)}" if explicit else "")
    )


def cmd_report(args: argparse.Namespace, flag_values: dict) -> int:
    """Apply the adaptor with the given flags, import megatron.core, print every patch."""
    import mindspeed_like
    import mindspeed_like.megatron_adaptor  # noqa: F401

    mindspeed_like.configure(**flag_values)
    import megatron.core  # noqa: F401

    rows = [
        (
            r.feature,
            r.kind,
            r.status,
            r.target + (" [GLOBAL]" if r.global_change else ""),
            str(len(r.aliases)),
            " < ".join(r.stack) if len(r.stack) > 1 else "",
        )
        for r in mindspeed_like.report()
    ]
    _print_table(("feature", "kind", "status", "target", "aliases", "stack (inner < outer)"), rows)
    from mindspeed_like.adapters import compile_cache

    if any(r.feature == compile_cache.NAME for r in mindspeed_like.report()):
        print(compile_cache.describe())  # where compiled graphs are cached, and why there
    from mindspeed_like import runtime
    from mindspeed_like.adapters import collective_streams

    ctx = runtime.current_context()
    if collective_streams.NAME in ctx.enabled_names:
        print(collective_streams.describe(ctx.device))  # what collectives' buffers need here, and what was set
    if args.verbose:
        for r in mindspeed_like.report():
            print(f"{r.target}: {r.why}")
            for alias in r.aliases:
                print(f"    also {alias}")
    return 0


def cmd_demo(args: argparse.Namespace, flag_values: dict) -> int:
    from mindspeed_like.demo import run_demo

    return run_demo(args, flag_values)


def cmd_compare(args: argparse.Namespace, flag_values: dict) -> int:
    """megatron-core's own path vs the features, same model, data and seed; a table and files."""
    from mindspeed_like.compare import CompareFailed, run_compare
    from mindspeed_like.compare.report import PLOT_HINT, summary_line, table

    try:
        result = run_compare(args, flag_values)
    except CompareFailed as error:
        print(f"mindspeed-like compare: {error}", file=sys.stderr)
        return 1
    print()
    print(table(result))
    print()
    print("summary: " + summary_line(result))
    print(f"wrote {', '.join(result['files'])}")
    if not any(path.endswith(".png") for path in result["files"]):
        print(PLOT_HINT)
    return 0


def cmd_audit(args: argparse.Namespace, flag_values: dict) -> int:
    """Every declared patch target against megatron-core sources, without importing them."""
    from mindspeed_like import audit

    try:
        sources = [audit.Source(path) for path in args.megatron_source]
        baseline = audit.Source(args.against) if args.against else audit.installed_source()
    except audit.SourceError as error:
        print(f"mindspeed-like audit: {error}", file=sys.stderr)
        return 2
    results = [(source, audit.audit(source, baseline)) for source in sources]
    against = f"{baseline.version} ({baseline.path})" if baseline is not None else "none (pass --against)"
    if args.markdown:
        print(audit.markdown(results, baseline))
    else:
        for source, rows in results:
            print(f"megatron-core {source.version} ({source.path}); signatures against {against}")
            shown = [r for r in rows if args.verbose or r.status != audit.PRESENT or r.signature not in ("same", "-")]
            table = [
                (r.feature, r.target.removeprefix("megatron."), r.status, r.signature, r.versions or "", r.note)
                for r in shown
            ]
            if table:
                _print_table(("feature", "target", "status", "signature", "versions", "note"), table)
            hidden = len(rows) - len(shown)
            if hidden:
                print(f"({hidden} more targets present with the same signature; -v lists them)")
            print()
            _print_table(("feature", "verdict"), list(audit.feature_summary(rows).items()))
            print()
    failed = [(source, row) for source, rows in results for row in audit.failures(rows)]
    for source, row in failed:
        print(
            f"mindspeed-like audit: megatron-core {source.version}: {row.feature} needs {row.target} ({row.status})",
            file=sys.stderr,
        )
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    from mindspeed_like import runtime

    parser = argparse.ArgumentParser(prog="mindspeed-like", description=__doc__, allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, handler, help_text in (
        ("features", cmd_features, "list every feature: flags, on/off, backend on this host, megatron-core support"),
        ("report", cmd_report, "apply the features for the given flags and print the patch report"),
        ("demo", cmd_demo, "train a small GPT with megatron-core through the adaptor on this machine"),
        ("compare", cmd_compare, "train a preset twice (megatron-core's path, then the features) and compare"),
        ("run", None, "run a training script with the adaptor imported first: run SCRIPT [ARGS...]"),
        ("plan", None, "predict every rank's memory (megatron's path and the features) for Megatron-LM arguments"),
        ("audit", cmd_audit, "check every declared patch target against megatron-core sources (not imported)"),
    ):
        sub = commands.add_parser(name, help=help_text, allow_abbrev=False)
        if handler is None:
            continue  # handled in main() before parsing
        sub.set_defaults(handler=handler)
        sub.add_argument("-v", "--verbose", action="store_true", help="more detail")
        if name == "demo":
            from mindspeed_like.demo import add_demo_arguments

            add_demo_arguments(sub)
        if name == "compare":
            from mindspeed_like.compare import add_compare_arguments

            add_compare_arguments(sub)
        if name == "audit":
            sub.add_argument(
                "--megatron-source",
                action="append",
                required=True,
                metavar="DIR_OR_WHEEL",
                help="a megatron-core source tree (a directory holding megatron/) or a megatron_core wheel; repeatable",
            )
            sub.add_argument(
                "--against",
                metavar="DIR_OR_WHEEL",
                help="the release whose signatures count as tested (default: the installed megatron-core)",
            )
            sub.add_argument("--markdown", action="store_true", help="one markdown table over all sources (docs)")
            continue  # the audit builds every feature as switched on: no feature flags
        group = sub.add_argument_group("feature flags")
        for flag in runtime.flags():
            add_flag(group, flag)
        for flag in negatable(runtime.flags()):
            add_negation(group, flag)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from mindspeed_like import runtime

    own_process = argv is None  # the console script: this process runs the one command
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # everything after the script belongs to the script
        from mindspeed_like.run import main as run_main

        run_main(argv[1:])
        return 0
    if argv[:1] == ["plan"]:  # Megatron-LM's arguments (or compare's options): plan parses them itself
        from mindspeed_like.plan.cli import main as plan_main

        return plan_main(argv[1:], own_process=own_process)
    parser = build_parser()
    args = parser.parse_args(argv)
    flag_names = {flag.name for flag in runtime.flags()}
    flag_values = {k: v for k, v in vars(args).items() if k in flag_names}
    try:
        return args.handler(args, flag_values)
    except ConfigError as error:
        print(f"mindspeed-like: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
