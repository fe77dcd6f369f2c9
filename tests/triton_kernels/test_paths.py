"""The declared kernel paths (``paths:`` in ``manifests/operators/*.yaml``) against what the kernels select and
launch: for every declared table, device class and size bucket the dispatch's plan is the declared path (read here
straight from the manifest model, not through the kernels' selection), the launch goes to that path's kernel, the
paths and tilings of the block's layers are the ones they were before the tables were declared, and a table the
kernels cannot honour fails ``check_paths`` (so ``h3gate validate``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from h3gate.errors import InputError
from h3gate.kernels import attention, gemm, selection
from h3gate.manifests.operators import DEVICE_CLASSES, PathRule, PathTable, load_operator_specs
from h3gate.ops import registry

BF16 = torch.bfloat16
TABLES = {name: spec for name, spec in load_operator_specs().items() if spec.paths is not None}
LAYERS = {"qkv": (7168, 5376), "o": (5376, 7168), "gate_up": (28672, 5376), "down": (5376, 14336)}


def _sizes(table: PathTable) -> list[int]:
    """Every bucket's first and last size (and a large one): the sizes where a wrong selection would show."""
    bounds = {1, 100_000, *(b for r in table.rules for b in r.size if b)}
    return sorted(bounds | {b - 1 for b in bounds if b > 1})


@pytest.fixture
def on(monkeypatch):
    """Selects as on device class ``name`` (no GPU here)."""

    def set_class(name: str) -> None:
        monkeypatch.setattr(selection, "device_class", lambda device: name)

    return set_class


def test_every_declared_table_belongs_to_a_module_that_implements_it() -> None:
    assert set(TABLES) == {"h3_qkv_gemm", "h3_attention_o_gemm", "h3_ffn_gate_up_gemm", "h3_ffn_down_gemm",
                           "h3_full_attention"}  # fmt: skip
    for spec in TABLES.values():
        registry.check_paths(spec)


@pytest.mark.parametrize("name", sorted(n for n in TABLES if TABLES[n].family == "gemm"))
@pytest.mark.parametrize("device", DEVICE_CLASSES)
def test_the_gemm_dispatch_selects_the_declared_path(on, name, device) -> None:
    table = TABLES[name].paths
    n, k = table.scope.weight
    on(device)
    w = SimpleNamespace(shape=(n, k), dtype=BF16)
    for m in _sizes(table):
        x = SimpleNamespace(shape=(m, k), dtype=BF16, device=torch.device("cpu"), numel=lambda m=m: m * k)
        path, cfg = gemm.forward_plan(x, w)
        assert path == table.path(device, "forward", m), (m, path)
        rec = gemm.launch_record(x, w)
        assert rec["forward"]["kernel"] == path and rec["forward"]["tiling"] == cfg.tag
        assert rec["dx"]["kernel"] == rec["dw"]["kernel"] == table.path(device, "backward", m) == "triton"
        grouped = gemm.grouped_plan(x, (w, w, w))
        assert (grouped is not None) == (table.path(device, "grouped", m) == "gluon_grouped"), m


@pytest.mark.parametrize("device", DEVICE_CLASSES)
def test_the_attention_dispatch_selects_the_declared_paths(on, device) -> None:
    table = TABLES["h3_full_attention"].paths
    on(device)
    for s in _sizes(table):
        q = torch.empty(1, s, 2, table.scope.head_dim, dtype=BF16, device="meta")
        want = (table.path(device, "forward", s), table.path(device, "backward", s))
        assert attention.paths(q) == want, s
        rec = attention.launch_record(q)
        assert (rec["forward"], rec["backward"]) == want


def test_an_undeclared_scope_runs_the_familys_otherwise_path(on) -> None:
    on("cuda-sm90")
    x, w = (
        SimpleNamespace(dtype=BF16, device=torch.device("cpu"), numel=lambda: 264 * 64),
        SimpleNamespace(shape=(32, 64), dtype=BF16),
    )
    assert gemm.forward_plan(x, w)[0] == TABLES["h3_qkv_gemm"].paths.otherwise == "triton"
    q = torch.empty(1, 4096, 2, 128, dtype=torch.float32, device="meta")
    assert attention.paths(q) == ("triton_pointer", "triton_pointer")


