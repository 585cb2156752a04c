"""The flags the Megatron-LM flag sweep tries, derived from the installed ``arguments.py``.

``make test-megatron-lm-flags`` (tests/megatron_lm_flags/) runs Megatron-LM's ``pretrain_gpt.py``
with the import line once per batch of flags. Which flags, and with what value, is read here from
Megatron-LM's own parser (``add_megatron_arguments``: every action with its option strings, type,
choices, default, nargs and argument group), not from a hand-kept list:

* in scope: the argument groups a CPU run can exercise (:data:`GROUPS`: logging, checking,
  checkpointing, precision, data loading, profiling, timers, evaluation) and, of the transformer
  configuration group, recompute and the precision switches (:data:`CONFIG_DESTS`);
* one case per flag, and per non-default choice of a flag with choices (at most
  :data:`MAX_CHOICES`); a flag the lane's base command line sets (the tiny model) is not a case;
* the value of a flag that takes one follows from its type and default (:func:`values_for`);
  an interval or iteration count becomes 2, so it acts within the sweep's 3 iterations;
* a flag that acts only beside another (``--loss-scale`` beside ``--fp16``, ``--save-interval``
  beside ``--save``, ``--profile-step-start`` beside ``--profile``) runs with its companions
  (:func:`companions_for`); a case's result is compared with the companions' own run.

The only hand-kept parts are :data:`COMPANIONS`, :data:`VALUES` (for flags whose value cannot
follow from the type: a port, a 3-number ramp-up) and :data:`NOT_RUN` (with the reason), each entry
checked against the parser so a renamed flag fails the lane instead of going stale.
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
from dataclasses import dataclass, field

# the argument groups of Megatron-LM 0.16's parser (titles), what the issue names as CPU-testable
GROUPS = (
    "logging",
    "straggler",
    "profiling",
    "training",
    "checkpointing",
    "mixed precision",
    "validation",
    "data and dataloader",
    "rerun engine",
)
# of "transformer configuration" (TransformerConfig's fields): recompute and the precision switches
CONFIG_DESTS = ("fp16", "bf16", "recompute_", "distribute_saved_activations", "fp32_residual_connection")
MAX_CHOICES = 6  # a flag with more choices (e.g. --exit-signal's 33 signals) tries its first non-default one

# Placeholders the runner fills per run: a fresh directory / file, and the checkpoint it prepared.
TMP_DIR, TMP_FILE, CHECKPOINT = "{tmp_dir}", "{tmp_file}", "{checkpoint}"

FULL_RECOMPUTE = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
# dest (exact, a prefix ending in "_", or one case's name: "--flag value") -> the flags it needs beside it to act at all
COMPANIONS: dict[str, tuple[str, ...]] = {
    "loss_scale": ("--fp16",),
    "initial_loss_scale": ("--fp16",),
    "min_loss_scale": ("--fp16",),
    "loss_scale_window": ("--fp16",),
    "hysteresis": ("--fp16",),
    "fp16_lm_cross_entropy": ("--fp16",),
    "profile": ("--profile-step-start", "1", "--profile-step-end", "2"),  # megatron's default start: 10
    # torch's profiler writes its trace to --tensorboard-dir (megatron hands it to tensorboard_trace_handler;
    # without it the handler gets None and the run dies when the trace is written, on any device)
    # a window inside the 3 iterations (megatron's default, 10-12, lies past them)
    "profile_": (
        "--profile",
        "--use-pytorch-profiler",
        "--tensorboard-dir",
        TMP_DIR,
        "--profile-step-start",
        "1",
        "--profile-step-end",
        "2",
    ),  # fmt: skip
    "memory_snapshot_path": ("--record-memory-history",),
    "straggler_": ("--log-straggler",),
    "disable_straggler_on_startup": ("--log-straggler",),
    "tensorboard_": ("--tensorboard-dir", TMP_DIR),
    "log_timers_to_tensorboard": ("--tensorboard-dir", TMP_DIR),
    "log_loss_scale_to_tensorboard": ("--tensorboard-dir", TMP_DIR),
    "log_validation_ppl_to_tensorboard": ("--tensorboard-dir", TMP_DIR, "--eval-interval", "2", "--eval-iters", "1"),
    "log_memory_to_tensorboard": ("--tensorboard-dir", TMP_DIR),
    "log_world_size_to_tensorboard": ("--tensorboard-dir", TMP_DIR),
    "wandb_exp_name": ("--wandb-project", "sweep"),
    "wandb_save_dir": ("--wandb-project", "sweep", "--wandb-exp-name", "sweep"),
    "wandb_entity": ("--wandb-project", "sweep", "--wandb-exp-name", "sweep"),
    "timing_log_option": ("--timing-log-level", "1"),
    "barrier_with_L1_time": ("--timing-log-level", "1"),
    "manual_gc_": ("--manual-gc",),
    "exit_signal": ("--exit-signal-handler",),
    "full_validation": ("--eval-interval", "2", "--eval-iters", "1"),
    "multiple_validation_sets": ("--eval-interval", "2", "--eval-iters", "1"),
    "test_mode": ("--eval-interval", "2", "--eval-iters", "1"),
    "eval_iters": ("--eval-interval", "2"),
    "eval_interval": ("--eval-iters", "1"),
    "check_for_spiky_loss": ("--rerun-mode", "validate_results"),
    # an injected error makes megatron save a checkpoint and exit (rerun_state_machine.py): it needs --save
    "error_injection_": ("--rerun-mode", "validate_results", "--save", TMP_DIR, "--save-interval", "100"),
    "replication_": ("--replication",),
    "non_persistent_": ("--non-persistent-save-interval", "2", "--save", TMP_DIR, "--save-interval", "2"),
    # full recompute needs all three (megatron's TransformerConfig checks); a case's own value overrides the
    # companion's (argparse keeps the last), so "--recompute-method block" runs block with one layer
    "--recompute-granularity full": ("--recompute-method", "uniform", "--recompute-num-layers", "1"),
    "recompute_method": FULL_RECOMPUTE,
    "recompute_num_layers": FULL_RECOMPUTE,
    "distribute_saved_activations": FULL_RECOMPUTE,
    "recompute_modules": ("--recompute-granularity", "selective"),
    "fim_": ("--fim-data",),
    "optimizer_offload_fraction": ("--optimizer-cpu-offload",),
    "use_torch_optimizer_for_cpu_offload": ("--optimizer-cpu-offload",),
    "overlap_cpu_optimizer_d2h_h2d": ("--optimizer-cpu-offload",),
    "pin_cpu_": ("--optimizer-cpu-offload",),
}
# a checkpointing flag whose name does not say "load" but that acts on loading
LOAD_SIDE = ("finetune", "use_checkpoint_args", "use_mp_args_from_checkpoint_args", "ckpt_step",
             "auto_detect_ckpt_format", "dist_ckpt_strictness", "exit_on_missing_checkpoint",
             "pretrained_checkpoint", "use_tokenizer_model_from_checkpoint_args")  # fmt: skip
SAVE = ("--save", TMP_DIR, "--save-interval", "2")
LOAD = ("--load", CHECKPOINT)

# dest -> value tokens, where the type and default do not give a usable one
VALUES: dict[str, tuple[str, ...]] = {
    "straggler_ctrlr_port": ("0",),  # its default is the highest port; any other is as good
    "rampup_batch_size": ("2", "2", "8"),  # start, increment, samples
    "profile_step_start": ("1",),
    "profile_step_end": ("2",),
    "profile_ranks": ("0",),
    # not "mlp": megatron's selective mlp recompute with biases (the base model has them) never ends
    # (docs/megatron-lm.md, the sweep's section)
    "recompute_modules": ("core_attn", "layernorm"),
    "recompute_num_layers": ("2",),  # 1 is FULL_RECOMPUTE's own
    "iterations_to_skip": ("2",),
    "exit_duration_in_mins": ("100",),
    "ckpt_step": ("2",),
    "loss_scale": ("1024",),
    "num_workers": ("0",),
    "wandb_project": ("sweep",),
    "wandb_exp_name": ("sweep",),
    "wandb_entity": ("sweep",),
    "split": ("90,5,5",),
}


# dest -> why the sweep does not run it (each seen to need what the tiny mock-data run cannot give)
# (a dest, or one case's name), seen in the sweep and not a host's doing
NOT_RUN: dict[str, str] = {
    "full_validation": "seen to fail in megatron's evaluation (TypeError: 'int' object is not subscriptable) and, "
    "beside --multiple-validation-sets, to run past 300 s on --mock-data's validation split; not investigated",
    "save_dgrads_interval": "megatron's own backward fails under its dgrad hooks on the output layer (RuntimeError: "
    "Output 0 of BackwardHookFunction is a view ... modified inplace, in tensor_parallel/cross_entropy.py's "
    "backward; the same with --transformer-impl local): autograd's rule, on any device",
    "--dataloader-type external": "the script's dataset provider must return iterators; pretrain_gpt.py's returns "
    "datasets (TypeError: 'MockGPTDataset' object is not an iterator, on any device)",
}


@dataclass(frozen=True)
class Case:
    """One flag as the sweep passes it: ``--option [values]`` beside ``companions``."""

    option: str
    dest: str
    group: str
    values: tuple[str, ...] = ()
    companions: tuple[str, ...] = ()
    note: str = ""  # why the case is not tried (then it has no run)
    aliases: tuple[str, ...] = field(default=(), compare=False)

    @property
    def name(self) -> str:
        return " ".join((self.option, *self.values))

    @property
    def args(self) -> tuple[str, ...]:
        return (self.option, *self.values)


def megatron_parser(megatron_lm: str) -> argparse.ArgumentParser:
    """Megatron-LM's own parser, as ``parse_args`` builds it (its actions carry their groups)."""
    if megatron_lm not in sys.path:
        sys.path.insert(0, megatron_lm)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return parser


