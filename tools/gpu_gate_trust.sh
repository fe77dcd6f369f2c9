#!/usr/bin/env bash
# H200 evidence for the gate-trust issue, run from the repository root on the lent GPU host (device tool), with the
# wheels of `make wheelhouse` carried in .whl/ and the stamp of tools/stamp_revision.py in .h3gate-revision:
#   block:   ws1-block, released widths, strict: tiny / small / medium forward + backward with the one-row fault
#            matrix; two injected one-row faults at medium (negative controls: must exit 1, located);
#   768p:    ws1-block 768p forward;
#   reruns:  the row operators' ws1-ops and 768p bench and the four medium ablation sets, at the current code;
#   rooms:   after a refactor: ws1-block medium (compare its hashes with the committed run), ws1-ops GEMM/attention
#            and row operators under the row rule, the block bench at medium.
#   usage: tools/gpu_gate_trust.sh SECTION...
# Evidence folders go to $OUT/ev (packed as $OUT/evidence.tgz), one log per run, a summary on stdout.
. tools/gpu_common.sh
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
rows_ops=(timestep_sinusoid_h3 timestep_mlp_silu adaln_silu_cast adaln_row_gather h3_rmsnorm h3_rmsnorm_modulate
  final_adaln_out h3_qk_rmsnorm_d128 h3_mm_rope_3axis_partial adaln_gate_residual h3_swiglu residual_add
  packed_index_copy packed_index_select conditioning_noise_mix)
op_args=()
for op in "${rows_ops[@]}"; do op_args+=(--op "$op"); done
for section in "$@"; do
  case $section in
  block)
    for layout in tiny small medium; do
      run "ws1-block-real-$layout" 0 run ws1-block "${common[@]}" --layout "$layout" --fault-matrix
    done
    run ws1-block-real-medium-fault-fwd 1 run ws1-block "${common[@]}" --layout medium --fault attention:3159:zero_tail
    run ws1-block-real-medium-fault-bwd 1 run ws1-block "${common[@]}" --layout medium --fault ffn_down:100:scale:backward
    ;;
  768p) run ws1-block-real-768p-forward 0 run ws1-block "${common[@]}" --layout 768p --no-backward ;;
  reruns)
    run ws1-ops-rows 0 run ws1-ops --device cuda --config real --layouts tiny,small,medium,768p "${op_args[@]}"
    run bench-ops-rows-768p 0 bench --device cuda --config real --layout 768p "${op_args[@]}"
    run ablate-real-medium-a 0 ablate A0,A1,A2,A3,A4,A5,A6,A7,C1,C2 "${common[@]}" --layout medium
    run ablate-real-medium-controls 0 ablate H-C0,H-C1,H-C3,H-C7 "${common[@]}" --layout medium
    run ablate-real-medium-h 0 ablate H1,H2,H3,H4,H5,H6,H7,H8,H14,H16 "${common[@]}" --layout medium
    run ablate-real-medium-traj 0 ablate H9,H10,H11,H12,H13,H15,H-C2 "${common[@]}" --layout medium
    ;;
  profile)  # the one-block gate at medium again, its evidence now holding the first drift's per-row profile
    run ws1-block-real-medium 0 run ws1-block "${common[@]}" --layout medium --fault-matrix
    ;;
  rooms)  # after the rooms refactor: the same gate at medium (node hashes compared with the committed run), the
    # GEMM/attention operators under the row rule, the block bench
    run ws1-block-real-medium 0 run ws1-block "${common[@]}" --layout medium --fault-matrix
    gemm_ops=(h3_qkv_gemm h3_attention_o_gemm h3_ffn_gate_up_gemm h3_ffn_down_gemm adaln_projection_3mod
      text_context_projection video_input_projection_fp32 audio_input_projection_fp32 timestep_mlp_fp32
      final_adaln_projection video_output_projection_fp32 audio_output_projection_fp32 h3_full_attention)
    gemm_args=()
    for op in "${gemm_ops[@]}"; do gemm_args+=(--op "$op"); done
    run ws1-ops-gemm-attention 0 run ws1-ops --device cuda --config real --layouts tiny,small,medium "${gemm_args[@]}"
    run ws1-ops-rows 0 run ws1-ops --device cuda --config real --layouts tiny,small,medium,768p "${op_args[@]}"
    run bench-ws1-block-medium 0 bench ws1-block --config real --layout medium --device cuda
    ;;
  *) echo "unknown section $section" >&2 ;;
  esac
done
tar czf "$out/evidence.tgz" -C "$ev" .
