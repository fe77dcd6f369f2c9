"""On a GPU: the seg8 kernel's TMA walk equals its pointer walk byte for byte at the block's real shapes (forward and
dX, TP1 and the TP8 subtrees), and each segment equals the single-walk kernel on its K-slice.

    python3 tools/gpu_seg8_tma_check.py            # prints one line per check; exit 1 on any difference
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from h3gate.kernels import gemm_merge as gm
from h3gate.kernels.gemm_configs import PRODUCTION, gemm_config
from h3gate.kernels.gemm_triton import matmul

POINTERS = replace(PRODUCTION, seg8_tma=False)  # the seg8 kernel's pointer walk wherever TMA would run


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    bad = 0
    for name, (n, k) in {"o_proj": (5376, 7168), "ffn_down": (5376, 14336)}.items():
        for m in (264, 3160):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            xs = x[:, : k // 8].contiguous()
            w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
            tma = gm.linear_merge(x, w)
            ptr = gm.linear_merge(x, w, launch=POINTERS)
            sub_ptr = gm.segment_partials(xs, w[:, : k // 8].contiguous(), range(0, 1), (n, k), launch=POINTERS)
            sub_tma = gm.segment_partials(xs, w[:, : k // 8].contiguous(), range(0, 1), (n, k))
            single = torch.empty((m, n), dtype=torch.float32, device="cuda")
            cfg = gemm_config("fwd", n, k, torch.bfloat16)
            matmul(xs, w[:, : k // 8].contiguous(), single, None, cfg, a_trans=False,
                   b_trans=True)  # fmt: skip
            checks = {"tma == pointer (TP1 forward)": torch.equal(tma, ptr),
                      "segment 0: tma == pointer": torch.equal(sub_tma, sub_ptr),
                      "segment 0 == single walk on its slice": torch.equal(sub_tma, single)}  # fmt: skip
            for what, ok in checks.items():
                bad += not ok
                print(f"{name} M={m}: {what}: {'bitwise' if ok else 'DIFFERENT'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
