"""The segmented-8 Gluon forward's dispatch, on the CPU: which calls run it (Hopper, bfloat16, the layer's pinned
BLOCK_K equal to its tiling's, never under the interpreter), what the launch record names, and the host checks. The
kernel runs only on a GPU (bytes against the Triton seg8 kernel: ``tools/gpu_seg8_gluon_check.py``);
``test_sm90_compile.py`` lowers it for sm_90."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from h3gate.kernels import gemm_merge, launches, selection
from h3gate.kernels.common import INTERPRET
from h3gate.kernels.gemm_configs import PRODUCTION
from tests.triton_kernels.test_gemm_gluon import _stub, _weight  # what the dispatch reads of x and the weight

gemm_gluon_seg8 = pytest.importorskip("h3gate.kernels.gemm_gluon_seg8")  # Triton's Gluon (3.6 and later)
gluon = pytest.importorskip("triton.experimental.gluon")
gl = gluon.language

BF16 = torch.bfloat16
O_PROJ, DOWN = (5376, 7168), (5376, 14336)


@gluon.jit
def _slot_store(out_ptr, SHARED: gl.constexpr, CONFLICTS: gl.constexpr):
    """An accumulator of ``_tree_onchip`` stored to a slot of layout SHARED, asserting Triton's bank-conflict count."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    acc = gl.zeros([64, 128], gl.float32, layout)
    slot = gl.allocate_shared_memory(gl.float32, [64, 128], SHARED)
    gl.static_assert(gl.bank_conflicts(acc.type, slot.type) == CONFLICTS)
    slot.store(acc)


@pytest.fixture
def hopper(monkeypatch):
    """A Hopper GPU outside the interpreter, as the path selection sees it."""
    monkeypatch.setattr(selection, "device_class", lambda device: "cuda-sm90")


@pytest.mark.parametrize("layer", [O_PROJ, DOWN])
@pytest.mark.parametrize("m", [1, 264, 3160, 38974])
def test_hopper_bf16_block_layers_run_the_gluon_seg8_forward(hopper, layer, m) -> None:
    n, k = layer
    path, cfg = gemm_merge.forward_plan(_stub(m, k), _weight(n, k))
    assert (path, cfg) == (gemm_merge.GLUON, gemm_gluon_seg8.SEG8_GLUON)
    assert cfg.block_k == gemm_merge.pinned_config("fwd", layer, BF16).block_k  # the same segments and chunks


def test_the_triton_seg8_kernel_runs_everywhere_else(monkeypatch, hopper) -> None:
    n, k = O_PROJ
    triton = (gemm_merge.TRITON, gemm_merge.fused_config("fwd", O_PROJ, BF16))
    assert gemm_merge.forward_plan(_stub(3160, k), _weight(n, k), replace(PRODUCTION, seg8_gluon=False)) == triton
    assert gemm_merge.forward_plan(_stub(0, k), _weight(n, k)) == triton  # no rows: nothing to launch
    fp32 = gemm_merge.forward_plan(_stub(3160, k, torch.float32), _weight(n, k, torch.float32))
    assert fp32[0] == gemm_merge.TRITON
    # a layer whose pinned BLOCK_K is 128 (the final AdaLN projection), and rows TMA cannot address (N % 8)
    assert gemm_merge.forward_plan(_stub(2, 2688), _weight(10752, 2688))[0] == gemm_merge.TRITON
    assert gemm_merge.pinned_config("fwd", (10752, 2688), BF16).block_k == 128
    assert gemm_merge.forward_plan(_stub(64, 64), _weight(12, 64))[0] == gemm_merge.TRITON
    for other in ("cuda-other", "cpu-interpreter"):
        monkeypatch.setattr(selection, "device_class", lambda device, other=other: other)
        assert gemm_merge.forward_plan(_stub(3160, k), _weight(n, k)) == triton


def test_a_gluon_tiling_with_another_block_k_is_never_used(monkeypatch, hopper) -> None:
    """Negative control of the BLOCK_K guard: the same layer, the Gluon tiling's BLOCK_K changed, runs Triton."""
    n, k = O_PROJ
    assert gemm_merge.gluon_tiling(n, k, BF16) is not None
    monkeypatch.setattr(gemm_merge, "SEG8_GLUON", replace(gemm_gluon_seg8.SEG8_GLUON, block_k=128))
    assert gemm_merge.gluon_tiling(n, k, BF16) is None
    assert gemm_merge.forward_plan(_stub(3160, k), _weight(n, k))[0] == gemm_merge.TRITON


