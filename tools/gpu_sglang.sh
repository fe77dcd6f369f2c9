#!/usr/bin/env bash
# H200 evidence for the one-house issue (candidate hashes of the strict block and model at released widths against
# the committed ones) and the SGLang issue (SGLang 0.5.23's MiniMax-H3 DiT at released widths as a WS1 candidate and
# as the rollout engine of `run arms`). Run from the repository root on the lent GPU host (device tool) with
# `make wheelhouse WITH_SGLANG=1 WITH_DIFFUSERS=1 SLIM_SGLANG=1` carried in .whl/ (sgl_kernel at sm90 only):
#   house-block:  run ws1-block, real, medium, strict (forward + backward);
#   house-model:  run ws1-model, real, medium, strict (50 blocks, forward + backward);
#   sg-env:       what the host offers SGLang (versions, nvcc, sgl_kernel, the fused paths' JIT);
#   sg-tiny:      the sglang candidate at tiny widths on the GPU (a smoke of the CUDA paths);
#   sg-block / sg-block-exact:  the sglang candidate, real widths, block 0, medium, quality lossless (its default
#                 fast paths) / exact;
#   sg-model / sg-model-exact:  the sglang candidate, real widths, blocks 0:2 + refiner + final, medium;
#   sg-arms:      run arms --rollout sglang, real widths cut to $ARMS_LAYERS blocks, medium, $ARMS_STEPS steps;
#   sg-fault:     negative control: one row of block.1.o_proj scaled inside SGLang's module (exit 1 expected).
#   usage: tools/gpu_sglang.sh SECTION...   (a section is skipped once $BUDGET_S seconds have passed)
. tools/gpu_common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
budget=${BUDGET_S:-540}
sg=(--candidate sglang --no-backward)
real=(--config real --device cuda)
for section in "$@"; do
  case $section in
  house-block) gate ws1-block-real-medium 0 run ws1-block "${real[@]}" --mode strict --layout medium ;;
  house-model) gate ws1-model-real-medium 0 run ws1-model "${real[@]}" --mode strict --layout medium ;;
  sg-env) python3 - >"$ev/logs/sg-env.log" 2>&1 <<'PY'
import importlib.metadata as md, json, shutil, subprocess, torch, triton
def ver(d):
    try: return md.version(d)
    except md.PackageNotFoundError: return None
nvcc = shutil.which("nvcc")
rec = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__, "nvcc": nvcc,
       "nvcc_version": subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout[-120:] if nvcc else None,
       **{d: ver(d) for d in ("sglang", "sglang-kernel", "flashinfer-python", "torchvision", "apache-tvm-ffi", "diffusers",
                              "transformers", "tokenizers", "huggingface-hub", "pillow")}}
try:
    import sgl_kernel
    rec["sgl_kernel_import"] = f"ok: {sgl_kernel.__file__}"
except Exception as exc:  # what failed is the record
    rec["sgl_kernel_import"] = f"{type(exc).__name__}: {str(exc)[:600]}"
try:
    from h3gate.adapters.sglang.runtime import require_sglang
    rec["require_sglang"] = require_sglang("gpu_sglang.sh")
except Exception as exc:  # what failed is the record
    rec["require_sglang"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(rec, indent=1))
PY
    echo "== sg-env"; cat "$ev/logs/sg-env.log" | tail -n 30 ;;
  sg-tiny) gate ws1-block-tiny-sglang 0 run ws1-block --config tiny --device cuda --layout micro "${sg[@]}" ;;
  sg-block) gate ws1-block-real-medium-sglang 0 run ws1-block "${real[@]}" --layout medium "${sg[@]}" ;;
  sg-block-exact) gate ws1-block-real-medium-sglang-exact 0 run ws1-block "${real[@]}" --layout medium "${sg[@]}" \
    --sglang-quality exact ;;
  sg-model) gate ws1-model-real-medium-sglang 0 run ws1-model "${real[@]}" --layout medium --layers 0:2 "${sg[@]}" ;;
  sg-model-exact) gate ws1-model-real-medium-sglang-exact 0 run ws1-model "${real[@]}" --layout medium --layers 0:2 \
    "${sg[@]}" --sglang-quality exact ;;
  sg-arms) gate arms-real-medium-sglang 0 run arms "${real[@]}" --layout medium --layers "${ARMS_LAYERS:-2}" \
    --steps "${ARMS_STEPS:-4}" --rollout sglang ;;
  sg-fault) gate ws1-model-real-medium-sglang-fault 1 run ws1-model "${real[@]}" --layout medium --layers 0:2 \
    "${sg[@]}" --fault block.1.o_proj:3000 ;;
  *) echo "unknown section $section" >&2 ;;
  esac
done
tar czf "$out/evidence.tgz" -C "$ev" .
ls -la "$out"
