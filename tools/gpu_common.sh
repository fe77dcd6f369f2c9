# Sourced by the tools/gpu_*.sh scripts on the lent GPU host: $OUT/ev/logs exists, the wheels of .whl/ (all but
# h3gate's own) are installed into /tmp/site, and h3gate runs from this checkout (PYTHONPATH).
set -u
out=${OUT:?}
ev=$out/ev
mkdir -p "$ev/logs"
ls .whl/*.whl | grep -v '/h3gate-' | xargs python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site || exit 2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
