#!/usr/bin/env bash
# The torchvision that pairs with the torch installed in PYTHON's environment, kept only if it imports there.
#
#   tools/install_torchvision.sh PYTHON
#
# SGLang's import chain imports torchvision (unrelated preprocessors; the MiniMax-H3 DiT never calls it). torch 2.N
# pairs with torchvision 0.(N+15) (2.11 -> 0.26, 2.13 -> 0.28). A CPU build of torch (+cpu) takes the +cpu torchvision
# from torch's CPU index ($TORCH_CPU_INDEX, asked alone with a 5 s timeout, as tools/install_torch.sh asks for torch);
# any other torch takes PyPI's (the CUDA build), with torch pinned to the installed version so pip never replaces it.
# PyPI's torchvision does not import beside a CPU torch (its _C needs libtorch_cuda), so a CPU torch never takes it.
# Whatever was installed is removed again if `import torchvision` fails; h3gate's adapter then stands an import shim
# in for it (h3gate/adapters/sglang/tvshim.py). A torchvision that already imports is left as it is.
set -euo pipefail
py=$1
index=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
if "$py" -c "import torchvision" >/dev/null 2>&1; then
  echo "install_torchvision: torchvision $("$py" -c 'import torchvision; print(torchvision.__version__)') imports; kept"
  exit 0
fi
torch=$("$py" -c "import torch; print(torch.__version__)")
minor=$(echo "$torch" | cut -d. -f2)
want="torchvision==0.$((minor + 15)).*"
constraint=$(mktemp)
trap 'rm -f "$constraint"' EXIT
echo "torch==$torch" >"$constraint"
if [[ "$torch" == *+cpu ]]; then
  PIP_CONFIG_FILE=/dev/null "$py" -m pip --isolated install -q --timeout 5 --retries 0 --no-deps --index-url "$index" \
    "$want" >/dev/null 2>&1 || echo "install_torchvision: torch's CPU index $index has no $want for torch $torch here"
else
  "$py" -m pip install -q -c "$constraint" "$want" || echo "install_torchvision: no $want for torch $torch"
fi
if "$py" -m pip show -q torchvision >/dev/null 2>&1 && ! "$py" -c "import torchvision" >/dev/null 2>&1; then
  "$py" -m pip uninstall -q -y torchvision
  echo "install_torchvision: the torchvision found does not import beside torch $torch; removed"
fi
if "$py" -c "import torchvision" >/dev/null 2>&1; then
  echo "install_torchvision: torchvision $("$py" -c 'import torchvision; print(torchvision.__version__)') for torch $torch"
else
  echo "install_torchvision: no torchvision for torch $torch; h3gate's import shim stands in (h3gate/adapters/sglang/tvshim.py)"
fi
