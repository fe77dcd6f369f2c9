"""The warp-specialised Gluon GEMM forward's host side, on the CPU: which calls it runs (the tiling buckets, Hopper,
bfloat16, never under the interpreter), what the launch record names, and that a launch's tiles cover every output
element exactly once. The kernel itself runs only on the H200 (bytes against the Triton kernel:
``tools/gpu_gemm_gluon.py``, ``docs/measurements/perf-probe-{30,31}.json``); ``test_sm90_compile.py`` lowers it."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from h3gate.kernels import gemm, gemm_configs, selection
from h3gate.kernels.gemm_configs import GemmConfig

gemm_gluon = pytest.importorskip("h3gate.kernels.gemm_gluon")  # Triton's Gluon (3.6 and later)
gemm_gluon_plan = pytest.importorskip("h3gate.kernels.gemm_gluon_plan")

BF16 = torch.bfloat16
QKV, O_PROJ, GATE_UP, DOWN = (7168, 5376), (5376, 7168), (28672, 5376), (5376, 14336)


def _stub(m: int, k: int, dtype: torch.dtype = BF16, device: str = "cuda:0") -> SimpleNamespace:
    """What the dispatch reads of x: device, dtype, element count (no CUDA here)."""
    return SimpleNamespace(device=torch.device(device), dtype=dtype, numel=lambda: m * k)


def _weight(n: int, k: int, dtype: torch.dtype = BF16) -> SimpleNamespace:
    return SimpleNamespace(shape=(n, k), dtype=dtype)


@pytest.fixture
def hopper(monkeypatch):
    """A Hopper GPU outside the interpreter, as the path selection sees it."""
    monkeypatch.setattr(selection, "device_class", lambda device: "cuda-sm90")


@pytest.mark.parametrize(
    ("layer", "m", "tag"),
    [
        (QKV, 264, "128x128x64_g1_w4_s5_tma_pers_swap8_gluon"),
        (O_PROJ, 264, "128x64x64_g1_w4_s6_tma_pers_swap32_gluon"),
        (GATE_UP, 925, "128x256x64_g16_w4_s3_tma_pers_gluon"),
        (O_PROJ, 925, None),
        (QKV, 3160, None),
        (DOWN, 3160, "128x256x64_g16_w4_s3_tma_pers_gluon"),
        (QKV, 38974, "128x256x64_g16_w4_s3_tma_pers_t128_gluon"),
        ((96768, 2688), 2, None),  # not a block layer: the Triton kernel at every M
    ],
)
def test_forward_runs_gluon_where_the_manifest_declares_it(hopper, layer, m, tag) -> None:
    n, k = layer
    x, w = _stub(m, k), _weight(n, k)
    path, cfg = gemm.forward_plan(x, w)
    assert (cfg.tag if path == "gluon_warp_specialised" else None) == tag
    rec = gemm.launch_record(x, w)
    want = "gluon_warp_specialised" if tag else ("triton_swapped" if cfg.swap_ab else "triton")
    assert rec["forward"] == {"tiling": cfg.tag, "tma": cfg.tma, "kernel": want} and path == want
    assert rec["dx"]["kernel"] == rec["dw"]["kernel"] == "triton"  # the backward is the Triton kernel's


def test_gluon_never_runs_interpreted_off_hopper_or_outside_bfloat16(monkeypatch, hopper) -> None:
    n, k = QKV
    assert gemm.forward_plan(_stub(264, k), _weight(n, k))[0] == "gluon_warp_specialised"
    assert gemm.forward_plan(_stub(264, k, torch.float32), _weight(n, k, torch.float32))[0] == "triton"
    for other in ("cuda-other", "cpu-interpreter"):
        monkeypatch.setattr(selection, "device_class", lambda device, other=other: other)
        assert gemm.forward_plan(_stub(264, k), _weight(n, k))[0] == "triton_swapped"


def test_the_device_class_is_the_interpreter_hopper_or_another_gpu(monkeypatch) -> None:
    monkeypatch.setattr(selection, "INTERPRET", True)
    assert selection.device_class(torch.device("cuda", 0)) == selection.device_class(torch.device("cpu"))
    assert selection.device_class(torch.device("cpu")) == "cpu-interpreter"
    monkeypatch.setattr(selection, "INTERPRET", False)
    for hop, name in ((True, "cuda-sm90"), (False, "cuda-other")):
        monkeypatch.setattr(selection, "hopper", lambda index, hop=hop: hop)
        assert selection.device_class(torch.device("cuda", 0)) == name


def test_cpu_calls_record_the_triton_kernel() -> None:
    x, w = torch.zeros(5, 64, dtype=BF16), torch.zeros(32, 64, dtype=BF16)
    rec = gemm.launch_record(x, w)
    assert {rec[p]["kernel"] for p in ("forward", "dx", "dw")} == {"triton"}


def test_shipped_gluon_buckets_keep_each_layers_k_tiling() -> None:
    bounds = [bound for bound, _ in gemm_configs.GLUON_BUCKETS]
    assert bounds == [512, 1024, 8192, None]
    for _, table in gemm_configs.GLUON_BUCKETS:
        for key, cfg in table.items():
            assert cfg.gluon and cfg.block_m == 128 and cfg.block_k == gemm_configs.TABLE[key].block_k, key


def test_gluon_bucket_check_rejects_a_changed_k_tiling_or_order() -> None:
    key = ("fwd", *QKV, "bfloat16")
    bad = replace(gemm_configs._GLUON_WIDE, block_k=128)
    with pytest.raises(AssertionError, match=r"GLUON_BUCKETS\[M < None\].*BLOCK_K"):
        gemm_configs._check_gluon_buckets(((None, {key: bad}),))
    odd = ("fwd", 7, 64, "bfloat16")  # 14-byte weight rows: no TMA descriptor
    with pytest.raises(AssertionError, match="16-byte aligned"):
        gemm_configs._check_gluon_buckets(((None, {odd: gemm_configs._GLUON_WIDE}),), {odd: GemmConfig(128, 256, 64)})
    with pytest.raises(AssertionError, match="strictly ascend"):
        gemm_configs._check_gluon_buckets(((1024, {}), (512, {}), (None, {})))
    with pytest.raises(AssertionError, match="end with None"):
        gemm_configs._check_gluon_buckets(((512, {}),))


@pytest.mark.parametrize(
    "fields",
    [
        {"block_m": 64},  # two consumers of 64 rows: 128
        {"block_m": 192},  # three consumers: measured slower than two, not shipped
        {"tail_m": 16},  # a B tail only on swapped tiles
        {"num_warps": 8},  # one warpgroup a consumer: the tag would misstate the launch
        {"block_n": 136},  # register tiles are powers of two: 128 + a tail of 8 instead
        {"swap_ab": True, "tail_m": 4},  # the MMA's N is at least 8
        {"swap_ab": True, "tail_block_n": 128},  # narrow tiles only unswapped
        {"tail_block_n": 256},  # narrower than the wide tile
    ],
)
def test_gluon_tiling_validation(fields) -> None:
    with pytest.raises(ValueError, match="Gluon tiling"):
        GemmConfig(**{**vars(gemm_configs._GLUON_WIDE), **fields})


def _dealt(p, programs: int) -> tuple[list[int], list[int]]:
    """Each wide and narrow tile's count of programs that take it, dealt as the kernel deals them."""
    wide, narrow = [0] * p.tiles, [0] * p.narrow_tiles
    for pid in range(p.grid):
        for t in range(pid, p.tiles, p.grid):
            wide[t] += 1
        first = (pid + p.grid - p.tiles % p.grid) % p.grid
        for t in range(first, p.narrow_tiles, p.grid):
            narrow[t] += 1
    return wide, narrow


