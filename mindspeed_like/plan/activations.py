"""Bytes saved for backward by one microbatch's forward of one model chunk, op by op.

What autograd keeps is a list of tensors per op, and each is counted once by its storage (as
``SavedBytesMeter`` counts them: a view of a saved storage adds nothing). The rows below are the
tensors megatron-core 0.13-0.19 saves on the paths this library runs without TransformerEngine
(the te-backend under megatron's TE spec, and the local spec: the same saves; the te-backend's grouped
experts keep their own weights, no stacked copy, as GroupedMLP's views do),
read off the real model with a saved-tensor hook per module and written as shapes (where
releases differ, the installed megatron-core's code decides: ``megatron_code``):

    t   = micro_batch x seq / CP     tokens of this rank's sequence chunk
    tsp = t / TP under --sequence-parallel, else t   (the residual stream, norms, linear inputs)
    a, g, d, f, fm, fs, V: heads, query groups, head dim, ffn, expert ffn, shared-expert ffn and
    vocabulary on this rank (divided by TP / expert TP); R = t x top-k routed rows (expected: the
    actual split depends on the router)

Each row names the feature that changes it from megatron's own row (``Paths``), so the features'
share of the saving is read row by row. A feature whose effect is not written here changes nothing
in this model, and ``plan`` says which of the switched-on ones those are.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from mindspeed_like.plan import megatron_code
from mindspeed_like.plan.paths import Paths
from mindspeed_like.plan.spec import BYTES, Model, Run

FP32, INT64, INT32, BOOL = 4, 8, 4, 1


@dataclass(frozen=True)
class Saved:
    """One kind of tensor kept for backward: ``count`` storages of ``bytes`` each."""

    component: str  # attention, mlp, moe, norm, loss, embedding, mtp
    what: str
    bytes: int
    count: int = 1
    feature: str | None = None  # the feature whose path this row is (None: megatron's own)

    @property
    def total(self) -> int:
        return self.bytes * self.count


@dataclass(frozen=True)
class Dims:
    """Per-rank sizes of one microbatch (module docstring)."""

    b: int
    s: int  # sequence on this rank (seq / CP)
    t: int
    tsp: int
    h: int
    a: int
    g: int
    d: int
    f: int
    v: int
    p: int  # bytes of the model's dtype
    torch_fused_rmsnorm: bool = False  # megatron's own RMSNorm runs torch's fused kernel (torch_fuses_rmsnorm)

    @classmethod
    def of(cls, run: Run) -> Dims:
        m, lay = run.model, run.layout
        s = m.seq_length // lay.cp
        t = lay.micro_batch_size * s
        tp = lay.tp
        return cls(
            b=lay.micro_batch_size,
            s=s,
            t=t,
            tsp=t // tp if lay.sequence_parallel else t,
            h=m.hidden_size,
            a=m.num_attention_heads // tp,
            g=max(1, m.num_query_groups // tp),
            d=m.kv_channels,
            f=m.ffn_hidden_size // tp,
            v=m.vocab_size // tp,
            p=BYTES[run.precision.params],
            torch_fused_rmsnorm=torch_fuses_rmsnorm(run.device),
        )


@functools.cache
def _torch_version() -> tuple[int, int]:
    """The installed torch's major.minor, read from its metadata (plan imports no torch)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version("torch").split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except (PackageNotFoundError, ValueError):
        return (0, 0)


def torch_fuses_rmsnorm(device: str) -> bool:
    """Whether megatron's own RMSNorm (the local spec's ``torch.nn.RMSNorm``, the te-backend's norm:
    ``F.rms_norm``) runs torch's fused kernel (``aten._fused_rms_norm``, CUDA from torch 2.9), which
    keeps the input and an fp32 rstd like the fused-rmsnorm feature; torch's composite elsewhere
    keeps fp32 copies of the input and the normalized output. Measured: an H200 with torch 2.11
    (tests/cuda/test_lane_plan.py) against this CPU host. The target's torch is taken to be the
    installed one."""
    return device == "cuda" and _torch_version() >= (2, 9)


def fused_rmsnorm(paths: Paths, dims: Dims) -> tuple[bool, str | None]:
    """Whether an RMSNorm keeps only its input and an fp32 rstd, and whose path that is: torch's
    fused kernel under megatron's own norm (:func:`torch_fuses_rmsnorm`: no feature's doing), else
    the fused-rmsnorm feature where it is on."""
    if dims.torch_fused_rmsnorm:
        return True, None
    return paths.fused_rmsnorm, "fused-rmsnorm"


