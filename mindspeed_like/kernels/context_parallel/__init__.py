"""Context-parallel attention without TransformerEngine: each rank holds megatron's two zigzag
chunks of the sequence (``get_batch_on_this_cp_rank``: chunks ``r`` and ``2*CP-1-r`` of 2*CP) and
the algorithms compute exact attention over the whole sequence:

* ``ring`` (MindSpeed ``megatron_cp_algo``): K/V blocks travel around the CP ring (asynchronous
  send/recv overlapped with the current block's attention), partial outputs merged with their
  log-sum-exp; backward is a ring too (dK/dV travel with their block back home);
* ``ulysses`` (``ulysses_cp_algo``): all-to-all from sequence to heads, full attention, and back;
* ``allgather_kv`` (``kvallgather_cp_algo``): K/V all-gathered, local queries (Llama-3 style);
* ``hybrid`` (``hybrid_cp_algo``): Ulysses inside groups of consecutive CP ranks, ring across.

Layout everywhere: ``[b, heads, s_local, d]``, the two local chunks concatenated. Attention dropout:
``dropout=AttentionDropout(p, seed)`` (``kernels/attention_dropout.py``, shared with the blocked kernel).
"""

from mindspeed_like.kernels.attention_dropout import AttentionDropout
from mindspeed_like.kernels.context_parallel.allgather_kv import allgather_kv_attention
from mindspeed_like.kernels.context_parallel.groups import CPGroup
from mindspeed_like.kernels.context_parallel.hybrid import hybrid_attention
from mindspeed_like.kernels.context_parallel.ring import ring_attention
from mindspeed_like.kernels.context_parallel.ulysses import ulysses_attention

__all__ = [
    "AttentionDropout",
    "CPGroup",
    "allgather_kv_attention",
    "hybrid_attention",
    "ring_attention",
    "ulysses_attention",
]
