#!/usr/bin/env bash
# Wheels, for the lent GPU machine, of what the quantized tests need and its image lacks:
# nvidia-modelopt and its needs (the image has torch, transformers, accelerate, safetensors,
# numpy, scipy, rich, regex, tqdm, PyYAML, requests, ninja, nvidia-ml-py). Run it here, where
# pip reaches the package index; then name `.whl` in the device call's `carry`, and
# benchmarks/gpu_check.sh installs them (--target /tmp/site, nothing fetched there). ~21 MB.
#
#   bash benchmarks/gpu_wheels.sh
set -eu
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  nvidia-modelopt==0.47.0 omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 pulp==3.3.2 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
du -sh .whl