def norm(
    n: int, width: int, model: Model, paths: Paths, dims: Dims, where: str, component: str = "norm"
) -> list[Saved]:
    """A norm over ``n`` tokens of ``width``; its output is saved by the op that reads it (a linear)."""
    if model.normalization == "LayerNorm":
        return [Saved(component, f"{where}: LayerNorm input, mean, rstd", dims.p * n * width + 2 * dims.p * n)]
    fused, feature = fused_rmsnorm(paths, dims)
    if fused:
        kernel = "fused RMSNorm" if feature else "torch's fused RMSNorm"
        what = f"{where}: input + fp32 rstd ({kernel})"
        return [Saved(component, what, dims.p * n * width + FP32 * n, feature=feature)]
    return [
        Saved(component, f"{where}: fp32 copies of the input and normalized output", FP32 * n * width, count=2),
        Saved(component, f"{where}: fp32 rstd", FP32 * n),
    ]


def linear_input(n: int, width: int, dims: Dims, where: str, component: str) -> Saved:
    return Saved(component, f"{where}: linear input", dims.p * n * width)


def dropout_mask(run: Run, elements: int, dtype_bytes: int) -> int:
    """What one dropout keeps for backward. On a CPU host torch's dropout multiplies by a noise
    tensor in the input's dtype and keeps it (``_dropout_impl``: the fused ``native_dropout`` is
    taken on accelerators only); on an accelerator ``native_dropout`` keeps a bool mask (assumed
    from torch's contract: no GPU or NPU run measured it)."""
    return (dtype_bytes if run.device == "cpu" else BOOL) * elements


def hidden_dropouts(run: Run, dims: Dims, where: str, count: int) -> list[Saved]:
    """megatron's hidden dropout on the residual stream (``tsp x h``): after the embedding and in
    each bias-dropout-add (after attention, after the MLP). ``--hidden-dropout 0`` keeps nothing."""
    if run.model.hidden_dropout <= 0:
        return []
    return [Saved("residual", f"{where}: hidden dropout's mask", dropout_mask(run, dims.tsp * dims.h, dims.p), count)]


def blocked_on_host(run: Run, paths: Paths) -> bool:
    """Whether the flash-attention feature's portable kernel runs the blocked kernel
    (``kernels/blocked_attention.py``): on a CPU host with attention dropout, which torch's CPU
    flash kernel does not take. It keeps q, k and v only (no output, no log-sum-exp): its backward
    recomputes each block and draws the block's dropout mask again."""
    return paths.flash_attention and run.device == "cpu" and run.model.attention_dropout > 0


def rope(model: Model, paths: Paths, dims: Dims, width: int, calls: int = 2) -> list[Saved]:
    """Rotary embedding: megatron's unfused apply keeps cos and sin per call; the fused kernel one
    freqs tensor per layer (per call under MLA, which rotates q and k apart)."""
    if model.position_embedding_type != "rope" and not model.multi_latent_attention:
        return []
    if paths.fused_rope:
        n = 2 if model.multi_latent_attention else 1
        return [
            Saved(
                "attention",
                "rotary freqs (fused RoPE)",
                dims.p * dims.s * width,
                count=n,
                feature="fused-rotary-pos-emb",
            )
        ]
    return [Saved("attention", "rotary cos / sin per q and k", dims.p * dims.s * width, count=2 * calls)]


