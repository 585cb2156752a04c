"""MindSpeed's FSDP2 YAML (``--fsdp2-config-path``), read and checked before anything is built.

The keys and their meaning are MindSpeed's (``docs/features/fsdp2.md`` of MindSpeed / MindSpeed-MM and
its ``Fsdp2Config``): ``sharding_size``, ``sub_modules_to_wrap``, ``ignored_modules``,
``recompute_modules``, ``use_reentrant``, ``reshard_after_forward``, ``param_dtype``, ``reduce_dtype``,
``output_dtype``, ``cast_forward_inputs``, ``offload_to_cpu``, ``pin_memory``,
``num_to_forward_prefetch``, ``num_to_backward_prefetch``. Everything that can be wrong without the
model is found here, each error naming the file and the key: an unknown key (with the nearest known
one), a value of the wrong type, a dtype we do not take, a module pattern that is not MindSpeed's
grammar. Whether a pattern matches a module needs the model: that is checked when megatron's wrapper
is built (``sharding.py``), still before any forward.

Module entries are MindSpeed's two spellings:

* a dotted path from the model (below megatron's ``Float16Module``), with at most one pattern in
  braces: ``decoder.layers.{*}`` (every child of ``decoder.layers``), ``decoder.layers.{0-3,6}``
  (those indices), ``output_layer``;
* a class as ``package.module.Class`` (MindSpeed's earlier format): every instance of it.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindspeed_like.toolkit.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
"""The dtypes the keys take: MindSpeed's spellings (``bf16``, ``fp32``) and torch's names."""

REFUSED_DTYPES = {
    "fp16": "megatron refuses fp16 under --use-torch-fsdp2 ('--use-torch-fsdp2 not supported with fp16 yet': "
    "fp16 needs its loss scaler, which this path does not run); use bf16",
    "float16": "megatron refuses fp16 under --use-torch-fsdp2 (no loss scaling on this path); use bf16",
}

MODULE_KEYS = ("sub_modules_to_wrap", "ignored_modules", "recompute_modules")
DTYPE_KEYS = ("param_dtype", "reduce_dtype", "output_dtype")

KEYS: dict[str, str] = {
    "sharding_size": "int or 'auto': shard in groups of this many data-parallel ranks, replicate across groups (HSDP)",
    "sub_modules_to_wrap": "module paths/patterns or classes: the FSDP units (default: megatron's choice)",
    "ignored_modules": "module paths/patterns or classes FSDP leaves alone (frozen modules only)",
    "recompute_modules": "module paths/patterns or classes whose forward is recomputed in backward",
    "use_reentrant": "bool: reentrant activation checkpointing for recompute_modules (MindSpeed's default True)",
    "reshard_after_forward": "bool, or an int dividing sharding_size: free (or reshard smaller) after forward",
    "param_dtype": "bf16/fp32: the dtype the units compute in (MixedPrecisionPolicy.param_dtype)",
    "reduce_dtype": "bf16/fp32: the dtype gradients are reduced in",
    "output_dtype": "bf16/fp32: the dtype of each unit's forward output",
    "cast_forward_inputs": "bool: cast each unit's floating inputs to param_dtype",
    "offload_to_cpu": "bool: keep sharded parameters, gradients and optimizer states in host memory",
    "pin_memory": "bool: pinned host memory for offload_to_cpu (an accelerator's; ignored without offload)",
    "num_to_forward_prefetch": "int >= 0: how many following units each unit all-gathers ahead in forward",
    "num_to_backward_prefetch": "int >= 0: how many preceding units each unit all-gathers ahead in backward",
}
"""Every key taken, with what it means here (the docs' table is checked against it)."""

NOT_TAKEN = {
    "align_fsdp_param_groups": "MindSpeed-MM's native FSDP2 trainer only",
    "expert_parallel_size": "MindSpeed-MM's native FSDP2 trainer only (megatron refuses EP under --use-torch-fsdp2)",
    "reshard_local_experts": "MindSpeed-MM's native FSDP2 trainer only",
    "moe_modules": "MindSpeed-MM's native FSDP2 trainer only",
}
"""Keys of MindSpeed-MM's own FSDP2 trainer, which megatron's path has no counterpart for."""

_PATH_SEGMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+")
_RANGE_ITEM = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


@dataclass(frozen=True)
class ModuleEntry:
    """One entry of a module key: a path (``prefix.{indices}.suffix``) or a class.

    ``indices``: None (no pattern), ``"*"`` (every child of ``prefix``) or a tuple of ints."""

    text: str
    prefix: str = ""
    indices: tuple[int, ...] | str | None = None
    suffix: str = ""
    cls: type | None = None

    @property
    def is_class(self) -> bool:
        return self.cls is not None


@dataclass(frozen=True)
class Fsdp2Options:
    """The YAML's values, typed; a key absent from the file is None (megatron's or torch's default)."""

    path: str
    given: frozenset[str]
    sharding_size: int | str | None = None
    sub_modules_to_wrap: tuple[ModuleEntry, ...] | None = None
    ignored_modules: tuple[ModuleEntry, ...] = ()
    recompute_modules: tuple[ModuleEntry, ...] = ()
    use_reentrant: bool = True
    reshard_after_forward: bool | int | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    offload_to_cpu: bool = False
    pin_memory: bool = True
    num_to_forward_prefetch: int = 0
    num_to_backward_prefetch: int = 0

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"--fsdp2-config-path {self.path}: {key}: {message}")

    def shard_size(self, group_size: int) -> int:
        """The shard group's size in a data-parallel group of ``group_size`` ranks."""
        return group_size if self.sharding_size in (None, "auto") else int(self.sharding_size)

    def check_group_size(self, group_size: int, what: str) -> None:
        """``sharding_size`` (and an int ``reshard_after_forward``) against the data-parallel size."""
        shard = self.shard_size(group_size)
        if shard > group_size or group_size % shard:
            raise self.error(
                "sharding_size",
                f"{shard} does not divide {what} ({group_size} ranks): HSDP shards in groups of sharding_size and "
                f"replicates across them; take a divisor of {group_size} or 'auto'",
            )
        reshard = self.reshard_after_forward
        if (
            isinstance(reshard, int)
            and not isinstance(reshard, bool)
            and (reshard <= 1 or reshard >= shard or shard % reshard)
        ):
            raise self.error(
                "reshard_after_forward",
                f"{reshard} must divide the shard group's size {shard} and lie strictly between 1 and it (torch's "
                "fully_shard: the world size to reshard to after forward); use true or false otherwise",
            )


