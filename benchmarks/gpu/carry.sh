#!/usr/bin/env bash
# Here (the CPU machine), once per session: what a lent GPU machine needs and cannot download,
# into the git-ignored folders the device tool carries (.whl: wheels for its Python 3.12;
# .gpu: Megatron-LM's training loop). notes/gpu.md (the project's shared notes) says why each.
#
#   benchmarks/gpu/carry.sh /path/to/Megatron-LM-checkout-of-core_v0.16.1
set -euo pipefail
cd "$(dirname "$0")/../.."
MEGATRON_LM=${1:?give a Megatron-LM checkout of core_v0.16.1}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
mkdir -p .whl .gpu
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  megatron-core==0.16.1 liger-kernel==0.8.5 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection
# megatron.training etc. (not in the megatron-core wheel), and the dataset helpers' Makefile, which
# the wheel does not ship but megatron's own path runs `make` with
tar czf .gpu/megatron-lm.tgz -C "$MEGATRON_LM" --exclude='megatron/core' megatron pretrain_gpt.py gpt_builders.py model_provider.py
tar czf .gpu/megatron-core-datasets-makefile.tgz -C "$MEGATRON_LM" megatron/core/datasets/Makefile
du -sh .whl .gpu
