"""reuse-fp32-param for megatron's ``DistributedOptimizer``: where each rank's master shard lives.

megatron keeps, per rank, the bf16 param buffer of DDP (2 B/param, all params, all-gathered
after each step) plus fp32 master clones of the rank's 1/DP shard (4 B/param/DP). Here the
master shard is replaced by an int16 residual shard (2 B/param/DP) beside the bf16 buffer: the
master's high half *is* the rank's own bf16 shard already in the param buffer. Saving: exactly
2 B/param/DP, with no full-size temporary:

- **between steps** (layout ``split``) every master tensor the optimizer holds is a
  zero-stride fp32 placeholder of the right shape (no memory; megatron assigns ``.grad`` to it).
- **during the step** (layout ``scratch``) the exact masters of a bucket are built in place
  *inside that bucket's bf16 param buffer*: the other ranks' regions are dead until the
  all-gather that follows the step overwrites them, and the ``S`` fp32 masters of a shard
  (``4 S`` bytes) fit in the bucket's ``2 * DP * S`` bytes for ``DP >= 2``. Rank ``r`` puts them
  at its own shard (``r < DP - 1``, built in descending chunks) or one shard lower (the last
  rank, ascending chunks): in that order a chunk's writes only land on bf16 values already
  read, so the build needs one chunk of workspace. After the step the masters are split back
  (the reverse order), the own bf16 shard is the rounded master, and megatron's all-gather runs.
- **checkpoint methods** (layout ``materialized``) get real fp32 master tensors decoded from
  bf16 + residual (megatron's own memory for them, until the next step splits them again), so
  every checkpoint format megatron has reads and writes plain fp32 masters.

Ties (``kernels/bf16_ties.py``) are kept per bucket shard, indexed by the element's position in
the shard: an index table on the host, a bitmask (``ceil(S / 8)`` bytes) on CUDA, where every
move above is then free of host syncs (chunks of ``kernels/bf16_residual.chunk_for``: 2**22
elements on CUDA; a chunk whose masters overlap the bf16 values it reads is staged through one
chunk-sized copy, which keeps the read-before-write order above).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mindspeed_like.kernels import bf16_residual as kernel


@dataclass
class BucketShard:
    """One bucket's own shard: bf16 in ``param16[own:own+S]``, residuals, side table."""

    param16: torch.Tensor  # the bucket's bf16 param buffer viewed as int16
    own: int  # start of this rank's shard in param16
    size: int  # S
    scratch: int  # int16 offset of the fp32 masters during the step
    descending: bool  # build order (see module docstring)
    residual: torch.Tensor
    side: kernel.Ties


@dataclass
class Entry:
    main: torch.Tensor  # the optimizer's master tensor (1-D shard)
    bucket: int
    offset: int  # index of its first element within the bucket's shard


@dataclass
class DistState:
    buckets: list[BucketShard] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    layout: str = "split"
    chunk: int = kernel.DEFAULT_CHUNK

    def extra_bytes(self) -> int:
        """Residual shards and tie records (held outside megatron's param buffer)."""
        return sum(b.residual.untyped_storage().nbytes() + b.side.nbytes() for b in self.buckets)

    # -- layouts

    def to_fp32(self) -> None:
        """Masters usable by the inner optimizer: scratch layout (or keep materialized ones)."""
        if self.layout != "split":
            return
        for bucket in self.buckets:
            _build_scratch(bucket, self.chunk)
        for entry in self.entries:
            bucket = self.buckets[entry.bucket]
            masters = bucket.param16[bucket.scratch : bucket.scratch + 2 * bucket.size].view(torch.float32)
            entry.main.data = masters[entry.offset : entry.offset + entry.main.numel()]
        self.layout = "scratch"

    def to_split(self) -> None:
        if self.layout == "scratch":
            for bucket in self.buckets:
                _split_scratch(bucket, self.chunk)
        elif self.layout == "materialized":
            for entry in self.entries:
                bucket = self.buckets[entry.bucket]
                lo, hi = entry.offset, entry.offset + entry.main.numel()
                weights = bucket.param16[bucket.own + lo : bucket.own + hi]
                bucket.side.encode(entry.main.data.view(-1), weights, bucket.residual[lo:hi], lo)
            for bucket in self.buckets:
                bucket.side.commit()
        else:
            return
        for entry in self.entries:
            entry.main.data = _placeholder(entry.main)
        self.layout = "split"

    def materialize(self) -> None:
        """Real fp32 master tensors (for checkpoint methods) until the next step."""
        if self.layout != "split":
            return
        for entry in self.entries:
            bucket = self.buckets[entry.bucket]
            lo, hi = entry.offset, entry.offset + entry.main.numel()
            master = torch.empty(hi - lo, dtype=torch.float32, device=bucket.residual.device)
            bucket.side.decode(bucket.param16[bucket.own + lo : bucket.own + hi], bucket.residual[lo:hi], lo, master)
            entry.main.data = master
        self.layout = "materialized"


