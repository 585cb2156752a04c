"""te-client-module: ``import transformer_engine`` works for clients where TE is not installed.

Clients that import TransformerEngine themselves (Megatron-Bridge's ``peft/lora_layers.py`` does
``import transformer_engine.pytorch as te`` unconditionally, so ``from megatron.bridge import
AutoBridge`` fails without TE) get a ``transformer_engine`` module whose layers
(``te.pytorch.Linear``, ``LayerNormLinear``, ``RMSNorm``, ``LayerNorm``, ``DotProductAttention``,
``GroupedLinear``, and the whole-layer ``TransformerLayer``, ``MultiheadAttention``,
``LayerNormMLP`` built from them in ``layers.py``) run on our kernels (``pytorch.py``) and whose
TE-only mechanisms (fp8 recipes
and enabled autocasts, userbuffers, CUDA graphs, TE's CPU offload, fusible ops) are refused by
name with the alternative (``refusals.py``). The models such clients build from megatron's TE
specs are the te-backend's (this feature is on only with it).

The module exists ONLY where no real TransformerEngine is installed, ONLY after our import line
(the feature's ``activate`` appends the finder to ``sys.meta_path``), NEVER shadows a real TE (the
finder sits after the path finder and asks it first), and megatron-core keeps seeing no TE in any
import order (``finder.py`` says how and why). ``reset()`` (or ``--no-te-client-module``) removes the
finder and the modules it served. The report lists it as a declared global change: the patch
below wraps the finder's own ``find_spec`` (a pass-through; the change itself is the finder's place
on ``sys.meta_path``, which is not an attribute the engine can patch), as the npu-adapter lists
torch_npu's ``transfer_to_npu``.
"""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch, pass_through
from mindspeed_like.toolkit import transformer_engine
from mindspeed_like.toolkit.declaration import Context, Feature, Flag

NAME = "te-client-module"
FINDER = "mindspeed_like.te_shim.finder.ClientModuleFinder.find_spec"


PATCHES = [
    Patch(
        FINDER,
        Kind.WRAP,
        pass_through,  # the report entry stands for the finder's place on sys.meta_path
        global_change=True,
        why="appended to sys.meta_path: `import transformer_engine` (and .pytorch, .common.recipe) gives clients our "
        "TE-compatible module; never megatron-core, never over a real TE",
    ),
]


def _activate(ctx: Context) -> None:
    from mindspeed_like.te_shim import finder

    finder.install()


def _switch_off() -> None:
    from mindspeed_like.te_shim import finder

    finder.uninstall()


def enabled(ctx: Context) -> bool:
    return not ctx["no_te_client_module"] and not ctx["no_te_backend"] and not transformer_engine.installed()


FEATURE = Feature(
    name=NAME,
    summary="`import transformer_engine` for clients that import TE themselves (Megatron-Bridge), on our kernels, "
    "where no TransformerEngine is installed; megatron-core keeps seeing no TE",
    patches=PATCHES,
    flags=(
        Flag(
            "no_te_client_module",
            bool,
            False,
            "off switch: no `transformer_engine` module for clients (their `import transformer_engine` fails as "
            "without TE); never served where a real TransformerEngine is installed",
        ),
    ),
    enabled=enabled,
    activate=_activate,
    before_switch_off=_switch_off,
    backend=lambda ctx: "off: TransformerEngine is installed" if transformer_engine.installed() else ctx.kernel_backend,
    switched_by="no TransformerEngine installed, te-backend on (off: --no-te-client-module)",
    kind="adapter",
)

__all__ = ["FEATURE", "NAME"]