def attention(run: Run, paths: Paths, dims: Dims) -> list[Saved]:
    """Self-attention (not MLA) from the norm to the output projection's input."""
    m, lay = run.model, run.layout
    p, t, tsp, a, g, d = dims.p, dims.t, dims.tsp, dims.a, dims.g, dims.d
    out: list[Saved] = []
    if run.transformer_impl == "transformer_engine":
        out += norm(tsp, dims.h, m, paths, dims, "input norm (fused into linear_qkv)")
    else:
        out += norm(tsp, dims.h, m, paths, dims, "input_layernorm")
    out.append(linear_input(tsp, dims.h, dims, "linear_qkv", "attention"))
    qkv = p * t * (a + 2 * g) * d  # the projection's output: q, k and v are views of it
    rope_on = m.position_embedding_type == "rope"
    qkv_viewed = False
    # q is sliced from each query group's block of the projection: reshaping it to one head a row
    # copies it where a group holds several heads of several groups (GQA), a view otherwise
    q_copied = 1 < g < a
    if m.qk_layernorm:
        fused, feature = fused_rmsnorm(paths, dims)
        if m.normalization == "LayerNorm":
            # torch's layer norm keeps its input (q: the copy or a view of qkv; k: a view) and its mean
            # and rstd in the input's dtype; checked against Megatron-LM's built model (local spec)
            out.append(
                Saved(
                    "attention",
                    "q_layernorm: " + ("q (a copy) + " if q_copied else "") + "mean, rstd",
                    (p * t * a * d if q_copied else 0) + 2 * p * t * a,
                )
            )
            out.append(Saved("attention", "k_layernorm: mean, rstd (input: a view of qkv)", 2 * p * t * g))
            qkv_viewed = True
        elif fused:
            out.append(
                Saved(
                    "attention",
                    "q_layernorm: " + ("q (a copy) + " if q_copied else "") + "fp32 rstd",
                    (p * t * a * d if q_copied else 0) + FP32 * t * a,
                    feature=feature,
                )
            )
            k_norm = "k_layernorm: fp32 rstd (input: a view of qkv)"
            out.append(Saved("attention", k_norm, FP32 * t * g, feature=feature))
            qkv_viewed = True
        else:
            out.append(
                Saved("attention", "q_layernorm: fp32 input/output copies + rstd", 2 * FP32 * t * a * d + FP32 * t * a)
            )
            out.append(
                Saved("attention", "k_layernorm: fp32 input/output copies + rstd", 2 * FP32 * t * g * d + FP32 * t * g)
            )
    out += rope(m, paths, dims, d)
    if lay.cp > 1:
        out += _context_parallel_core(run, dims, qkv, rope_on or m.qk_layernorm)
    elif paths.flash_attention:
        new_q = rope_on or m.qk_layernorm
        rows = [Saved("core_attn", "q (rotated)", p * t * a * d, feature="flash-attention")] if new_q else []
        rows.append(Saved("core_attn", "k (rotated)", p * t * g * d, feature="flash-attention") if new_q else None)
        rows = [r for r in rows if r is not None]
        qkv_viewed = True  # v (and q, k without RoPE) are views of the projection's output
        blocked = blocked_on_host(run, paths)
        if blocked:
            # the blocked kernel keeps no output: it is a new tensor that only linear_proj keeps
            what, component = "attention output (linear_proj input)", "attention"
        else:
            what, component = "attention output (the kernel's, for its backward)", "core_attn"
        rows.append(Saved(component, what, p * t * a * d, feature="flash-attention"))
        # the output plus megatron's NaN rows (kernels/flash_attention._nan_query_rows) is a new tensor
        # on an accelerator; on a host the repair runs only when q holds a NaN
        if run.device != "cpu":
            rows.append(
                Saved(
                    "attention",
                    "attention output + NaN rows (linear_proj input)",
                    p * t * a * d,
                    feature="flash-attention",
                )
            )
        if not blocked:
            rows.append(Saved("core_attn", "fp32 log-sum-exp", FP32 * dims.b * a * dims.s, feature="flash-attention"))
        out += rows
    else:
        new_q = rope_on or m.qk_layernorm
        expanded = g < a
        out.append(Saved("core_attn", "q" + (" (rotated)" if new_q else ""), p * t * a * d) if new_q else None)
        if expanded:
            out.append(Saved("core_attn", "k, v expanded to every head (GQA)", p * t * a * d, count=2))
            if not new_q:
                # SelfAttention reshapes the grouped q to one head a row: a copy (its group stride is
                # (heads/groups + 2) heads); the expanded k and v are copies too, so nothing keeps qkv's output
                out.append(Saved("attention", "q (a copy: the grouped heads' reshape)", p * t * a * d))
        else:
            out.append(Saved("core_attn", "k (rotated)", p * t * a * d) if new_q else None)
        if not expanded:
            qkv_viewed = True
        out += softmax(run, dims)
        out.append(Saved("attention", "attention output (linear_proj input)", p * t * a * d))
    if qkv_viewed:
        out.append(Saved("attention", "qkv projection output (v viewed from it)", qkv))
    return [r for r in out if r is not None]


def softmax_upcast(run: Run, dims: Dims) -> bool:
    """megatron's unfused softmax computes fp16/bf16 scores in fp32 when attention_softmax_in_fp32
    (``FusedScaleMaskSoftmax.forward_torch_softmax``), then casts the probabilities back."""
    return dims.p < FP32 and run.model.attention_softmax_in_fp32


