"""Adam(W) with low-precision optimizer state: TransformerEngine FusedAdam's contract, in PyTorch.

megatron-core's precision-aware optimizer (``OptimizerConfig(use_precision_aware_optimizer=True,
...)``) hands its optimizer the bf16 parameter shards themselves, gradients on ``.decoupled_grad``
(bf16 or fp32 main-grad views) and expects the optimizer to own the fp32 masters and the moments
in the dtypes it asks for. Only TE's ``FusedAdam`` does that; :class:`PrecisionAwareAdam` is a
drop-in with the same constructor, ``initialize_state``, ``get_unscaled_state`` /
``set_scaled_state`` (what megatron's DistributedOptimizer checkpointing calls), ``state_dict`` /
``load_state_dict`` (unscaled fp32 values, masters included) and ``zero_grad``.

State dtypes (``exp_avg_dtype`` / ``exp_avg_sq_dtype``):

- ``torch.float32``: plain, updated in place (bitwise what ``torch.optim.AdamW`` computes).
- ``torch.bfloat16``: plain cast, round to nearest even, no scale (as TE).
- ``torch.float16``: codes ``x / s`` with one fp32 scale ``s = absmax / 65504`` per block of
  :data:`BLOCK` elements (TE uses one scale per tensor; per-block keeps small blocks precise).
- ``torch.uint8`` (megatron's spelling of fp8): E4M3 codes (``torch.float8_e4m3fn`` bits) with one
  fp32 scale ``s = absmax / 448`` per block of :data:`BLOCK` = 128 elements (1 x 128 tiles, as
  DeepSeek-V3's fp8 training; 4/128 = 0.031 extra B/param per state). The second moment is stored
  in the square-root domain (codes of ``sqrt(v)``): ``v`` spans twice the binades of ``|g|`` and
  E4M3 covers only ~17.8 binades per block, so storing ``v`` directly would flush small ``v`` to 0
  next to a non-zero ``m`` and blow up ``m / (sqrt(v) + eps)``. ``get_unscaled_state`` returns
  ``v`` itself, so checkpoints hold the same quantity as TE's.

Masters (``master_weights=True``): ``master_weight_dtype`` fp32 (plain) or fp16 (block scaled);
with ``store_param_remainders`` and bf16 params the fp32 master is the bf16 param plus an int16
remainder: ``master_bits = (bf16_bits << 16) + remainder`` (signed, two's complement), the identity
of :mod:`mindspeed_like.kernels.bf16_residual`. Here the bf16 value is the master rounded to
nearest with ties away from zero (low half >= 0x8000 rounds the high half up), so every remainder
is the master's low 16 bits read as int16 and no side table is needed; that is also TE's layout,
so remainders in checkpoints are interchangeable with TE's. It differs from PyTorch's
round-to-nearest-even only on exact ties (low half == 0x8000), by one bf16 ulp.

Layout and the fused pass: per parameter group and parameter dtype (a *bucket*) every state is one
flat buffer; each parameter owns a segment starting at a multiple of :data:`BLOCK` when a state of
the bucket is block scaled (so blocks never straddle parameters; otherwise segments are unpadded),
and ``self.state[p][name]`` is a view of its segment. A step is, per bucket:
gradients and (for remainders) weights gathered into flat fp32 workspaces with ``torch._foreach_copy_``,
non-fp32 states decoded in one op each, the Adam(W) update as single ops on the flat buffers, states
encoded back, weights scattered with ``torch._foreach_copy_``, all piece by piece (:func:`step_chunk`:
:data:`STEP_CHUNK` elements on a host so each piece stays in cache, :data:`CUDA_STEP_CHUNK` on CUDA
where each op of a piece is one kernel launch). No Python loop over parameters does tensor math,
and nothing in the step reads tensor data on the host (no sync on an accelerator); the transient
fp32 workspace is one piece's grads, masters and decoded moments (TE's unfused path materializes
fp32 copies of every non-fp32 state).

DTensor parameters (Megatron-FSDP hands the optimizer DTensor shards of its buffers): the step
works on each one's local shard (the bytes this rank holds and updates, as TE's FusedAdam does),
and its states are DTensors of the same global shape and placements over the local segments, so a
sharded checkpoint (megatron's ``fsdp_dtensor``) saves and loads every rank's part of them.

A skipped step (megatron found inf/nan in the grads) never calls :meth:`step`; nothing here
changes state outside :meth:`step`, :meth:`set_scaled_state` and :meth:`load_state_dict`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from mindspeed_like.kernels.backend import backend_for

BLOCK = 128
STEP_CHUNK = 1 << 17
"""Elements per piece of the step (a multiple of BLOCK, so block scales never straddle pieces).
Why pieces: every op of the step was a pass over the whole bucket (tens of MB), so a step of
~15 elementwise ops streamed memory ~15 times; on a piece of 2^17 elements (0.5 MiB per fp32
array) the decode, the update and the encode run while the piece is in cache. Per-element math
is unchanged, so results are bitwise those of the whole-bucket pass."""
CUDA_STEP_CHUNK = 1 << 24
"""Elements per piece on CUDA (the ``cuda`` backend): a GPU has no cache to stay in, and each of
the ~20 elementwise ops of a piece is a kernel launch; pieces of 2^17 made a 300M-parameter step
~2,300 pieces, ~50,000 launches. 2^24 elements: two 64 MiB fp32 workspaces plus the decoded
moments of one piece."""
FP8 = torch.uint8  # megatron / TE spelling of an fp8 (E4M3) state
STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, FP8)
MASTER_DTYPES = (torch.float32, torch.float16)
_RANGE = {torch.float16: 65504.0, FP8: 448.0}
_CODE_DTYPE = {torch.float16: torch.float16, FP8: torch.float8_e4m3fn}
STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")


def _pad(n: int, align: int = BLOCK) -> int:
    return -(-n // align) * align


def step_chunk(param: torch.Tensor) -> int:
    """Elements per piece of the step for a parameter on this device (its backend)."""
    return CUDA_STEP_CHUNK if backend_for(param) == "cuda" else STEP_CHUNK


# ---------------------------------------------------------------- block codecs (flat tensors)


def encode_blocks(x: torch.Tensor, dtype: torch.dtype, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """fp32 flat ``x`` (length a multiple of BLOCK) -> ``codes`` (storage dtype) and per-block ``scales``."""
    rng = _RANGE[dtype]
    xb = x.view(-1, BLOCK)
    torch.div(xb.abs().amax(dim=1), rng, out=scales)
    inv = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
    q = (xb * inv[:, None]).clamp_(-rng, rng)
    codes.view(-1, BLOCK).view(_CODE_DTYPE[dtype]).copy_(q)


_E4M3_VALUES: dict[tuple[torch.device, torch.device], torch.Tensor] = {}


def e4m3_to_float(codes: torch.Tensor) -> torch.Tensor:
    """fp8 E4M3 codes (uint8 storage, flat) -> fp32, by a 256-entry table of torch's own conversion.

    Why a table: torch's ``float8_e4m3fn -> float32`` cast measured 361 us per 2^17 elements on
    this CPU (27x a multiply), the table lookup (``index_select`` with int32 indices) 72 us; the
    values are bit for bit the cast's (the table is the cast of every code, test_adam_kernel.py)."""
    key = (codes.device, codes.untyped_storage().device)  # testing.fake_cuda labels host memory "cuda"
    table = _E4M3_VALUES.get(key)
    if table is None:
        codes_all = torch.arange(256, dtype=torch.uint8, device=codes.device)
        table = _E4M3_VALUES[key] = codes_all.view(torch.float8_e4m3fn).float()
    return torch.index_select(table, 0, codes.reshape(-1).int())


