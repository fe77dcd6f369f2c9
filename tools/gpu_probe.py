"""One-off GPU facts probe: which rounding order torch's CUDA rms_norm uses, SDPA default backend, env."""
import json
import os
import sys

import torch
import torch.nn.functional as F

out = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name()}
g = torch.Generator(device="cuda").manual_seed(0)
for H in (128, 5376):
    x = torch.randn(4096, H, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()
    eps = 1e-5
    ref = F.rms_norm(x, (H,), w, eps)
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    two_round = (xf * rstd).bfloat16() * w
    one_round = (xf * rstd * w.float()).bfloat16()
    cpu = F.rms_norm(x.cpu(), (H,), w.cpu(), eps).cuda()
    out[f"rms_norm_H{H}"] = {
        "eq_two_round": bool(torch.equal(ref, two_round)),
        "eq_one_round": bool(torch.equal(ref, one_round)),
        "eq_cpu": bool(torch.equal(ref, cpu)),
        "ndiff_two": int((ref != two_round).sum()),
        "ndiff_one": int((ref != one_round).sum()),
    }
    # 4-D (qk norm style)
    x4 = torch.randn(2, 300, 56, 128, device="cuda", generator=g).bfloat16()
    w4 = (1 + 0.1 * torch.randn(128, device="cuda", generator=g)).bfloat16()
    r4 = F.rms_norm(x4, (128,), w4, eps)
    x4f = x4.float()
    r4s = torch.rsqrt(x4f.pow(2).mean(-1, keepdim=True) + eps)
    out["rms_norm_4d"] = {"eq_two_round": bool(torch.equal(r4, (x4f * r4s).bfloat16() * w4)),
                         "eq_one_round": bool(torch.equal(r4, (x4f * r4s * w4.float()).bfloat16()))}
# fp32 rms_norm
xf32 = torch.randn(1000, 5376, device="cuda", generator=g)
wf32 = 1 + 0.1 * torch.randn(5376, device="cuda", generator=g)
r = F.rms_norm(xf32, (5376,), wf32, 1e-5)
rs = torch.rsqrt(xf32.pow(2).mean(-1, keepdim=True) + 1e-5)
out["rms_norm_fp32"] = {"eq_x_rstd_w": bool(torch.equal(r, xf32 * rs * wf32)), "eq_cpu": bool(torch.equal(r, F.rms_norm(xf32.cpu(), (5376,), wf32.cpu(), 1e-5).cuda()))}
# sin/cos/exp vs CPU
t = torch.rand(100000, device="cuda", generator=g) * 1000
out["sin_eq_cpu"] = bool(torch.equal(torch.sin(t).cpu(), torch.sin(t.cpu())))
out["cos_eq_cpu"] = bool(torch.equal(torch.cos(t).cpu(), torch.cos(t.cpu())))
e = -torch.rand(1000, device="cuda", generator=g) * 10
out["exp_eq_cpu"] = bool(torch.equal(torch.exp(e).cpu(), torch.exp(e.cpu())))
s = torch.randn(100000, device="cuda", generator=g)
out["silu_eq_cpu_fp32"] = bool(torch.equal(F.silu(s).cpu(), F.silu(s.cpu())))
sb = s.bfloat16()
out["silu_eq_cpu_bf16"] = bool(torch.equal(F.silu(sb).cpu(), F.silu(sb.cpu())))
# SDPA backend selection on bf16 (B,nh,S,D)
q = torch.randn(1, 56, 3160, 128, device="cuda", dtype=torch.bfloat16, generator=g)
from torch.nn.attention import SDPBackend, sdpa_kernel
ref = F.scaled_dot_product_attention(q, q, q)
eq = {}
for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
    try:
        with sdpa_kernel([b]):
            eq[b.name] = bool(torch.equal(ref, F.scaled_dot_product_attention(q, q, q)))
    except Exception as ex:  # noqa
        eq[b.name] = f"err {ex}"[:80]
out["sdpa_default_equals"] = eq
out["allow_tf32"] = [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32]
try:
    import pydantic, jsonschema, diffusers  # noqa
    out["wheels"] = [pydantic.VERSION, jsonschema.__version__ if hasattr(jsonschema, "__version__") else "?", diffusers.__version__]
except Exception as ex:
    out["wheels"] = str(ex)
import triton
out["triton"] = triton.__version__
print(json.dumps(out, indent=1))
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w"), indent=1)
