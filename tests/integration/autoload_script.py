"""Run in a fresh interpreter by test_autoload.py (directly, or as each torchrun worker): one
import order under MINDSPEED_LIKE_AUTOLOAD as the environment sets it, then what the process
holds, as JSON on the last line of stdout (torchrun workers: in OUT_DIR/rank<N>.json).

Nothing here imports mindspeed_like before the import under test: whether the adaptor came in,
and when, is the point."""

from __future__ import annotations

import json
import os
import sys

ADAPTOR = "mindspeed_like.megatron_adaptor"


class Recorder:
    """Placed right after the trigger on ``sys.meta_path``: asked first once the trigger hands the
    look-up on, it records, for the first look-up of each watched package, whether the adaptor was
    in by then (the look-up comes before the package's module executes)."""

    def __init__(self) -> None:
        self.seen: dict[str, bool] = {}

    def find_spec(self, fullname, path=None, target=None):
        root = fullname.partition(".")[0]
        if root in ("megatron", "transformer_engine", "mcore_bridge") and root not in self.seen:
            self.seen[root] = ADAPTOR in sys.modules
        return None


def ours_loaded() -> list[str]:
    return sorted(n for n in sys.modules if n.split(".")[0] == "mindspeed_like")


def trigger_armed() -> bool:
    return any(type(f).__name__ == "_Trigger" for f in sys.meta_path)


def have_te_true() -> list[str]:
    """megatron-core modules whose HAVE_TE* flags are True (te-client-module must keep none)."""
    found = []
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and module is not None:
            found += [
                f"{name}.{attr}"
                for attr, value in list(vars(module).items())
                if attr.startswith("HAVE_TE") and value is True
            ]
    return found


def adaptor_state() -> dict:
    out = {"adaptor": ADAPTOR in sys.modules, "trigger_armed": trigger_armed()}
    if out["adaptor"]:
        import mindspeed_like

        out["optimization_level"] = mindspeed_like.current_config()["optimization_level"]
        out["patches_applied"] = sum(r.status == "applied" for r in mindspeed_like.report())
    return out


def main(order: str) -> dict:
    out: dict = {}
    recorder = Recorder()
    if order == "megatron-first":
        import megatron.core  # noqa: F401  (imports torch: torch's autoload runs inside megatron's import)

        out["after_megatron_core"] = adaptor_state()
        from megatron.core.models.gpt import gpt_model  # noqa: F401  (megatron.core did not import it)

        out["after_gpt_model"] = adaptor_state()
        import transformer_engine

        out["te_served_by_us"] = type(transformer_engine.__spec__.loader).__name__ == "ClientModuleFinder"
        out["have_te_true"] = have_te_true()
        return out
    import torch  # noqa: F401  (torch's autoload runs here)

    out["after_torch"] = {"ours": ours_loaded(), "trigger_armed": trigger_armed()}
    position = next((i + 1 for i, f in enumerate(sys.meta_path) if type(f).__name__ == "_Trigger"), 0)
    sys.meta_path.insert(position, recorder)
    if order == "adaptor-alone":
        import mindspeed_like.megatron_adaptor  # noqa: F401

        out["watched_loaded"] = sorted(
            n for n in sys.modules if n.partition(".")[0] in ("megatron", "transformer_engine", "mcore_bridge")
        )
        return out
    if order == "te-first":
        import transformer_engine

        out["te_served_by_us"] = type(transformer_engine.__spec__.loader).__name__ == "ClientModuleFinder"
        from megatron.core import fp8_utils

        out["have_te_true"] = have_te_true()
        out["fp8_utils_have_te"] = fp8_utils.HAVE_TE
    else:
        import megatron.core  # noqa: F401
    if order == "torchrun":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        out["rank"], out["world_size"] = dist.get_rank(), dist.get_world_size()
        flag = torch.tensor([int(ADAPTOR in sys.modules)])
        dist.all_reduce(flag)
        out["ranks_with_adaptor"] = int(flag.item())
        dist.destroy_process_group()
    out["adaptor_in_before"] = recorder.seen
    out.update(adaptor_state())
    out["ours"] = ours_loaded()
    return out


if __name__ == "__main__":
    result = main(sys.argv[1])
    if sys.argv[1] == "torchrun":
        with open(os.path.join(os.environ["OUT_DIR"], f"rank{os.environ['RANK']}.json"), "w") as handle:
            json.dump(result, handle)
    print(json.dumps(result))