def decode_blocks(dtype: torch.dtype, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_blocks`: a new fp32 flat tensor."""
    if dtype == FP8:
        q = e4m3_to_float(codes.view(torch.uint8)).view(-1, BLOCK)
    else:
        q = codes.view(_CODE_DTYPE[dtype]).view(-1, BLOCK).float()
    return q.mul_(scales[:, None]).view(-1)


# ---------------------------------------------------------------- one bucket's flat storage


@dataclass
class _Store:
    """One state of one bucket: flat storage in its dtype (+ block scales when scaled)."""

    dtype: torch.dtype  # the logical dtype asked for (uint8 = fp8)
    data: torch.Tensor
    scales: torch.Tensor | None = None
    sqrt_domain: bool = False  # fp8 second moment: codes of sqrt(v)

    def part(self, lo: int, hi: int) -> _Store:
        """Elements ``[lo, hi)`` (block-aligned when scaled) as a store over the same memory."""
        scales = None if self.scales is None else self.scales[lo // BLOCK : hi // BLOCK]
        return _Store(self.dtype, self.data[lo:hi], scales, self.sqrt_domain)

    def decode(self) -> torch.Tensor:
        if self.dtype == torch.float32:
            return self.data
        if self.dtype == torch.bfloat16:
            return self.data.float()
        x = decode_blocks(self.dtype, self.data, self.scales)
        return x.square_() if self.sqrt_domain else x

    def encode(self, x: torch.Tensor) -> None:
        if self.dtype == torch.float32:
            if x.data_ptr() != self.data.data_ptr():
                self.data.copy_(x)
        elif self.dtype == torch.bfloat16:
            self.data.copy_(x)
        else:
            encode_blocks(x.sqrt() if self.sqrt_domain else x, self.dtype, self.data, self.scales)


def _new_store(dtype: torch.dtype, size: int, device: torch.device, sqrt_domain: bool = False) -> _Store:
    if dtype in (torch.float32, torch.bfloat16):
        return _Store(dtype, torch.zeros(size, dtype=dtype, device=device))
    storage = torch.uint8 if dtype == FP8 else torch.float16
    scales = torch.zeros(size // BLOCK, dtype=torch.float32, device=device)
    return _Store(dtype, torch.zeros(size, dtype=storage, device=device), scales, sqrt_domain and dtype == FP8)


@dataclass
class _Bucket:
    """The params of one group sharing a dtype, laid out in one padded flat index space."""

    params: list[torch.Tensor]
    offsets: list[int]
    size: int
    master: str  # "remainder" | "buffer" | "param" (the param is its own master)
    align: int = BLOCK  # segment alignment: BLOCK when a state is block scaled, else 1 (no padding)
    stores: dict[str, _Store] = field(default_factory=dict)
    remainders: torch.Tensor | None = None
    shapes: list[torch.Size] = field(default_factory=list)  # each param's local shape (a DTensor's shard)
    plans: dict[int, list[tuple[int, int, list[tuple[int, int, int]]]]] = field(default_factory=dict)

    def chunks(self, chunk: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
        """The step's chunks of ``chunk`` elements ``(lo, hi, pieces)``; a piece ``(i, a, b)`` is
        elements ``[a, b)`` of param ``i`` (flattened), which sit at ``offsets[i] + a`` of the flat
        layout."""
        plan = self.plans.get(chunk)
        if plan is None:
            plan = self.plans[chunk] = []
            for lo in range(0, self.size, chunk):
                hi = min(self.size, lo + chunk)
                pieces = []
                for i in range(len(self.params)):
                    a, b = max(lo, self.offsets[i]) - self.offsets[i], min(hi, self.offsets[i] + self.numel(i))
                    if b - self.offsets[i] > a:
                        pieces.append((i, a, b - self.offsets[i]))
                plan.append((lo, hi, pieces))
        return plan

    def numel(self, i: int) -> int:
        return self.shapes[i].numel()

    def segment(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        return flat[self.offsets[i] : self.offsets[i] + self.numel(i)].view(self.shapes[i])

    def segments(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [self.segment(flat, i) for i in range(len(self.params))]


def _is_dtensor(t: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor
        return False
    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its own storage: what the step reads and writes), any other tensor itself."""
    return t._local_tensor if _is_dtensor(t) else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a state of ``param``'s local shard) as ``param`` is: a DTensor with its global shape
    and placements when ``param`` is one (a sharded checkpoint then keys every rank's part), else itself."""
    if not _is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _workspace(bucket: _Bucket, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A zeroed flat fp32 tensor holding ``tensors`` in the bucket's layout (one foreach copy)."""
    flat = torch.zeros(bucket.size, dtype=torch.float32, device=device)
    torch._foreach_copy_(bucket.segments(flat), tensors)
    return flat


class PrecisionAwareAdam(torch.optim.Optimizer):
    """Adam / AdamW with fp32, bf16, fp16 or fp8 moments and fp32, fp16 or bf16+int16 masters.

    The constructor is TransformerEngine ``FusedAdam``'s (keyword names, defaults, accepted
    dtypes); ``capturable`` is accepted only as False (no CUDA graphs here).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor | dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
        set_grad_none: bool | None = None,
        fused: bool | None = None,  # megatron's HybridDeviceOptimizer passes torch's flag; one path here
    ) -> None:
        if amsgrad:
            raise ValueError("PrecisionAwareAdam does not implement AMSGrad (neither does TE's FusedAdam)")
        if capturable:
            raise ValueError("PrecisionAwareAdam has no capturable (CUDA graph) mode; pass capturable=False")
        if master_weights and master_weight_dtype not in MASTER_DTYPES:
            raise ValueError(f"master_weight_dtype must be one of {MASTER_DTYPES}, got {master_weight_dtype}")
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in STATE_DTYPES:
                raise ValueError(f"{name} must be one of {STATE_DTYPES} (torch.uint8 = fp8 E4M3), got {dtype}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        defaults["bias_correction"] = bias_correction
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.name_to_dtype_map = {
            "exp_avg": exp_avg_dtype,
            "exp_avg_sq": exp_avg_sq_dtype,
            "master_param": master_weight_dtype,
        }
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = store_param_remainders and master_weights and master_weight_dtype == torch.float32
        self.set_grad_none = set_grad_none
        self._buckets: dict[int, _Bucket] = {}  # id(param) -> its bucket
        self._index: dict[int, int] = {}  # id(param) -> its index in the bucket
        self._step_tensors: dict[int, torch.Tensor] = {}  # group index -> its step as a state tensor (DTensor params)

    # ------------------------------------------------------------ layout

    def _master_kind(self, p: torch.Tensor) -> str:
        if not self.master_weights or p.dtype == torch.float32:
            return "param"
        if self.store_param_remainders and p.dtype == torch.bfloat16:
            return "remainder"
        return "buffer"

    def _group_of(self, p: torch.Tensor) -> dict:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise KeyError("parameter is not in this optimizer")

    def _build_group(self, group: dict) -> None:
        """Allocate every bucket of ``group`` and attach each param's state views (zeroed moments)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in group["params"]:
            if id(p) not in self._buckets:
                by_dtype.setdefault(p.dtype, []).append(p)
        for params in by_dtype.values():
            master = self._master_kind(params[0])
            scaled = {self.exp_avg_dtype, self.exp_avg_sq_dtype} | (
                {self.master_weight_dtype} if master == "buffer" else set()
            )
            align = BLOCK if scaled & set(_RANGE) else 1
            offsets, size = [], 0
            locals_ = [_local(p.detach()) for p in params]
            for local in locals_:
                offsets.append(size)
                size += _pad(local.numel(), align)
            device = locals_[0].device
            bucket = _Bucket(params, offsets, size, master, align, shapes=[local.shape for local in locals_])
            bucket.stores["exp_avg"] = _new_store(self.exp_avg_dtype, size, device)
            bucket.stores["exp_avg_sq"] = _new_store(self.exp_avg_sq_dtype, size, device, sqrt_domain=True)
            if bucket.master == "remainder":
                bucket.remainders = torch.zeros(size, dtype=torch.int16, device=device)
            elif bucket.master == "buffer":
                store = _new_store(self.master_weight_dtype, size, device)
                store.encode(_workspace(bucket, locals_, device))
                bucket.stores["master_param"] = store
            for i, p in enumerate(params):
                self._buckets[id(p)] = bucket
                self._index[id(p)] = i
                self._attach(p)

    def _attach(self, p: torch.Tensor) -> None:
        bucket, i = self._buckets[id(p)], self._index[id(p)]
        state = self.state[p]
        for name, store in bucket.stores.items():
            state[name] = _like(p, bucket.segment(store.data, i))
        if bucket.master == "remainder":
            state["master_param"] = _like(p, bucket.segment(bucket.remainders, i))
        if _is_dtensor(p):
            state["step"] = self._step_tensor(p)
        elif bucket.master == "param" and self.master_weights:
            state["master_param"] = p.detach()

    def _step_tensor(self, p: torch.Tensor) -> torch.Tensor:
        """The step count of ``p``'s group as one fp32 tensor every param of the group shares in its
        state (DTensor params only). Megatron-FSDP's ``fsdp_dtensor`` checkpoint saves the raw state,
        keyed by parameter, and restores the groups' hyperparameters as they are when the load is
        built: a count kept only in the group (as TE's) would be lost there, as torch's per-param
        ``step`` tensor is not; :meth:`load_state_dict` reads it back into the group."""
        index = next(i for i, g in enumerate(self.param_groups) if any(q is p for q in g["params"]))
        tensor = self._step_tensors.get(index)
        if tensor is None:
            step = float(self.param_groups[index].get("step", 0))
            tensor = self._step_tensors[index] = torch.tensor(step, dtype=torch.float32)
        return tensor

    def _ensure(self, p: torch.Tensor) -> None:
        if id(p) not in self._buckets:
            self._build_group(self._group_of(p))
        elif len(self.state[p]) == 0:
            self._attach(p)

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool | None = None) -> None:
        """Zero moments and a master equal to the param (remainders 0), for ``param``'s whole group.

        ``store_param_remainders`` is accepted for TE's signature; remainders are decided by the
        constructor's flag and the param's dtype (bf16)."""
        self._ensure(param)

    # ------------------------------------------------------------ TE's state API

    def _scaled_view(self, p: torch.Tensor, name: str) -> tuple[_Store, slice]:
        bucket, i = self._buckets[id(p)], self._index[id(p)]
        start = bucket.offsets[i]
        return bucket.stores[name], slice(start, start + _pad(bucket.numel(i), bucket.align))

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        """fp32 value of a state. A remainder master is returned as the exact fp32 master (TE returns
        the int16 remainder; megatron's DP-zero and reshardable checkpoint formats gather every
        ``param`` into fp32 buffers, where an int16 remainder would be converted numerically and
        lose its meaning, so the full master is what must travel; :meth:`set_scaled_state` takes
        either)."""
        self._ensure(param)
        bucket = self._buckets[id(param)]
        if state_name == "master_param" and bucket.master != "buffer":
            return self.master_param(param)
        store, seg = self._scaled_view(param, state_name)
        if store.dtype == torch.float32:
            return self.state[param][state_name]
        if store.dtype == torch.bfloat16:
            return self.state[param][state_name].float()
        sub = _Store(
            store.dtype, store.data[seg], store.scales[seg.start // BLOCK : seg.stop // BLOCK], store.sqrt_domain
        )
        local = _local(param.detach())
        return _like(param, sub.decode()[: local.numel()].view(local.shape))

    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Store an fp32 value (int16 for a remainder master) into a state, encoding as its dtype."""
        self._ensure(param)
        bucket = self._buckets[id(param)]
        view = _local(self.state[param][state_name])
        unscaled_state = _local(unscaled_state)
        data = _local(param.detach())  # the param's own (local) storage
        if state_name == "master_param" and bucket.master == "remainder":
            if unscaled_state.dtype == torch.int16:  # TE's form: the remainder of the current bf16 param
                view.copy_(unscaled_state.view(view.shape))
                return
            if unscaled_state.dtype != torch.float32:
                raise TypeError(
                    f"master_param takes the fp32 master or TE's int16 remainder, got {unscaled_state.dtype}"
                )
            # an fp32 master (megatron's checkpoints): weight = master rounded ties away, remainder = low half
            bits = unscaled_state.reshape(data.shape).contiguous().view(torch.int32)
            low = bits.view(torch.int16).view(-1, 2)[:, 0].view(data.shape)
            view.copy_(low)
            data.copy_((bits - low).view(torch.float32))
            return
        if state_name == "master_param" and bucket.master == "param":
            data.copy_(unscaled_state.view(data.shape))
            return
        if unscaled_state.dtype != torch.float32:
            raise TypeError(f"set_scaled_state takes the fp32 value of {state_name!r}, got {unscaled_state.dtype}")
        store = bucket.stores.get(state_name)
        if store is None or store.dtype in (torch.float32, torch.bfloat16):
            view.copy_(unscaled_state.view(view.shape))
            return
        _, seg = self._scaled_view(param, state_name)
        x = torch.zeros(seg.stop - seg.start, dtype=torch.float32, device=view.device)
        x[: data.numel()].copy_(unscaled_state.reshape(-1))
        sub = _Store(
            store.dtype, store.data[seg], store.scales[seg.start // BLOCK : seg.stop // BLOCK], store.sqrt_domain
        )
        sub.encode(x)

    def master_param(self, param: torch.Tensor) -> torch.Tensor:
        """The exact fp32 master of ``param`` (reconstructed from bf16 + remainder where stored so)."""
        self._ensure(param)
        kind = self._buckets[id(param)].master
        if kind == "remainder":
            remainder = _local(self.state[param]["master_param"]).to(torch.int32)
            bits = _local(param.detach()).float().view(torch.int32) + remainder
            return _like(param, bits.view(torch.float32))
        if kind == "param":
            return param.detach().float()
        return self.get_unscaled_state(param, "master_param")

    def state_dict(self) -> dict[str, Any]:
        """torch's format with every state as its unscaled fp32 value (int16 remainders), plus each
        param's ``step`` (megatron reads it there when it does not know the optimizer is TE's)."""
        sd = super().state_dict()
        ids = dict(zip(chain.from_iterable(g["params"] for g in sd["param_groups"]), self._all_params()))
        steps = {id(p): g.get("step", 0) for g in self.param_groups for p in g["params"]}
        for k, v in list(sd["state"].items()):
            p = ids[k]
            sd["state"][k] = {name: self.get_unscaled_state(p, name) for name in v if name in STATE_NAMES}
            sd["state"][k]["step"] = torch.tensor(float(steps[id(p)]))
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hyperparameters and step from ``param_groups`` (or the per-state ``step``), states through
        :meth:`set_scaled_state` from the given values (never cast to the param's dtype first)."""
        states = state_dict["state"]
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        ids = dict(zip(chain.from_iterable(g["params"] for g in state_dict["param_groups"]), self._all_params()))
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        for k, values in states.items():
            p = ids[k]
            self._ensure(p)
            for name, value in values.items():
                if name == "step":
                    group_of[id(p)]["step"] = int(value.item() if torch.is_tensor(value) else value)
                elif value is not None and name in self.state[p]:
                    keep = name == "master_param" and value.dtype == torch.int16  # TE's remainder form
                    self.set_scaled_state(p, name, value if keep else value.float())
        for index, tensor in self._step_tensors.items():
            tensor.fill_(float(self.param_groups[index].get("step", 0)))

    def _all_params(self) -> list[torch.Tensor]:
        return list(chain.from_iterable(g["params"] for g in self.param_groups))

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if set_to_none is None:
            set_to_none = True if self.set_grad_none is None else self.set_grad_none
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for p in self._all_params():
            if set_to_none:
                p.decoupled_grad = None
            elif getattr(p, "decoupled_grad", None) is not None:
                p.decoupled_grad.zero_()

    # ------------------------------------------------------------ the step

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        return getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):  # noqa: ANN001, ANN201 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            if not group["params"]:
                continue
            group["step"] = int(group.get("step", 0)) + 1
            if index in self._step_tensors:
                self._step_tensors[index].fill_(group["step"])
            buckets: dict[int, _Bucket] = {}
            for p in group["params"]:
                self._ensure(p)
                buckets.setdefault(id(self._buckets[id(p)]), self._buckets[id(p)])
            for bucket in buckets.values():
                self._step_bucket(group, bucket)
        return loss

    def _step_bucket(self, group: dict, bucket: _Bucket) -> None:
        grads = [self._grad(p) for p in bucket.params]
        frozen = [i for i, g in enumerate(grads) if g is None]
        if len(frozen) == len(grads):
            return
        datas = [_local(p.detach()) for p in bucket.params]
        device = datas[0].device
        saved = self._snapshot(bucket, frozen)
        flat_grads = [None if x is None else _local(x.detach()).reshape(-1) for x in grads]
        # megatron's params are contiguous views; any other is stepped in a contiguous copy
        flat_params = [d.reshape(-1) if d.is_contiguous() else d.flatten() for d in datas]
        chunk = step_chunk(bucket.params[0])
        workspace = torch.empty(2, min(chunk, bucket.size), dtype=torch.float32, device=device)
        for lo, hi, pieces in bucket.chunks(chunk):
            g = workspace[0, : hi - lo].zero_()
            live = [(i, a, b) for i, a, b in pieces if flat_grads[i] is not None]
            torch._foreach_copy_(
                [g[bucket.offsets[i] + a - lo : bucket.offsets[i] + b - lo] for i, a, b in live],
                [flat_grads[i][a:b] for i, a, b in live],
            )
            m_store, v_store = bucket.stores["exp_avg"].part(lo, hi), bucket.stores["exp_avg_sq"].part(lo, hi)
            m, v = m_store.decode(), v_store.decode()
            w = self._load_master(bucket, lo, hi, pieces, flat_params, workspace[1, : hi - lo])
            adam_math(
                w,
                g,
                m,
                v,
                step=group["step"],
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                adam_w_mode=self.adam_w_mode,
                bias_correction=group.get("bias_correction", True),
            )
            m_store.encode(m)
            v_store.encode(v)
            self._store_master(bucket, lo, hi, pieces, flat_params, w)
        for data, flat in zip(datas, flat_params):
            if not data.is_contiguous():
                data.copy_(flat.view(data.shape))
        self._restore(bucket, saved)

    @staticmethod
    def _load_master(bucket: _Bucket, lo: int, hi: int, pieces, flat_params, space: torch.Tensor) -> torch.Tensor:
        """The fp32 masters of elements ``[lo, hi)``: decoded, or the params (+ remainders) in ``space``."""
        if bucket.master == "buffer":
            return bucket.stores["master_param"].part(lo, hi).decode()
        w = space.zero_()
        torch._foreach_copy_(  # bf16 -> fp32 is exact: (bf16_bits << 16)
            [w[bucket.offsets[i] + a - lo : bucket.offsets[i] + b - lo] for i, a, b in pieces],
            [flat_params[i][a:b] for i, a, b in pieces],
        )
        if bucket.master == "remainder":
            w.view(torch.int32).add_(bucket.remainders[lo:hi])
        return w

    @staticmethod
    def _store_master(bucket: _Bucket, lo: int, hi: int, pieces, flat_params, w: torch.Tensor) -> None:
        if bucket.master == "buffer":
            bucket.stores["master_param"].part(lo, hi).encode(w)
            out = w
        elif bucket.master == "remainder":
            low = w.view(torch.int16)[0::2]  # little endian: the low half of each fp32 word
            bucket.remainders[lo:hi].copy_(low)
            out = (w.view(torch.int32) - low).view(torch.float32)  # low half 0: exactly a bf16 value
        else:
            out = w
        torch._foreach_copy_(
            [flat_params[i][a:b] for i, a, b in pieces],
            [out[bucket.offsets[i] + a - lo : bucket.offsets[i] + b - lo] for i, a, b in pieces],
        )

    def _snapshot(self, bucket: _Bucket, frozen: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(view, copy) of every storage slice of the params without a grad: restored after the pass,
        so such a param's weight and state stay bit for bit (their segments are whole blocks)."""
        saved = []
        for i in frozen:
            seg = slice(bucket.offsets[i], bucket.offsets[i] + _pad(bucket.numel(i), bucket.align))
            views = [_local(bucket.params[i].detach())]
            for store in bucket.stores.values():
                views.append(store.data[seg])
                if store.scales is not None:
                    views.append(store.scales[seg.start // BLOCK : seg.stop // BLOCK])
            if bucket.remainders is not None:
                views.append(bucket.remainders[seg])
            saved.extend((t, t.clone()) for t in views)
        return saved

    @staticmethod
    def _restore(bucket: _Bucket, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for view, copy in saved:
            view.copy_(copy)


def adam_math(
    w: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bias_correction: bool = True,
) -> None:
    """One Adam(W) update in place on fp32 tensors, in ``torch.optim.AdamW``'s operation order
    (so fp32 states are bitwise what torch computes)."""
    beta1, beta2 = betas
    if weight_decay != 0:
        if adam_w_mode:
            w.mul_(1 - lr * weight_decay)
        else:
            g = g.add(w, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1 ** float(step) if bias_correction else 1.0
    bc2 = 1 - beta2 ** float(step) if bias_correction else 1.0
    denom = (v.sqrt() / bc2**0.5).add_(eps)
    w.addcdiv_(m, denom, value=-(lr / bc1))
