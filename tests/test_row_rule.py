"""The row rule (h3gate/gate/rows.py) and the one-row faults (h3gate/gate/faults.py), on small hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch

from h3gate.gate.faults import SCALE, RowFault, corrupt
from h3gate.gate.rows import (
    as_rows,
    describe,
    dtype_floor,
    envelope,
    group_ids,
    row_check,
    row_errors,
    rule_sha256,
    spread,
)
from h3gate.gate.variants import provider_variants
from h3gate.manifests.tolerances import load_tolerance


def test_row_errors_are_per_row_relative_l2():
    golden = torch.tensor([[[3.0, 4.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]], dtype=torch.float64)
    cand = torch.tensor([[[3.0, 4.5], [1.0, 0.0], [0.0, 0.0], [0.0, 1.0]]], dtype=torch.float64)
    errs = row_errors(cand, golden, row_dim=1)
    assert errs.tolist() == [0.1, 0.0, 0.0, math.inf]  # a zero golden row: 0 only when the candidate is zero too


def test_non_finite_candidate_rows_are_infinitely_wrong():
    golden = torch.ones(1, 3, 4)
    cand = golden.clone()
    cand[0, 2, 1] = float("nan")
    assert row_errors(cand, golden, 1).tolist() == [0.0, 0.0, math.inf]


def test_rows_of_tensors_without_a_row_axis():
    assert as_rows(torch.zeros(5, 7), None).shape == (5, 7)  # a table: rows along dim 0 (weights: output channels)
    assert as_rows(torch.zeros(9), None).shape == (1, 9)  # a vector: one row
    assert as_rows(torch.zeros(2, 3, 4), 1).shape == (3, 8)  # batch of 2: the row axis moves first


def test_envelope_widens_over_modality_groups():
    mods = ["text", "text", "video", "video", "audio"]
    a = torch.tensor([0.1, 0.2, 0.3, 0.1, 0.5], dtype=torch.float64)
    b = torch.tensor([0.3, 0.1, 0.1, 0.1, 0.4], dtype=torch.float64)
    groups = group_ids(5, mods, "modality")
    assert envelope([a, b], groups).tolist() == [0.3, 0.3, 0.3, 0.3, 0.5]
    assert envelope([a, b], group_ids(5, mods, "row")).tolist() == [0.3, 0.2, 0.3, 0.1, 0.5]
    assert envelope([a, b], group_ids(5, mods, "tensor")).tolist() == [0.5] * 5


def test_row_check_names_the_first_and_the_worst_row():
    env = torch.full((6,), 0.01, dtype=torch.float64)
    errs = torch.tensor([0.01, 0.02, 0.014, 0.05, 0.0, 0.016], dtype=torch.float64)
    check = row_check(errs, env, factor=1.5, floor=0.0, modalities=["text", "video", "video", "audio", "a", "b"])
    assert check["pass"] is False and check["rows_over"] == 3
    assert (check["first_over_row"], check["first_over_modality"]) == (1, "video")
    assert (check["worst_row"], check["worst_modality"]) == (3, "audio")
    assert check["ratio"] == pytest.approx(0.05 / 0.015)
    assert "row 1 video: 3 of 6 rows over the row bound" in describe(
        check, ["text", "video", "video", "audio", "a", "b"]
    )
    ok = row_check(errs.clamp(max=0.015), env, 1.5, 0.0, None)
    assert ok["pass"] is True and ok["rows_over"] == 0 and ok["first_over_row"] is None


def test_floor_is_in_ulps_of_the_dtype():
    assert dtype_floor(torch.bfloat16, 0.25) == 2.0**-9
    assert dtype_floor(torch.float32, 1.0) == 2.0**-23


def test_spread_is_leave_one_out():
    groups = torch.zeros(3, dtype=torch.long)
    variants = {
        "default": torch.tensor([0.1, 0.2, 0.1], dtype=torch.float64),
        "other": torch.tensor([0.1, 0.3, 0.1], dtype=torch.float64),
    }
    assert spread(variants, groups) == {"default": pytest.approx(2 / 3), "other": pytest.approx(1.5)}
    assert spread({"default": variants["default"]}, groups) == {"default": None}


def _spread_by_definition(variants, groups):
    """The rule's leave-one-out spread one variant at a time: the envelope of the others, then the worst ratio."""
    out = {}
    for name, errs in variants.items():
        others = [e for k, e in variants.items() if k != name]
        if not others:
            out[name] = None
            continue
        env = envelope(others, groups)
        ratio = torch.where(env > 0, errs / torch.where(env > 0, env, 1.0), torch.where(errs > 0, math.inf, 1.0))
        top = float(ratio.max())
        out[name] = top if math.isfinite(top) else None
    return out


@pytest.mark.parametrize("scope", ["row", "modality", "tensor"])
@pytest.mark.parametrize("count", [2, 3, 7])
def test_spread_equals_its_definition_value_for_value(scope, count):
    gen = torch.Generator().manual_seed(count)
    rows = 41
    mods = [("text", "video", "audio")[i % 3] for i in range(rows)]
    variants = {}
    for v in range(count):
        e = torch.rand(rows, generator=gen, dtype=torch.float64)
        e[torch.rand(rows, generator=gen) < 0.2] = 0.0  # zero envelopes: the inf / 1 branches
        e[v] = 0.25  # ties across variants
        variants[f"v{v}"] = e
    variants["v1"][7] = math.inf  # a non-finite candidate row in one variant
    groups = group_ids(rows, mods, scope)
    got = spread(variants, groups)
    assert list(got) == list(variants) and got == _spread_by_definition(variants, groups)


