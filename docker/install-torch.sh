#!/bin/sh
# Installs torch into the image's venv (Dockerfile, build stage): the wheel copied beside this script when the
# build was given one (TORCH_WHEEL), else the CPU build from $TORCH_INDEX_URL.
set -eu
here=$(dirname "$0")
wheel=$(find "$here" -maxdepth 1 -name 'torch-*.whl' | head -n 1)
if [ -n "$wheel" ]; then
    pip install "$wheel"
else
    pip install --index-url "$TORCH_INDEX_URL" "torch>=2.4,<3"
fi
rm -rf "$here"
