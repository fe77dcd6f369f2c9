#!/usr/bin/env bash
# H200 runs of the Ref2VA / Phase B issue (#22), from the repository root on the lent GPU host, .whl (built with
# WITH_DIFFUSERS=1: run vae builds diffusers' VAE classes) and .h3gate-revision carried:
#   bash tools/gpu_phase_b.sh SECTION [SECTION ...]
#   ref2va-block-medium    run ws1-block --mode strict at ref2va-medium (released widths, transformer_ref/ weights)
#   ref2va-block-768p      run ws1-block --mode strict --no-backward at ref2va-768p (S = 83386, the released geometry:
#                          the streamed forward, value store in host memory)
#   block-768p             run ws1-block --mode strict --no-backward at 768p (S = 38974; the streamed forward with
#                          its store on the device, against the committed ws1-block-real-768p-forward)
#   vae-video, vae-audio   run vae --geometry real --mode strict on CUDA (124 frames at 768x1344 / their soundtrack)
#   vae-video-off          run vae --geometry real --mode off (the provider's batched call, measured)
# BUDGET_S (default 540): a section that would start later than that is skipped. Evidence under $OUT/ev/<name>/,
# all of it in $OUT/evidence.tgz.
. tools/gpu_common.sh
# Large blocks of many sizes come and go in the streamed forward: let the allocator grow segments instead of
# keeping fragments (arithmetic unchanged).
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
H="python3 -m h3gate"
for s in "$@"; do
  case $s in
    ref2va-block-medium) step 200 ws1-block-real-ref2va-medium $H run ws1-block --config real --layout ref2va-medium \
      --device cuda --mode strict --out "$ev/ws1-block-real-ref2va-medium";;
    ref2va-block-768p) step 480 ws1-block-real-ref2va-768p-forward $H run ws1-block --config real \
      --layout ref2va-768p --device cuda --mode strict --no-backward --out "$ev/ws1-block-real-ref2va-768p-forward";;
    block-768p) step 240 ws1-block-real-768p-forward $H run ws1-block --config real --layout 768p --device cuda \
      --mode strict --no-backward --out "$ev/ws1-block-real-768p-forward";;
    vae-video|vae-audio) M=${s#vae-}
      step 200 "vae-$M-real-strict" $H run vae --modality "$M" --geometry real --device cuda --mode strict \
        --out "$ev/vae-$M-real-strict";;
    vae-video-off) step 200 vae-video-real-off $H run vae --modality video --geometry real --device cuda --mode off \
      --out "$ev/vae-video-real-off";;
    *) echo "unknown section $s"; exit 2;;
  esac
done
tar czf "$out/evidence.tgz" -C "$ev" .