CAUSAL_MASK = "causal mask (bool s x s)"
DATALOADER_MASK = "attention mask (bool b x s x s, the dataloader's: every layer's)"
SHARED_MASK = "the shared mask (counted at its first layer)"


def softmax(run: Run, dims: Dims) -> list[Saved]:
    """megatron's unfused attention softmax, its causal mask, attention dropout and the value
    matmul's input. Upcast: the fp32 softmax output, and the probabilities cast back (or their
    dropped copy) for the value matmul. In the model's dtype (Megatron-LM's default, and fp32
    models): the softmax output, which the value matmul also reads unless dropout makes a copy.
    Measured through Megatron-LM on an H200 (megatron_lm_device_check's allocator trace: 5 bytes
    an element at dropout 0.1 in bf16) and on this CPU host (the parity tests)."""
    elements = dims.b * dims.a * dims.s**2
    if softmax_upcast(run, dims):
        rows = [
            Saved("core_attn", "fp32 softmax output", FP32 * elements),
            Saved("core_attn", "softmax probabilities (model dtype, for the value matmul)", dims.p * elements),
        ]
    else:
        rows = [Saved("core_attn", "softmax output (model dtype)", dims.p * elements)]
        if run.model.attention_dropout > 0:
            rows.append(Saved("core_attn", "dropped probabilities (the value matmul's input)", dims.p * elements))
    if run.model.attention_mask_in_dataloader:
        rows.append(Saved("core_attn", DATALOADER_MASK, BOOL * dims.b * dims.s**2))
    else:
        rows.append(Saved("core_attn", CAUSAL_MASK, BOOL * dims.s**2))
    return rows + _attention_dropout(run, dims)


def _one_shared_mask(rows: dict[str, list[Saved]]) -> None:
    """Where every layer's softmax keeps the same mask tensor (megatron-core 0.13 caches its causal
    mask, :func:`megatron_code.caches_causal_mask`; Megatron-LM's dataloader makes one a microbatch
    for every layer), it is counted at the first layer that keeps it."""
    seen = False
    for group in rows.values():
        for i, row in enumerate(group):
            if row.what in (CAUSAL_MASK, DATALOADER_MASK):
                if seen:
                    group[i] = Saved(row.component, SHARED_MASK, 0)
                seen = True


def _attention_dropout(run: Run, dims: Dims) -> list[Saved]:
    """megatron's attention dropout on its model-dtype probabilities: the value matmul then keeps
    the dropped probabilities in their place, and the dropout its mask."""
    if run.model.attention_dropout <= 0:
        return []
    elements = dims.b * dims.a * dims.s**2
    return [Saved("core_attn", "attention dropout's mask (s x s)", dropout_mask(run, elements, dims.p))]


def _context_parallel_core(run: Run, dims: Dims, qkv: int, rotated: bool) -> list[Saved]:
    """The context-parallel feature's attention (both arms: megatron has no local CP attention): q,
    k, v of this rank's chunks, the output and the per-block log-sum-exp."""
    p, t, a, g, d = dims.p, dims.t, dims.a, dims.g, dims.d
    rows = []
    if rotated:
        rows += [Saved("core_attn", "q (rotated)", p * t * a * d), Saved("core_attn", "k (rotated)", p * t * g * d)]
    rows += [
        Saved("attention", "qkv projection output (v viewed from it)", qkv),
        Saved("core_attn", "attention output (the CP kernel's [b, heads, s, d] layout)", p * t * a * d),
        Saved("attention", "attention output (linear_proj input)", p * t * a * d),
        Saved("core_attn", "fp32 log-sum-exp", FP32 * dims.b * a * dims.s),
    ]
    return rows


