"""megatron's ``--pipeline-model-parallel-layout`` (``PipelineParallelLayerLayout``), read without
importing megatron: ``"Et*3|t|t*3|tL"`` lists the pipeline's PP x VPP stages, '|' between stages,
``E`` the embedding, ``t`` a decoder layer, ``m`` an MTP layer, ``L`` the loss, ``x*n`` and
``(...)*n`` repeats, commas cosmetic. Stage k is pipeline rank ``k % PP``'s virtual chunk ``k // PP``,
and decoder layers are numbered in stage order (megatron's ``get_layer_offset``)."""

from __future__ import annotations

import re

from mindspeed_like.toolkit.errors import ConfigError

_REPEATS = (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)")  # megatron's parse_str_to_list unrolls these, in order


def stages(layout: str) -> list[str]:
    """The layout's stages, each a string of layer letters."""
    text = layout.replace(",", "")
    for pattern in _REPEATS:
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    out = text.split("|")
    unknown = sorted({c for stage in out for c in stage} - set("EtmL"))
    if unknown:
        raise ConfigError(
            f"plan: --pipeline-model-parallel-layout {layout!r}: unknown layer letter(s) {', '.join(unknown)} "
            "(E embedding, t decoder layer, m MTP layer, L loss, '|' between stages)"
        )
    return out


def virtual_stages(layout: str, pp: int) -> int:
    count = len(stages(layout))
    if count % pp:
        raise ConfigError(
            f"plan: --pipeline-model-parallel-layout has {count} stages, not a multiple of "
            f"--pipeline-model-parallel-size {pp}"
        )
    return count // pp


def decoder_layers(layout: str, pp: int, num_layers: int) -> list[list[tuple[int, ...]]]:
    """``[pipeline rank][chunk] -> decoder layer indices``, checked as megatron's validate_layer_layout
    does for the decoder layers, the embedding and the loss."""
    listed = stages(layout)
    chunks = virtual_stages(layout, pp)
    counted = sum(stage.count("t") for stage in listed)
    if counted != num_layers:
        raise ConfigError(
            f"plan: --pipeline-model-parallel-layout has {counted} decoder layers ('t'), --num-layers is {num_layers}"
        )
    if listed[0].count("E") != 1 or any("E" in stage for stage in listed[1:]):
        raise ConfigError("plan: --pipeline-model-parallel-layout needs one 'E' (the embedding), in the first stage")
    if listed[-1].count("L") != 1 or any("L" in stage for stage in listed[:-1]):
        raise ConfigError("plan: --pipeline-model-parallel-layout needs one 'L' (the loss), in the last stage")
    out: list[list[tuple[int, ...]]] = [[() for _ in range(chunks)] for _ in range(pp)]
    start = 0
    for k, stage in enumerate(listed):
        count = stage.count("t")
        out[k % pp][k // pp] = tuple(range(start, start + count))
        start += count
    return out
