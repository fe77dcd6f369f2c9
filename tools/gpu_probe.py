"""One-off GPU facts probe: CUDA rms_norm rounding order, transcendental parity with the CPU, SDPA default backend.

PYTHONPATH=$PWD python3 tools/gpu_probe.py      (writes $OUT/probe.json; results in docs/gpu-notes.md)
"""

import json
import os

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel


def rms_orders(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> dict:
    """Compare torch's CUDA rms_norm with the two rounding orders and with the CPU result."""
    h = x.shape[-1]
    ref = F.rms_norm(x, (h,), w, eps)
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    two_round = (xf * rstd).to(x.dtype) * w
    one_round = (xf * rstd * w.float()).to(x.dtype)
    cpu = F.rms_norm(x.cpu(), (h,), w.cpu(), eps).cuda()
    return {
        "eq_two_round": bool(torch.equal(ref, two_round)),
        "eq_one_round": bool(torch.equal(ref, one_round)),
        "eq_cpu": bool(torch.equal(ref, cpu)),
        "ndiff_two": int((ref != two_round).sum()),
        "ndiff_one": int((ref != one_round).sum()),
    }


def main() -> None:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name()}
    out["triton"] = triton.__version__
    g = torch.Generator(device="cuda").manual_seed(0)
    for h in (128, 5376):
        x = torch.randn(4096, h, device="cuda", generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).bfloat16()
        out[f"rms_norm_H{h}"] = rms_orders(x, w)
    t = torch.rand(100000, device="cuda", generator=g) * 1000
    for name, fn in (("sin", torch.sin), ("cos", torch.cos), ("exp", torch.exp), ("silu", F.silu)):
        out[f"{name}_eq_cpu_fp32"] = bool(torch.equal(fn(t).cpu(), fn(t.cpu())))
    q = torch.randn(1, 56, 3160, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = F.scaled_dot_product_attention(q, q, q)
    equal = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        with sdpa_kernel([backend]):
            equal[backend.name] = bool(torch.equal(ref, F.scaled_dot_product_attention(q, q, q)))
    out["sdpa_default_equals"] = equal
    out["allow_tf32"] = [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32]
    print(json.dumps(out, indent=1))
    folder = os.environ.get("OUT", ".")
    with open(os.path.join(folder, "probe.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
