"""ms-swift's unmodified ``megatron sft`` on a CPU host (issue 55 items 1 and 7): the CI-sized part.

Opt-in: ms-swift and mcore-bridge are not dependencies. ``make ms-swift-smoke`` builds
``.venv-ms-swift`` with both pinned beside torch 2.13.0, megatron-core 0.16.1 and transformers 4.57.6
(mcore-bridge's export check needs a Qwen3Config with ``rope_theta``) and runs the whole matrix
(mindspeed_like/testing/ms_swift_smoke.py); this file runs its CI-sized part there, through the same
driver: one rank in the default lane, TP=2 with sequence parallelism in the slow lane. Each is one
``megatron sft`` launch with ``MINDSPEED_LIKE_AUTOLOAD=1`` and ``--transfer-to-host``, on a random
2-layer Qwen3 made here (no hub).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from mindspeed_like.testing import ms_swift_smoke

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("swift", "mcore_bridge", "transformers")),
    reason="ms-swift / mcore-bridge are not installed (opt-in lane: `make ms-swift-smoke` builds .venv-ms-swift "
    "with ms-swift 4.6.0 and mcore-bridge 1.6.5)",
)


def _run(tmp_path, *cases: str) -> dict:
    record = tmp_path / "record.json"
    ms_swift_smoke.main(["--root", str(tmp_path), "--record", str(record), "--no-export", "--cases", *cases])
    return json.loads(record.read_text())["cases"]


def test_one_rank_trains_saves_and_logs_the_hosts_memory(tmp_path):
    result = _run(tmp_path, "qwen3-full-bf16")["qwen3-full-bf16"]
    assert result["rc"] == 0, result.get("log_tail")
    assert len(result["loss"]) == ms_swift_smoke.ITERS and result["check"]["finite"]
    assert all(m and m > 0 for m in result["memory_gib"])  # the host's figure (0.0 before item 3)
    assert {"checkpoint-2", "checkpoint-4"} <= set(result["checkpoints"])


@pytest.mark.slow
def test_tp2_with_sequence_parallel_equals_one_rank(tmp_path):
    cases = _run(tmp_path, "qwen3-full-bf16", "qwen3-full-bf16-tp2-sp")
    check = cases["qwen3-full-bf16-tp2-sp"]["check"]
    assert check["trained"] and check["equal"], check
