#!/usr/bin/env bash
# H200 runs of the speed issue (#20), from the repository root on the lent GPU host, .whl and .h3gate-revision
# carried:  bash tools/gpu_speed.sh SECTION [SECTION ...]
#   attn-probe          tools/gpu_perf_probe.py --sections attn_tma: TMA-load forward tilings (bitwise vs production),
#                       SDPA cuDNN / flash, backward TMA / tilings, the walk order vs full copies ($PROBE.json)
#   gemm-gluon          tools/gpu_gemm_gluon.py: the warp-specialised Gluon GEMM forward's bytes against the Triton
#                       forward and its time next to cuBLAS at the block's four layers, M = 264 ... 38974 ($PROBE.json)
#   attn-gluon          tools/gpu_attention_gluon.py: the warp-specialised Gluon forward's bytes against the Triton
#                       forward (S = 264 ... 38974, batch 2, walk orders) and its time next to cuDNN / flash
#                       (ATTN_SECTIONS, default bytes,time; sustained: back to back at the power cap)
#   attn-bwd            tools/gpu_attention_bwd.py: the backward variants' dq/dk/dv bytes against the three-kernel
#                       backward and their time next to cuDNN's / flash's backward ($BWD_PROBE.json; BWD_SECTIONS,
#                       default bytes,time; split: the Gluon kernels timed alone)
#   floor               tools/gpu_floor_probe.py: the block forward at the power cap with every elementwise node's output
#                       cached (no launch), strict and provider, and with only the fusable ones cached ($PROBE.json)
#   gemm-kernels        tools/gpu_perf_probe.py --sections cublas_kernels: the kernels cuBLAS and the strict GEMM run for
#                       the block's four shapes at M = 264 / 925 / 3160 (names, device us; $PROBE.json)
#   gemm-<layout>       bench --op of the block's four GEMMs at tiny / small / medium / 768p
#   attn-<layout>       bench --op h3_full_attention at tiny / small / medium / 768p (identity and permuted order arms)
#   gemm-ops[-768p]     run ws1-ops of the block's four GEMMs at tiny, small, medium / 768p (bytes / accuracy against
#                       the provider, the prefix probe across M buckets: the Gluon and Triton kernels)
#   attn-ops[-768p|-tiny-small]  run ws1-ops of h3_full_attention at medium / 768p / tiny and small (bitwise /
#                       accuracy against the provider)
#   block-<layout>      bench ws1-block at medium / 768p (strict next to the provider)
#   gate-block[-tiny|-small]  run ws1-block --mode strict at medium (tiny, small)
#   gate-model          run ws1-model --mode strict at medium (forward and complete backward)
#   gate-block-768p, gate-model-768p   the strict forward gates at 768p (the block; the model's blocks 0-4)
#   model-<layout>      bench ws1-model at medium / 768p
# BUDGET_S (default 540): a section that would start later than that is skipped. Evidence under $OUT/ev/<name>/,
# all of it in $OUT/evidence.tgz.
. tools/gpu_common.sh
H="python3 -m h3gate"
BLOCK_GEMM="--op h3_qkv_gemm --op h3_attention_o_gemm --op h3_ffn_gate_up_gemm --op h3_ffn_down_gemm"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
for s in "$@"; do
  case $s in
    attn-probe) P=${PROBE:-perf-probe-15}; step 300 "$P" python3 tools/gpu_perf_probe.py --sections attn_tma --out "$ev/$P.json";;
    floor) step 420 floor-probe python3 tools/gpu_floor_probe.py --out "$ev/${PROBE:-perf-probe-41}.json";;
    gemm-kernels) P=${PROBE:-perf-probe-26}; step 200 "$P" python3 tools/gpu_perf_probe.py --sections cublas_kernels \
      --out "$ev/$P.json";;
    gemm-gluon) step "${GLUON_CAP:-420}" gemm-gluon python3 tools/gpu_gemm_gluon.py ${GEMM_VARIANTS:+--variants "$GEMM_VARIANTS"} \
      --sections "${GEMM_SECTIONS:-bytes,time}" --out "$ev/${PROBE:-perf-probe-30}.json";;
    attn-gluon) step "${GLUON_CAP:-240}" attention-gluon python3 tools/gpu_attention_gluon.py --variants "${GLUON_VARIANTS:-ws}" --sections "${ATTN_SECTIONS:-bytes,time}" \
      --out "$ev/${PROBE:-perf-probe-16}.json";;
    attn-bwd-smoke) step 120 attention-bwd-smoke python3 tools/gpu_attention_bwd.py --small --sections bytes \
      --variants fused --out "$ev/attention-bwd-smoke.json";;
    attn-bwd) step 300 attention-bwd python3 tools/gpu_attention_bwd.py --variants "${BWD_VARIANTS:-fused,fused_s2,fused_ptr}" \
      --sections "${BWD_SECTIONS:-bytes,time}" --out "$ev/${BWD_PROBE:-perf-probe-17}.json";;
    gemm-tiny|gemm-small|gemm-medium|gemm-768p) L=${s#gemm-}
      step 200 "bench-ops-gemm-$L" $H bench --device cuda --config real --layout "$L" --op h3_qkv_gemm \
        --op h3_attention_o_gemm --op h3_ffn_gate_up_gemm --op h3_ffn_down_gemm --out "$ev/bench-ops-gemm-$L";;
    attn-tiny|attn-small|attn-medium|attn-768p) L=${s#attn-}
      step 240 "bench-attention-$L" $H bench --device cuda --config real --layout "$L" --op h3_full_attention \
        --out "$ev/bench-attention-$L";;
    gemm-ops) step 240 ws1-ops-gemm-block $H run ws1-ops --device cuda --config real --layouts tiny,small,medium \
      $BLOCK_GEMM --out "$ev/ws1-ops-gemm-block";;
    gemm-ops-768p) step 200 ws1-ops-gemm-768p $H run ws1-ops --device cuda --config real --layouts 768p $BLOCK_GEMM \
      --out "$ev/ws1-ops-gemm-768p";;
    attn-ops) step 200 ws1-ops-attention-medium $H run ws1-ops --device cuda --config real --layouts medium \
      --op h3_full_attention --out "$ev/ws1-ops-attention-medium";;
    attn-ops-768p) step 200 ws1-ops-attention-768p $H run ws1-ops --device cuda --config real --layouts 768p \
      --op h3_full_attention --out "$ev/ws1-ops-attention-768p";;
    attn-ops-tiny-small) step 200 ws1-ops-attention-tiny-small $H run ws1-ops --device cuda --config real \
      --layouts tiny,small --op h3_full_attention --out "$ev/ws1-ops-attention-tiny-small";;
    gate-block-768p) step 200 ws1-block-real-768p-forward $H run ws1-block --config real --layout 768p --device cuda \
      --mode strict --no-backward --out "$ev/ws1-block-real-768p-forward";;
    gate-model-768p) step 200 ws1-model-real-768p-forward-blocks-0-4 $H run ws1-model --config real --device cuda \
      --mode strict --layout 768p --no-backward --layers 0:4 --out "$ev/ws1-model-real-768p-forward-blocks-0-4";;
    gate-block-tiny|gate-block-small) L=${s#gate-block-}
      step 200 "ws1-block-real-$L" $H run ws1-block --config real --layout "$L" --device cuda --mode strict --fault-matrix \
        --out "$ev/ws1-block-real-$L";;
    gate-model) step 300 ws1-model-real-medium $H run ws1-model --config real --layout medium --device cuda \
      --mode strict --out "$ev/ws1-model-real-medium";;
    block-medium|block-768p) L=${s#block-}
      step 300 "bench-ws1-block-$L" $H bench ws1-block --config real --layout "$L" --device cuda \
        --out "$ev/bench-ws1-block-$L";;
    gate-block) step 200 ws1-block-real-medium $H run ws1-block --config real --layout medium --device cuda \
      --mode strict --out "$ev/ws1-block-real-medium";;
    model-medium|model-768p) L=${s#model-}
      step 420 "bench-ws1-model-$L" $H bench ws1-model --config real --layout "$L" --device cuda \
        --out "$ev/bench-ws1-model-$L";;
    *) echo "unknown section $s"; exit 2;;
  esac
done
tar czf "$out/evidence.tgz" -C "$ev" .