def mla(run: Run, paths: Paths, dims: Dims) -> list[Saved]:
    """Multi-latent attention (DeepSeek): down projections, normed latent up projections, cores."""
    m = run.model
    p, t, tsp, a = dims.p, dims.t, dims.tsp, dims.a
    qk = m.qk_head_dim + m.qk_pos_emb_head_dim
    dv = m.v_head_dim
    out = norm(tsp, dims.h, m, paths, dims, "input_layernorm")
    out.append(linear_input(tsp, dims.h, dims, "q/kv down projections (one input)", "attention"))
    if m.q_lora_rank:
        out += norm(tsp, m.q_lora_rank, m, paths, dims, "q LoRA norm (fused into linear_q_up_proj)", "attention")
        out.append(linear_input(tsp, m.q_lora_rank, dims, "linear_q_up_proj", "attention"))
    kvl = m.kv_lora_rank
    fused, feature = fused_rmsnorm(paths, dims)
    if fused:
        out.append(
            Saved(
                "attention",
                "kv down output (the kv norm's input is a view)",
                p * tsp * (kvl + m.qk_pos_emb_head_dim),
                feature=feature,
            )
        )
        out.append(Saved("attention", "kv LoRA norm: fp32 rstd", FP32 * tsp, feature=feature))
    else:
        out += norm(tsp, kvl, m, paths, dims, "kv LoRA norm (fused into linear_kv_up_proj)", "attention")
    out.append(linear_input(tsp, kvl, dims, "linear_kv_up_proj", "attention"))
    out += rope(m, paths, dims, m.qk_pos_emb_head_dim)
    unpadded = run.device == "cpu" and bool(run.flags.get("mla_fa_without_pad"))
    if paths.flash_attention and (blocked_on_host(run, paths) or unpadded):
        # the blocked kernel (dropout on a host, or --mla-fa-without-pad): q, k and the unpadded v
        out += [
            Saved("core_attn", "q, k (rope part concatenated; blocked kernel)", p * t * a * qk, count=2,
                  feature="flash-attention"),
            Saved("core_attn", "v (unpadded)", p * t * a * dv, feature="flash-attention"),
        ]  # fmt: skip
    elif paths.flash_attention and run.device == "cpu":
        out += [
            Saved(
                "core_attn",
                "q, k, v (v zero-padded to the q/k head dim), output",
                p * t * a * qk,
                count=4,
                feature="flash-attention",
            ),
            Saved("core_attn", "fp32 log-sum-exp", FP32 * dims.b * a * dims.s, feature="flash-attention"),
        ]
    elif paths.flash_attention:
        # an accelerator's kernel takes the two head dims as they are (kernels/flash_attention.py pads
        # on a CPU host only); measured on an H200 (the CUDA lane's plan cases)
        out += [
            Saved("core_attn", "q, k (rope part concatenated)", p * t * a * qk, count=2, feature="flash-attention"),
            Saved("core_attn", "v, output (the value head dim)", p * t * a * dv, count=2, feature="flash-attention"),
            Saved("core_attn", "fp32 log-sum-exp", FP32 * dims.b * a * dims.s, feature="flash-attention"),
        ]
    else:
        out += [
            Saved("core_attn", "q, k (rope part concatenated)", p * t * a * qk, count=2),
            Saved("core_attn", "v", p * t * a * dv),
            *softmax(run, dims),
        ]
    out.append(Saved("attention", "linear_proj input", p * t * a * dv))
    return out


def dense_mlp(
    run: Run,
    paths: Paths,
    dims: Dims,
    layer_in_chunk: int,
    width: int,
    label: str = "mlp",
    norm_rows: bool = True,
    input_saved: bool = False,
) -> list[Saved]:
    """A dense MLP of ffn ``width`` on this rank: norm, fc1 input, activation, fc2 input."""
    m = run.model
    p, t, tsp = dims.p, dims.t, dims.tsp
    out: list[Saved] = []
    if norm_rows:
        where = (
            "pre-MLP norm (fused into linear_fc1)"
            if run.transformer_impl == "transformer_engine"
            else "pre_mlp_layernorm"
        )
        out += norm(tsp, dims.h, m, paths, dims, where)
    if not input_saved:
        out.append(linear_input(tsp, dims.h, dims, f"{label} linear_fc1", "mlp"))
    if m.gated_linear_unit:
        out.append(Saved("mlp", f"{label} fc1 output (SwiGLU input)", p * t * 2 * width))
        if paths.fused_swiglu or m.bias_swiglu_fusion:
            out.append(
                Saved(
                    "mlp",
                    f"{label} SwiGLU halves: none (the fused kernel keeps its input)",
                    0,
                    feature=None if m.bias_swiglu_fusion else "fused-swiglu",
                )
            )
        else:
            out.append(_swiglu_halves("mlp", f"{label} SwiGLU halves", p * t * width))
    else:
        out.append(Saved("mlp", f"{label} fc1 output (activation input)", p * t * width))
    out.append(_activation_output(paths, layer_in_chunk, p * t * width, label))
    return out


