"""`mindspeed-like plan` / `python -m mindspeed_like.plan`: the command line.

    mindspeed-like plan <Megatron-LM arguments> [--device-memory 80GiB] [--world-size N] [--fit] [--json]
    mindspeed-like plan --preset llama --num-layers 4 ... --optimization-level 2     (compare's options)

Everything not plan's own is a Megatron-LM option (or one of this library's feature flags); with
``--preset`` the options are `mindspeed-like compare`'s.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mindspeed_like.plan.arg_errors import OneLineParser, values_attached
from mindspeed_like.toolkit.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


class MemorySize(int):
    """Bytes, with how the user wrote them (``said``), so the output can say binary or decimal."""

    said: str = ""


def memory_size(text: str) -> int:
    """``80GiB``, ``80GB``, ``81920MiB``, ``85899345920``: bytes."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match[2].lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 80GiB, 80GB, 81920MiB)")
    size = int(float(match[1]) * _UNITS[match[2].lower()])
    if not match[2] and size < 2**20:
        raise argparse.ArgumentTypeError(
            f"{text!r} would be {size} bytes: give a unit (e.g. {match[1]}GiB or {match[1]}GB)"
        )
    if size <= 0:
        raise argparse.ArgumentTypeError(f"a device's memory must be more than 0 bytes, got {text!r}")
    out = MemorySize(size)
    unit = match[2].lower()
    kind = "binary" if "i" in unit else "bytes" if unit in ("", "b") else "decimal"
    out.said = f"--device-memory {text.strip()}: " + (f"{size:,} bytes" if kind == "bytes" else kind)
    return out


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def plan_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="mindspeed-like plan",
        description=__doc__,
        add_help=False,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = parser.add_argument_group("plan")
    g.add_argument("-h", "--help", action="store_true", help="this help")
    g.add_argument(
        "--device-memory",
        type=memory_size,
        default=None,
        help="memory of one device (e.g. 80GiB): --fit's budget; with it the plan says whether each rank fits",
    )
    g.add_argument(
        "--world-size",
        type=positive_int,
        default=None,
        help="ranks of the run (default TP x PP x CP); with --fit, the layouts searched",
    )
    g.add_argument(
        "--fit",
        action="store_true",
        help="the flags that fit --device-memory with the least predicted step time, as a command line",
    )
    g.add_argument(
        "--headroom",
        type=float,
        default=0.05,
        help="--fit keeps the predicted peak within (1 - headroom) x --device-memory (default 0.05)",
    )
    g.add_argument(
        "--json", action="store_true", help="machine-readable: per rank, megatron and features, compare's metric names"
    )
    g.add_argument(
        "--parser",
        choices=("auto", "megatron-lm", "builtin"),
        default="auto",
        help="auto: Megatron-LM's own parser where megatron.training is importable, else the built-in one",
    )
    g.add_argument(
        "--target-device",
        choices=("cuda", "npu", "cpu"),
        default=None,
        help="where the run will train (default: cuda for a Megatron-LM command line, this host for compare's "
        "options); a CPU host's process peak includes the interpreter and the model build",
    )
    g.add_argument("-v", "--verbose", action="store_true", help="every saved tensor and state line")
    return parser


def main(argv: Sequence[str] | None = None, *, own_process: bool | None = None) -> int:
    """``own_process``: this process runs plan and nothing else (the console script and ``python -m``,
    where ``argv`` is None), so Megatron-LM's parser may be imported the cheap way
    (:func:`megatron_args.parse_with_megatron_lm`)."""
    own_process = argv is None if own_process is None else own_process
    argv = values_attached(sys.argv[1:] if argv is None else argv)
    try:
        own, rest = plan_parser().parse_known_args(argv)
        own.own_process = own_process
        if own.help:
            plan_parser().print_help()
            print("\nMegatron-LM's model/layout options read (the rest are accepted):")
            from mindspeed_like.plan.megatron_args import build_parser

            print("  " + " ".join(sorted(o for a in build_parser()._actions for o in a.option_strings)))
            return 0
        result = plan(rest, own)
    except ConfigError as error:
        print(f"mindspeed-like plan: {str(error).removeprefix('plan: ')}", file=sys.stderr)
        return 2
    print(json.dumps(result.output, indent=1) if own.json else result.output)
    return NOTHING_FITS if result.nothing_fits else 0


NOTHING_FITS = 1
"""--fit's exit status when no configuration fits (the answer is printed, as grep answers 1 for no
match): a script sweeping budgets can tell without reading the output; 2 stays a usage error."""


