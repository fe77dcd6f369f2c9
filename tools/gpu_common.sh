# Sourced by the tools/gpu_*.sh scripts on the lent GPU host: $OUT/ev/logs exists, the wheels of .whl/ (all but
# h3gate's own) are installed into /tmp/site, and h3gate runs from this checkout (PYTHONPATH).
set -u
out=${OUT:?}
ev=$out/ev
mkdir -p "$ev/logs"
# installed once per machine: scripts run side by side (xargs -P) find the marker and skip the install
if [ ! -f /tmp/site/.h3gate-wheels ]; then
  ls .whl/*.whl | grep -v '/h3gate-' | xargs python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site || exit 2
  touch /tmp/site/.h3gate-wheels
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
# step CAP NAME CMD...: CMD under a CAP-second timeout, its log in $ev/logs/NAME.log, rc and seconds echoed with
# the log's tail; skipped once the script has run past $BUDGET_S (default 540) seconds. A script may define its own.
budget=${BUDGET_S:-540}
step() { local cap=$1 name=$2; shift 2; local start=$SECONDS
  if [ $SECONDS -gt "$budget" ]; then echo "== $name: skipped (${SECONDS} s)"; return; fi
  timeout "$cap" "$@" >"$ev/logs/$name.log" 2>&1; local rc=$?
  echo "== $name: rc=$rc, $((SECONDS - start)) s: ${*:3}"; tail -n 14 "$ev/logs/$name.log"; }
# gate NAME EXPECT ARGS...: `h3gate ARGS --out $ev/NAME` under a ${CAP_S:-600}-second timeout, its log in
# $ev/logs/NAME.log; echoes rc against the EXPECTed exit code, seconds and the log's verdict lines ($GATE_LINES), the
# tail where it neither passed nor failed; skipped once the script has run past $budget seconds.
GATE_LINES='^(verdict|tensors judged|first (drift|failure)|injected|h3gate: (error|internal))|strict_over|x$|arm|byte'
gate() { local name=$1 expect=$2; shift 2
  if [ $SECONDS -gt "$budget" ]; then echo "== $name: skipped (${SECONDS} s > ${budget} s)"; return; fi
  local start=$SECONDS
  timeout "${CAP_S:-600}" python3 -m h3gate "$@" --out "$ev/$name" >"$ev/logs/$name.log" 2>&1; local rc=$?
  echo "== $name: rc=$rc (expected $expect), $((SECONDS - start)) s: h3gate $*"
  grep -E "$GATE_LINES" "$ev/logs/$name.log" | head -14
  [ "$rc" = 0 ] || [ "$rc" = 1 ] || tail -n 25 "$ev/logs/$name.log"; }
