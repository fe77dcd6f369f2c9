"""Tile sources of a walk in canonical order (``h3gate.kernels.attention_sources``): every tile the Gluon kernels load
from the packed tensor or from the copy of a few tiles must hold exactly the rows of a whole canonical copy, zeros
past S (the kernels' own bytes are compared on the H200: perf-probe-28 / -29). Here the host mirror of their loads,
``canonical_tile``, is checked against ``gather_rows`` for orders of every kind."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from h3gate.kernels.attention_config import PRODUCTION, attn_config
from h3gate.kernels.attention_math import gather_rows
from h3gate.kernels.attention_sources import TileSources, canonical_tile, copied_tiles, tile_sources


def _layout_order(s: int, text: int, audio: int) -> torch.Tensor:
    """A ``[text | video | audio]`` packing walked ``[text | audio | video]`` (the medium layout: 206 / 2880 / 74)."""
    return torch.cat([torch.arange(0, text), torch.arange(s - audio, s), torch.arange(text, s - audio)])


def _tiles_match(t: torch.Tensor, order: torch.Tensor, src: TileSources) -> bool:
    want = gather_rows(t, order)
    copy = copied_tiles(t, src)
    s, step = t.shape[1], src.step
    for j in range(src.tile_map.numel()):
        got = canonical_tile(t, copy, src, j)
        rows = want[:, j * step : (j + 1) * step]
        if not torch.equal(got[:, : rows.shape[1]], rows) or got[:, rows.shape[1] :].any():
            return False
    return src.tile_map.numel() == -(-s // step)


ORDERS = {
    "identity": lambda s: torch.arange(s),
    "layout": lambda s: _layout_order(s, s // 15 + 3, s // 40 + 1),
    "reversed": lambda s: torch.arange(s - 1, -1, -1),
    "random": lambda s: torch.randperm(s, generator=torch.Generator().manual_seed(3)),
    "rotated": lambda s: torch.roll(torch.arange(s), 37),
}


@pytest.mark.parametrize("kind", list(ORDERS))
@pytest.mark.parametrize("s", [128, 300, 3160])
@pytest.mark.parametrize("step", [64, 128])
def test_every_tile_holds_the_canonical_rows(kind, s, step) -> None:
    order = ORDERS[kind](s)
    t = torch.randn(2, s, 3, 8, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16)
    src = tile_sources(order, step)
    assert _tiles_match(t, order, src)
    copied = int((src.tile_map < 0).sum())
    assert src.copied == copied and src.copy_rows.numel() == sum(
        min(step, s - j * step) for j, p in enumerate(src.tile_map.tolist()) if p < 0
    )
    if copied:
        assert copied_tiles(t, src).shape[1] == src.copy_rows.numel()
    if kind == "identity":
        assert copied == 0 and copied_tiles(t, src) is t
    if kind == "random" and s > 2 * step:
        assert copied == src.tile_map.numel()  # no run of consecutive rows a tile long


def test_medium_layout_copies_only_the_tiles_across_a_modality_boundary() -> None:
    """Medium (text 206, video 2880, audio 74; packed text | video | audio): with 128-row tiles, tiles 1 and 2 straddle
    the text / audio / video boundaries and the last (88 rows) ends at packed row 3086, not S; 22 of 25 are read in
    place. With 64-row tiles (the backward's walks), 3 of 50 are copied."""
    order = _layout_order(3160, 206, 74)
    fwd = tile_sources(order, 128)
    assert [j for j, p in enumerate(fwd.tile_map.tolist()) if p < 0] == [1, 2, 24]
    assert fwd.tile_map[0] == 0 and fwd.tile_map[3] == 384 - 74 and fwd.copy_rows.numel() == 2 * 128 + 88
    bwd = tile_sources(order, 64)
    assert [j for j, p in enumerate(bwd.tile_map.tolist()) if p < 0] == [3, 4, 49]


def test_a_partial_last_tile_is_read_in_place_only_where_its_rows_end_at_s() -> None:
    """TMA fills a box's rows past the tensor's end with zeros; rows past S of a tile must be zeros (what the whole
    copy held), so a partial last tile of consecutive rows is read in place only when those rows end at S. Negative
    control: read in place anyway, the tile holds the next packed rows where zeros belong."""
    s, step = 300, 128  # last tile: canonical rows 256..299 (44 rows)
    tail_at_end = torch.cat([torch.arange(44, 300), torch.arange(0, 44)])  # last tile = packed rows 0..43
    src = tile_sources(tail_at_end, step)
    assert src.tile_map[-1] < 0
    t = torch.randn(1, s, 2, 8, generator=torch.Generator().manual_seed(1))
    wrong = TileSources(step, torch.tensor([*src.tile_map[:-1].tolist(), 0], dtype=torch.int32), src.copy_rows, 0)
    assert not _tiles_match(t, tail_at_end, wrong)
    assert _tiles_match(t, tail_at_end, src)
    ends_at_s = torch.cat([torch.arange(128, 256), torch.arange(0, 128), torch.arange(256, 300)])
    assert tile_sources(ends_at_s, step).tile_map.tolist() == [128, 0, 256]
    assert _tiles_match(t, ends_at_s, tile_sources(ends_at_s, step))


def test_a_tile_map_pointing_at_the_wrong_rows_is_caught() -> None:
    """Negative control of the check itself: shift one in-place tile's packed row by one."""
    order = _layout_order(3160, 206, 74)
    src = tile_sources(order, 128)
    t = torch.randn(1, 3160, 2, 8, generator=torch.Generator().manual_seed(2))
    bad_map = src.tile_map.clone()
    bad_map[5] += 1
    assert not _tiles_match(t, order, TileSources(128, bad_map, src.copy_rows, src.copied))


def test_sources_are_memoised_per_order_tensor_and_step() -> None:
    order = _layout_order(300, 20, 7)
    a, b = tile_sources(order, 64), tile_sources(order, 64)
    assert a is b and tile_sources(order, 128) is not a
    order[0], order[1] = order[1].item(), order[0].item()  # in place: a new version, a new plan
    assert tile_sources(order, 64) is not a and tile_sources(order, 64).tile_map[0] < 0


class _Launch:
    """A stand-in for a Gluon kernel: ``kernel[grid](*args, **kw)`` records its arguments."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


def _rows(desc) -> torch.Tensor:
    """The (B, rows, nh * D) tensor a host TMA descriptor reads."""
    assert desc.shape == list(desc.base.shape)
    return desc.base


@pytest.mark.parametrize("sources", [True, False], ids=["tile_sources", "whole_copies"])
def test_the_gluon_launches_hand_the_kernels_packed_operands_and_their_copied_tiles(monkeypatch, sources) -> None:
    """The host side of the Gluon forward and both backward walks with a layout's walk order (the kernels faked: the
    launch arguments are checked): with tile sources, the main descriptors read the packed tensors, the copy
    descriptors exactly the copied tiles' rows (their own row count), and the tile map is the order's plan at the
    walk's tile height; without, whole canonical copies and no map. (A copy viewed with the packed tensor's row count
    crashed the first H200 run of the backward, session 16.)"""
    from h3gate.kernels import attention_bwd_gluon as gb
    from h3gate.kernels import attention_gluon as gf

    launch = replace(PRODUCTION, tile_sources=sources)
    monkeypatch.setattr(gf, "num_sms", lambda device: 4)
    fwd, bwd = _Launch(), _Launch()
    monkeypatch.setattr(gf, "_attn_fwd_ws_kernel", fwd)
    monkeypatch.setattr(gb, "_bwd_ws_kernel", bwd)
    b, s, h, d = 2, 300, 2, 128
    order = _layout_order(s, 23, 9)
    q, k, v, do = (
        torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16) for i in range(4)
    )
    cfg = attn_config(d, torch.bfloat16)
    assert cfg.fwd_n == 128
    gf.forward_gluon_ws(q, k, v, cfg, order, launch)
    lse = torch.zeros(b * h, s)
    gb._launch(q, do, k, v, k, v, lse, lse, order, cfg, 1.0, 1.0, False, launch)
    gb._launch(k, v, q, do, q, q, lse, lse, order, cfg, 1.0, 1.0, True, launch)
    ((f_args, _),) = fwd.calls
    launches = [(f_args[:3], f_args[6], f_args[7:10], 128, (q, k, v))]
    for (args, _), walked in zip(bwd.calls, ((q, do), (k, v)), strict=True):
        launches.append((args[:2], args[11], args[12:14], 64, walked))
    for mains, tile_map, copies, step, walked in launches:
        if sources:
            plan = tile_sources(order, step)
            assert torch.equal(tile_map, plan.tile_map) and plan.copied > 0
            for desc, copy, t in zip(mains, copies, walked, strict=True):
                assert _rows(desc).data_ptr() == t.data_ptr()  # the packed tensor itself
                assert torch.equal(_rows(copy), t.index_select(1, plan.copy_rows).flatten(2))
        else:
            assert tile_map is None and all(c is None for c in copies)
            for desc, t in zip(mains, walked, strict=True):
                assert torch.equal(_rows(desc), gather_rows(t, order).flatten(2))


@pytest.mark.parametrize("s", [925, 2047, 2048, 3160])
def test_the_gluon_forward_stores_its_output_by_tma_from_the_declared_rows_on(monkeypatch, s) -> None:
    """The Gluon forward's output descriptor is the returned tensor itself, (1, 64, D) boxes of its (B, S, nh * D)
    rows (a box's rows past S are dropped, not written into the next item), and the kernel is told to store by TMA
    exactly from ``AttnLaunch.tma_store_from`` rows on (the launch faked; the bytes are the H200's, perf-probe-33)."""
    from h3gate.kernels import attention_gluon as gf

    monkeypatch.setattr(gf, "num_sms", lambda device: 4)
    fwd = _Launch()
    monkeypatch.setattr(gf, "_attn_fwd_ws_kernel", fwd)
    b, h, d = 2, 2, 128
    q = torch.zeros(b, s, h, d, dtype=torch.bfloat16)
    out, _ = gf.forward_gluon_ws(q, q, q, attn_config(d, torch.bfloat16))
    ((args, kw),) = fwd.calls
    o_desc = args[10]
    assert _rows(o_desc).data_ptr() == out.data_ptr() and list(o_desc.shape) == [b, s, h * d]
    assert list(o_desc.block_shape) == [1, 64, d]
    assert kw["TMA_STORE"] is (s >= PRODUCTION.tma_store_from) and PRODUCTION.tma_store_from == 2048
