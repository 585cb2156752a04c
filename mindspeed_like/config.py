"""Typed flags from four sources, later wins: defaults < MINDSPEED_LIKE_ARGS < argv < configure().

Flags are parsed with argparse (typed, choices checked); a value given in code through
``configure()`` must already have the flag's type (``int`` is ``int``: no strings, no
bools for ints). Unknown names in the env variable or in ``configure()`` are errors with a
did-you-mean suggestion; unknown command-line options are left for Megatron's parser.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from mindspeed_like.toolkit.declaration import Feature, Flag
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.resolved_config import Config

ENV_VAR = "MINDSPEED_LIKE_ARGS"
SOURCES = ("default", "optimization-level", "env", "argv", "megatron-args", "configure")

GLOBAL_FLAGS = (
    Flag(
        "device",
        str,
        "auto",
        "where megatron runs: auto (npu if torch_npu works, else cuda if available, else cpu), "
        "or force cpu / cuda / npu",
        choices=("auto", "cpu", "cuda", "npu"),
        generic=True,
    ),
    Flag(
        "strict",
        bool,
        False,
        "fail instead of falling back when a feature cannot run as asked",
        generic=True,
    ),
    Flag(
        "portable_kernels",
        str,
        "auto",
        "the portable SwiGLU/RMSNorm/RoPE kernels: compiled with torch.compile (auto: where TorchDynamo is on and "
        "Inductor can compile for the device), or always eager",
        choices=("auto", "compiled", "eager"),
    ),
    Flag(
        "optimization_level",
        int,
        None,
        "MindSpeed's levels: 0 = device adapters and fixes only; 1 = + every feature whose results equal "
        "megatron's bitwise or within fp32 rounding; 2 = + those trading numerics or time for memory "
        "(`mindspeed-like features` lists the members); flags given explicitly override the level",
        choices=(0, 1, 2),
    ),
)


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would sys.exit(2)
        raise ConfigError(f"mindspeed_like: {message}")


def all_flags(features: Iterable[Feature]) -> list[Flag]:
    flags: dict[str, Flag] = {f.name: f for f in GLOBAL_FLAGS}
    options: dict[str, str] = {o: f.name for f in GLOBAL_FLAGS for o in f.option_strings}
    for feature in features:
        for flag in feature.flags:
            if flag.name in flags and flags[flag.name] != flag:
                raise ConfigError(f"flag {flag.name!r} is declared twice with different definitions")
            for option in flag.option_strings:
                if options.setdefault(option, flag.name) != flag.name:
                    raise ConfigError(f"option {option} of flag {flag.name!r} is already flag {options[option]!r}'s")
            flags[flag.name] = flag
    return list(flags.values())


def add_flag(
    parser: argparse.ArgumentParser | Any, flag: Flag, suppress_default: bool = True, argv: bool = False
) -> None:
    """Add one flag to an argparse parser (or group). Defaults suppressed so 'given' is visible.
    argv: the spellings read from a script's own command line (see ``Flag.generic``)."""
    default = argparse.SUPPRESS if suppress_default else flag.default
    options = flag.argv_option_strings if argv else flag.option_strings
    if flag.type is bool:
        parser.add_argument(*options, dest=flag.name, action="store_true", default=default, help=flag.help)
    else:
        parser.add_argument(
            *options, dest=flag.name, type=flag.type, choices=flag.choices, default=default, help=flag.help
        )


def negation_option(flag: Flag) -> str:
    """``--no-<flag>``: ``--no-reuse-fp32-param``, ``--no-use-flash-attn`` (argparse's
    BooleanOptionalAction spelling: ``--no-`` before the flag's own name)."""
    return "--no-" + flag.option.removeprefix("--")


def negatable(flags: Sequence[Flag]) -> list[Flag]:
    """The flags that have ``--no-<flag>``: every feature's on switch (a bool flag, off by default),
    so a command line can keep an ``--optimization-level`` and switch one of its features off.
    Not: generic flags (``--strict``), off switches already named ``no_...``, and a flag whose
    ``--no-`` spelling is another flag of ours (``--no-gemm-gradient-accumulation-fusion``)."""
    taken = {o for f in flags for o in f.option_strings}
    return [
        f
        for f in flags
        if f.type is bool
        and f.default is False
        and not f.generic
        and not f.name.startswith("no_")
        and negation_option(f) not in taken
    ]


class _NegateAndMark(argparse.Action):
    """``--no-<flag>`` beside an option another parser owns: the flag's attribute becomes False (a
    later ``--<flag>`` sets it back: the later one wins) and ``dest`` (the marker) records that it
    was given, since False is also the owner's default."""

    def __init__(self, option_strings: Sequence[str], dest: str, flag_dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)
        self.flag_dest = flag_dest

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.flag_dest, False)
        setattr(namespace, self.dest, True)


