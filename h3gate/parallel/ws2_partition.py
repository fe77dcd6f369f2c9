"""Non-default rank partitions of ``run ws2``: internal plan settings of the ablation rows (no CLI flags).

The default partition is what ``run ws2`` proves: TP rank r owns TP chunk r (heads, FFN channels, weight shards,
the segments of every split reduction), every merge combines the gathered subtrees in chunk order, and CP rank c
holds its packed rows together with the same rows of every row-metadata tensor. The ablation rows vary one thing:

* ``tp_chunks`` - rank r owns chunk ``tp_chunks[r]`` (C0: ``(1, 0)``, the ranks' heads and channels swapped); the
  merges still combine the subtrees in LOGICAL (chunk) order. ``tp_merge="rank"`` combines them in rank order
  instead: a negative control. The tree's adds commute, so a reversal (any degree) merges to the same bytes in
  rank order; only a permutation that changes the tree's pairing (TP4 ``(0, 2, 1, 3)``) can drift.
* ``cp_metadata`` - ``local`` (H17): only the hidden rows are sharded; CP rank c reads the metadata rows
  ``[0, n_c)`` (its row count) by local position instead of its own rows (block scope; it declares no metadata
  ownership, so it runs and drifts). ``misowned`` (A4): rank 0's ``adaln_indices`` shard holds rank 1's first row
  in place of its own last; the ownership check refuses it before anything runs (:class:`OwnershipError`).
"""

from __future__ import annotations

from dataclasses import dataclass

from h3gate.errors import InputError
from h3gate.parallel.collectives import ROW_META, cp_bounds

TP_MERGES = ("logical", "rank")
CP_METADATA = ("co-sharded", "local", "misowned")


class OwnershipError(InputError):
    """A partition whose declared metadata rows are not its ranks' hidden rows (the arms are not comparable)."""


@dataclass(frozen=True)
class Partition:
    tp_chunks: tuple[int, ...] | None = None  # rank -> TP chunk; None: chunk = rank
    tp_merge: str = "logical"
    cp_metadata: str = "co-sharded"

    @property
    def default(self) -> bool:
        return self == Partition()

    def chunks(self, tp: int) -> tuple[int, ...]:
        return tuple(range(tp)) if self.tp_chunks is None else tuple(self.tp_chunks)

    def record(self) -> dict:
        chunks = None if self.tp_chunks is None else list(self.tp_chunks)
        return {"tp_chunks": chunks, "tp_merge": self.tp_merge, "cp_metadata": self.cp_metadata}

    @classmethod
    def from_record(cls, rec: dict | None) -> Partition:
        if rec is None:
            return cls()
        chunks = rec["tp_chunks"]
        return cls(None if chunks is None else tuple(chunks), rec["tp_merge"], rec["cp_metadata"])

    def check(self, tp: int, cp: int, sp: bool, scope: str, seq_len: int) -> None:
        """InputError for a partition the topology cannot run; :class:`OwnershipError` for mis-owned metadata."""
        chunks = self.tp_chunks
        if chunks is not None and sorted(chunks) != list(range(tp)):
            raise InputError(f"partition tp_chunks {list(chunks)}: must be a permutation of 0..{tp - 1} (a TP chunk "
                             f"per rank)")  # fmt: skip
        if self.tp_merge not in TP_MERGES:
            raise InputError(f"partition tp_merge {self.tp_merge!r}: must be one of {', '.join(TP_MERGES)}")
        if self.cp_metadata not in CP_METADATA:
            raise InputError(f"partition cp_metadata {self.cp_metadata!r}: must be one of {', '.join(CP_METADATA)}")
        if sp and not self.default:
            raise InputError("partition: the non-default partitions apply to topologies without SP")
        if self.cp_metadata != "co-sharded" and cp < 2:
            raise InputError(f"partition cp_metadata {self.cp_metadata!r}: needs a CP topology (cp >= 2)")
        if self.cp_metadata == "local" and scope != "block":
            raise InputError("partition cp_metadata 'local': block scope only (the block's inputs are sharded)")
        self.check_ownership(cp, seq_len)

    def check_ownership(self, cp: int, seq_len: int) -> None:
        """:class:`OwnershipError` when the CP ranks' declared metadata rows are not their hidden rows (needs neither
        a device nor weights)."""
        if cp > 1:
            bounds = cp_bounds(seq_len, cp)
            check_ownership(metadata_rows(self.cp_metadata, bounds), bounds)


def metadata_rows(metadata: str, bounds: tuple[int, ...]) -> dict[str, list[list[int]]] | None:
    """The packed rows of each row-metadata tensor every CP rank holds as ``metadata`` declares them (None: ``local``
    declares no ownership; each rank reads rows by local position)."""

    if metadata == "local":
        return None
    rows = {name: [list(range(bounds[c], bounds[c + 1])) for c in range(len(bounds) - 1)] for name in ROW_META}
    if metadata == "misowned":
        adaln = rows["adaln_indices"]
        adaln[0][-1], adaln[1][0] = adaln[1][0], adaln[0][-1]  # rank 0 holds rank 1's first row, not its own last
    return rows


def check_ownership(rows: dict[str, list[list[int]]] | None, bounds: tuple[int, ...]) -> None:
    """Every declared metadata shard holds exactly its rank's hidden rows ``[bounds[c], bounds[c + 1])``."""
    for name, shards in (rows or {}).items():
        for rank, held in enumerate(shards):
            lo, hi = bounds[rank], bounds[rank + 1]
            if sorted(held) != list(range(lo, hi)):
                foreign = sorted(set(held) - set(range(lo, hi)))
                raise OwnershipError(
                    f"rank {rank}: {name} holds packed row(s) {foreign} owned by another rank (its hidden rows are "
                    f"{lo}..{hi - 1}): metadata mis-owned, arms not comparable"
                )
