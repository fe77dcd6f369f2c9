"""The Gluon row-segment weight gradient's dispatch and host side, on the CPU: which calls run it (the knob on, Hopper,
one device, one batch item, bfloat16, the layer's dW BLOCK_K its tiling's), what launch records name, the segments
as chunk counts and per-segment descriptors, and the measurement-only ``H3GATE_GEMM_LAUNCH`` knobs. The kernel runs
only on a GPU (bytes against ``rows_dw``: ``tools/gpu_seg8_gluon_dw_check.py``); ``test_sm90_compile.py`` lowers it
for sm_90."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from h3gate.errors import InputError
from h3gate.kernels import gemm_configs, gemm_merge, rows_seg8, selection
from h3gate.kernels.gemm_configs import PRODUCTION
from h3gate.kernels.row_merge import DW_SEGMENTS, RowGroup, dw_bounds, one_device

gemm_gluon_rows_dw = pytest.importorskip("h3gate.kernels.gemm_gluon_rows_dw")  # Triton's Gluon (3.6 and later)

BF16 = torch.bfloat16
ON, OFF = replace(PRODUCTION, rows_dw_gluon=True), replace(PRODUCTION, rows_dw_gluon=False)
CUDA = torch.device("cuda:0")
BLOCK = {"q/k/v": (7168, 5376), "o": (5376, 7168), "gate_up": (28672, 5376), "down": (5376, 14336)}


@pytest.fixture
def hopper(monkeypatch):
    """A Hopper GPU outside the interpreter, as the path selection sees it."""
    monkeypatch.setattr(selection, "device_class", lambda device: "cuda-sm90")


def _path(full, m, launch=ON, batch=1, dtype=BF16, rows=None, device=CUDA) -> str:
    n, k = full
    return rows_seg8.dw_path((batch, m, n, k), dtype, device, rows or one_device(m), full, launch)


@pytest.mark.parametrize("full", list(BLOCK.values()), ids=list(BLOCK))
@pytest.mark.parametrize("m", [1, 264, 3160, 38974])
def test_the_knob_on_runs_the_gluon_dw_for_the_block_weights_on_hopper(hopper, full, m) -> None:
    assert _path(full, m) == rows_seg8.GLUON_DW
    assert rows_seg8.fused_dw_config(full, BF16).block_k == gemm_gluon_rows_dw.ROWS_DW_GLUON.block_k


def test_rows_dw_runs_everywhere_else(monkeypatch, hopper) -> None:
    o = BLOCK["o"]
    assert _path(o, 3160, OFF) == rows_seg8.TRITON_DW  # the knob off
    assert PRODUCTION.rows_dw_gluon or gemm_configs.launch_overrides()  # on in PRODUCTION
    assert _path(o, 3160, batch=2) == rows_seg8.TRITON_DW  # b-major segments: not one TMA box
    assert _path(o, 3160, dtype=torch.float32) == rows_seg8.TRITON_DW
    assert _path(o, 0) == rows_seg8.TRITON_DW
    assert _path((5376, 7164), 3160) == rows_seg8.TRITON_DW  # X rows TMA cannot address
    assert _path((12, 64), 64) == rows_seg8.TRITON_DW
    cp = RowGroup(2, 0, 3160, lambda t: [t, t])  # a CP rank: a subset of the segments, the FP32 subtree
    assert _path(o, 1580, rows=cp) == rows_seg8.TRITON_DW
    for other in ("cuda-other", "cpu-interpreter"):
        monkeypatch.setattr(selection, "device_class", lambda device, other=other: other)
        assert _path(o, 3160) == rows_seg8.TRITON_DW


def test_a_gluon_tiling_with_another_block_k_is_never_used(monkeypatch, hopper) -> None:
    """Negative control of the BLOCK_K guard: the Gluon tiling's BLOCK_K changed, the same call runs rows_dw."""
    assert _path(BLOCK["o"], 3160) == rows_seg8.GLUON_DW
    monkeypatch.setattr(rows_seg8, "ROWS_DW_GLUON", replace(gemm_gluon_rows_dw.ROWS_DW_GLUON, block_k=128))
    assert _path(BLOCK["o"], 3160) == rows_seg8.TRITON_DW


