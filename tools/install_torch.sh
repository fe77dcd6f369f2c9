#!/usr/bin/env bash
# Install torch's CPU build (and a triton) into the environment of PYTHON, for machines without an NVIDIA driver.
#
#   tools/install_torch.sh PYTHON TRITON_WITH_CPU_INDEX TRITON_FALLBACK
#
# 1. torch==$TORCH_VERSION from torch's CPU index ($TORCH_CPU_INDEX), asked alone: this machine's pip configuration
#    (local mirrors, extra indexes) is left out, so only that index can answer; 5 s timeout and no retries, so an
#    unreachable index fails within seconds. The +cpu wheel pins no triton: TRITON_WITH_CPU_INDEX is then installed
#    from the package index.
# 2. Otherwise torch==$TORCH_VERSION with TRITON_FALLBACK from the configured package index, which must be a pair
#    that index resolves (PyPI's torch 2.13.0 is the CUDA build, requires triton==3.7.1 and runs on the CPU too).
set -euo pipefail
py=$1
triton_cpu=$2
triton_fallback=$3
torch=${TORCH_VERSION:-2.13.0}
index=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
if PIP_CONFIG_FILE=/dev/null "$py" -m pip --isolated install -q --timeout 5 --retries 0 --index-url "$index" \
    "torch==$torch" >/dev/null 2>&1; then
  echo "install_torch: torch $torch (CPU build) from $index, triton $triton_cpu"
  "$py" -m pip install -q "triton==$triton_cpu"
else
  echo "install_torch: torch's CPU index $index did not answer; torch==$torch triton==$triton_fallback from the package index"
  "$py" -m pip install -q "torch==$torch" "triton==$triton_fallback"
fi
"$py" -c "from importlib.metadata import version as v; print('install_torch:', 'torch', v('torch'), 'triton', v('triton'))"
