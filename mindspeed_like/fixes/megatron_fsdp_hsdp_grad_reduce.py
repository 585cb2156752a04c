"""Fix: Megatron-FSDP's hybrid sharding (HSDP) never reduces gradients across the outer data-parallel group.

With ``--use-megatron-fsdp --num-distributed-optimizer-instances N`` (HSDP: sharded within a group of
DP/N ranks, replicated across the N groups), the gradient all-reduce across the outer group runs only
in ``MegatronFSDP``'s backward hooks, and only when ``is_last_microbatch`` (or ``model_auto_sync``) is
true. ``is_last_microbatch`` is set by ``MegatronFSDP.no_sync()`` alone (False inside, True on exit)
and read with ``getattr(self, "is_last_microbatch", False)``: until a ``no_sync()`` block has ended
once, every step is treated as a middle microbatch. Megatron-LM hands ``no_sync`` to its schedules
only with ``--overlap-grad-reduce`` (training.py: ``config.no_sync_func``), and megatron-core API
loops that call ``finish_grad_sync`` / ``finalize_model_grads`` themselves never do. There each of the
N replicas steps with the gradient of its own DP/N ranks' data, silently, on every device (the
logic is Python, nothing of the device): measured on 4 gloo ranks, ``optim_grads_params`` with 2
instances, Megatron-LM's pretrain_gpt.py logs grad norm 0.798 at iteration 1 against the
distributed optimizer's 1.212 with the same instances, and lm loss 5.538796 / 5.490762 at
iterations 2-3 against 5.517218 / 5.445676.

megatron's own DDP starts every bucket group with ``is_last_microbatch = True`` (outside ``no_sync``
each backward is the last microbatch), which is what ``no_sync()`` restores on exit here too. The fix
sets that starting state after ``MegatronFSDP`` is built, where megatron left it unset and the
outer reduction happens in the hooks: HSDP with ``overlap_grad_reduce`` (which Megatron-FSDP forces
for ``optim_grads`` and ``optim_grads_params``). Then the run equals the distributed optimizer's with
the same instances bit for bit (``tests/fsdp/test_fsdp_parallel_layouts.py``). Without overlap
(``optim`` without ``--overlap-grad-reduce``) gradients are reduced by ``start_grad_sync`` after
the backward, within the inner group only, and setting the flag would reduce them twice: refused
where Megatron-LM's arguments ask for it (``refuse_on_the_command_line``) and, for megatron-core API
users, where no argument validation runs, at ``MegatronFSDP``'s construction before anything is built
(``refuse_hybrid_without_overlap``; the tiny GPT of tests/fsdp on 4 gloo ranks in 2 instances, unrefused:
5.549927 / 5.576773 at steps 2-3 against the distributed optimizer's 5.534665 / 5.571401, on 0.16.1 and
0.19.2 alike).

Starting as the last microbatch is right for one microbatch a step. With more, the schedule must mark the
others with ``no_sync``, and Megatron-LM hands it over only with ``--overlap-grad-reduce`` on its command line,
while Megatron-FSDP turns the overlap on by itself for ``optim_grads`` / ``optim_grads_params``: every backward
was then the last and the outer all-reduce ran at each one, all-reducing again what the earlier microbatches
had already all-reduced (Megatron-LM on 4 ranks, DP 4 in 2 instances, micro-batch 1, two microbatches a step:
grad norm 1.554 against the distributed optimizer's 1.073). The same hook sets ``--overlap-grad-reduce``
there, as Megatron-FSDP does (logged); then the distributed optimizer's digits (1.073 / 0.948 / 1.277).

The same unset flag stops the inner reduction of the strategies that reduce on the last microbatch only,
``no_shard`` and ``optim``, with ``overlap_grad_reduce`` and one data-parallel group: a megatron-core API loop
that calls ``finish_grad_sync`` without ``no_sync`` (one microbatch a step) never reduced their gradients
at all, each rank stepping on its own (measured with tests/fsdp's tiny GPT on 2 gloo ranks, ``optim``:
5.576083 / 5.567298 at steps 2-3 against the distributed optimizer's 5.577414 / 5.553706). The fix starts
those as last microbatch too. Megatron-LM's schedules enter ``no_sync`` whenever it overlaps, so its runs
were not affected by this part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.argument_changes import say_adjusted
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.errors import ConfigError

NAME = "fix-megatron-fsdp-hsdp-grad-reduce"
VERSIONS = ">=0.14"
TARGET = "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp.MegatronFSDP.__init__"
DELAYED = ("no_shard", "optim")
"""Megatron-FSDP's strategies whose hooks reduce on the last microbatch only (``optim_grads`` and
``optim_grads_params`` reduce after every backward: megatron_fsdp.py's ``grad_reduce_every_bprop``)."""

