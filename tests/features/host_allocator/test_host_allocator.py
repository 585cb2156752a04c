"""host-allocator: glibc's settings act (page faults counted, not timed), stand aside for the
user's own allocator choice, come back on switch-off, and change no result of a megatron model."""

from __future__ import annotations

import logging
import resource

import pytest
import torch

import mindspeed_like
from mindspeed_like.features import host_allocator
from mindspeed_like.features.host_allocator import glibc
from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt, train_steps
from mindspeed_like.testing.parity import SEED, assert_losses_equal

BLOCK = 64 * 2**20  # far above glibc's mmap threshold (128 KiB, adaptive up to 32 MiB)
PAGES = BLOCK // resource.getpagesize()

pytestmark = pytest.mark.skipif(glibc.why_not() is not None, reason=f"not tunable here: {glibc.why_not()}")


@pytest.fixture(autouse=True)
def fresh():
    mindspeed_like.reset()
    yield
    destroy_parallel()
    mindspeed_like.reset()


def _faults_of_blocks(count: int) -> int:
    """Minor page faults of ``count`` rounds of allocating, writing and freeing one BLOCK."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(count):
        block = torch.empty(BLOCK, dtype=torch.uint8)
        block.fill_(1)
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_freed_blocks_are_reused_without_new_page_faults():
    mindspeed_like.configure(device="cpu")
    assert not host_allocator.tuned()
    untuned = _faults_of_blocks(8)
    assert untuned > 0.9 * 8 * PAGES, "glibc's default: every round maps (and faults) fresh pages"

    mindspeed_like.configure(device="cpu", tune_host_allocator=True)
    assert host_allocator.tuned()
    _faults_of_blocks(2)  # the heap grows to hold the block once
    assert _faults_of_blocks(8) < 0.05 * PAGES, "tuned: the freed block's pages are reused"

    mindspeed_like.configure(device="cpu", tune_host_allocator=False)  # switched off: defaults back
    assert not host_allocator.tuned()
    assert _faults_of_blocks(8) > 0.9 * 8 * PAGES


def test_level_1_switches_it_on_and_reset_restores():
    mindspeed_like.configure(device="cpu", optimization_level=1)
    assert host_allocator.tuned()
    mindspeed_like.configure(device="cpu", optimization_level=1, tune_host_allocator=False)
    assert not host_allocator.tuned()
    mindspeed_like.reset()  # configure() values accumulate: forget the explicit False
    mindspeed_like.configure(device="cpu", optimization_level=2)
    assert host_allocator.tuned()
    mindspeed_like.reset()
    assert not host_allocator.tuned()
    assert _faults_of_blocks(4) > 0.9 * 4 * PAGES


@pytest.mark.parametrize(
    "environ, says",
    [
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc"),
        ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, "tcmalloc"),
        ({"MALLOC_MMAP_MAX_": "0"}, "MALLOC_MMAP_MAX_"),
        ({"MALLOC_TRIM_THRESHOLD_": "1"}, "MALLOC_TRIM_THRESHOLD_"),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}, "GLIBC_TUNABLES"),
    ],
)
def test_the_users_own_allocator_choice_stands(environ, says):
    reason = glibc.why_not(environ)
    assert reason is not None and says in reason
    assert glibc.why_not({"LD_PRELOAD": "libfoo.so", "GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) is None


def test_stands_aside_with_one_line_when_the_user_chose_an_allocator(monkeypatch, caplog):
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")
    with caplog.at_level(logging.INFO, logger="mindspeed_like"):
        mindspeed_like.configure(device="cpu", tune_host_allocator=True, strict=True)  # never an error
        mindspeed_like.configure(device="cpu", tune_host_allocator=True, strict=True)  # once only
    assert not host_allocator.tuned()
    lines = [r.getMessage() for r in caplog.records if "host-allocator" in r.getMessage()]
    assert len(lines) == 1 and "MALLOC_MMAP_MAX_" in lines[0] and "the user's settings stand" in lines[0]


def test_a_device_with_its_own_allocator_is_said_once(caplog):
    from mindspeed_like.toolkit.declaration import Context

    ctx = Context(config=mindspeed_like.current_config(), device="npu")
    with caplog.at_level(logging.INFO, logger="mindspeed_like"):
        host_allocator.FEATURE.activate(ctx)
        host_allocator.FEATURE.activate(ctx)
    assert not host_allocator.tuned()
    lines = [r.getMessage() for r in caplog.records if "host-allocator" in r.getMessage()]
    assert len(lines) == 1 and "npu memory" in lines[0]


def _train(tuned: bool) -> list[float]:
    mindspeed_like.configure(device="cpu", tune_host_allocator=tuned)
    assert host_allocator.tuned() == tuned
    init_parallel(seed=SEED)
    losses = train_steps(tiny_gpt(), 4, seed=SEED)
    destroy_parallel()
    return losses


def test_gpt_losses_bitwise_with_and_without():
    assert_losses_equal(_train(True), _train(False), "GPT with the host allocator tuned vs glibc's defaults")
