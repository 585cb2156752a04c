"""MindSpeed's FSDP2 YAML applied inside megatron's ``TorchFullyShardedDataParallel.__init__``.

Why these targets:

* ``TorchFullyShardedDataParallel.__init__`` is where megatron picks its FSDP units (a walk of
  ``module.modules()`` matching ``sub_modules_to_wrap``), builds its 1-D mesh and calls
  ``fully_shard``; between saving and restoring the parameters' custom attributes (megatron's
  ``tensor_model_parallel`` and friends, which ``fully_shard`` would drop). The wrapper resolves the
  YAML's module entries against the model (a pattern matching nothing is a ConfigError naming the key
  and the pattern, before anything is sharded), wraps the recompute modules' forwards, builds the
  mesh, and hands megatron a ``sub_modules_to_wrap`` that matches exactly the YAML's units (or
  megatron's own, minus the ignored modules). Megatron's own body still runs (the cpu adapter's host
  twin below us on a CPU host; the te-backend's unit filter above us).
* ``torch_fully_sharded_data_parallel.fully_shard`` (the name megatron's module imported from
  torch): during that one ``__init__`` its calls get the YAML's arguments (mesh, mixed precision,
  offload, ``reshard_after_forward``, ignored parameters); YAML units are sharded bottom-up at the
  first call (nested units need it; megatron walks parents first). Outside such a call it is
  torch's, untouched.
* ``utils.get_data_parallel_group_if_dtensor`` (bound by name in ``optimizer.clip_grads``): megatron
  reduces grad norms and zero counts over a DTensor's ``device_mesh.get_group()``, which a 2-D (HSDP)
  mesh refuses; the norm of a ``(Replicate, Shard)`` gradient is the sum over the shard group alone.
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from mindspeed_like.features.fsdp2_config.options import Fsdp2Options, ModuleEntry, load
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.uncaught import message_only

_PLAN: contextvars.ContextVar[_Plan | None] = contextvars.ContextVar("fsdp2_config_plan", default=None)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model the YAML's paths start from: below megatron's ``Float16Module`` (and any wrapper
    holding the model as ``.module``), as MindSpeed's ``unwrap_model``."""
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def _children_text(module: torch.nn.Module) -> str:
    names = [name for name, _ in module.named_children()]
    return f"its children: {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}" if names else "no children"


def resolve(
    root: torch.nn.Module, entries: tuple[ModuleEntry, ...], key: str, options: Fsdp2Options
) -> list[torch.nn.Module]:
    """The modules ``entries`` name in ``root``, in ``root.modules()`` order; an entry matching no
    module, or an index or path that does not exist, is a ConfigError naming the key and the entry."""
    found: dict[int, torch.nn.Module] = {}
    for entry in entries:
        if entry.is_class:
            hits = [m for m in root.modules() if isinstance(m, entry.cls)]
            if not hits:
                raise options.error(key, f"{entry.text!r} matches no module of the model ({type(root).__name__})")
        else:
            hits = [_lookup(root, path, entry, key, options) for path in _paths(root, entry, key, options)]
        found.update((id(m), m) for m in hits)
    return [m for m in root.modules() if id(m) in found]


def _lookup(root: torch.nn.Module, path: str, entry: ModuleEntry, key: str, options: Fsdp2Options) -> torch.nn.Module:
    module = root
    walked: list[str] = []
    for part in path.split("."):
        child = module._modules.get(part) if isinstance(module, torch.nn.Module) else None
        if child is None:
            where = ".".join(walked) or type(root).__name__
            raise options.error(
                key, f"{entry.text!r} matches no module: {where} has no {part!r} ({_children_text(module)})"
            )
        walked.append(part)
        module = child
    return module