def _swiglu_halves(component: str, what: str, nbytes: int, also: int = 0, also_what: str = "") -> Saved:
    """megatron's unfused GLU: ``silu(x1)`` and, where megatron adds ``glu_linear_offset`` to ``x2``,
    that sum (:func:`megatron_code.glu_copies_linear_half`; without it ``x2`` is a view of fc1's
    output), plus ``also`` tensors of the same size kept after it."""
    copies = megatron_code.glu_copies_linear_half()
    kept = "silu(x1), x2 + offset" if copies else "silu(x1); x2 a view of fc1's output"
    return Saved(component, f"{what} ({kept}){also_what}", nbytes, count=(2 if copies else 1) + also)


def _activation_output(paths: Paths, layer_in_chunk: int, nbytes: int, label: str) -> Saved:
    limit = paths.recompute_activation_layers
    if paths.recompute_activation and (limit is None or layer_in_chunk < limit):
        return Saved(
            "mlp",
            f"{label} activation output: freed, recomputed in backward",
            0,
            feature="recompute-activation-function",
        )
    return Saved("mlp", f"{label} activation output (linear_fc2 input)", nbytes)


def moe_layer(run: Run, paths: Paths, dims: Dims, layer_in_chunk: int) -> list[Saved]:
    """An MoE layer: norm, router, token dispatch, experts, shared experts."""
    m, lay = run.model, run.layout
    p, t, tsp = dims.p, dims.t, dims.tsp
    k, experts = m.moe_router_topk, m.num_experts
    fm = m.moe_ffn_hidden_size // lay.expert_tp
    rows_r = int(t * k * run.moe_rows_factor)  # routed rows on this rank (1: balanced routing, the mean rank)
    probs = FP32 if m.moe_router_dtype in ("fp32", "fp64") else p
    gathered = tsp * (lay.tp if lay.sequence_parallel else 1) * lay.ep  # tokens the dispatcher routes
    out = norm(tsp, dims.h, m, paths, dims, "pre_mlp_layernorm")
    out.append(linear_input(tsp, dims.h, dims, "router (and shared experts' fc1)", "moe"))
    out += _router(m, paths, tsp, dims.b)
    if paths.fused_permute:
        out.append(Saved("moe", "fused permute: row indices", INT64 * rows_r, count=4, feature="moe-permute"))
    elif megatron_code.permute_selects_by_argsort():
        out += [
            Saved("moe", "argsort of the routing map (int64 experts x tokens; the probs' gather keeps it)",
                  INT64 * experts * gathered),
            Saved("moe", "permutation indices", INT64 * rows_r),
        ]  # fmt: skip
    else:
        out += [
            Saved("moe", "routing map (bool experts x tokens)", BOOL * experts * gathered),
            Saved("moe", "routing probs (experts x tokens)", probs * experts * gathered),
            Saved("moe", "permutation indices", INT64 * rows_r),
        ]
    if paths.moe_zero_memory:
        out += [
            Saved(
                "moe",
                "experts: dispatched rows (recomputed in backward)",
                p * rows_r * dims.h,
                feature="moe-zero-memory",
            ),
            Saved("moe", "experts: routing probs of the rows", probs * rows_r, feature="moe-zero-memory"),
        ]
    else:
        out += [
            Saved("moe", "experts: routing probs of the rows", probs * rows_r),
            Saved("moe", "experts: fc1 input rows", p * rows_r * dims.h),
            Saved("moe", "experts: fc1 output (activation input)", p * rows_r * 2 * fm),
        ]
        if paths.fused_swiglu or m.bias_swiglu_fusion:
            feature = None if m.bias_swiglu_fusion else "fused-swiglu"  # megatron's own weighted_bias_swiglu_impl
            out.append(Saved("moe", "experts: SwiGLU halves: none (fused weighted SwiGLU)", 0, feature=feature))
        else:
            out.append(
                _swiglu_halves("moe", "experts: SwiGLU halves", p * rows_r * fm, 1, " and the probs-weighted output")
            )
        act = _activation_output(paths, layer_in_chunk, p * rows_r * fm, "experts")
        out.append(Saved("moe", act.what, act.bytes, feature=act.feature))
    if m.moe_shared_expert_intermediate_size:
        fs = m.moe_shared_expert_intermediate_size // lay.tp
        out += dense_mlp(run, paths, dims, layer_in_chunk, fs, "shared experts", norm_rows=False, input_saved=True)
        if m.moe_shared_expert_gate:
            # SharedExpertMLP.forward: output * sigmoid(linear(input, gate_weight)) keeps the output and
            # the [t, 1] score (the linear's input is the layer's, counted)
            out.append(Saved("moe", "shared experts' gate: their output and its sigmoid score", p * tsp * (dims.h + 1)))
    return out


