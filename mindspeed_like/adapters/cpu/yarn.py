"""CPU adapter, YaRN rotary embedding (multi-latent attention's default ``rope_type='yarn'``).

``models.common.embeddings.yarn_rotary_pos_embedding.YarnRotaryEmbedding`` (0.13-0.19) subclasses
``RotaryEmbedding`` but places its own buffers, so the base class's adaptation (``devices.py``) does
not reach them:

* ``__init__``: ``device = torch.cuda.current_device()`` unless ``use_cpu_initialization`` (MLA never
  passes it), then ``inv_freq_extra``/``inv_freq_inter`` and the cos/sin cache under
  ``with torch.device(device)``; "Torch not compiled with CUDA enabled when instantiating
  MLASelfAttention" on a CPU host;
* the method that moves ``inv_freq_extra``/``inv_freq_inter`` to ``torch.cuda.current_device()`` at
  the first forward: ``get_emb`` from megatron-core 0.16 (an override of the base class's), the
  ``lru_cache``d ``forward`` before (0.13-0.15, where ``get_emb`` does not exist; the twin keeps
  the cache, as for ``RotaryEmbedding.forward``).

Each runs as its host twin (``host_view``): the same YaRN math (correction range, ramp mask,
mscale) on the CPU, from megatron's own bytecode.
"""

from __future__ import annotations

from mindspeed_like.adapters.cpu.devices import on_host

YARN = "models.common.embeddings.yarn_rotary_pos_embedding.YarnRotaryEmbedding"

PATCHES = [
    on_host(f"{YARN}.__init__", "inv_freq_extra/inv_freq_inter on torch.cuda.current_device()"),
    on_host(f"{YARN}.get_emb", "moves inv_freq_extra/inter to torch.cuda.current_device()", versions=">=0.16"),
    on_host(f"{YARN}.forward", "moves inv_freq_extra/inter to the device (lru_cache kept)", versions="<0.16"),
]
