"""Real text for the demo without downloads: the bytes of the installed megatron-core sources.

Byte-level tokens (vocab 256). Files are read in sorted order so a seed gives the same data
on every machine with the same megatron-core.
"""

from __future__ import annotations

import os

import torch

from mindspeed_like.megatron_version import _package_info_path


def megatron_source_bytes(limit: int = 4_000_000) -> torch.Tensor:
    """Up to `limit` bytes of megatron/core/**/*.py as an int64 tensor of token ids."""
    info = _package_info_path()
    if info is None:
        raise RuntimeError("megatron-core is not installed: the demo trains on its source files")
    root = os.path.dirname(info)
    chunks: list[bytes] = []
    total = 0
    for directory, subdirs, files in sorted(os.walk(root)):
        subdirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(directory, name), "rb") as handle:
                    data = handle.read()
                chunks.append(data)
                total += len(data)
                if total >= limit:
                    break
        if total >= limit:
            break
    raw = b"".join(chunks)[:limit]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


def sample_windows(tokens: torch.Tensor, batch_size: int, seq_length: int, generator: torch.Generator) -> torch.Tensor:
    """Random windows of seq_length + 1 tokens, [batch, seq + 1]: inputs and shifted labels."""
    starts = torch.randint(0, tokens.numel() - seq_length - 1, (batch_size,), generator=generator)
    return torch.stack([tokens[s : s + seq_length + 1] for s in starts.tolist()])
