#!/usr/bin/env bash
# H200 evidence for the gate-trust issue, run from the repository root on the lent GPU host (device tool), with the
# wheels of `make wheelhouse` carried in .whl/ and the stamp of tools/stamp_revision.py in .h3gate-revision:
#   ws1-block, released widths, strict: tiny / small / medium forward + backward with the one-row fault matrix,
#   768p forward; two injected one-row faults at medium (negative controls: must exit 1, located).
# Evidence folders go to $OUT/ev (packed as $OUT/evidence.tgz), one log per run, a summary on stdout.
set -u
out=${OUT:?}
ev=$out/ev
mkdir -p "$ev/logs"
ls .whl/*.whl | grep -v '/h3gate-' | xargs python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site || exit 2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
run() {
  local name=$1 expect=$2
  shift 2
  local start=$SECONDS
  python3 -m h3gate --quiet "$@" --out "$ev/$name" >"$ev/logs/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc (expected $expect), $((SECONDS - start)) s: h3gate $*"
  grep -E "^(verdict|first_row_failure|fault matrix|injected|h3gate: (error|internal))" "$ev/logs/$name.log"
}
common=(--config real --device cuda --mode strict)
for layout in tiny small medium; do
  run "ws1-block-real-$layout" 0 run ws1-block "${common[@]}" --layout "$layout" --fault-matrix
done
run ws1-block-real-medium-fault-fwd 1 run ws1-block "${common[@]}" --layout medium --fault attention:3159:zero_tail
run ws1-block-real-medium-fault-bwd 1 run ws1-block "${common[@]}" --layout medium --fault ffn_down:100:scale:backward
run ws1-block-real-768p-forward 0 run ws1-block "${common[@]}" --layout 768p --no-backward
tar czf "$out/evidence.tgz" -C "$ev" .