NO_OVERLAP = (
    "--num-distributed-optimizer-instances {instances} with --use-megatron-fsdp "
    "--data-parallel-sharding-strategy {strategy}: without --overlap-grad-reduce Megatron-FSDP reduces "
    "gradients within each of the {instances} sharding groups only, never across them (its outer "
    "data-parallel all-reduce runs in the overlapped path alone), so the replicas train apart. Add "
    "--overlap-grad-reduce, or use --data-parallel-sharding-strategy optim_grads / optim_grads_params."
)


NO_OVERLAP_API = (
    "Megatron-FSDP with hybrid sharding ({instances} replicas: DistributedDataParallelConfig."
    "num_distributed_optimizer_instances, or fully_shard's outer data-parallel mesh dimension) and "
    "data_parallel_sharding_strategy={strategy!r} with overlap_grad_reduce=False: finish_grad_sync then reduces "
    "gradients within each sharding group only, never across the replicas (Megatron-FSDP's outer data-parallel "
    "all-reduce runs in the overlapped path alone), so they would train apart silently. Set "
    "overlap_grad_reduce=True (DistributedDataParallelConfig, or fully_shard's argument), or use "
    "data_parallel_sharding_strategy='optim_grads' / 'optim_grads_params' (which overlap by themselves)."
)


def refuse_hybrid_without_overlap(dist_index, ddp_config) -> None:
    """``MegatronFSDP``'s construction (the megatron-core API path, where no argument validation runs):
    hybrid sharding whose reduction never crosses the instances refused. Only ``no_shard`` / ``optim``
    reach it: megatron sets ``overlap_grad_reduce`` itself for the other strategies, and a missing
    ``ddp_config`` is megatron's default (``optim_grads_params``, overlapped)."""
    if ddp_config is None or not getattr(dist_index, "use_hybrid_fsdp", False):
        return
    strategy = ddp_config.data_parallel_sharding_strategy
    if strategy in DELAYED and not ddp_config.overlap_grad_reduce:
        outer = getattr(dist_index, "outer_fsdp_group", None)
        instances = outer.size() if outer is not None else ddp_config.num_distributed_optimizer_instances
        raise ConfigError(NO_OVERLAP_API.format(instances=instances, strategy=strategy))


def start_as_last_microbatch(wrapped, instance, args, kwargs):
    # MegatronFSDP.__init__(module, dist_index, ddp_config, ...): refused before anything is built
    call = Call(wrapped, args, kwargs)
    refuse_hybrid_without_overlap(call["dist_index"], call["ddp_config"])
    result = wrapped(*args, **kwargs)
    hybrid = getattr(getattr(instance, "dist_index", None), "use_hybrid_fsdp", False)
    delayed = instance.ddp_config.data_parallel_sharding_strategy in DELAYED
    if (hybrid or delayed) and instance.ddp_config.overlap_grad_reduce and not hasattr(instance, "is_last_microbatch"):
        instance.is_last_microbatch = True
    return result


@contextlib.contextmanager
def refuse_on_the_command_line(args) -> Iterator[None]:
    """validate_args hook: HSDP without its outer reduction refused (``no_shard`` / ``optim`` without
    ``--overlap-grad-reduce``); for the strategies where Megatron-FSDP forces the overlap itself
    (``optim_grads`` / ``optim_grads_params``), ``--overlap-grad-reduce`` set on the command line too, so that
    Megatron-LM hands its schedules ``no_sync`` and the outer all-reduce runs on the last microbatch only
    (without it every backward was the last: the earlier microbatches' gradients were all-reduced again at
    each later one, Megatron-LM at 4 ranks, two microbatches a step: grad norm 1.554 against 1.073)."""
    instances = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    strategy = getattr(args, "data_parallel_sharding_strategy", None)
    hybrid = getattr(args, "use_megatron_fsdp", False) and instances > 1
    if hybrid and not getattr(args, "overlap_grad_reduce", False):
        if strategy in DELAYED:
            raise ConfigError(NO_OVERLAP.format(instances=instances, strategy=strategy))
        args.overlap_grad_reduce = True
        change = (
            f"args.overlap_grad_reduce: False -> True (Megatron-FSDP {strategy} overlaps anyway; with "
            f"--num-distributed-optimizer-instances {instances} the schedule's no_sync marks the last microbatch, "
            "where the outer all-reduce runs)"
        )
        say_adjusted(NAME, args, [change])
    yield


PATCHES = [
    Patch(
        TARGET,
        Kind.WRAP,
        start_as_last_microbatch,
        versions=VERSIONS,
        after=("cpu-adapter",),
        why="HSDP's outer gradient all-reduce, and no_shard / optim's overlapped reduction, wait for "
        "is_last_microbatch, unset outside no_sync",
    )
]

FEATURE = Feature(
    name=NAME,
    summary="--use-megatron-fsdp with --num-distributed-optimizer-instances > 1 reduces gradients across the "
    "outer data-parallel group without --overlap-grad-reduce too (megatron skipped it: the replicas trained apart)",
    patches=PATCHES,
    enabled=always_on,
    validate_args_hook=refuse_on_the_command_line,
    backend="any",
    kind="fix",
)
