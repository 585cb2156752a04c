"""A host twin reads megatron-FSDP's ``f"cuda:{torch.cuda.current_device()}"`` as ``"cpu"``.

megatron-FSDP (``MegatronFSDP.__init__``, ``FullyShardedDataParallel.__init__``) builds its device as
``torch.device(f"cuda:{torch.cuda.current_device()}")``; a twin dropped nothing of it before and the
f-string read ``"cuda:cpu"`` (an invalid device). Any other ``cuda:`` f-string stays loud, and the
inventory tells the two apart."""

from __future__ import annotations

import pytest
import torch

from mindspeed_like.adapters.cpu import cuda_sites as cs
from mindspeed_like.adapters.cpu.host_view import host_function


def _current_device():
    return torch.device(f"cuda:{torch.cuda.current_device()}")


def _literal_index(index):
    return torch.device(f"cuda:{index}")


def test_current_device_format_reads_the_host():
    assert host_function(_current_device)() == torch.device("cpu")


def test_an_integer_index_stays_loud():
    with pytest.raises(RuntimeError):
        host_function(_literal_index)(0)


def test_the_inventory_tells_the_two_apart():
    source = (
        "def mine():\n    return torch.device(f'cuda:{torch.cuda.current_device()}')\n"
        "def other(i):\n    return torch.device(f'cuda:{i}')\n"
    )
    sites = cs.sites_in_source(source)
    assert [site.kind for site in sites["mine"]] == [cs.CURRENT_DEVICE_FORMAT]
    assert [site.kind for site in sites["other"]] == [cs.CUDA_INDEXED]