def test_the_launch_record_names_the_path(monkeypatch) -> None:
    x, w = torch.zeros(5, 64, dtype=BF16), torch.zeros(32, 64, dtype=BF16)
    rec = gemm_merge.launch_record(x, w)
    cfg = gemm_merge.fused_config("fwd", (32, 64), BF16)
    assert rec["forward"] == {"tiling": cfg.tag, "tma": False, "kernel": gemm_merge.TRITON}
    monkeypatch.setattr(selection, "device_class", lambda device: "cuda-sm90")
    rec = gemm_merge.launch_record(x, w)
    assert rec["forward"] == {"tiling": gemm_gluon_seg8.SEG8_GLUON.tag, "tma": True, "kernel": gemm_merge.GLUON}


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's path (CPU tensors)")
def test_interpreted_calls_run_and_record_the_triton_kernel() -> None:
    """Under the interpreter (the suite's mode) the operator runs the Triton seg8 kernel and its record says so."""
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(s, generator=gen).to(BF16) for s in ((3, 64), (16, 64)))
    with launches.recording() as log:
        y = gemm_merge.h3_attention_o_gemm_seg8(x, w)
    (rec,) = log[""]["h3_attention_o_gemm_seg8"]
    assert rec["forward"]["kernel"] == gemm_merge.TRITON and rec["interpreted"]
    want = gemm_merge._subtree(x, w, range(8), (16, 64), "fwd", 64, None, BF16, PRODUCTION)
    assert torch.equal(y, want)


def test_the_host_side_refuses_segments_off_the_chunks() -> None:
    cfg = gemm_gluon_seg8.SEG8_GLUON
    x, w, y = torch.zeros(4, 128, dtype=BF16), torch.zeros(256, 128, dtype=BF16), torch.zeros(4, 256, dtype=BF16)
    with pytest.raises(ValueError, match="segment 96"):
        gemm_gluon_seg8.matmul_seg8_ws(x, w, y, None, cfg, 96, 132)
    assert gemm_gluon_seg8.halves(cfg) == (128, 0) and gemm_gluon_seg8.halves(replace(cfg, block_n=256)) == (128, 128)


def test_evidence_accepts_the_seg8_paths_and_nothing_unknown() -> None:
    """The launch record's schema (``common.schema.json#/$defs/launch``) names both seg8 paths; an unknown kernel name
    is refused (negative control)."""
    from jsonschema import Draft202012Validator

    from h3gate.evidence.schema import registry

    reg = registry()
    launch = reg.resolver(base_uri="common.schema.json").lookup("#/$defs/launch").contents
    validator = Draft202012Validator(launch, registry=reg)
    for kernel in (gemm_merge.TRITON, gemm_merge.GLUON):
        record = {"forward": {"tiling": gemm_gluon_seg8.SEG8_GLUON.tag, "tma": True, "kernel": kernel}}
        assert not list(validator.iter_errors({**record, "interpreted": False})), kernel
    wrong = {"forward": {"tiling": "t", "tma": True, "kernel": "gluon_seg8"}, "interpreted": False}
    assert list(validator.iter_errors(wrong))


ON_DX, OFF_DX = replace(PRODUCTION, seg8_gluon_dx=True), replace(PRODUCTION, seg8_gluon_dx=False)
QKV, GATE_UP = (7168, 5376), (28672, 5376)


@pytest.mark.parametrize("layer", [QKV, O_PROJ, GATE_UP, DOWN])
def test_the_dx_knob_runs_the_gluon_seg8_dx_on_hopper(hopper, layer) -> None:
    """dX = dY W (reduction over N, the column-parallel layers' TP split): the Gluon seg8 kernel where
    ``seg8_gluon_dx`` (on in PRODUCTION), its BLOCK_K the layer's pinned dX one; else the Triton seg8 kernel."""
    n, k = layer
    gluon = (gemm_merge.GLUON, gemm_gluon_seg8.SEG8_GLUON)
    assert gemm_merge.forward_plan(_stub(3160, n), _weight(n, k), ON_DX, "dx") == gluon
    assert gemm_merge.pinned_config("dx", layer, BF16).block_k == gemm_gluon_seg8.SEG8_GLUON.block_k
    triton = (gemm_merge.TRITON, gemm_merge.fused_config("dx", layer, BF16))
    assert gemm_merge.forward_plan(_stub(3160, n), _weight(n, k), OFF_DX, "dx") == triton


def test_the_dx_block_k_guard_and_other_devices(monkeypatch, hopper) -> None:
    """Negative controls: the Gluon tiling's BLOCK_K changed, or another device, runs the Triton seg8 dX."""
    n, k = QKV
    monkeypatch.setattr(gemm_merge, "SEG8_GLUON", replace(gemm_gluon_seg8.SEG8_GLUON, block_k=128))
    assert gemm_merge.forward_plan(_stub(3160, n), _weight(n, k), ON_DX, "dx")[0] == gemm_merge.TRITON
    monkeypatch.setattr(gemm_merge, "SEG8_GLUON", gemm_gluon_seg8.SEG8_GLUON)
    monkeypatch.setattr(selection, "device_class", lambda device: "cuda-other")
    assert gemm_merge.forward_plan(_stub(3160, n), _weight(n, k), ON_DX, "dx")[0] == gemm_merge.TRITON


