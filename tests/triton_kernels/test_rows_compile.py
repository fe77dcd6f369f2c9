"""Every strict row kernel and the GEMM's block variants compile for sm_90 (the H200 path: libdevice, cvt.rn, no FMA
contraction; the GEMM on wgmma, tail tiles and swapped operands included) without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # ~25 s of compiles: make test-slow and make test-newest run it, not make test


def test_row_kernels_compile_for_sm90_without_fma():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.triton_kernels.rows_aot"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(records) >= 22, proc.stderr[-2000:]
    bad = [r for r in records if not (r["ok"] and r["fma_free"])]
    assert not bad, bad
    gemm = {r["kernel"]: r["wgmma"] for r in records if r["kernel"].startswith("gemm.")}
    assert gemm == {
        "gemm.fwd.tma": ["m64n256k16"],
        "gemm.fwd.tma.tail128": ["m64n128k16", "m64n256k16"],  # the wide tiles, then the 128-wide tail tiles
        "gemm.fwd.ptr.tail128": ["m64n128k16", "m64n256k16"],
        "gemm.dw.tma": ["m64n256k16"],
        # swapped operands: the token chunk is the MMA's N extent, main block and tail block as two instructions
        "gemm.swap.tma.tail16": ["m64n16k16", "m64n256k16"],
        "gemm.swap.ptr.tail16": ["m64n16k16", "m64n256k16"],
        "gemm.swap.tma.tail64": ["m64n256k16", "m64n64k16"],
        # the fused row-segment dW: BLOCK_N capped at 128 (the accumulator and a scratch slot tile in registers)
        "gemm.rows_dw": ["m64n128k16"],
        "gemm.rows_dw.tma": ["m64n128k16"],
        "gemm.rows_dw.cp4": ["m64n128k16"],
        "gemm.seg8": ["m64n128k16"],  # the seg8 forward shares the dW's tree fold (kernels.exact.fold_segment)
    }, gemm
    assert proc.returncode == 0