@dataclass(frozen=True)
class Answer:
    output: Any  # the text, or the JSON object
    nothing_fits: bool = False


HOST_ALLOCATOR_NOTE = (
    "host-allocator (features arm, CPU host): glibc keeps every freed block in its heap; the plan counts the "
    "loss's temporaries whole for it (its share below), not the holes between live blocks (docs/plan.md, "
    '"Megatron-LM\'s own runs", measures level 1 with and without it): --no-tune-host-allocator trades that '
    "memory for time"
)


CPU_HEAP_NOTE = (
    "CPU host: the process peaks are step 1's; glibc's heap grows over the next steps (measured: up to a fifth "
    "more by step 6 with its allocator as it is, ~7% with host-allocator; docs/plan.md, 'The CPU peak is the "
    "weakest figure')"
)


def plan(rest: list[str], own: argparse.Namespace) -> Answer:
    """Read the run, predict, and render (text, or the JSON object with ``own.json``)."""
    from mindspeed_like.plan import report
    from mindspeed_like.plan.predict import predict

    run, switches = read_run(rest, own)
    notes = []
    if run.layout.ep > 1:
        notes.append(
            "expert parallel: the activations are the mean rank's, its routed rows taken as balanced (the router "
            "decides them at run time); a rank can hold more, up to the 'largest EP rank (bound)' line (dropless "
            "routing's worst case): size for that"
        )
    from mindspeed_like.plan.paths import fsdp2_keys_not_modeled

    unmodeled = fsdp2_keys_not_modeled(switches.config) if "fsdp2-config" in switches.enabled else ()
    if unmodeled:
        notes.append(
            "fsdp2-config: the plan models its sharding_size (HSDP); not its " + ", ".join(unmodeled) + " (the "
            "features arm is counted with megatron's FSDP2 units, dtypes and resharding)"
        )
    if run.device == "cpu":
        notes.append(CPU_HEAP_NOTE)
    if run.device == "cpu" and "host-allocator" in switches.enabled:
        notes.append(HOST_ALLOCATOR_NOTE)
    pred = predict(run, switches.paths(run), switches.enabled, (*run.notes, *notes))
    line = switches_line(switches)
    fit_result = None
    if own.fit:
        from mindspeed_like.plan.fit import fit, render_fit

        if own.device_memory is None:
            raise ConfigError("plan: --fit needs --device-memory (e.g. --device-memory 80GiB)")
        if not 0 <= own.headroom < 1:
            raise ConfigError(f"plan: --headroom must be in [0, 1), got {own.headroom}")
        fit_result = fit(run, switches, own.device_memory, own.world_size, own.headroom)
        if not own.json:
            text = report.text(pred, line, own.verbose) + "\n\n" + render_fit(fit_result)
            return Answer(text, nothing_fits=fit_result.best is None)
    if own.json:
        extra: dict[str, Any] = {
            "features": {
                "enabled": list(switches.enabled),
                "level": switches.level,
                "level_by_default": switches.defaulted,
            },
        }
        if own.device_memory is not None:
            extra["device_memory_bytes"] = own.device_memory
        if fit_result is not None:
            from mindspeed_like.plan.fit import fit_json

            extra["fit"] = fit_json(fit_result)
        return Answer(report.as_json(pred, extra), nothing_fits=fit_result is not None and fit_result.best is None)
    out = report.text(pred, line, own.verbose)
    if own.device_memory is not None:
        out += "\n" + fits_line(pred, own.device_memory)
    return Answer(out)


def switches_line(switches) -> str:
    level = f"--optimization-level {switches.level}" if switches.level is not None else "the flags given"
    how = " (no feature flag given: level 2, as compare does)" if switches.defaulted else ""
    return f"features arm: {level}{how}: " + (", ".join(switches.enabled) or "none")


def fits_line(pred, budget: int) -> str:
    from mindspeed_like.plan.report import as_given, size

    out = []
    for arm in pred.arms():
        peak = max(s.peak.total for s in arm.stages)
        verdict = "fits" if peak <= budget else f"does NOT fit ({size(peak - budget)} over)"
        out.append(f"{arm.name}: {size(peak)} of {size(budget)}: {verdict}")
    return f"device memory{as_given(budget)}: " + "; ".join(out)


def predict_argv(argv: Sequence[str]):
    """The :class:`~mindspeed_like.plan.predict.Prediction` of a plan command line, as the CLI makes
    it, without rendering it (the checks and tests that hold the plan to measurements)."""
    from mindspeed_like.plan.predict import predict

    own, rest = plan_parser().parse_known_args(list(argv))
    run, switches = read_run(rest, own)
    return predict(run, switches.paths(run), switches.enabled)


