#!/usr/bin/env bash
# Produce the committed H200 evidence (run from the repository root on the GPU host, .whl carried).
#   bash tools/gpu_evidence.sh STAGE [STAGE ...]
# Stages: ops-rows ops-gemm ops-gemm-768p block bench-block bench-ops bench-gemm (bench-gemm-small-m: its tiny and
# small layouts only) ablate. Each stage runs under a
# time cap so one cannot take the others' evidence with it; stage `tar` packs evidence/h200 into $OUT; stage `seal`
# seals it.
# Stages ops-rows, ops-gemm and block may share the GPU; ablate (the 50-block model, ~70 GB) and the bench stages
# need it to themselves (a concurrent ablate ran ops-rows out of memory once: git log -- evidence/h200/PROVENANCE.md).
set -uo pipefail
[ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
H="python3 -m h3gate"
E=evidence/h200
OUTDIR=${OUT:-/tmp/out}
mkdir -p "$E" "$OUTDIR"
step() { local cap=$1; shift; echo "== $(date +%H:%M:%S) $*"; timeout "$cap" "$@"; echo "rc=$?"; }
ROWS="--op timestep_sinusoid_h3 --op timestep_mlp_silu --op adaln_silu_cast --op adaln_row_gather --op h3_rmsnorm
 --op h3_rmsnorm_modulate --op final_adaln_out --op h3_qk_rmsnorm_d128 --op h3_mm_rope_3axis_partial
 --op adaln_gate_residual --op h3_swiglu --op residual_add --op packed_index_copy --op packed_index_select
 --op conditioning_noise_mix"
GEMM="--op h3_qkv_gemm --op h3_attention_o_gemm --op h3_ffn_gate_up_gemm --op h3_ffn_down_gemm
 --op adaln_projection_3mod --op text_context_projection --op video_input_projection_fp32
 --op audio_input_projection_fp32 --op timestep_mlp_fp32 --op final_adaln_projection
 --op video_output_projection_fp32 --op audio_output_projection_fp32 --op h3_full_attention"
BLOCK_GEMM="--op h3_qkv_gemm --op h3_attention_o_gemm --op h3_ffn_gate_up_gemm --op h3_ffn_down_gemm"
for s in "$@"; do
  case $s in
    ops-rows) step 240 $H run ws1-ops --device cuda --config real --layouts tiny,small,medium,768p $ROWS --force --out $E/ws1-ops-rows;;
    ops-gemm) step 240 $H run ws1-ops --device cuda --config real --layouts tiny,small,medium $GEMM --force --out $E/ws1-ops-gemm-attention;;
    ops-gemm-768p) step 150 $H run ws1-ops --device cuda --config real --layouts 768p $BLOCK_GEMM --force --out $E/ws1-ops-gemm-768p
                   step 150 $H run ws1-ops --device cuda --config real --layouts 768p --op h3_full_attention \
                     --force --out $E/ws1-ops-attention-768p;;
    block) for L in tiny small medium; do
             step 150 $H run ws1-block --config real --layout $L --device cuda --mode strict --force --out $E/ws1-block-real-$L
           done;;
    bench-block) for L in medium 768p; do
             step 120 $H bench ws1-block --config real --layout $L --device cuda --force --out $E/bench-ws1-block-$L
           done;;
    bench-ops) step 150 $H bench --device cuda --config real --layout 768p $ROWS --force --out $E/bench-ops-rows-768p;;
    bench-gemm-small-m|bench-gemm)
                step 100 $H bench --device cuda --config real --layout tiny $BLOCK_GEMM --op h3_full_attention \
                  --force --out $E/bench-ops-gemm-tiny
                step 100 $H bench --device cuda --config real --layout small $BLOCK_GEMM --op h3_full_attention \
                  --force --out $E/bench-ops-gemm-small;;&
    bench-gemm) step 150 $H bench --device cuda --config real --layout medium $GEMM --force --out $E/bench-ops-gemm-attention-medium
                step 150 $H bench --device cuda --config real --layout 768p $BLOCK_GEMM --force --out $E/bench-ops-gemm-768p
                step 150 $H bench --device cuda --config real --layout 768p --op h3_full_attention \
                  --force --out $E/bench-ops-attention-768p;;
    ablate) step 200 $H ablate A0,A1,A2,A3,A4,A5,A6,A7,C1,C2 --config real --layout medium --device cuda --mode strict --force --out $E/ablate-real-medium-a
            step 200 $H ablate H1,H2,H3,H4,H5,H6,H7,H8,H14,H16 --config real --layout medium --device cuda --mode strict --force --out $E/ablate-real-medium-h
            step 200 $H ablate H9,H10,H11,H12,H13,H15,H-C2 --config real --layout medium --device cuda --mode strict --force --out $E/ablate-real-medium-traj
            step 200 $H ablate H-C0,H-C1,H-C3,H-C7 --config real --layout medium --device cuda --mode strict --force --out $E/ablate-real-medium-controls;;
    seal) step 120 $H seal $E;;
    tar) tar czf "$OUTDIR/evidence-h200.tgz" "$E"; echo "tarred $(du -sh "$OUTDIR/evidence-h200.tgz")";;
  esac
done