def in_scope(group: str, dest: str) -> bool:
    return group in GROUPS or (group == "transformer configuration" and dest.startswith(CONFIG_DESTS))


def base_options(base: list[str]) -> set[str]:
    return {token for token in base if token.startswith("--")}


def cases(parser: argparse.ArgumentParser, base: list[str]) -> tuple[list[Case], dict[str, int]]:
    """The sweep's cases, and the number of flags of every group left out of scope."""
    given = base_options(base)
    found: list[Case] = []
    out_of_scope: dict[str, int] = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            if not in_scope(group.title, action.dest):
                out_of_scope[group.title] = out_of_scope.get(group.title, 0) + 1
                continue
            option = max(action.option_strings, key=lambda o: (o.startswith("--"), not o.startswith("--disable")))
            if action.dest in NOT_RUN:
                found.append(Case(option, action.dest, group.title, note=NOT_RUN[action.dest]))
                continue
            if set(action.option_strings) & given:
                found.append(Case(option, action.dest, group.title, note="set by the sweep's base command line"))
                continue
            aliases = tuple(o for o in action.option_strings if o != option)
            for values in values_for(action):
                name = " ".join((option, *values)) if not isinstance(values, str) else option
                companions = COMPANIONS.get(name) or companions_for(action.dest, group.title)
                if name in NOT_RUN:
                    found.append(Case(option, action.dest, group.title, values, note=NOT_RUN[name]))
                elif isinstance(values, str):
                    found.append(Case(option, action.dest, group.title, note=values, aliases=aliases))
                else:
                    found.append(Case(option, action.dest, group.title, values, companions, aliases=aliases))
    return found, out_of_scope


