"""The attention kernels' CUDA-only paths (TMA loads, the walk order's indexed rows, the warp-specialised Gluon
forward) compiled for Hopper (sm_90) on the CPU: the interpreter never runs TMA or Gluon, so this is where CI sees
those paths lower to PTX with TMA copies, wgmma and the declared exp2 / fma instructions, and ptxas keep the Gluon
kernel's wgmma asynchronous without spills (their bytes are compared with the pointer kernels on the H200:
``tools/gpu_perf_probe.py --sections attn_tma``, ``tools/gpu_attention_gluon.py``)."""

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


def test_gluon_forward_keeps_its_mmas_asynchronous_and_the_declared_math(facts) -> None:
    """Both consumer warpgroups' MMAs (2 x 24 wgmma), the producer's TMA loads (Q, K, V; with a walk order Q is a
    canonical copy too), register reallocation between partitions, the contract's ex2.approx.ftz + fma; ptxas
    neither serialises the wgmma (it does when an MMA group stays in flight across the loop's back edge, warning
    C7514) nor spills (checked with Triton 3.6, 3.7 and 3.9)."""
    for ordered in (False, True):
        got = facts[f"fwd_gluon_ordered={ordered}"]
        assert got["wgmma.mma_async"] == 48 and got["setmaxnreg"] >= 4 and got["cp.async.bulk.tensor"] >= 3, got
        assert got["ex2.approx.ftz.f32"] and got["fma.rn.f32"], got
        assert got["wgmma_serialized"] is False and got["spill_bytes"] == 0, got