def test_linear_row_grads_launches_the_chosen_kernel(monkeypatch, hopper) -> None:
    """Knob on: the Gluon host function gets dY and X as (S, N) and (S, K) and rows_dw is not called; off: rows_dw."""
    calls = []
    monkeypatch.setattr(rows_seg8, "rows_dw_ws", lambda g, x, out, programs: calls.append(("gluon", g.shape, x.shape)))
    monkeypatch.setattr(rows_seg8, "rows_dw", lambda g, x, *a: calls.append(("triton", g.shape, x.shape)))
    monkeypatch.setattr(rows_seg8, "num_sms", lambda device: 132)
    gy, x = torch.zeros(1, 40, 32, dtype=BF16), torch.zeros(1, 40, 64, dtype=BF16)
    rows_seg8.linear_row_grads(gy, x, (32, 64), (32, 64), one_device(40), False, ON)
    rows_seg8.linear_row_grads(gy, x, (32, 64), (32, 64), one_device(40), False, OFF)
    assert calls == [("gluon", (40, 32), (40, 64)), ("triton", (1, 40, 32), (1, 40, 64))]


def test_the_launch_record_names_the_dw_path(monkeypatch) -> None:
    x, w = torch.zeros(5, 64, dtype=BF16), torch.zeros(32, 64, dtype=BF16)
    dw = gemm_merge.launch_record(x, w, ON)["dw"]
    assert dw == {"tiling": rows_seg8.fused_dw_config((32, 64), BF16).tag, "tma": False, "kernel": rows_seg8.TRITON_DW}
    monkeypatch.setattr(selection, "device_class", lambda device: "cuda-sm90")
    assert gemm_merge.launch_record(x, w, OFF)["dw"]["kernel"] == rows_seg8.TRITON_DW
    assert gemm_merge.launch_record(x, w)["dw"]["kernel"] == rows_seg8.GLUON_DW  # on in PRODUCTION
    dw = gemm_merge.launch_record(x, w, ON)["dw"]
    assert dw == {"tiling": gemm_gluon_rows_dw.ROWS_DW_GLUON.tag, "tma": True, "kernel": rows_seg8.GLUON_DW}


def test_evidence_accepts_the_dw_paths_and_nothing_unknown() -> None:
    from jsonschema import Draft202012Validator

    from h3gate.evidence.schema import registry

    reg = registry()
    launch = reg.resolver(base_uri="common.schema.json").lookup("#/$defs/launch").contents
    validator = Draft202012Validator(launch, registry=reg)
    fwd = {"tiling": "t", "tma": True, "kernel": gemm_merge.TRITON}
    for kernel in (rows_seg8.TRITON_DW, rows_seg8.GLUON_DW):
        record = {"forward": fwd, "dw": {"tiling": "t", "tma": True, "kernel": kernel}, "interpreted": False}
        assert not list(validator.iter_errors(record)), kernel
    wrong = {"forward": fwd, "dw": {"tiling": "t", "tma": True, "kernel": "gluon_rows_dw"}, "interpreted": False}
    assert list(validator.iter_errors(wrong))


def _chunks(cps: int, total: int) -> list[int]:
    """Each segment's chunk count as the consumers' walk (``gemm_gluon_seg8._segment``) derives it."""
    return [min(min(j * cps, total) + cps, total) - min(j * cps, total) for j in range(DW_SEGMENTS)]


