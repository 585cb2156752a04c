"""The output layer and the vocab-parallel cross-entropy in one chunked autograd function: the
``[tokens, vocab/TP]`` logits never exist, only one chunk's ``[chunk, vocab/TP]`` at a time.

Per chunk of tokens, the same arithmetic as megatron's output layer followed by its
``vocab_parallel_cross_entropy`` (``tensor_parallel/cross_entropy.py``):
``logits = hidden @ weight^T`` in the model's dtype, then in fp32: the max over the vocabulary
(all-reduced MAX over TP), logits minus max, the target's logit on the rank whose vocab shard
holds it (SUM over TP), ``sum(exp)`` (SUM over TP), ``loss = log(sum_exp) - target_logit``.
Forward keeps only the per-token max and ``sum(exp)`` (fp32) and target index (int32) besides the
inputs. Backward walks the vocabulary instead of the tokens: per slice of vocabulary columns it
recomputes all tokens' logits of that slice, forms megatron's ``(exp(logits - max) / sum_exp -
onehot) * grad`` as ``(exp(logits - max) - sum_exp * onehot) * (grad / sum_exp)`` (the division
folded into the scaling, no pass of its own; ``grad`` is the incoming per-token gradient:
megatron's loss is per token, the caller's mask and normalisation arrive there), casts
it to the model's dtype as megatron's autograd does, writes that slice's rows of ``d weight``
once (or adds them to ``weight.main_grad`` with gradient-accumulation fusion, megatron's rule
reproduced by the tp-overlap wgrad helper) and adds its term of ``d hidden`` (fp32).
Why not one saved log-sum-exp, ``exp(logits - (max + log(sum_exp)))`` (flash-style, one fp32 a
token): in fp32, ``max + log(sum_exp)`` loses ``log(sum_exp)`` (at most log V) to rounding once
``|max|`` grows (its ulp reaches 1 at 2^24), so the probabilities stop summing to 1: at a largest
``|logit|`` of 1.4e5 / 1.4e7 / 1.4e9 ``d hidden`` was 0.09% / 10% / 36% off megatron's and
``d weight`` 0.14% / 26% / 97% (a tied maximum got probability 1 at each tied logit instead of
1/n). Logits that large are what a diverging run reaches just before megatron's NaN guard fires:
issue 37 item 3 measured ``--lr 1e3`` (bf16) stopping at iteration 7 (DP=2; 12 at DP=1) instead
of megatron's 3 with this feature alone, at megatron's iteration after the change
(tests/kernels/test_nonfinite_propagation.py,
tests/reliability/test_megatron_lm_nan_guard.py). ``logits - max`` is clamped at 0 before the
exp: the backward's recomputed logits come from another matmul shape than forward's and BLAS may
round them differently (MKL did for 16 tokens x 2 columns); at ``|logit|`` 1e9 one fp32 ulp is 64,
so a recomputed maximum one ulp higher gave ``exp(64)`` and an inf gradient where megatron's softmax
(saved from forward) never exceeds 1. The price, one more elementwise pass (the clamp) per
vocabulary slice and 4 bytes a token: fwd+bwd time within the noise of this shared 2-core CPU
(-1% to +4% at hidden 128, vocab 32k; +-1.5% at hidden 1024).
Why columns in backward: with token chunks every chunk re-read and re-wrote the whole
``[vocab/TP, hidden]`` fp32 weight gradient (at vocab 128k, hidden 1024 and 128-token chunks,
32 passes over 512 MiB), measured 1.8x megatron's time where the extra matmul explains 1.33x;
per column slice only ``d hidden`` ``[tokens, hidden]`` is accumulated.

Cost: one more ``hidden @ weight^T`` than megatron (recomputed in backward), in exchange for the
``[tokens, vocab/TP]`` logits, their fp32 copy and the fp32 softmax megatron keeps for backward.
The partial ``d hidden`` of this TP rank's vocab shard is reduced by the caller's
``copy_to_tensor_model_parallel_region`` / sequence-parallel gather (megatron's own functions).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mindspeed_like.kernels.tp_overlap.wgrad import weight_gradient

AUTO_CHUNK_BYTES = 64 * 2**20
"""The default chunk on a host: its fp32 logits take at most this many bytes (64 MiB). The block's
peak is the weight gradient plus about one chunk: at vocab 128k and hidden 1024 the fp32 weight
gradient is 512 MiB, and a 64 MiB chunk keeps the peak >= 4x below megatron's at 4096 tokens."""
CUDA_AUTO_CHUNK_BYTES = 256 * 2**20
"""The default chunk on a GPU (``cuda`` backend): 4x the host's. Each chunk costs ~a dozen kernel
launches forward and a dozen per vocabulary slice backward, and a GPU training step waits on the
host's launches (the first H100 run); 256 MiB is 2 chunks at 4096 tokens of a 32k vocabulary,
still far below megatron's ``[tokens, vocab]`` bf16 logits plus their fp32 copies (1.3 GiB there)."""
MIN_AUTO_CHUNK, MAX_AUTO_CHUNK = 64, 8192


