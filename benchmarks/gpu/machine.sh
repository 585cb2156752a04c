# There (the GPU machine), sourced at the start of a device command, from the project's root:
#
#   source benchmarks/gpu/machine.sh
#
# installs the carried wheels (.whl) into a fresh folder on PYTHONPATH (its python3 has torch,
# Triton, numpy, pytest, wrapt, einops, ...), unpacks Megatron-LM's training loop (.gpu) and sets
# MEGATRON_LM_PATH, so `python3 -m mindspeed_like.cli ...`, `benchmarks/bench_gpu.sh python3 DIR`
# and the CUDA lane run without make or a venv. Prints one line on the device and versions.
SITE=$(mktemp -d /tmp/site.XXXX)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || return 1
MEGATRON_LM_PATH=$(mktemp -d /tmp/megatron-lm.XXXX)
tar xzf .gpu/megatron-lm.tgz -C "$MEGATRON_LM_PATH"
# Megatron-LM's megatron/ package beside the wheel's megatron.core: one package, as in a checkout
# (and none left beside pretrain_gpt.py, whose folder comes first on sys.path)
cp -r "$MEGATRON_LM_PATH"/megatron/* "$SITE/megatron/"
rm -rf "$MEGATRON_LM_PATH/megatron"
tar xzf .gpu/megatron-core-datasets-makefile.tgz -C "$SITE"
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 MEGATRON_LM_PATH OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
python3 - <<'PY'
import torch, triton, megatron.core
print(f"gpu machine: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} "
      f"| megatron-core {megatron.core.__version__} | python {__import__('sys').version.split()[0]}", flush=True)
PY
