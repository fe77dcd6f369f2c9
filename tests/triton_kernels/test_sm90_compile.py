"""The attention kernels' CUDA-only paths (TMA loads, the walk order's indexed rows) compiled for Hopper (sm_90) on
the CPU: the interpreter never runs TMA, so this is where CI sees those paths lower to PTX with TMA copies, wgmma
and the declared exp2 / fma instructions (their bytes are compared with the pointer kernels on the H200:
``tools/gpu_perf_probe.py --sections attn_tma``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")


@pytest.fixture(scope="module")
def facts() -> dict:
    script = Path(__file__).with_name("sm90_lowering.py")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_tma_forward_lowers_to_tma_copies_wgmma_and_the_declared_math(facts) -> None:
    for ordered in (False, True):
        got = facts[f"fwd_tma_ordered={ordered}"]
        assert got["cp.async.bulk.tensor"] and got["wgmma.mma_async"], got
        assert got["ex2.approx.ftz.f32"] and got["fma.rn.f32"], got  # ex2ftz + the explicit fma of the contract


def test_backward_kernels_use_tma_only_when_asked(facts) -> None:
    for kernel in ("dkdv", "dq"):
        with_tma, without = facts[f"{kernel}_tma=True"], facts[f"{kernel}_tma=False"]
        assert with_tma["cp.async.bulk.tensor"] and not without["cp.async.bulk.tensor"], kernel
        assert with_tma["wgmma.mma_async"] and without["wgmma.mma_async"], kernel