def _paths(root: torch.nn.Module, entry: ModuleEntry, key: str, options: Fsdp2Options) -> list[str]:
    if entry.indices is None:
        return [entry.prefix]
    base = _lookup(root, entry.prefix, entry, key, options) if entry.prefix else root
    names = [name for name, _ in base.named_children()]
    if entry.indices == "*":
        if not names:
            raise options.error(key, f"{entry.text!r} matches no module: {entry.prefix or 'the model'} has no children")
        chosen = names
    else:
        missing = [i for i in entry.indices if str(i) not in names]
        if missing:
            raise options.error(
                key,
                f"{entry.text!r}: {entry.prefix or 'the model'} has no {', '.join(map(str, missing))} "
                f"({_children_text(base)})",
            )
        chosen = [str(i) for i in entry.indices]
    return [".".join(p for p in (entry.prefix, name, entry.suffix) if p) for name in chosen]


# ---------------------------------------------------------------------------------------------
# the mesh


def build_mesh(group: Any, options: Fsdp2Options, device_type: str):
    """A 1-D mesh over the data-parallel group (``sharding_size`` absent, 'auto' or the whole group),
    else a 2-D ``(replicate, shard)`` mesh: consecutive ranks of the group shard, groups replicate.

    Every rank creates every subgroup in the same order (``new_group`` is collective over the
    world), so each learns all data-parallel groups first (they differ across TP/PP ranks)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    ranks = dist.get_process_group_ranks(group)
    size = len(ranks)
    options.check_group_size(size, "the data-parallel group (data x context parallel ranks)")
    shard = options.shard_size(size)
    if shard == size:
        return DeviceMesh.from_group(group, device_type)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(ranks))
    rank = dist.get_rank()
    mine: dict[str, Any] = {}
    for ranks_of_group in sorted({tuple(r) for r in everyone}):
        layout = torch.tensor(ranks_of_group).view(len(ranks_of_group) // shard, shard)
        for dim, lines in (("shard", layout.tolist()), ("replicate", layout.t().tolist())):
            for line in lines:
                made = dist.new_group(line)
                if rank in line:
                    mine[dim] = made
    return DeviceMesh.from_group(
        [mine["replicate"], mine["shard"]],
        device_type,
        mesh=torch.tensor(ranks).view(size // shard, shard),
        mesh_dim_names=("replicate", "shard"),
    )


# ---------------------------------------------------------------------------------------------
# recompute


class _Rerun:
    """The forward a checkpoint runs twice: the second run (the recompute in backward) sees
    megatron's RNG tracker states as the first saw them, so dropout inside its model-parallel
    regions draws the same masks (torch's checkpoint restores torch's generators only)."""

    def __init__(self, forward) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        self.forward = forward
        self.tracker = get_cuda_rng_tracker()
        self.states = self.tracker.get_states()
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.forward(*args, **kwargs)
        now = self.tracker.get_states()
        self.tracker.set_states(self.states)
        try:
            return self.forward(*args, **kwargs)
        finally:
            self.tracker.set_states(now)


def checkpoint_forward(module: torch.nn.Module, use_reentrant: bool) -> None:
    """``module``'s forward recomputed in backward (activation checkpointing), the module left in
    place: no checkpoint-wrapper module in the tree, so megatron's attribute reads, state dicts and
    FSDP's hooks around the call see the same module. Reentrant checkpoints take no keyword
    arguments: they travel packed as positional ones."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    @functools.wraps(forward)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        rerun = _Rerun(forward)
        if not use_reentrant:
            return checkpoint(rerun, *args, use_reentrant=False, **kwargs)
        keys = tuple(kwargs)
        count = len(args)

        def packed(*flat: Any) -> Any:
            return rerun(*flat[:count], **dict(zip(keys, flat[count:])))

        return checkpoint(packed, *args, *(kwargs[k] for k in keys), use_reentrant=True)

    module.forward = recomputed


# ---------------------------------------------------------------------------------------------
# the plan of one TorchFullyShardedDataParallel.__init__