def _suggest(name: str, candidates: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def _entry(raw: Any, key: str, fail) -> ModuleEntry:
    if not isinstance(raw, str) or not raw.strip():
        raise fail(key, f"entry {raw!r} is not a module path: write e.g. 'decoder.layers.{{*}}' or 'output_layer'")
    text = raw.strip()
    opens, closes = text.count("{"), text.count("}")
    if opens > 1 or closes > 1:
        raise fail(key, f"pattern {text!r} has more than one pair of braces; one pattern per entry")
    if opens != closes or (opens and text.index("{") > text.index("}")):
        raise fail(key, f"pattern {text!r} has unbalanced braces")
    if not opens:
        if not all(_PATH_SEGMENT.fullmatch(part) for part in text.split(".")):
            raise fail(key, f"entry {text!r} is not a dotted module path (segments: names or indices)")
        cls = _class_of(text)
        return ModuleEntry(text, prefix=text, cls=cls)
    head, rest = text.split("{", 1)
    body, tail = rest.split("}", 1)
    if head and not head.endswith("."):
        raise fail(key, f"pattern {text!r}: the braces must be a whole path segment ('layers.{{0-3}}')")
    if tail and not tail.startswith("."):
        raise fail(key, f"pattern {text!r}: the braces must be a whole path segment ('layers.{{0-3}}.mlp')")
    prefix, suffix = head.rstrip("."), tail.lstrip(".")
    for part in [p for p in (prefix, suffix) if p]:
        if not all(_PATH_SEGMENT.fullmatch(segment) for segment in part.split(".")):
            raise fail(key, f"pattern {text!r}: {part!r} is not a dotted module path")
    if body.strip() == "*":
        return ModuleEntry(text, prefix=prefix, indices="*", suffix=suffix)
    indices: set[int] = set()
    for item in body.split(","):
        match = _RANGE_ITEM.fullmatch(item)
        if not match:
            raise fail(key, f"pattern {text!r}: {{{body}}} is not '*' nor indices and ranges such as {{0-20,22,25-30}}")
        start, end = int(match[1]), int(match[2] if match[2] is not None else match[1])
        if end < start:
            raise fail(key, f"pattern {text!r}: range {start}-{end} runs backwards")
        indices.update(range(start, end + 1))
    return ModuleEntry(text, prefix=prefix, indices=tuple(sorted(indices)), suffix=suffix)


def _class_of(text: str) -> type | None:
    """``package.module.Class`` as a torch module class (MindSpeed's earlier spelling), else None:
    a path such as ``decoder.layers.0`` names no importable module and stays a path."""
    module_name, _, name = text.rpartition(".")
    if not module_name or not name[:1].isupper():
        return None
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    found = getattr(module, name, None)
    return found if isinstance(found, type) and issubclass(found, torch.nn.Module) else None


def _bool(value: Any, key: str, fail) -> bool:
    if not isinstance(value, bool):
        raise fail(key, f"{value!r} is not true or false")
    return value


def _dtype(value: Any, key: str, fail) -> torch.dtype | None:
    if value is None:
        return None
    text = str(value).strip().lower().removeprefix("torch.")
    if text in REFUSED_DTYPES:
        raise fail(key, f"{value!r}: {REFUSED_DTYPES[text]}")
    if text not in DTYPES:
        raise fail(key, f"{value!r} is not a dtype taken here: one of bf16, fp32 (or bfloat16, float32)")
    return DTYPES[text]


def _nonnegative_int(value: Any, key: str, fail) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise fail(key, f"{value!r} is not an int >= 0")
    return value


def from_mapping(values: Mapping[str, Any], path: str = "<configure>") -> Fsdp2Options:
    """Typed options from the YAML's mapping; every mistake a ConfigError naming ``path`` and the key."""

    def fail(key: str, message: str) -> ConfigError:
        return ConfigError(f"--fsdp2-config-path {path}: {key}: {message}")

    if not isinstance(values, Mapping):
        raise ConfigError(
            f"--fsdp2-config-path {path}: the file must hold a mapping of keys, got {type(values).__name__}"
        )
    for key in values:
        if key in NOT_TAKEN:
            raise fail(key, f"not taken on megatron's --use-torch-fsdp2 path ({NOT_TAKEN[key]}); remove it")
        if key not in KEYS:
            raise fail(key, f"not a key of MindSpeed's FSDP2 YAML.{_suggest(str(key), KEYS)} Keys: {', '.join(KEYS)}")
    fields: dict[str, Any] = {}
    size = values.get("sharding_size")
    if size is not None:
        if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise fail("sharding_size", f"{size!r} is not 'auto' nor an int >= 1")
        fields["sharding_size"] = size
    for key in MODULE_KEYS:
        entries = values.get(key)
        if entries is None:
            continue
        if isinstance(entries, str) or not isinstance(entries, list | tuple):
            raise fail(key, f"{entries!r} is not a list of module paths")
        if not entries:
            raise fail(key, "an empty list; remove the key for the default")
        fields[key] = tuple(_entry(raw, key, fail) for raw in entries)
    for key in ("use_reentrant", "cast_forward_inputs", "offload_to_cpu", "pin_memory"):
        if key in values:
            fields[key] = _bool(values[key], key, fail)
    if "reshard_after_forward" in values:
        reshard = values["reshard_after_forward"]
        if not isinstance(reshard, bool) and (not isinstance(reshard, int) or reshard < 2):
            raise fail("reshard_after_forward", f"{reshard!r} is not true, false nor an int >= 2")
        fields["reshard_after_forward"] = reshard
    for key in DTYPE_KEYS:
        if key in values:
            fields[key] = _dtype(values[key], key, fail)
    for key in ("num_to_forward_prefetch", "num_to_backward_prefetch"):
        if key in values:
            fields[key] = _nonnegative_int(values[key], key, fail)
    options = Fsdp2Options(path=path, given=frozenset(values), **fields)
    if isinstance(size, int) and not isinstance(size, bool):
        reshard = options.reshard_after_forward
        if isinstance(reshard, int) and not isinstance(reshard, bool):
            options.check_group_size(size, "its own sharding_size")
    overlap = _overlap(options)
    if overlap:
        raise fail("ignored_modules", f"{overlap!r} is also in sub_modules_to_wrap: a module is sharded or ignored")
    return options


def _overlap(options: Fsdp2Options) -> str | None:
    ignored = {e.text for e in options.ignored_modules}
    return next((e.text for e in options.sub_modules_to_wrap or () if e.text in ignored), None)


def load(path: str) -> Fsdp2Options:
    """The options of the YAML file at ``path``."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--fsdp2-config-path {path}: no such file")
    try:
        values = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"--fsdp2-config-path {path}: not valid YAML ({error})") from None
    return from_mapping(values if values is not None else {}, path)