def _router(m: Model, paths: Paths, tsp: int, b: int) -> list[Saved]:
    """The router's saves, as measured per kind: top-k softmax; with a load-balancing loss (its
    full fp32 scores); sigmoid with expert groups (DeepSeek, whose sequence-level loss keeps a
    [b, experts] tensor: :func:`_seq_aux_loss_cost`)."""
    k, e = m.moe_router_topk, m.num_experts
    seq_cost = _seq_aux_loss_cost(e, b)
    fused = "moe-router" if paths.fused_router else None
    rows = [
        Saved("moe", "router: top-k fp32 scores", FP32 * tsp * k, feature=fused),
        Saved("moe", "router: top-k indices", INT64 * tsp * k, feature=fused),
    ]
    if m.moe_router_score_function == "sigmoid" and m.moe_router_num_groups:
        if paths.fused_router:
            rows += [
                Saved(
                    "moe",
                    "router: fp32 scores, group/aux terms",
                    FP32 * tsp * e + 2 * FP32 * tsp + seq_cost + 4,
                    feature="moe-router",
                )
            ]
        else:
            rows += [
                Saved(
                    "moe",
                    "router: fp32 scores / sigmoid, group masks and top-k indices",
                    2 * FP32 * tsp * e
                    + BOOL * tsp * e
                    + 2 * INT64 * tsp * k
                    + INT64 * tsp * m.moe_router_num_groups
                    + 2 * FP32 * tsp
                    + seq_cost
                    + 4,
                ),
            ]
    elif m.moe_aux_loss:
        extra = 0 if paths.fused_router else INT64 * tsp * k
        rows += [
            Saved(
                "moe",
                "router: fp32 scores for the load-balancing loss",
                FP32 * tsp * e + extra + 8 * e + 4,
                feature="moe-router" if paths.fused_router else None,
            )
        ]
    return rows


def _seq_aux_loss_cost(experts: int, b: int) -> int:
    """The [b, experts] tensor the sequence-level load-balancing loss keeps: int64 tokens per
    (sequence, expert), or fp32 costs where megatron computes the loss in
    ``sequence_load_balancing_loss_func`` (:func:`megatron_code.seq_aux_loss_keeps_fp32_cost`).
    (Read at b = 2 and b = 4 on the parity model: b x experts.)"""
    return (FP32 if megatron_code.seq_aux_loss_keeps_fp32_cost() else INT64) * b * experts


def embedding(run: Run, dims: Dims) -> list[Saved]:
    rows = [Saved("embedding", "token ids (int64)", INT64 * dims.b * dims.s)]
    if run.model.position_embedding_type == "learned_absolute":
        rows.append(Saved("embedding", "position ids (int64)", INT64 * dims.s))
    return rows + hidden_dropouts(run, dims, "embedding", 1)


def head(run: Run, paths: Paths, dims: Dims, outputs: int = 1) -> list[Saved]:
    """Final norm, output layer and loss (``outputs`` > 1 with multi-token prediction: megatron runs
    the output layer once on the decoder's and the MTP layers' hidden states concatenated, or, where
    the MTP block runs it per MTP layer, on the decoder's normed output, which the first MTP layer's
    ``hnorm`` keeps already when it keeps its input: :func:`_decoder_output_kept_by_mtp`)."""
    m = run.model
    p, t, tsp = dims.p, dims.t, dims.tsp
    out = norm(tsp, dims.h, m, paths, dims, "final_layernorm")
    shared = 1 if outputs > 1 and _decoder_output_kept_by_mtp(run, paths, dims) else 0
    note = " (the decoder's is the MTP hnorm's input, counted there)" if shared else ""
    if paths.fused_linear_cross_entropy:
        out += [
            Saved(
                "loss",
                "output layer input (gathered hidden states)" + note,
                p * (outputs - shared) * t * dims.h,
                feature="fused-linear-cross-entropy",
            ),
            Saved(
                "loss",
                "per-token fp32 max and sum(exp) + int32 target",
                (2 * FP32 + INT32) * t,
                count=outputs,
                feature="fused-linear-cross-entropy",
            ),
        ]
    else:
        out += [
            Saved("loss", "output layer input" + note, p * (outputs - shared) * tsp * dims.h),
            Saved(
                "loss", "fp32 softmax of the logits (vocab-parallel cross entropy)", FP32 * t * dims.v, count=outputs
            ),
            Saved("loss", "targets (int64) and their vocab-shard mask", (INT64 + BOOL) * t, count=outputs),
        ]
    return out