def read_run(rest: list[str], own: argparse.Namespace):
    """The :class:`Run` and the feature switches from compare's options (``--preset``) or a
    Megatron-LM command line."""
    from mindspeed_like.plan import features

    if any(token == "--preset" or token.startswith("--preset=") for token in rest):
        return _from_compare(rest, own)
    from mindspeed_like.plan import megatron_args

    device = own.target_device or "cuda"
    ns, unknown = megatron_args.parse_builtin(rest)
    megatron_args.check_sizes(ns)
    megatron_args.check_exclusive(ns, rest)
    switches = features.resolve(argv=rest)
    ours = _our_options()
    not_modeled = megatron_args.classify_unknown(unknown, ours | set(_plan_options()))
    source = "builtin"
    notes: list[str] = []
    if ns.max_position_embeddings is None and ns.seq_length is not None:
        # Megatron-LM requires it (validate_args); the plan answers, with the value it took, and the
        # command lines --fit prints carry it
        rest = [*rest, "--max-position-embeddings", str(ns.seq_length)]
        ns.max_position_embeddings = ns.seq_length
        notes.append(
            f"no --max-position-embeddings: taken as --seq-length ({ns.seq_length}); Megatron-LM refuses a "
            "command line without it, so add it"
        )
    if own.parser in ("auto", "megatron-lm"):
        try:
            ns, note = megatron_args.parse_with_megatron_lm(
                rest,
                own.world_size or _model_parallel(ns),
                parse_only_process=getattr(own, "own_process", False),
                device=device,
            )
            source = "megatron-lm" if note is None else "megatron-lm parser, built-in derivations"
            if note:
                notes.append(note)
        except ImportError as error:
            absent = error.name in ("megatron", "megatron.training")
            why = (
                "megatron.training is not importable (put Megatron-LM on PYTHONPATH)"
                if absent
                else f"importing megatron.training failed: {error} (install what it needs)"
            )
            if own.parser == "megatron-lm":
                raise ConfigError(f"plan: --parser megatron-lm: {why}") from None
            if not absent:  # Megatron-LM is there but broken: say which parser read the arguments, and why
                notes.append(f"Megatron-LM's parser not used, {why}: the built-in parser read the arguments")
    if source == "builtin":
        ns = megatron_args.derive(ns, own.world_size)
    run = megatron_args.run_from_namespace(
        ns,
        device=device,
        flags=switches.given(),
        command=tuple(rest),
        source=source,
        not_modeled=not_modeled,
        notes=tuple(notes),
    )
    return run, switches


def _model_parallel(ns: argparse.Namespace) -> int:
    return ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size * ns.context_parallel_size


def _our_options() -> set[str]:
    from mindspeed_like import runtime

    names = set()
    for flag in runtime.flags():
        names.update(flag.option_strings)
        names.add("--no-" + flag.option_strings[0].removeprefix("--"))
    return names


def _plan_options() -> list[str]:
    return [o for a in plan_parser()._actions for o in a.option_strings]


def _from_compare(rest: list[str], own: argparse.Namespace):
    from mindspeed_like import runtime
    from mindspeed_like.compare import add_compare_arguments, check_arguments
    from mindspeed_like.config import add_flag, add_negation, negatable
    from mindspeed_like.plan import features
    from mindspeed_like.plan.compare_args import run_from_compare
    from mindspeed_like.plan.megatron_args import import_notices_kept_out

    if getattr(own, "world_size", None) is not None:
        raise ConfigError(
            "plan: --world-size is for a Megatron-LM command line; with compare's options (--preset) the ranks are "
            "its layout: --tensor-model-parallel-size x --pipeline-model-parallel-size x --context-parallel-size x "
            "--data-parallel-size"
        )
    parser = OneLineParser(prog="mindspeed-like plan (compare's options)", allow_abbrev=False)
    add_compare_arguments(parser)
    group = parser.add_argument_group("feature flags")
    for flag in runtime.flags():
        add_flag(group, flag)
    for flag in negatable(runtime.flags()):
        add_negation(group, flag)
    args = parser.parse_args(rest)
    names = {flag.name for flag in runtime.flags()}
    values = {k: v for k, v in vars(args).items() if k in names}
    with import_notices_kept_out():  # it builds megatron's TransformerConfig: megatron's first import
        check_arguments(args, values)
    switches = features.resolve(values=values)
    device = own.target_device or runtime.context_for(switches.config).device
    return run_from_compare(args, values, device, command=("--preset", *[t for t in rest if t != "--preset"])), switches