def test_the_dx_launches_the_chosen_kernel(monkeypatch, hopper) -> None:
    """Knob on, all 8 segments of the full layer: the Gluon seg8 kernel with ``dx`` and the layer's dX segments, into
    the finished output or the FP32 sum (the column-parallel layers round after their merge); a rank's segments, a
    slice of the layer, or the knob off: the Triton seg8 launch."""
    calls = []
    monkeypatch.setattr(gemm_merge, "matmul_seg8_ws",
                        lambda g, w, y, b, cfg, seg, p, dx: calls.append(("gluon", seg, dx, y.dtype)))  # fmt: skip
    monkeypatch.setattr(gemm_merge, "_launch", lambda a, b, out, *args: calls.append(("triton", out.dtype)))
    monkeypatch.setattr(gemm_merge, "num_sms", lambda device: 132)
    g2, w = torch.zeros(5, 1000, dtype=BF16), torch.zeros(1000, 64, dtype=BF16)
    seg = gemm_merge.segment_size(1000, 64)
    for out in (BF16, None):
        gemm_merge._subtree(g2, w, range(8), (1000, 64), "dx", seg, None, out, ON_DX)
    gemm_merge._subtree(g2, w, range(8), (1000, 64), "dx", seg, None, None, OFF_DX)
    gemm_merge._subtree(g2[:, :512], w[:512], range(4), (1000, 64), "dx", seg, None, None, ON_DX)
    gemm_merge._subtree(g2, w[:, :32], range(8), (1000, 64), "dx", seg, None, None, ON_DX)
    gluon = [("gluon", seg, True, BF16), ("gluon", seg, True, torch.float32)]
    assert calls == gluon + [("triton", torch.float32)] * 3 and seg == 128


def test_the_launch_record_names_the_dx_path(monkeypatch) -> None:
    x, w = torch.zeros(5, 64, dtype=BF16), torch.zeros(32, 64, dtype=BF16)
    assert gemm_merge.launch_record(x, w, ON_DX)["dx"]["kernel"] == gemm_merge.TRITON
    monkeypatch.setattr(selection, "device_class", lambda device: "cuda-sm90")
    assert gemm_merge.launch_record(x, w, OFF_DX)["dx"]["kernel"] == gemm_merge.TRITON
    assert gemm_merge.launch_record(x, w)["dx"]["kernel"] == gemm_merge.GLUON  # on in PRODUCTION
    assert gemm_merge.launch_record(x, w, ON_DX)["dx"] == {"tiling": gemm_gluon_seg8.SEG8_GLUON.tag, "tma": True,
                                                           "kernel": gemm_merge.GLUON}  # fmt: skip


def test_the_dx_host_side_refuses_the_scratch_tiling() -> None:
    """The dX's B boxes are one 128-column MMA: the 256-wide tiling (two halves, slots in global scratch) is refused."""
    cfg = replace(gemm_gluon_seg8.SEG8_GLUON, block_n=256, num_stages=3)
    g2, w, y = torch.zeros(4, 128, dtype=BF16), torch.zeros(128, 256, dtype=BF16), torch.zeros(4, 256, dtype=BF16)
    with pytest.raises(ValueError, match="segment 64"):
        gemm_gluon_seg8.matmul_seg8_ws(g2, w, y, None, cfg, 64, 132, dx=True)


def _slot_compiles(shared, conflicts: int) -> bool:
    """Whether a consumer's (64, 128) FP32 accumulator in wgmma's register layout (``_tree_onchip``'s), stored to
    ``shared``, compiles for sm_90 under the assertion that Triton counts ``conflicts`` bank conflicts for it
    (``gl.bank_conflicts``: excess accesses per wavefront, evaluated while the kernel is built)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.experimental.gluon._runtime import GluonASTSource

    if not hasattr(gl, "bank_conflicts"):
        pytest.skip("this Triton has no gl.bank_conflicts (Triton 3.7 on)")
    sig = {"out_ptr": "*fp32", "SHARED": "constexpr", "CONFLICTS": "constexpr"}
    src = GluonASTSource(fn=_slot_store, signature=sig, constexprs={"SHARED": shared, "CONFLICTS": conflicts})
    try:
        triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4})
    except CompileTimeAssertionFailure:
        return False
    return True


def test_the_tree_slot_in_shared_memory_has_no_bank_conflicts() -> None:
    """The level-2 slot of the seg8 forward, its dX and the row-segment dW (SLOT_LAYOUT, 64 x 128 FP32 a consumer):
    written and read in the accumulator's register layout with no bank conflict. The control: the row-XOR swizzle it
    replaced, (2, 1, 8), counts 3 excess accesses a wavefront (4x; ncu on an H100 saw 8-way loads and 11-way stores),
    so the same assertion of 0 fails to compile there."""
    old = gl.SwizzledSharedLayout(2, 1, 8, order=[1, 0])
    assert _slot_compiles(gemm_gluon_seg8.SLOT_LAYOUT.value, 0)
    assert _slot_compiles(old, 3) and not _slot_compiles(old, 0)
    rows_dw = pytest.importorskip("h3gate.kernels.gemm_gluon_rows_dw")
    assert rows_dw.SLOT_LAYOUT is gemm_gluon_seg8.SLOT_LAYOUT  # the dW kernel allocates the same slot
