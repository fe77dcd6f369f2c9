#!/usr/bin/env bash
# h3gate as a user installs it: build the wheel from the working tree, install it WITHOUT the test extra into a fresh
# venv, and from a temporary folder outside the checkout import every module and run layout, validate, fingerprint
# and the one-block gate (manifests and schemas must come from the package data; evidence must land in
# ./evidence/local of that folder, not in site-packages).
#
#   tools/wheel_smoke.sh        (PY=python3; torch as tools/install_torch.sh installs it, triton $TRITON / $TRITON_PYPI)
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PY:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/h3gate-wheel-smoke.XXXXXX")
trap 'rm -rf "$work"' EXIT
step() { printf '== wheel_smoke: %s\n' "$*"; }

step "build the wheel from a copy of the working tree (no stale build/ can leak into it)"
mkdir -p "$work/src" "$work/dist" "$work/run"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard | tar --null -T - --ignore-failed-read -cf -) |
  tar -xf - -C "$work/src"
"$py" -m pip wheel -v --no-deps -w "$work/dist" "$work/src" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
if grep -E "[A-Za-z]*Warning:|is deprecated|absent from the .packages." "$work/build.log"; then
  echo "wheel_smoke: the build warns (above)"; exit 1
fi
wheel=$(ls "$work"/dist/h3gate-*.whl)
"$py" - "$wheel" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = ["h3gate/data/manifests/layouts.yaml", "h3gate/data/manifests/configs/tiny.yaml",
        "h3gate/data/schemas/common.schema.json", "h3gate/manifests/loader.py", "h3gate/kernels/gemm.py"]
missing = [n for n in need if n not in names]
sys.exit(f"wheel_smoke: missing from the wheel: {missing}" if missing else None)
PY

step "fresh venv: torch, then the wheel alone (no test extra)"
"$py" -m venv "$work/venv"
vpy=$work/venv/bin/python
"$repo/tools/install_torch.sh" "$vpy" "${TRITON:-3.6.0}" "${TRITON_PYPI:-3.7.1}"
"$vpy" -m pip install -q "$wheel"
if "$vpy" -c "import pytest" 2>/dev/null; then echo "wheel_smoke: pytest present: not a wheel-only venv"; exit 1; fi

cd "$work/run"
unset H3GATE_HOME TRITON_INTERPRET
step "import every module (tests/test_imports.py without pytest)"
"$vpy" "$repo/tests/test_imports.py" | tee imports.log
grep -q "from $work/venv/" imports.log || { echo "wheel_smoke: h3gate was not imported from the wheel"; exit 1; }
h3=$work/venv/bin/h3gate
step "h3gate layout tiny";  "$h3" layout tiny
step "h3gate validate";     "$h3" validate
step "h3gate fingerprint";  "$h3" fingerprint
step "h3gate run ws1-block"; "$h3" run ws1-block
for f in evidence/local/fingerprint/latest/fingerprint.json evidence/local/ws1-block/tiny-tiny/latest/ws1-block.json; do
  [ -f "$f" ] || { echo "wheel_smoke: $f not written under $PWD"; exit 1; }
done
if [ -n "$(find "$work/venv" -path "*/evidence/local*" -print -quit)" ]; then
  echo "wheel_smoke: evidence written into the venv"; exit 1
fi
step "ok: $(basename "$wheel") installed without the test extra runs from $PWD"