@pytest.mark.parametrize("m", [1, 7, 136, 137, 191, 192, 193, 264, 300, 925, 3160, 38974])
def test_every_output_tile_is_computed_exactly_once(m) -> None:
    """For every shipped Gluon tiling: A tiles cover the A rows, wide tiles the B rows up to the split, narrow tiles
    the rest, the K chunks all of K, and the persistent deal hands each tile to exactly one program."""
    tilings = {cfg.tag: cfg for _, table in gemm_configs.GLUON_BUCKETS for cfg in table.values()}
    for cfg in tilings.values():
        for n, k in (QKV, O_PROJ, GATE_UP, DOWN):
            p = gemm_gluon.plan(m, n, k, cfg, programs=132)
            a_rows, b_rows = (n, m) if cfg.swap_ab else (m, n)
            width = cfg.block_n + cfg.tail_m
            rows = cfg.block_m
            assert p.pid_a * rows >= a_rows > (p.pid_a - 1) * rows and p.k_tiles * cfg.block_k >= k
            split = b_rows if p.n_split is None else p.n_split
            assert p.pid_b * width >= split > (p.pid_b - 1) * width and p.tiles == p.pid_a * p.pid_b
            if p.n_split is not None:
                assert split == p.pid_b * cfg.block_n and p.pid_n * cfg.tail_block_n >= b_rows - split
            assert 1 <= p.grid <= 132
            wide, narrow = _dealt(p, 132)
            assert set(wide) == {1} and set(narrow) <= {1}, (cfg.tag, n, k)


