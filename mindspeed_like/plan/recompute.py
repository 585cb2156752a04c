"""megatron's own activation recomputation applied to a chunk's saved rows.

- ``--recompute-granularity full --recompute-method uniform --recompute-num-layers N``: the chunk's
  layers in groups of N, each group keeping only its input hidden states (``tsp x h``) and
  re-running its forward in backward; ``--recompute-method block``: the first N layers of the chunk
  each keep only their input, the others everything.
- ``--recompute-granularity selective`` (``--recompute-modules``, default ``core_attn``): the
  attention core keeps q, k, v (the checkpoint's inputs) instead of its internals; ``mlp`` keeps the
  MLP's input instead of its activations; ``moe_act`` drops the experts' activation rows;
  ``layernorm`` keeps the norms' inputs only. Other modules are not modeled (``plan`` says so).
"""

from __future__ import annotations

from mindspeed_like.plan.activations import DATALOADER_MASK, SHARED_MASK, Dims, Saved
from mindspeed_like.plan.spec import Run

MODELED_MODULES = ("core_attn", "mlp", "moe_act", "layernorm")


def apply_recompute(run: Run, groups: dict[str, list[Saved]], layers: tuple[int, ...]) -> dict[str, list[Saved]]:
    rc = run.recompute
    if rc.granularity is None:
        return groups
    dims = Dims.of(run)
    layer_keys = [f"layer {i}" for i in layers]
    out = dict(groups)
    if rc.granularity == "full":
        n = rc.num_layers or 1
        hidden = Saved("recompute", "checkpointed layers' input hidden states", dims.p * dims.tsp * dims.h)
        if rc.method == "block":
            for key in layer_keys[:n]:
                out[key] = [hidden]
        else:  # uniform (megatron's default when a method is needed)
            for start in range(0, len(layer_keys), n):
                group = layer_keys[start : start + n]
                for key in group:
                    out[key] = []
                out[group[0]] = [hidden]
        if run.model.attention_mask_in_dataloader and layer_keys:
            # every checkpoint is given the dataloader's mask: one tensor, kept once
            out[layer_keys[0]] = [*out[layer_keys[0]], Saved("recompute", DATALOADER_MASK, dims.b * dims.s**2)]
        return out
    for key in layer_keys:
        out[key] = _selective(run, dims, out[key])
    return out


def _selective(run: Run, dims: Dims, rows: list[Saved]) -> list[Saved]:
    modules = run.recompute.modules
    out = list(rows)
    if "core_attn" in modules:
        out = _core_attention_inputs(run, dims, out)
    if "mlp" in modules:
        out = [r for r in out if r.component != "mlp" or "linear_fc1" in r.what]
    if "moe_act" in modules:
        out = [r for r in out if not (r.component == "moe" and ("SwiGLU" in r.what or "activation output" in r.what))]
    if "layernorm" in modules:
        out = [
            Saved(r.component, r.what + " (input only: recomputed)", dims.p * dims.tsp * dims.h, feature=r.feature)
            if r.component == "norm" and "rstd" not in r.what
            else r
            for r in out
            if not (r.component == "norm" and "rstd" in r.what)
        ]
    return out


def _core_attention_inputs(run: Run, dims: Dims, rows: list[Saved]) -> list[Saved]:
    """Selective ``core_attn``: the checkpoint keeps the core attention's inputs instead of its
    internals (the s x s scores, masks, probabilities; GQA's expanded keys and values). Megatron's
    unfused path passes q and k rotated (new tensors: the rows already counted) or as views of the
    qkv projection's output, and v always as such a view, so what stays is the rotated q, the
    rotated k at its own (unexpanded) heads, and the qkv output where nothing else kept it; checked
    on the local spec's model (a user's report: the view-sharing inputs were once counted again, +13%).
    MLA and the flash kernel's inputs are storages of their own (counted as the checkpoint's)."""
    m = run.model
    # the output linear_proj keeps is "attention"; a mask the layer is given is a checkpoint input too
    kept = [r for r in rows if r.component != "core_attn" or r.what in (DATALOADER_MASK, SHARED_MASK)]
    flash = any("log-sum-exp" in r.what for r in rows if r.component == "core_attn")
    if m.multi_latent_attention or flash:
        if m.multi_latent_attention:
            qk = m.qk_head_dim + m.qk_pos_emb_head_dim
            qkv = dims.p * dims.t * dims.a * (2 * qk + m.v_head_dim)
        else:
            qkv = dims.p * dims.t * (dims.a + 2 * dims.g) * dims.d
        return kept + [Saved("recompute", "core attention checkpoint inputs (q, k, v)", qkv)]
    p, t, d = dims.p, dims.t, dims.d
    if any(r.component == "core_attn" and r.what.startswith("q (rotated)") for r in rows):
        kept += [
            Saved("recompute", "core attention input: q (rotated)", p * t * dims.a * d),
            Saved("recompute", "core attention input: k (rotated, its own heads)", p * t * dims.g * d),
        ]
    if not any(r.what.startswith("qkv projection output") for r in kept):
        kept.append(
            Saved(
                "attention",
                "qkv projection output (v viewed from it: a checkpoint input)",
                p * t * (dims.a + 2 * dims.g) * d,
            )
        )
    return kept


def reforward_bytes(before: dict[str, list[Saved]], after: dict[str, list[Saved]], layers: tuple[int, ...]) -> int:
    """What megatron's recomputation re-creates at once in backward, beyond what the chunk keeps:
    the largest recomputed unit's saved rows less its kept ones (full: a group of layers, re-run
    together; selective: one layer's recomputed modules). They live while that unit's backward
    runs, on top of the activations still held."""
    keys = [f"layer {i}" for i in layers]

    def total(rows: list[Saved]) -> int:
        return sum(r.total for r in rows)

    units: list[list[str]] = []
    for key in keys:  # full recompute keeps a group's input on its first layer and nothing on the rest
        if units and not after[key] and total(before[key]):
            units[-1].append(key)
        else:
            units.append([key])
    return max((sum(total(before[k]) - total(after[k]) for k in unit) for unit in units), default=0)