def _placeholder(main: torch.Tensor) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=main.device).expand(main.shape)


def _chunks(size: int, chunk: int, descending: bool) -> list[tuple[int, int]]:
    spans = [(s, min(size, s + chunk)) for s in range(0, size, chunk)]
    return spans[::-1] if descending else spans


def _build_scratch(bucket: BucketShard, chunk: int) -> None:
    p16, own, base = bucket.param16, bucket.own, bucket.scratch
    for i0, i1 in _chunks(bucket.size, chunk, bucket.descending):
        masters = p16[base + 2 * i0 : base + 2 * i1].view(torch.float32)
        bucket.side.decode(p16[own + i0 : own + i1], bucket.residual[i0:i1], i0, masters)


def _split_scratch(bucket: BucketShard, chunk: int) -> None:
    p16, own, base = bucket.param16, bucket.own, bucket.scratch
    for i0, i1 in _chunks(bucket.size, chunk, not bucket.descending):
        master = p16[base + 2 * i0 : base + 2 * i1].view(torch.float32)
        bucket.side.encode(master, p16[own + i0 : own + i1], bucket.residual[i0:i1], i0)
    bucket.side.commit()


def unsupported_reason(opt) -> str | None:
    """Why this DistributedOptimizer cannot use the shared layout (None: it can)."""
    import torch.distributed as dist

    ddp = opt.ddp_config
    if getattr(ddp, "use_megatron_fsdp", False) or getattr(ddp, "use_custom_fsdp", False):
        return "megatron FSDP (its masters are Megatron-FSDP's buffers; megatron-fsdp-lean-state shrinks them)"
    if getattr(opt.config, "use_precision_aware_optimizer", False):
        return "precision-aware optimizer"
    if getattr(ddp, "num_distributed_optimizer_instances", 1) != 1:
        return "several distributed-optimizer instances"
    if any(getattr(b, "param_data", None) is None for b in opt.buffers):
        return "no bf16 param buffer"
    if dist.get_world_size(opt.data_parallel_group) < 2:
        return "DP=1 (no room for the masters in the param buffer; use the Float16 optimizer)"
    return None


def build(opt) -> DistState | str:
    """Move every bf16 master shard of ``opt`` into the residual layout; a reason string if not possible."""
    import torch.distributed as dist

    reason = unsupported_reason(opt)
    if reason is not None:
        return reason
    dp = dist.get_world_size(opt.data_parallel_group)
    rank = dist.get_rank(opt.data_parallel_group)
    state = DistState()
    if opt.buffers:
        state.chunk = kernel.chunk_for(opt.buffers[0].buckets[0].param_data)
    index: dict[tuple[int, int], int] = {}
    pairs = [
        (model, main)
        for model_group, main_group in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups)
        for model, main in zip(model_group, main_group)
    ]
    for model, main in pairs:
        if model.dtype != torch.bfloat16 or main is None:
            return "a non-bf16 or fp8 parameter"
        gbuf_index, _, bucket_id = opt.model_param_gbuf_map[model]
        key = (gbuf_index, bucket_id)
        if key not in index:
            data = opt.buffers[gbuf_index].buckets[bucket_id].param_data
            size = data.numel() // dp
            if data.numel() % dp or size % 2 or data.storage_offset() % 2 or not data.is_contiguous():
                return "bucket size or alignment does not allow an fp32 view"
            last = rank == dp - 1
            index[key] = len(state.buckets)
            state.buckets.append(
                BucketShard(
                    param16=data.view(torch.int16),
                    own=rank * size,
                    size=size,
                    scratch=(rank - 1) * size if last else rank * size,
                    descending=not last,
                    residual=torch.zeros(size, dtype=torch.int16, device=data.device),
                    side=kernel.new_ties(size, data),
                )
            )
        bucket = state.buckets[index[key]]
        world = opt._get_model_param_range_map(model)["gbuf_world_in_bucket"]
        offset = world.start - bucket.own
        if offset < 0 or offset + main.numel() > bucket.size:
            return "a parameter shard outside this rank's bucket shard"
        state.entries.append(Entry(main, index[key], offset))
    with torch.no_grad():
        for entry in state.entries:  # masters were cloned from the bf16 shard: residual 0 is exact
            entry.main.data = _placeholder(entry.main)
    return state
