#!/usr/bin/env bash
# H200 evidence for the WS2 issue (#18), from the repository root on the lent GPU host, .whl and .h3gate-revision
# carried:  bash tools/gpu_ws2.sh SECTION [SECTION ...]
#   ops-tiny, ops-medium, ops-768p  the block GEMMs, single walk next to their seg8 twins (bench --op, one run each)
#   attn-order-medium, attn-order-768p  bench --op h3_full_attention: the strict operator with an identity and a
#                                   permuted walk order (the canonical order's row copies) next to the plain kernel
#   merge-tests                     tests/triton_kernels/test_{gemm,row}_merge.py compiled on CUDA
#                                   (TRITON_INTERPRET=0; PYTEST_K selects tests)
#   tma-check                       tools/gpu_seg8_tma_check.py: the seg8 TMA walk == its pointer walk == single walk
#   block                           bench ws1-block --merge-order seg8 at medium and 768p (strict, strict_seg8, provider)
#   model                           bench ws1-model --merge-order seg8 at medium (the whole 50-block model)
#   block-gate                      run ws1-block --merge-order seg8 at medium (the seg8 block through the gate)
#   block-gate-single               run ws1-block (the default single-walk strict path) at medium
#   ws2-<topology>                  run ws2 (tp2, tp8, cp2, tp2cp2, ...) at released widths, block, medium: gloo ranks
#                                   sharing the GPU, collectives staged through host memory
#   ws2-nccl                        run ws2 tp1 over NCCL (one GPU: world size 1)
#   ws2-faults                      one-row faults at released widths (tp8 forward, tp2cp2 backward): must fail, located
#   ws2-sp-fault                    a one-row backward fault on an SP node (tp4cp2sp rank 6 residual_attn)
#   ops-bitwise                     run ws1-ops of the seg8 twins and their single-walk operators at medium (bitwise
#                                   vs cuBLAS, accuracy vs FP64)
# BUDGET_S (default 540): a section that would start later than that is skipped.
# Every step runs under a time cap; each evidence folder lands under $OUT/ev/<name>/ and $OUT/evidence.tgz.
. tools/gpu_common.sh
H="python3 -m h3gate"
GEMMS="--op h3_attention_o_gemm --op h3_attention_o_gemm_seg8 --op h3_ffn_down_gemm --op h3_ffn_down_gemm_seg8
 --op h3_qkv_gemm --op h3_qkv_gemm_seg8 --op h3_ffn_gate_up_gemm --op h3_ffn_gate_up_gemm_seg8"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
for s in "$@"; do
  case $s in
    ops-tiny|ops-medium|ops-768p) L=${s#ops-}
      step 240 "bench-ops-seg8-$L" $H bench --device cuda --config real --layout "$L" $GEMMS --out "$ev/bench-ops-seg8-$L";;
    attn-order-medium|attn-order-768p) L=${s#attn-order-}
      step 240 "bench-attention-order-$L" $H bench --device cuda --config real --layout "$L" --op h3_full_attention \
        --out "$ev/bench-attention-order-$L";;
    merge-tests) step 200 merge-tests env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
      ${PYTEST_K:+-k "$PYTEST_K"} tests/triton_kernels/test_gemm_merge.py tests/triton_kernels/test_row_merge.py;;
    tma-check) step 150 tma-check python3 tools/gpu_seg8_tma_check.py;;
    block) for L in medium 768p; do
        step 200 "bench-ws1-block-seg8-$L" $H bench ws1-block --merge-order seg8 --config real --layout "$L" \
          --device cuda --out "$ev/bench-ws1-block-seg8-$L"
      done;;
    model) step 300 bench-ws1-model-seg8-medium $H bench ws1-model --merge-order seg8 --config real --layout medium \
      --device cuda --out "$ev/bench-ws1-model-seg8-medium";;
    block-gate) step 200 ws1-block-seg8-real-medium $H run ws1-block --merge-order seg8 --config real --layout medium \
      --device cuda --mode strict --out "$ev/ws1-block-seg8-real-medium";;
    block-gate-single) step 200 ws1-block-real-medium $H run ws1-block --config real --layout medium \
      --device cuda --mode strict --out "$ev/ws1-block-real-medium";;
    ws2-nccl) step 150 ws2-tp1-nccl-real-block-medium $H run ws2 --topology tp1 --backend nccl --device cuda \
      --config real --scope block --layout medium --out "$ev/ws2-tp1-nccl-real-block-medium";;
    ws2-faults)  # negative controls at released widths: one row on one rank must fail (exit 1) and be located
      step 200 ws2-tp8-fault-real-block-medium $H run ws2 --topology tp8 --backend gloo --device cuda --config real \
        --scope block --layout medium --fault 5:o_proj:1000 --out "$ev/ws2-tp8-fault-real-block-medium"
      step 200 ws2-tp2cp2-fault-bwd-real-block-medium $H run ws2 --topology tp2cp2 --backend gloo --device cuda \
        --config real --scope block --layout medium --fault 3:ffn_down:2000:backward \
        --out "$ev/ws2-tp2cp2-fault-bwd-real-block-medium";;
    ws2-sp-fault) step 200 ws2-tp4cp2sp-fault-bwd-real-block-medium $H run ws2 --topology tp4cp2sp --backend gloo \
      --device cuda --config real --scope block --layout medium --fault 6:residual_attn:2400:backward \
      --out "$ev/ws2-tp4cp2sp-fault-bwd-real-block-medium";;
    ws2-*) T=${s#ws2-}
      step 240 "ws2-$T-real-block-medium" $H run ws2 --topology "$T" --backend gloo --device cuda --config real \
        --scope block --layout medium --out "$ev/ws2-$T-real-block-medium";;
    ops-bitwise) step 200 ws1-ops-seg8-medium $H run ws1-ops --device cuda --config real --layouts medium \
      --op h3_attention_o_gemm_seg8 --op h3_ffn_down_gemm_seg8 --op h3_qkv_gemm_seg8 --op h3_ffn_gate_up_gemm_seg8 \
      --op h3_qk_rmsnorm_d128_seg8 --op h3_attention_o_gemm --op h3_ffn_down_gemm --op h3_qkv_gemm \
      --op h3_ffn_gate_up_gemm --op h3_qk_rmsnorm_d128 --op h3_rmsnorm_modulate_seg8 --op h3_rmsnorm_modulate \
      --op adaln_gate_residual_seg8 --op adaln_gate_residual --op final_adaln_out_seg8 --op final_adaln_out \
      --out "$ev/ws1-ops-seg8-medium";;
  esac
done
tar czf "$out/evidence.tgz" -C "$ev" .
