"""Where each tile of a walk in canonical order is loaded from: the packed tensor itself, or a copy of a few tiles.

The strict attention walks its rows in canonical order (``order[i]``: the packed row of canonical row ``i``). The
Gluon kernels load ``STEP``-row tiles by TMA, which has no row gather on Hopper, so the walked operands used to be
copied whole into canonical order first (``attention.gather_rows``: at S = 3160 the three forward copies cost about
14 % of the kernel's time). A real layout's order is a few runs of consecutive packed rows (``[text | audio | video]``
of a ``[text | video | audio]`` packing), so most tiles are consecutive packed rows already.

Tile ``j`` (canonical rows ``j * STEP ... j * STEP + STEP - 1``; rows past S are zeros) is *in place* when its rows
are the packed rows ``p0, p0 + 1, ...`` and, for a partial last tile, ``p0 + rows == S`` (so the TMA box's rows past
S are zero-filled as before); ``tile_map[j] = p0``. Every other tile is *copied*: its rows gathered, in canonical
order, into a compact (B, rows, nh, D) buffer, slot after slot in ascending tile order (a partial last tile is the
last slot, its box's rows past the buffer zero-filled); ``tile_map[j] = -1 - slot``. The kernel loads tile ``j`` from
the packed tensor at row ``p0`` or from the copy at row ``slot * STEP``: shared memory holds the same bytes as with a
whole canonical copy, so nothing downstream changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3gate.kernels.common import cached


@dataclass(frozen=True)
class TileSources:
    """A walk order's tile sources at one tile height: ``tile_map`` (n_tiles,) int32 on the order's device,
    ``copy_rows`` the packed rows of the copied tiles' rows (int64, canonical order), ``copied`` how many tiles."""

    step: int
    tile_map: torch.Tensor
    copy_rows: torch.Tensor
    copied: int


def _plan(order: torch.Tensor, step: int) -> TileSources:
    """One host read of ``order``: which tiles are consecutive packed rows."""
    rows = order.cpu().tolist()
    s = len(rows)
    tile_map: list[int] = []
    copy_rows: list[int] = []
    for j in range(0, s, step):
        tile = rows[j : j + step]
        p0 = tile[0]
        in_place = all(r == p0 + i for i, r in enumerate(tile)) and (len(tile) == step or p0 + len(tile) == s)
        if in_place:
            tile_map.append(p0)
        else:
            tile_map.append(-1 - len(copy_rows) // step)
            copy_rows.extend(tile)
    return TileSources(
        step=step,
        tile_map=torch.tensor(tile_map, dtype=torch.int32, device=order.device),
        copy_rows=torch.tensor(copy_rows, dtype=torch.int64, device=order.device),
        copied=sum(1 for p in tile_map if p < 0),
    )


def tile_sources(order: torch.Tensor, step: int) -> TileSources:
    """:class:`TileSources` of ``order`` (a permutation of 0..S-1, checked by the caller) at tile height ``step``,
    memoised per order tensor (one host read each)."""
    return cached("attention-tile-sources", (order,), (step,), lambda: _plan(order, step))


def copied_tiles(t: torch.Tensor, sources: TileSources) -> torch.Tensor:
    """The copied tiles of ``t`` (B, S, nh, D): their rows in canonical order, slot after slot (contiguous; a
    partial last tile ends the buffer). Without copied tiles, ``t`` itself (a descriptor needs a tensor; never read)."""
    return t if sources.copied == 0 else t.index_select(1, sources.copy_rows)


def canonical_tile(t: torch.Tensor, copy: torch.Tensor, sources: TileSources, j: int) -> torch.Tensor:
    """Tile ``j`` as the kernel loads it (B, step, nh, D): from ``t`` at its packed row or from ``copy`` at its slot,
    rows past the source's end zero-filled as TMA does. The host mirror of the kernels' loads (tests)."""
    p = int(sources.tile_map[j])
    src, row = (t, p) if p >= 0 else (copy, (-1 - p) * sources.step)
    box = src[:, row : row + sources.step]
    pad = sources.step - box.shape[1]
    return torch.cat([box, box.new_zeros(box.shape[0], pad, *box.shape[2:])], 1) if pad else box