def add_negation(parser: argparse.ArgumentParser | Any, flag: Flag, marker: str | None = None) -> None:
    """``--no-<flag>``: stores False in the flag (default suppressed, so 'given' is visible; with
    ``--<flag>`` the later one wins, as argparse's BooleanOptionalAction). ``marker``: for a flag
    whose own option belongs to Megatron-LM's parser, this attribute is set True as well (the
    flag's False is also Megatron's default, so a given ``--no-`` would not be visible)."""
    help_text = f"switch {flag.option} off (e.g. keep an --optimization-level without it)"
    option = negation_option(flag)
    if marker is None:
        parser.add_argument(
            option, dest=flag.name, action="store_const", const=False, default=argparse.SUPPRESS, help=help_text
        )
    else:
        parser.add_argument(
            option, dest=marker, action=_NegateAndMark, flag_dest=flag.name, default=argparse.SUPPRESS, help=help_text
        )


def build_parser(flags: Sequence[Flag], argv: bool = False) -> argparse.ArgumentParser:
    parser = _RaisingParser(prog="mindspeed_like", add_help=False, allow_abbrev=False)
    for flag in flags:
        add_flag(parser, flag, argv=argv)
    for flag in negatable(flags):
        add_negation(parser, flag)
    return parser


def _suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def parse_env(flags: Sequence[Flag], text: str | None) -> dict[str, Any]:
    """Parse MINDSPEED_LIKE_ARGS; it holds only our flags, so anything unknown is an error."""
    if not text or not text.strip():
        return {}
    try:
        tokens = shlex.split(text)
    except ValueError as error:  # e.g. "No closing quotation"
        raise ConfigError(
            f"{ENV_VAR}={text!r} cannot be split into flags ({error}); balance its quotes, "
            f"e.g. {ENV_VAR}='--device cpu --use-flash-attn'"
        ) from None
    namespace, unknown = build_parser(flags).parse_known_args(tokens)
    options = [o for f in flags for o in f.option_strings] + [negation_option(f) for f in negatable(flags)]
    for token in unknown:
        if token.startswith("-"):
            option = token.split("=", 1)[0]
            raise ConfigError(f"{ENV_VAR}: unknown flag {option!r}.{_suggest(option, options)}")
        raise ConfigError(f"{ENV_VAR}: unexpected value {token!r} (values follow their flag: '--flag VALUE')")
    return vars(namespace)


def parse_argv(flags: Sequence[Flag], argv: Sequence[str]) -> dict[str, Any]:
    """Our flags from a script's command line; everything else is the script's or Megatron's and
    passes through. Never an error: the command line belongs to the script, so a value our parser
    rejects is dropped with a one-time warning, and an unknown option that looks like a
    misspelling of ours (not one of Megatron-LM's) gets a one-time warning with the suggestion."""
    tokens = list(argv)
    parser = build_parser(flags, argv=True)
    while True:
        try:
            namespace, unknown = parser.parse_known_args(tokens)
        except ConfigError as error:
            options = _options_in_error(str(error))
            remaining = _drop_options(tokens, options)
            _warn_once(
                f"mindspeed_like: ignoring {'/'.join(options) or 'the command line'} "
                f"({str(error).removeprefix('mindspeed_like: ')}); the script keeps its command line. "
                f"Fix the value, or set it in {ENV_VAR} or mindspeed_like.configure()."
            )
            if not options or remaining == tokens:
                return {}
            tokens = remaining
            continue
        _warn_misspelt(unknown, flags)
        return vars(namespace)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, UserWarning, stacklevel=4)


def _options_in_error(message: str) -> list[str]:
    """The option strings argparse names in its error (``argument --a/--b: invalid ...``)."""
    match = re.search(r"argument (\S+?):", message)
    return match.group(1).split("/") if match else []


def _drop_options(tokens: list[str], options: Sequence[str]) -> list[str]:
    """``tokens`` without each occurrence of ``options`` and its value."""
    out: list[str] = []
    skip = False
    for token in tokens:
        if skip:
            skip = False
            if not token.startswith("-"):
                continue
        if token in options:
            skip = True
            continue
        if any(token.startswith(option + "=") for option in options):
            continue
        out.append(token)
    return out


def _warn_misspelt(unknown: Sequence[str], flags: Sequence[Flag]) -> None:
    from mindspeed_like.toolkit.megatron_lm_options import MEGATRON_LM_OPTIONS

    ours = {o for f in flags for o in f.argv_option_strings} | {negation_option(f) for f in negatable(flags)}
    generic = {o for f in flags if f.generic for o in (f.option, *f.aliases)}
    for token in unknown:
        if not token.startswith("--") or token == "--":
            continue
        option = token.split("=", 1)[0]
        if option in MEGATRON_LM_OPTIONS or option in generic:
            continue
        suggestion = _close_option(option, ours)
        if suggestion is not None:
            _warn_once(
                f"mindspeed_like: {option} on the command line is not one of our flags and is left to the "
                f"script; did you mean {suggestion}? (`mindspeed-like features -v` lists them)"
            )