# The block's four layers: (path, tiling) by device class and M as selected before the paths were declared in the
# manifest (the selection then lived in gemm_configs' tables and Hopper predicates): the declared tables keep it.
BEFORE = {
    "qkv": {
        "cpu-interpreter": {264: ("triton_swapped", "256x64x64_g1_w4_s4_tma_swap16"),
                            925: ("triton_swapped", "256x128x64_g1_w8_s3_tma_swap"),
                            3160: ("triton", "128x256x64_g16_w8_s3_tma_pers_t128")},
        "cuda-sm90": {264: ("gluon_warp_specialised", "128x128x64_g1_w4_s5_tma_pers_swap8_gluon"),
                      925: ("gluon_warp_specialised", "128x256x64_g16_w4_s3_tma_pers_gluon"),
                      3160: ("triton", "128x256x64_g16_w8_s3_tma_pers_t128"),
                      38974: ("gluon_warp_specialised", "128x256x64_g16_w4_s3_tma_pers_t128_gluon")},
    },
    "o": {
        "cuda-other": {264: ("triton", "64x256x64_g8_w4_s4_tma"),
                       925: ("triton_swapped", "256x128x64_g1_w8_s3_tma_swap64"),
                       3160: ("triton", "128x256x64_g8_w8_s3_tma_pers")},
        "cuda-sm90": {264: ("gluon_warp_specialised", "128x64x64_g1_w4_s6_tma_pers_swap32_gluon"),
                      925: ("triton_swapped", "256x128x64_g1_w8_s3_tma_swap64"),
                      3160: ("gluon_warp_specialised", "128x256x64_g16_w4_s3_tma_pers_gluon")},
    },
    "gate_up": {
        "cuda-other": {264: ("triton_swapped", "256x64x64_g1_w4_s4_tma_swap16"),
                       925: ("triton", "128x256x64_g16_w8_s3_tma_pers"),
                       38974: ("triton", "128x256x64_g32_w8_s3_tma_pers")},
        "cuda-sm90": {264: ("gluon_warp_specialised", "128x128x64_g1_w4_s5_tma_pers_swap8_gluon"),
                      3160: ("gluon_warp_specialised", "128x256x64_g16_w4_s3_tma_pers_gluon")},
    },
    "down": {
        "cpu-interpreter": {264: ("triton", "64x256x64_g8_w4_s4_tma"),
                            925: ("triton_swapped", "256x128x64_g1_w8_s3_tma_swap64")},
        "cuda-sm90": {925: ("triton_swapped", "256x128x64_g1_w8_s3_tma_swap64"),
                      38974: ("gluon_warp_specialised", "128x256x64_g16_w4_s3_tma_pers_t128_gluon")},
    },
}  # fmt: skip


@pytest.mark.parametrize("layer", sorted(BEFORE))
def test_the_block_layers_run_what_they_ran_before_the_tables(on, layer) -> None:
    n, k = LAYERS[layer]
    for device, by_m in BEFORE[layer].items():
        on(device)
        for m, want in by_m.items():
            x = SimpleNamespace(dtype=BF16, device=torch.device("cpu"), numel=lambda m=m: m * k)
            path, cfg = gemm.forward_plan(x, SimpleNamespace(shape=(n, k), dtype=BF16))
            assert (path, cfg.tag) == want, (device, m)


def test_the_forward_launches_the_kernel_of_its_path(monkeypatch, on) -> None:
    """``gemm.forward`` hands the call to the kernel its plan names (the launches stubbed; meta tensors)."""
    launched: list[str] = []
    monkeypatch.setattr(gemm, "matmul_ws", lambda *a, **kw: launched.append("gluon_warp_specialised"))
    monkeypatch.setattr(gemm, "matmul", lambda a, b, out, bias, cfg, **kw: launched.append(
        "triton_swapped" if cfg.swap_ab else "triton"))  # fmt: skip
    n, k = LAYERS["o"]
    w = torch.empty(n, k, dtype=BF16, device="meta")
    for device in DEVICE_CLASSES:
        on(device)
        for m in (264, 925, 3160):
            launched.clear()
            gemm.forward(torch.empty(m, k, dtype=BF16, device="meta"), w, None)
            assert launched == [TABLES["h3_attention_o_gemm"].paths.path(device, "forward", m)], (device, m)


def _with(table: PathTable, *rules: PathRule) -> PathTable:
    return table.model_copy(update={"rules": list(rules)})


def test_a_table_the_kernels_cannot_honour_fails_its_check() -> None:
    qkv = TABLES["h3_qkv_gemm"].paths
    everywhere = ["cuda-sm90", "cuda-other", "cpu-interpreter"]
    with pytest.raises(ValueError, match="has no tiling"):  # qkv below 1024 rows has swapped Triton tilings only
        gemm.check_paths(_with(qkv, PathRule(devices=everywhere, size=(0, None), path="triton")))
    with pytest.raises(ValueError, match="runs on \\['cuda-sm90'\\] only"):
        gemm.check_paths(_with(qkv, PathRule(devices=everywhere, size=(0, None), path="gluon_warp_specialised")))
    att = TABLES["h3_full_attention"].paths
    with pytest.raises(ValueError, match="runs on"):  # no TMA under the interpreter
        attention.check_paths(_with(att, PathRule(devices=["cpu-interpreter"], size=(0, None), path="triton_tma")))
    spec = TABLES["h3_qkv_gemm"]
    bad = spec.model_copy(update={"paths": _with(qkv, PathRule(devices=everywhere, size=(0, None), path="cutlass"))})
    with pytest.raises(InputError, match=r"paths.rules\[0\].path: 'cutlass' is not a forward path"):
        registry.check_paths(bad)


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ([{"devices": ["cuda-sm90"], "size": [0, 512], "path": "triton"}], "must cover every size"),
        ([{"devices": ["cuda-sm90"], "size": [0, 512], "path": "triton"},
          {"devices": ["cuda-sm90"], "size": [1024, None], "path": "triton"}], "no path for sizes \\[512, 1024\\)"),
        ([{"devices": ["cuda-sm90"], "size": [0, None], "path": "triton"},
          {"devices": ["cuda-sm90"], "size": [512, None], "path": "triton"}], "overlaps"),
        ([{"devices": ["cuda-sm90"], "size": [512, 512], "path": "triton"}], "must exceed the start"),
    ],
)  # fmt: skip
def test_a_table_with_a_gap_or_an_overlap_is_refused(rules, message) -> None:
    base = {"size": "rows", "scope": {"dtype": "bfloat16", "weight": [8, 8]}, "otherwise": "triton"}
    with pytest.raises(ValueError, match=message):
        PathTable.model_validate({**base, "rules": rules})
