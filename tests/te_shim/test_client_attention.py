"""``transformer_engine.pytorch.attention`` for clients (issue 55 item 6): what mcore-bridge's patcher
looks up is served, as TE 2.1 serves it.

mcore-bridge 1.6.5 (``mcore_bridge/patcher.py``, ``_patch_transformer_engine``, run at its import)
does (``te`` is ``transformer_engine``), and logs "Failed to patch apply_rotary_pos_emb." / "Failed to
patch _SplitAlongDim." on a miss::

    from transformer_engine.pytorch.attention import apply_rotary_pos_emb  # else
    te.pytorch.attention.apply_rotary_pos_emb = te.pytorch.attention.rope.apply_rotary_pos_emb
    from transformer_engine.pytorch.attention import _SplitAlongDim  # else
    te.pytorch.attention._SplitAlongDim = te.pytorch.utils.SplitAlongDim

``_SplitAlongDim`` against ``torch.split``: the same views forward (no copy), the gradient of the
whole (gradcheck in float64, int and list sections, squeeze), and TE's no-copy backward when the
incoming gradients are adjacent slices of one buffer.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

import mindspeed_like
from mindspeed_like.te_backend import rope
from mindspeed_like.te_shim.attention import _SplitAlongDim


@pytest.fixture
def te():
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    yield importlib.import_module("transformer_engine")
    mindspeed_like.reset()


def _patch_transformer_engine(logger: logging.Logger) -> None:
    """mcore-bridge 1.6.5's ``_patch_transformer_engine``, verbatim but for its logger."""
    import transformer_engine

    try:
        from transformer_engine.pytorch.attention import apply_rotary_pos_emb  # noqa: F401
    except ImportError:
        try:
            transformer_engine.pytorch.attention.apply_rotary_pos_emb = (
                transformer_engine.pytorch.attention.rope.apply_rotary_pos_emb
            )
        except (ImportError, AttributeError):
            logger.warning("Failed to patch apply_rotary_pos_emb.")
    try:
        from transformer_engine.pytorch.attention import _SplitAlongDim  # noqa: F401
    except ImportError:
        try:
            transformer_engine.pytorch.attention._SplitAlongDim = transformer_engine.pytorch.utils.SplitAlongDim
        except (ImportError, AttributeError):
            logger.warning("Failed to patch _SplitAlongDim.")


def test_mcore_bridge_patcher_finds_both_names(te, caplog):
    logger = logging.getLogger("test.mcore_bridge")
    with caplog.at_level(logging.WARNING, logger="test.mcore_bridge"):
        _patch_transformer_engine(logger)
    assert [r.getMessage() for r in caplog.records if r.name == "test.mcore_bridge"] == []
    attention = te.pytorch.attention
    assert attention.apply_rotary_pos_emb is rope.apply_rotary_pos_emb
    assert attention._SplitAlongDim is _SplitAlongDim
    # TE 2.1 re-exports its attention classes from this module: the same classes
    assert attention.DotProductAttention is te.pytorch.DotProductAttention


def test_served_as_te_2_1_lays_it_out(te):
    assert te.__version__ == "2.1.0"
    with pytest.raises(ImportError, match="not a package"):
        importlib.import_module("transformer_engine.pytorch.attention.rope")  # TE >= 2.3's module
    with pytest.raises(ImportError):
        exec("from transformer_engine.pytorch.attention import apply_fused_qkv_rotary_pos_emb", {})  # TE >= 2.3
    assert not hasattr(te.pytorch.attention, "InferenceParams")


def test_without_the_client_module_mcore_bridge_cannot_import_transformer_engine():
    """Off (--no-te-client-module), as without TE: the patcher stops at its first line."""
    mindspeed_like.reset()
    try:
        mindspeed_like.configure(device="cpu", no_te_client_module=True)
        logger = logging.getLogger("test.mcore_bridge")
        with pytest.raises(ImportError):  # mcore-bridge itself then stops at `import transformer_engine`
            _patch_transformer_engine(logger)
    finally:
        mindspeed_like.reset()


# ------------------------------------------------------------------------------------- _SplitAlongDim
@pytest.mark.parametrize(
    ("shape", "dim", "sections", "squeeze"),
    [
        ((4, 2, 9), -1, [3, 3, 3], False),
        ((4, 2, 9), 2, [2, 4, 3], False),
        ((4, 5, 3), 1, 2, False),  # int sections, a shorter last piece
        ((3, 2, 3, 5), 2, [1, 1, 1], True),  # q, k, v of [s, b, 3, d], squeezed as TE's attention does
    ],
)
def test_split_is_torch_split_views_with_the_whole_gradient(shape, dim, sections, squeeze):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    pieces = _SplitAlongDim.apply(x, dim, sections, squeeze)
    expected = torch.split(x.detach(), sections, dim=dim)
    if squeeze:
        expected = [e.squeeze(dim) for e in expected]
    assert len(pieces) == len(expected)
    for piece, want in zip(pieces, expected):
        assert torch.equal(piece, want)
        assert piece.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # views, no copy
    assert torch.autograd.gradcheck(lambda t: _SplitAlongDim.apply(t, dim, sections, squeeze), (x,))
    weights = [torch.randn_like(p) for p in pieces]
    sum((p * w).sum() for p, w in zip(pieces, weights)).backward()
    reference = x.detach().clone().requires_grad_()
    ref_pieces = torch.split(reference, sections, dim=dim)
    if squeeze:
        ref_pieces = [p.squeeze(dim) for p in ref_pieces]
    sum((p * w).sum() for p, w in zip(ref_pieces, weights)).backward()
    assert torch.equal(x.grad, reference.grad)


def test_unused_piece_gets_a_zero_gradient():
    x = torch.randn(2, 6, requires_grad=True)
    q, k, v = _SplitAlongDim.apply(x, 1, [2, 2, 2])
    (q * 3).sum().backward()
    assert torch.equal(x.grad, torch.cat((torch.full((2, 2), 3.0), torch.zeros(2, 4)), dim=1))


def test_adjacent_gradient_slices_come_back_as_one_view():
    """TE's no-copy backward: gradients that are consecutive slices of one buffer are that buffer."""
    buffer = torch.randn(4, 9)
    grads = torch.split(buffer, [3, 3, 3], dim=1)

    class Ctx:
        split_dim, sizes, squeezed = 1, [3, 3, 3], [False] * 3

    whole, *rest = _SplitAlongDim.backward(Ctx, *grads)
    assert rest == [None, None, None]
    assert torch.equal(whole, buffer) and whole.data_ptr() == buffer.data_ptr()  # no copy
    shuffled = (grads[1], grads[0], grads[2])  # not in order: concatenated, a new tensor
    joined = _SplitAlongDim.backward(Ctx, *shuffled)[0]
    assert torch.equal(joined, torch.cat(shuffled, dim=1)) and joined.data_ptr() != buffer.data_ptr()


def test_sections_that_do_not_add_up_are_refused():
    with pytest.raises(ValueError, match=r"sections \[2, 2\] do not add up to the size 5 of dim 1"):
        _SplitAlongDim.apply(torch.randn(2, 5), 1, [2, 2])