@pytest.mark.parametrize("block_k", [64, 128])
def test_segments_as_chunk_counts_are_each_segments_own(block_k) -> None:
    """(cps, T) give every segment ceil(len / BLOCK_K) chunks, trailing empty segments none, for every S up to 1100
    and the block's; negative control: T = ceil(S / BLOCK_K) (chunks of the rows, not of the segments) differs."""
    wrong = 0
    for s in [*range(1, 1100), 3160, 38974]:
        bounds = dw_bounds(s)
        want = [-(-(b - a) // block_k) for a, b in zip(bounds, bounds[1:], strict=False)]
        cps, total = gemm_gluon_rows_dw.segment_chunks(s, block_k)
        assert _chunks(cps, total) == want, s
        wrong += _chunks(cps, -(-s // block_k)) != want
    assert wrong > 0


def test_each_segment_has_descriptors_over_its_rows_alone() -> None:
    """Segment i's boxes address rows [r'_i, r'_i+1) of dY and X (base at r'_i, shape ending at the segment's end,
    so the tail chunk's further rows are TMA's zero fill); empty segments repeat segment 0's (never loaded)."""
    s = 17  # L' = 6: segments of 6 rows, the third of 5, the last empty
    g, x = torch.zeros(s, 32, dtype=BF16), torch.zeros(s, 128, dtype=BF16)
    g_descs, x_descs = gemm_gluon_rows_dw.segment_descriptors(g, x, 64)
    bounds = dw_bounds(s)
    for i, (gd, xd) in enumerate(zip(g_descs, x_descs, strict=True)):
        lo, hi = (bounds[i], bounds[i + 1]) if bounds[i + 1] > bounds[i] else bounds[:2]
        for d, t, box in ((gd, g, [64, 64]), (xd, x, [64, 128])):
            want = (t[lo].data_ptr(), [hi - lo, t.shape[1]], box)
            assert (d.base.data_ptr(), list(d.shape), list(d.block_shape)) == want, i
    assert [list(d.shape)[0] for d in g_descs] == [6, 6, 5, 6]


def test_the_host_side_refuses_other_tilings() -> None:
    cfg = replace(gemm_gluon_rows_dw.ROWS_DW_GLUON, block_k=128)
    g, x, out = torch.zeros(8, 32, dtype=BF16), torch.zeros(8, 64, dtype=BF16), torch.zeros(32, 64, dtype=BF16)
    with pytest.raises(ValueError, match="gemm_gluon_rows_dw"):
        gemm_gluon_rows_dw.rows_dw_ws(g, x, out, 132, cfg)


def test_gemm_launch_knobs_from_the_environment(monkeypatch) -> None:
    """``H3GATE_GEMM_LAUNCH``'s syntax; unknown knobs or values are refused; overrides list what differs."""
    assert gemm_configs.parse_launch("") == {}
    assert gemm_configs.parse_launch("rows_dw_gluon, rows_dw_tma=0,seg8_tma=1") == {
        "rows_dw_gluon": True, "rows_dw_tma": False, "seg8_tma": True}  # fmt: skip
    for bad in ("rows_dw_glu", "rows_dw_gluon=yes", "=1"):
        with pytest.raises(InputError, match="H3GATE_GEMM_LAUNCH"):
            gemm_configs.parse_launch(bad)
    monkeypatch.setattr(gemm_configs, "PRODUCTION", replace(gemm_configs.GemmLaunch(), rows_dw_gluon=False))
    assert gemm_configs.launch_overrides() == {"rows_dw_gluon": False}
    monkeypatch.setattr(gemm_configs, "PRODUCTION", gemm_configs.GemmLaunch())
    assert gemm_configs.launch_overrides() == {}


def test_stubbed_forward_shapes_read_for_the_record() -> None:
    """The record reads only x's leading dims, dtype and device: a (B, S, K) input of B > 1 records rows_dw."""
    x = SimpleNamespace(ndim=3, shape=torch.Size([2, 40, 64]), dtype=BF16, device=CUDA, is_cuda=True)
    x.reshape = lambda *s: x
    rec = rows_seg8.dw_record(x, (32, 64), one_device(40), ON)
    assert rec["kernel"] == rows_seg8.TRITON_DW


def test_the_bench_record_names_the_knobs_set() -> None:
    """bench ws1-block's ``gemm_launch`` (the knobs ``H3GATE_GEMM_LAUNCH`` set) is knob -> boolean; anything else is
    refused (negative control)."""
    from jsonschema import Draft202012Validator

    from h3gate.evidence.schema import registry

    reg = registry()
    prop = reg.resolver(base_uri="bench-ws1-block.schema.json").lookup("#/properties/gemm_launch").contents
    validator = Draft202012Validator(prop, registry=reg)
    assert not list(validator.iter_errors({"rows_dw_gluon": True}))
    assert list(validator.iter_errors({"rows_dw_gluon": "1"}))


def test_the_bench_prints_the_knobs_set(capsys) -> None:
    """A bench record with ``gemm_launch`` says so above its verdict; one without says nothing of it."""
    from h3gate.commands import bench_cmd
    from tests.test_verdicts import _committed, verdict_of

    doc, path = _committed("bench-ws1-block")
    for knobs in ({"rows_dw_gluon": True, "seg8_gluon_dx": True}, None):
        bench_cmd._print_phases("ws1-block", {**doc, **({"gemm_launch": knobs} if knobs else {})}, path, False)
        out = capsys.readouterr().out
        said = "GEMM launch knobs set by H3GATE_GEMM_LAUNCH (measurement only): rows_dw_gluon=1, seg8_gluon_dx=1."
        assert (said in " ".join(out.split())) == bool(knobs) and verdict_of(out) == "complete"