def _decoder_output_kept_by_mtp(run: Run, paths: Paths, dims: Dims) -> bool:
    """Whether the decoder's output layer reads a storage the first MTP layer's ``hnorm`` keeps:
    where the MTP block runs the output layer itself (:func:`megatron_code.mtp_block_runs_output_layer`,
    megatron-core 0.13) and that norm keeps its input (a LayerNorm, a fused RMSNorm). The fused
    linear cross entropy keeps the hidden states it gathers, the same tensor unless sequence
    parallelism gathers a new one."""
    if not megatron_code.mtp_block_runs_output_layer():
        return False
    keeps_input = run.model.normalization == "LayerNorm" or fused_rmsnorm(paths, dims)[0]
    return keeps_input and (not paths.fused_linear_cross_entropy or dims.tsp == dims.t)


def mtp_layer(run: Run, paths: Paths, dims: Dims) -> list[Saved]:
    """One multi-token-prediction layer: the shifted tokens' embedding, the two norms, eh_proj, a
    transformer layer (the decoder's last layer kind) and its final norm; the shifted labels."""
    m = run.model
    tsp = dims.tsp
    out = [Saved("mtp", "shifted token ids (int64)", INT64 * dims.b * dims.s)]
    out += hidden_dropouts(run, dims, "mtp embedding", 1)
    out += [
        Saved(r.component, "mtp " + r.what, r.bytes, r.count, r.feature)
        for r in norm(tsp, dims.h, m, paths, dims, "enorm")
    ]
    out += [
        Saved(r.component, "mtp " + r.what, r.bytes, r.count, r.feature)
        for r in norm(tsp, dims.h, m, paths, dims, "hnorm")
    ]
    out.append(linear_input(tsp, 2 * dims.h, dims, "eh_proj", "mtp"))
    out += layer(run, paths, dims, m.num_layers - 1, 0)
    out += [
        Saved(r.component, "mtp " + r.what, r.bytes, r.count, r.feature)
        for r in norm(tsp, dims.h, m, paths, dims, "final_layernorm")
    ]
    out.append(Saved("mtp", "shifted labels (int64), loss mask (fp32)", (INT64 + FP32) * dims.b * dims.s + INT64))
    return out


def layer(run: Run, paths: Paths, dims: Dims, index: int, layer_in_chunk: int) -> list[Saved]:
    """One decoder layer (``index`` in the model; ``layer_in_chunk`` its position in its chunk)."""
    m = run.model
    rows = mla(run, paths, dims) if m.multi_latent_attention else attention(run, paths, dims)
    if m.layer_is_moe(index):
        rows += moe_layer(run, paths, dims, layer_in_chunk)
    else:
        rows += dense_mlp(run, paths, dims, layer_in_chunk, dims.f)
    return rows + hidden_dropouts(run, dims, "bias-dropout-add after attention and after the MLP", 2)


def chunk(run: Run, paths: Paths, layers: tuple[int, ...], first: bool, last: bool) -> dict[str, list[Saved]]:
    """Every saved row of one microbatch through one model chunk, grouped: ``embedding``,
    ``layer <i>`` per decoder layer, ``mtp``, ``head``."""
    dims = Dims.of(run)
    out: dict[str, list[Saved]] = {}
    if first:
        out["embedding"] = embedding(run, dims)
    made: dict[tuple[bool, bool], list[Saved]] = {}  # a layer's rows depend on these two only (80 layers x 720 fits)
    limit = paths.recompute_activation_layers
    for position, index in enumerate(layers):
        key = (run.model.layer_is_moe(index), paths.recompute_activation and (limit is None or position < limit))
        if key not in made:
            made[key] = layer(run, paths, dims, index, position)
        out[f"layer {index}"] = list(made[key])
    if last:
        mtp = run.model.mtp_num_layers
        for i in range(mtp):
            out[f"mtp {i}"] = mtp_layer(run, paths, dims)
        out["head"] = head(run, paths, dims, outputs=1 + mtp)
    if megatron_code.caches_causal_mask() or run.model.attention_mask_in_dataloader:
        _one_shared_mask(out)
    return out