def auto_chunk_tokens(vocab_per_rank: int, device: torch.device | str | None = None) -> int:
    """Tokens per chunk so that one chunk's fp32 logits fit the device's chunk budget
    (:data:`AUTO_CHUNK_BYTES`, :data:`CUDA_AUTO_CHUNK_BYTES` for CUDA tensors) clamped to [64, 8192]:
    below 64 rows the matmuls lose efficiency, above 8192 nothing is gained."""
    on_gpu = device is not None and torch.device(device).type == "cuda"
    budget = CUDA_AUTO_CHUNK_BYTES if on_gpu else AUTO_CHUNK_BYTES
    fitting = budget // (4 * max(1, vocab_per_rank))
    return int(min(MAX_AUTO_CHUNK, max(MIN_AUTO_CHUNK, fitting)))


def vocab_columns(chunk_tokens: int, vocab_local: int, tokens: int) -> int:
    """Backward's slice of the vocabulary: as many columns over all ``tokens`` as a forward
    chunk of ``chunk_tokens`` rows over the whole shard holds elements, so both passes keep the
    same bytes alive."""
    return max(1, min(vocab_local, chunk_tokens * vocab_local // max(1, tokens)))


def _subtract_onehot(probs: torch.Tensor, targets: torch.Tensor, lo: int, hi: int, value: torch.Tensor) -> None:
    """``probs[t, targets[t] - lo] -= value[t]`` for the tokens whose target lies in ``[lo, hi)``.

    A scatter of ``-value`` (holders) or ``-0.0`` (everyone else, at a clamped column) instead of
    ``nonzero()`` + advanced indexing: same values bit for bit (``x + (-v) == x - v`` and
    ``x + (-0.0) == x`` for every float, signed zeros included), but no data-dependent shape, so
    no host synchronisation per vocabulary slice on an accelerator."""
    inside = (targets >= lo) & (targets < hi)
    columns = (targets - lo).clamp_(0, hi - lo - 1).long().unsqueeze(-1)
    delta = torch.where(inside, -value, -0.0).to(probs.dtype).unsqueeze(-1)
    probs.scatter_add_(1, columns, delta)


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _local_targets(labels: torch.Tensor, vocab_start: int, vocab_local: int) -> torch.Tensor:
    """Targets as int32 indices into this rank's vocab shard; -1 where another rank holds it
    (int32: backward keeps 4 bytes a token, less than megatron's int64 target + bool mask)."""
    local = labels - vocab_start
    return local.masked_fill_((local < 0) | (local >= vocab_local), -1).to(torch.int32)


def _split(local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into the shard, usable by gather; where the target is on another rank)."""
    elsewhere = local < 0
    return local.clamp(min=0).long(), elsewhere


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``(hidden [N, H], weight [V/TP, H], labels [N]) -> per-token loss [N]`` (fp32)."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk: int,
        vocab_start: int,
        tp_group,
        accumulation_fusion: bool,
    ) -> torch.Tensor:
        tokens, vocab_local = hidden.shape[0], weight.shape[0]
        loss = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        norm = torch.empty(2, tokens, dtype=torch.float32, device=hidden.device)  # [max, sum(exp)]
        targets = _local_targets(labels, vocab_start, vocab_local)
        for lo in range(0, tokens, chunk):
            hi = min(tokens, lo + chunk)
            logits = torch.matmul(hidden[lo:hi], weight.t()).float()
            top = logits.max(dim=-1).values
            _all_reduce(top, dist.ReduceOp.MAX, tp_group)
            logits.sub_(top.unsqueeze(-1))
            local, elsewhere = _split(targets[lo:hi])
            sums = torch.empty(2, hi - lo, dtype=torch.float32, device=hidden.device)
            sums[0] = logits.gather(1, local.unsqueeze(-1)).squeeze(-1).masked_fill_(elsewhere, 0.0)
            sums[1] = logits.exp_().sum(dim=-1)
            _all_reduce(sums, dist.ReduceOp.SUM, tp_group)
            target_logit, sum_exp = sums[0], sums[1]
            loss[lo:hi] = torch.log(sum_exp) - target_logit
            norm[0, lo:hi], norm[1, lo:hi] = top, sum_exp
            del logits  # before the next chunk's matmul allocates: one chunk alive at a time
        ctx.save_for_backward(hidden, weight, targets, norm)
        ctx.chunk, ctx.accumulation_fusion = chunk, accumulation_fusion
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, targets, norm = ctx.saved_tensors
        tokens, vocab_local = hidden.shape[0], weight.shape[0]
        width = vocab_columns(ctx.chunk, vocab_local, tokens)
        fusion = ctx.accumulation_fusion and hasattr(weight, "main_grad")
        # d hidden sums over the vocabulary slices: in fp32 (in place for fp32 models)
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = None if fusion else torch.empty_like(weight)
        top, sum_exp = norm[0].unsqueeze(-1), norm[1]
        scale = (grad_loss / sum_exp).unsqueeze(-1)  # megatron's division by sum_exp, folded in
        for lo in range(0, vocab_local, width):
            hi = min(vocab_local, lo + width)
            block = weight[lo:hi]
            probs = torch.matmul(hidden, block.t()).float()
            probs.sub_(top).clamp_(max=0.0).exp_()  # megatron's exp(logits - max), never above 1
            _subtract_onehot(probs, targets, lo, hi, sum_exp)
            grad_logits = probs.mul_(scale).to(hidden.dtype)
            if hidden.dtype == torch.float32:
                grad_hidden.addmm_(grad_logits, block)
            else:
                grad_hidden.add_(torch.matmul(grad_logits, block))
            if fusion:
                weight_gradient(
                    weight,
                    grad_logits,
                    hidden,
                    accumulation_fusion=True,
                    compute=True,
                    input_dtype=hidden.dtype,
                    rows=slice(lo, hi),
                )
            else:
                torch.matmul(grad_logits.t(), hidden, out=grad_weight[lo:hi])
            del probs, grad_logits
        if fusion:
            # megatron's dummy gradient (or None) once the slices are accumulated into main_grad
            grad_weight = weight_gradient(
                weight, hidden[:0], hidden[:0], accumulation_fusion=True, compute=False, input_dtype=hidden.dtype
            )
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int = 0,
    vocab_start: int = 0,
    tp_group=None,
    accumulation_fusion: bool = False,
) -> torch.Tensor:
    """Per-token cross-entropy of ``hidden [..., H] @ weight [V/TP, H]^T`` against ``labels
    [...]`` (global vocabulary ids; this rank holds ``[vocab_start, vocab_start + V/TP)``), fp32,
    shaped like ``labels``. ``chunk_tokens`` 0: :func:`auto_chunk_tokens`."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on the tokens")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} != the output weight's {weight.shape[-1]}")
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0 (0: automatic), got {chunk_tokens}")
    chunk = chunk_tokens or auto_chunk_tokens(weight.shape[0], weight.device)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    tokens = flat_hidden.shape[0]
    loss = ChunkedLinearCrossEntropy.apply(
        flat_hidden,
        weight,
        labels.reshape(-1),
        max(1, min(chunk, tokens or 1)),
        vocab_start,
        tp_group,
        accumulation_fusion,
    )
    return loss.view(labels.shape)