def _close_option(option: str, ours: Iterable[str]) -> str | None:
    """Ours, if ``option`` is a misspelling of it: underscores for dashes, a prefix or an
    extension of it, or a close spelling."""
    normalized = option.replace("_", "-").lower()
    candidates = sorted(ours)
    if normalized in candidates:
        return normalized
    for candidate in candidates:
        shorter, longer = sorted((normalized, candidate), key=len)
        if len(shorter) >= 10 and longer.startswith(shorter) and len(longer) - len(shorter) <= 2:
            return candidate
    close = difflib.get_close_matches(normalized, candidates, n=1, cutoff=0.88)
    return close[0] if close else None


def check_value(flag: Flag, value: Any, source: str) -> Any:
    """A value set from code must have the flag's type already; return it (ints become floats)."""
    expected = flag.type
    if value is None and flag.default is None:
        return None  # "unset": the flag's documented default
    value = _plain_scalar(value, expected)
    ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        example = flag.default if flag.default is not None else _EXAMPLES.get(expected, expected())
        kind = type(value).__module__ + "." + type(value).__name__ if type(value).__module__ != "builtins" else ""
        raise ConfigError(
            f"{source}: {flag.name}={value!r} has type {kind or type(value).__name__}, expected {expected.__name__} "
            f"(e.g. {flag.name}={example!r}" + (", or None for the default" if flag.default is None else "") + ")"
        )
    if flag.choices is not None and value not in flag.choices:
        raise ConfigError(f"{source}: {flag.name}={value!r} is not one of {list(flag.choices)}")
    return value


_EXAMPLES: dict[type, Any] = {int: 2, float: 0.5, str: "value", bool: True}


def _plain_scalar(value: Any, expected: type) -> Any:
    """numpy's scalars as the Python values they stand for (``np.bool_`` -> bool, ``np.int64`` ->
    int, ``np.float32`` -> float): configs built from numpy/pandas data carry them."""
    if type(value).__module__ != "numpy" or getattr(value, "ndim", 0) != 0:
        return value
    kind = getattr(getattr(value, "dtype", None), "kind", "")
    if expected is bool and kind == "b":
        return bool(value)
    if expected in (int, float) and kind in "iu":
        return int(value)
    if expected is float and kind == "f":
        return float(value)
    return value


def normalize_names(flags: Sequence[Flag], overrides: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Map configure() keyword names (ours or MindSpeed's, - or _) to flag names; unknown -> error."""
    by_name: dict[str, Flag] = {}
    for flag in flags:
        for option in flag.option_strings:
            by_name[option.lstrip("-").replace("-", "_")] = flag
    negations = {negation_option(f).lstrip("-").replace("-", "_"): f for f in negatable(flags)}
    result = {}
    for key, value in overrides.items():
        name = key.lstrip("-").replace("-", "_")
        flag = by_name.get(name)
        if flag is None and name in negations:
            raise ConfigError(
                f"{source}: unknown flag {key!r}; --{name.replace('_', '-')} is the command line's spelling, "
                f"in code pass {negations[name].name}=False"
            )
        if flag is None:
            raise ConfigError(f"{source}: unknown flag {key!r}.{_suggest(key.replace('-', '_'), by_name)}")
        result[flag.name] = check_value(flag, value, source)
    return result


def resolve(
    flags: Sequence[Flag],
    env: str | None = None,
    argv: Sequence[str] | None = None,
    megatron_args: Mapping[str, Any] | None = None,
    code: Mapping[str, Any] | None = None,
    level_values: Callable[[int], Mapping[str, Any]] | None = None,
) -> Config:
    """Merge the sources in priority order into one Config.

    level_values: the flag values an ``--optimization-level`` stands for; they fill only flags
    no source set (source "optimization-level"), so explicit flags override the level."""
    values = {f.name: f.default for f in flags}
    sources = {f.name: "default" for f in flags}
    layers = (
        ("env", parse_env(flags, env)),
        ("argv", parse_argv(flags, argv or [])),
        ("megatron-args", dict(megatron_args or {})),
        ("configure", normalize_names(flags, code or {}, "configure()")),
    )
    for source, layer in layers:
        for name, value in layer.items():
            values[name] = value
            sources[name] = source
    level = values.get("optimization_level")
    if level is not None and level_values is not None:
        for name, value in level_values(level).items():
            if sources.get(name) == "default":
                values[name] = value
                sources[name] = "optimization-level"
    return Config(values, sources)


def env_text() -> str | None:
    return os.environ.get(ENV_VAR)