@dataclass
class _Plan:
    options: Fsdp2Options
    mesh: Any
    units: list[torch.nn.Module] | None  # the YAML's sub_modules_to_wrap; None: megatron's choice
    ignored: set[int]  # ids of ignored modules and everything under them
    ignored_params: set[torch.nn.Parameter]
    sharded: set[int] = field(default_factory=set)
    started: bool = False

    def arguments(self, kwargs: dict) -> dict:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        options = self.options
        kwargs = dict(kwargs, mesh=self.mesh)
        if options.reshard_after_forward is not None:
            kwargs["reshard_after_forward"] = options.reshard_after_forward
        if {"param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"} & options.given:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=options.param_dtype,
                reduce_dtype=options.reduce_dtype,
                output_dtype=options.output_dtype,
                cast_forward_inputs=options.cast_forward_inputs,
            )
        if options.offload_to_cpu:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=options.pin_memory)
        if self.ignored_params:
            kwargs["ignored_params"] = set(self.ignored_params)
        return kwargs


def _matcher(plan: _Plan, megatrons: Any, config: Any) -> type:
    """What megatron's ``isinstance(sub_module, entry)`` walk should match: the YAML's units, or
    megatron's own entries minus the ignored modules. Megatron drops ``ColumnParallelLinear`` from
    its entries for the local spec (whose layers' linears are ``ColumnParallelLinear`` and sit inside
    an already-sharded layer) by comparing entries: it cannot see inside this matcher, so the same
    rule is applied here."""
    from megatron.core import tensor_parallel

    entries = tuple(megatrons or ())
    if getattr(config, "transformer_impl", None) == "local":
        entries = tuple(e for e in entries if e != tensor_parallel.ColumnParallelLinear)

    class _Units(type):
        def __instancecheck__(cls, instance: Any) -> bool:
            if id(instance) in plan.ignored:
                return False
            if plan.units is not None:
                return any(instance is unit for unit in plan.units)
            return any(isinstance(instance, entry) for entry in entries)

        def __subclasscheck__(cls, subclass: type) -> bool:
            return False

    return _Units("Fsdp2ConfigUnits", (), {})


def _checked_modules(
    root: torch.nn.Module, options: Fsdp2Options
) -> tuple[list[torch.nn.Module] | None, list[torch.nn.Module], list[torch.nn.Module]]:
    """The YAML's units (None: megatron's), ignored and recompute modules in ``root``; an entry that
    matches nothing, or an ignored module with trainable parameters, is a ConfigError naming the key."""
    units = (
        resolve(root, options.sub_modules_to_wrap, "sub_modules_to_wrap", options)
        if options.sub_modules_to_wrap
        else None
    )
    ignored = resolve(root, options.ignored_modules, "ignored_modules", options)
    recompute = resolve(root, options.recompute_modules, "recompute_modules", options)
    for module in ignored:
        trainable = [name for name, p in module.named_parameters() if p.requires_grad]
        if trainable:
            raise options.error(
                "ignored_modules",
                f"{type(module).__name__} has trainable parameters ({', '.join(trainable[:3])}): FSDP would "
                "neither shard them nor reduce their gradients, so each rank would train its own copy; "
                "freeze them (requires_grad=False) or shard the module",
            )
    return units, ignored, recompute