def test_small_m_tilings_fill_one_wave_at_the_tiny_layout() -> None:
    """264 tokens: 128 + 8 tokens a tile is two token tiles (qkv 56 x 2 = 112 programs), 64 + 32 three (o 42 x 3)."""
    cfg_qkv = gemm_configs.gluon_config(*QKV, BF16, 264)
    cfg_o = gemm_configs.gluon_config(*O_PROJ, BF16, 264)
    assert gemm_gluon.plan(264, *QKV, cfg_qkv, 132).grid == 112
    assert gemm_gluon.plan(264, *O_PROJ, cfg_o, 132).grid == 126


def test_descriptors_and_constants_follow_the_orientation() -> None:
    """Unswapped tiles (the wide tiling) load the 128-row A tile as one box and are stored by TMA, a consumer's
    (64, block_n) box each; swapped ones (W as A, a B tail of tokens) are stored from registers, so they get no C box.
    Two consumers launch with 12 warps' registers (12 x 168 <= 64K)."""
    x, w = torch.zeros(300, 256, dtype=BF16), torch.zeros(512, 256, dtype=BF16)
    y = torch.zeros(300, 512, dtype=BF16)
    wide = gemm_configs._GLUON_WIDE
    d = gemm_gluon.descriptors(x, w, y, wide, split=False)
    assert d["b1_desc"] is d["b2_desc"] is d["c1_desc"] is d["c2_desc"] is None  # grouped launches only
    assert d["a_desc"].block_shape == [128, 64] and d["b_desc"].block_shape == [256, 64] and d["bt_desc"] is None
    assert d["c_desc"].block_shape == [64, 256] and d["bn_desc"] is None
    two = gemm_gluon.launch_constants(wide, split=False, bias=True)
    assert (two["A_ROWS"], two["TMA_STORE"], two["maxnreg"]) == (128, True, 168)
    assert 2 * 128 * two["REGS_C"] + 128 * two["REGS_P"] <= 12 * 32 * two["maxnreg"] <= 65536
    swapped = gemm_configs._GLUON_SWAP8
    d = gemm_gluon.descriptors(x, w, y, swapped, split=False)
    assert d["c_desc"] is None and d["bt_desc"].block_shape == [8, 64]
    assert not gemm_gluon.launch_constants(swapped, False, False)["TMA_STORE"]