def companions_for(dest: str, group: str) -> tuple[str, ...]:
    extra: tuple[str, ...] = ()
    for key, flags in COMPANIONS.items():
        if key.startswith("--"):
            continue  # one case's own entry (cases() looks it up by name)
        if dest == key or (key.endswith("_") and dest.startswith(key)):
            extra = flags
            break
    if group == "checkpointing" and dest not in ("save", "load") and not {"--save", "--load"} & set(extra):
        extra = (*(LOAD if "load" in dest or dest in LOAD_SIDE else SAVE), *extra)
    return extra


def values_for(action: argparse.Action) -> list[tuple[str, ...] | str]:
    """The value tokens of each case of ``action`` (a string: why it is not tried)."""
    if action.nargs == 0:  # store_true / store_false / store_const
        return [()]
    if action.dest in VALUES:
        return [VALUES[action.dest]]
    if action.choices is not None:
        options = [c for c in action.choices if c != action.default]
        options = options[:1] if len(options) > MAX_CHOICES else options
        return [(_text(choice),) for choice in options]
    kind = action.type
    name = action.dest
    if kind in (int, float):
        number = _number(name, action.default, kind)
        count = action.nargs if isinstance(action.nargs, int) else 1
        return [tuple([str(number)] * count)]
    words = name.split("_")
    if "dir" in words or name in ("save", "load", "data_cache_path", "object_storage_cache_path"):
        return [(TMP_DIR,)]
    if {"file", "filename", "path", "filepath"} & set(words):
        return [(TMP_FILE,)]
    if action.default not in (None, ""):
        return [f"takes a {getattr(kind, '__name__', 'string')} value; its default ({action.default!r}) is what runs"]
    return ["takes a value the sweep cannot derive from its type (a name or a file in a format of its own)"]


def _number(name: str, default, kind: type):
    words = set(name.split("_"))
    if words & {"interval", "iters", "iterations", "iter"}:
        return kind(2)
    if default in (None, 0, 0.0) or isinstance(default, list):
        return kind(1) if kind is int else 0.5
    if isinstance(default, bool):
        return kind(1)
    return default + 1 if kind is int else default / 2


def _text(choice) -> str:
    if isinstance(choice, enum.Enum):
        return choice.name
    return str(choice)


def unmatched_entries(parser: argparse.ArgumentParser) -> list[str]:
    """Hand-kept entries that match no dest of the installed parser (stale after a rename)."""
    dests = {action.dest for action in parser._actions}
    stale = [f"VALUES[{key!r}]" for key in VALUES if key not in dests]
    for key in COMPANIONS:
        if key.startswith("--"):
            if key.split()[0] not in parser._option_string_actions:
                stale.append(f"COMPANIONS[{key!r}]")
            continue
        if not any(d == key or (key.endswith("_") and d.startswith(key)) for d in dests):
            stale.append(f"COMPANIONS[{key!r}]")
    stale += [f"LOAD_SIDE {key!r}" for key in LOAD_SIDE if key not in dests]
    stale += [f"NOT_RUN[{key!r}]" for key in NOT_RUN if key not in dests and not key.startswith("--")]
    return stale


def fill(tokens: tuple[str, ...], tmp: str, checkpoint: str) -> list[str]:
    """A run's tokens with the placeholders filled: one fresh directory/file per run under ``tmp``."""
    out = []
    for index, token in enumerate(tokens):
        if token == TMP_DIR:
            token = os.path.join(tmp, f"dir{index}")
        elif token == TMP_FILE:
            token = os.path.join(tmp, f"file{index}")
        elif token == CHECKPOINT:
            token = checkpoint
        out.append(token)
    return out
