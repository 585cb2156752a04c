"""CPU adapter, multi-token prediction (``--mtp-num-layers``, DeepSeek-V3's MTP heads).

Targets (``megatron/core/transformer/multi_token_prediction.py``):

* ``MTPLossLoggingHelper.save_loss_to_tracker`` (0.14-0.18; ``save_metrics_to_tracker`` from 0.19,
  which also tracks accuracy): every MTP layer's loss is added to a tracker tensor created on
  ``torch.cuda.current_device()`` at the first training step (0.13 creates it on the loss's device
  and needs nothing). ``GPTModel._postprocess`` calls it whenever ``mtp_num_layers`` is set.
* ``roll_tensor`` (0.14+): the labels and loss mask of MTP depth ``k`` are the sequence shifted by
  ``k``; with context parallelism > 1 the boundary tokens come from the neighbouring CP rank
  through receive buffers on ``torch.cuda.current_device()``.

Both run as host twins (``host_view``): megatron's own code with the tracker and the buffers on
the CPU, where gloo reduces and exchanges them.
"""

from __future__ import annotations

from mindspeed_like.adapters.cpu.devices import on_host

MTP = "transformer.multi_token_prediction"

PATCHES = [
    on_host(
        f"{MTP}.MTPLossLoggingHelper.save_loss_to_tracker",
        "loss tracker on torch.cuda.current_device()",
        versions=">=0.14,<0.19",
    ),
    on_host(
        f"{MTP}.MTPLossLoggingHelper.save_metrics_to_tracker",
        "loss/accuracy trackers on torch.cuda.current_device()",
        versions=">=0.19",
    ),
    on_host(f"{MTP}.roll_tensor", "CP boundary receive buffers on torch.cuda.current_device()", versions=">=0.14"),
]
