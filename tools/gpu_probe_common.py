"""What the H200 probes (``tools/gpu_attention_gluon.py``, ``tools/gpu_attention_bwd.py``, ``tools/gpu_floor_probe.py``,
...) share: byte equality, medians with failures recorded, and the JSON file every probe writes even when a section
fails (:func:`records_file`).
Imported by those scripts from their own folder (``python3 tools/NAME.py`` puts it on ``sys.path``)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import triton

SMALL_CASES = [(1, 264, False), (2, 300, True)]  # (B, S, walk order): a smoke run's byte cases
# (text, audio) rows of the layouts whose walk order "layout" imitates; other S: S // 15 and S // 40
LAYOUT_ROWS = {3160: (206, 74), 38974: (256, 414)}


def walk_order(kind: bool | str, s: int, device: str = "cuda") -> torch.Tensor | None:
    """A case's walk order: False none; True a seeded random permutation (every tile copied); "layout" the order of a
    ``[text | video | audio]`` packing walked ``[text | audio | video]`` (medium / 768p's rows at S = 3160 / 38974):
    a few runs of consecutive packed rows, as real layouts give (most tiles read in place)."""
    if kind is False:
        return None
    if kind is True:
        return torch.randperm(s, device=device, generator=torch.Generator(device=device).manual_seed(5))
    t, a = LAYOUT_ROWS.get(s, (s // 15, s // 40))
    return torch.cat([torch.arange(0, t), torch.arange(s - a, s), torch.arange(t, s - a)]).to(device)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality of two 16- or 32-bit tensors (NaN payloads and signed zeros included)."""
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return bool(torch.equal(a.contiguous().view(view), b.contiguous().view(view)))


def error_text(exc: BaseException, limit: int = 300) -> str:
    return f"{type(exc).__name__}: {str(exc)[:limit]}"


def time_into(rec: dict, fns: dict[str, Callable], flops: float, warmup: int, rep: int) -> None:
    """``rec["ms"][name]`` / ``rec["tflops"][name]``: each function's ``do_bench`` median; a failure is recorded under
    ``rec["errors"][name]`` with a null time, never raised."""
    rec.setdefault("ms", {})
    rec.setdefault("tflops", {})
    for name, fn in fns.items():
        try:
            ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
            rec["ms"][name], rec["tflops"][name] = ms, flops / ms / 1e9
        except Exception as exc:  # noqa: BLE001 - recorded, the probe goes on
            rec["ms"][name] = None
            rec.setdefault("errors", {})[name] = error_text(exc)


def best_over(rec: dict, variants: list[str], reference: str) -> float:
    """``reference``'s median over the fastest variant's (NaN when either is missing)."""
    best = min((v for k, v in rec["ms"].items() if k in variants and v), default=math.nan)
    return (rec["ms"].get(reference) or math.nan) / best


def probe_main(variants: dict, sections: dict[str, Callable[[list, list[str], bool], None]]) -> int:
    """Parse ``--out --sections --variants --small``, run the sections in order (TF32 off) and write
    ``{"meta", "records"}`` to ``--out`` whatever happens."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default=",".join(sections))
    ap.add_argument("--variants", default=",".join(variants))
    ap.add_argument("--small", action="store_true", help="bytes at two small cases only (a smoke run)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with records_file(args.out) as records:
        for section in args.sections.split(","):
            sections[section](records, args.variants.split(","), args.small)
    return 0


@contextmanager
def records_file(path: str, **meta: object) -> Iterator[list[dict]]:
    """The probe's record list; on leaving, ``{"meta", "records"}`` is written to ``path`` whatever happened (a failed
    section keeps what ran before it). ``meta``: torch, Triton and the device, and the keys given."""
    records: list[dict] = []
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    head = {"torch": torch.__version__, "triton": triton.__version__, "device": device, **meta}
    try:
        yield records
    finally:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"meta": head, "records": records}, f, indent=1)