def test_group_ids_are_memoised_per_modality_list():
    mods = ["text", "video", "video", "audio"]
    first = group_ids(4, mods, "modality")
    assert group_ids(4, list(mods), "modality") is first and first.tolist() == [0, 1, 1, 2]
    assert group_ids(4, mods[:3] + ["text"], "modality").tolist() == [0, 1, 1, 0]
    assert group_ids(4, mods[:3], "modality").tolist() == [0, 0, 0, 0]  # the list does not name every row
    assert group_ids(4, mods, "row").tolist() == [0, 1, 2, 3] and group_ids(4, mods, "tensor").tolist() == [0] * 4


def test_rule_hash_changes_with_any_field():
    rule = load_tolerance("ws1-block").row_rule.model_dump(mode="json")
    other = {**rule, "factor": rule["factor"] + 0.01}
    assert rule_sha256(rule) != rule_sha256(other) and rule_sha256(rule) == rule_sha256(dict(reversed(rule.items())))


def test_cpu_variants_run_and_cuda_variants_are_reported_skipped():
    rule = load_tolerance("ws1-block").row_rule
    run, skipped = provider_variants(list(rule.variants), "cpu")
    assert [v.name for v in run][:2] == ["default", "threads-1"]
    assert {s["name"] for s in skipped} == {n for n in rule.variants if n.startswith(("sdpa-", "blas-"))}
    before = torch.get_num_threads()
    with run[1].enter():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_unknown_variant_is_refused_by_the_manifest(tmp_path):
    from h3gate.errors import InputError
    from h3gate.manifests.tolerances import tolerance_path

    text = tolerance_path("ws1-block").read_text(encoding="utf-8").replace("threads-1,", "threads-7,")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text, encoding="utf-8")
    with pytest.raises(InputError, match=r"row_rule.variants.*unknown provider variant 'threads-7'"):
        load_tolerance(bad)


@pytest.mark.parametrize("row_dim", [1, None])
def test_faults_touch_exactly_one_row(row_dim):
    t = torch.randn(1, 6, 40).to(torch.bfloat16) if row_dim == 1 else torch.randn(6, 40).to(torch.bfloat16)
    scaled = corrupt(t, 4, row_dim, "scale")
    zeroed = corrupt(t, 4, row_dim, "zero_tail")
    rows_t, rows_s, rows_z = (as_rows(x, row_dim) for x in (t, scaled, zeroed))
    changed = (rows_t != rows_s).any(dim=1)
    assert changed.nonzero().flatten().tolist() == [4]
    assert torch.allclose(rows_s[4], (rows_t[4] * SCALE).to(torch.bfloat16).double())
    assert (rows_z[4, -16:] == 0).all() and torch.equal(rows_z[4, :-16], rows_t[4, :-16])
    assert torch.equal(rows_z[:4], rows_t[:4])


def test_a_backward_fault_corrupts_only_the_input_gradient_row():
    from h3gate.graph.core import Node

    node = Node("double", "x", (), ("x",), lambda ops, x, p: 2 * x["x"], row_dim=1)
    fault = RowFault("double", 2, "scale", "backward")
    x = torch.ones(1, 4, 8, requires_grad=True)
    out = fault.override(node, {"x": 1})(None, {"x": x}, {})
    assert torch.equal(out, 2 * torch.ones(1, 4, 8))  # the forward is intact
    out.backward(torch.ones_like(out))
    assert torch.equal(x.grad[0, 2], torch.full((8,), 2 * SCALE)) and (x.grad[0, [0, 1, 3]] == 2).all()


def test_large_tensors_are_measured_in_chunks_of_whole_rows(monkeypatch):
    """Rows and errors upcast a chunk at a time (a 768p value would need 38 GB of float64 at once): the same row
    errors, the same max_abs, rel_l2 within float64 rounding, and a non-finite element still reported."""
    from h3gate.gate import compare, rows

    gen = torch.Generator().manual_seed(3)
    golden = torch.randn(2, 37, 3, 5, generator=gen, dtype=torch.float64)
    cand = (golden + 1e-3 * torch.randn(golden.shape, generator=gen, dtype=torch.float64)).to(torch.bfloat16)
    whole_rows, whole_err = row_errors(cand, golden, 1), compare.error(cand, golden)
    monkeypatch.setattr(rows, "CHUNK_ELEMENTS", 40)  # 2 rows of 30 elements a chunk: 19 chunks
    assert rows.row_chunks(37, 30)[:2] == [(0, 1), (1, 2)] and rows.row_chunks(37, 15)[-1] == (36, 37)
    assert torch.equal(row_errors(cand, golden, 1), whole_rows)
    chunked = compare.error(cand, golden)
    assert chunked["max_abs"] == whole_err["max_abs"]
    assert chunked["rel_l2"] == pytest.approx(whole_err["rel_l2"], rel=1e-12)
    cand[1, 30, 2, 4] = float("nan")
    assert compare.error(cand, golden) == {"max_abs": None, "rel_l2": None}
    assert row_errors(cand, golden, 1)[30] == math.inf