@dataclass(frozen=True)
class ShardWithConfig:
    """WRAP of ``TorchFullyShardedDataParallel.__init__``: the YAML's plan for this one call (the
    file is read here, once per wrapper built: what it says when the model is wrapped is applied)."""

    path: str
    device_type: str

    def __call__(self, wrapped, instance, args, kwargs):
        from megatron.core import parallel_state
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_device_from_mesh

        options = load(self.path)
        call = Call(wrapped, args, kwargs)
        group = call.get("process_group") or parallel_state.get_data_parallel_group(with_context_parallel=True)
        try:
            units, ignored, recompute = _checked_modules(unwrap(call["module"]), options)
            mesh = build_mesh(group, options, self.device_type)
        except ConfigError as error:
            # the user's YAML, not a bug: its message, not megatron's 60-frame stack on every rank
            raise message_only(error) from None
        ignored_ids = {id(m) for module in ignored for m in module.modules()}
        if units is not None:
            units = [unit for unit in units if id(unit) not in ignored_ids]  # a unit inside an ignored module
        ignored_params = {p for module in ignored for p in module.parameters()}
        device = _get_device_from_mesh(mesh)
        for module in ignored:
            module.to(device)  # FSDP moves what it shards only
        for module in recompute:
            checkpoint_forward(module, options.use_reentrant)
        plan = _Plan(options, mesh, units, ignored_ids, ignored_params)
        token = _PLAN.set(plan)
        try:
            result = call(sub_modules_to_wrap={_matcher(plan, call.get("sub_modules_to_wrap"), call["config"])})
        finally:
            _PLAN.reset(token)
        instance.device_mesh = mesh
        top = instance.module
        sharded = [m for m in top.modules() if m is not top and isinstance(m, FSDPModule)]
        _prefetch(sharded, options)
        return result


def _prefetch(units: list, options: Fsdp2Options) -> None:
    """Explicit prefetch: each unit all-gathers the next ``num_to_forward_prefetch`` units in forward
    (and the previous ``num_to_backward_prefetch`` in backward), in the model's order."""
    forward, backward = options.num_to_forward_prefetch, options.num_to_backward_prefetch
    for i, unit in enumerate(units):
        if forward and units[i + 1 : i + 1 + forward]:
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + forward])
        earlier = units[max(0, i - backward) : i][::-1]
        if backward and earlier:
            unit.set_modules_to_backward_prefetch(earlier)


def shard_as_planned(wrapped, instance, args, kwargs):
    """WRAP of megatron's ``fully_shard`` name: the plan's arguments while a plan is active."""
    plan = _PLAN.get()
    if plan is None:
        return wrapped(*args, **kwargs)
    call = Call(wrapped, args, kwargs)
    module = call["module"]
    rest = {k: v for k, v in call.arguments.items() if k != "module"}
    if plan.units is not None and not plan.started:
        plan.started = True
        for unit in _post_order(plan.units):  # bottom-up: a unit inside another is sharded first
            wrapped(unit, **plan.arguments(rest))
            plan.sharded.add(id(unit))
    if id(module) in plan.sharded:
        return module
    plan.sharded.add(id(module))
    return wrapped(module, **plan.arguments(rest))


def _post_order(units: list[torch.nn.Module]) -> list[torch.nn.Module]:
    chosen = {id(u) for u in units}
    inside = {id(u): {id(m) for m in u.modules() if m is not u and id(m) in chosen} for u in units}
    ordered: list[torch.nn.Module] = []
    placed: set[int] = set()
    while len(ordered) < len(units):
        for unit in units:
            if id(unit) not in placed and inside[id(unit)] <= placed:
                ordered.append(unit)
                placed.add(id(unit))
    return ordered


def shard_group_of_hsdp(wrapped, instance, args, kwargs):
    """WRAP of ``get_data_parallel_group_if_dtensor``: a 2-D (replicate, shard) DTensor's norm is
    reduced over its shard group (its replicas hold the same values)."""
    call = Call(wrapped, args, kwargs)
    tensor = call["tensor"]
    try:
        from torch.distributed.tensor import DTensor, Replicate
    except ImportError:  # pragma: no cover - torch without DTensor has no FSDP2 either
        return wrapped(*args, **kwargs)
    if (
        not isinstance(tensor, DTensor)
        or tensor.device_mesh.ndim != 2
        or not isinstance(tensor.placements[0], Replicate)
    ):
        return wrapped(*args, **kwargs)
    group = tensor.device_mesh.get_group(1)
    given = call.get("data_parallel_group")
    # megatron's own check (an assert there): every gradient of one norm on one group
    assert given is None or given == group, "gradients of one grad norm on different FSDP2 meshes"
    return group
