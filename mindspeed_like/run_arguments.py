"""What the demo and `mindspeed-like compare` share: model size arguments and quiet output."""

from __future__ import annotations

import warnings

from mindspeed_like.toolkit.cli_values import at_least


def add_model_arguments(group, **defaults: int) -> None:
    """The model size and training arguments the demo and `compare` share (named as Megatron-LM's)."""
    group.add_argument(
        "--steps", type=int, default=defaults["steps"], help=f"training steps (default {defaults['steps']})"
    )
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size"):
        group.add_argument(
            "--" + name.replace("_", "-"), type=int, default=defaults[name], help=f"(default {defaults[name]})"
        )
    group.add_argument("--lr", type=at_least(0), default=3e-3, help="learning rate, finite and >= 0 (default 3e-3)")
    group.add_argument("--seed", type=int, default=1234)


def quiet_expected_warnings() -> None:
    """megatron-core tells at import that TransformerEngine/Apex are absent: true, and expected
    here; the demo and compare hide only those lines so their own output stays readable."""
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated")
