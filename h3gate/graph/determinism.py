"""Within-run determinism: two evaluations of one node on bit-identical inputs give bit-identical outputs.

The executor (:mod:`h3gate.graph.execute`) reports every node evaluation (forward: :func:`observe`; a node's VJP:
:func:`observe` with ``kind="vjp"``) to the :class:`Recorder` an engine entered with :func:`recording`. An evaluation
is keyed by (node, kind, the op table and override that ran it, the provider variant in force, the fingerprints of
its inputs, parameters and cotangent); the first evaluation of a key keeps its outputs' per-row fingerprints, every
later one is compared with them (a *pair*). Which pass an evaluation belongs to (chained, isolated, repeat, ...) is
a label (:func:`evaluation`) that names the pair and never enters the key.

Fingerprints (:mod:`h3gate.graph.fingerprints`): exact int64 sums of a tensor's bits, per row and whole. They stay
on the device until the recorder reads them back: :func:`observe` queues an evaluation and :meth:`Recorder.flush`
reads the queue's fingerprints in one transfer a device every :data:`FLUSH_EVERY` evaluations (and before any count,
mismatch or record is read), so the executor never waits for the device on the recorder's account. Keys, pairs and
mismatches are then settled in evaluation order, as if each had been settled at once.

Failing or reported: pairs of a table registered as ``candidate`` (:meth:`Recorder.role`) fail the gate (strict
kernels are deterministic by contract); the provider's and the golden's are reported.

:class:`Injection` (a test hook, entered with :func:`injecting`): adds one ulp to one element of one node's output
(``forward``) or of the gradient its backward hands its first differentiable input (``backward``), in exactly the
``call``-th such evaluation of that node (1-based) in the run.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from h3gate.errors import InputError
from h3gate.graph.fingerprints import MASK, bits, row_fingerprints, whole

FLUSH_EVERY = 64  # evaluations queued between two reads of their fingerprints

Fingerprint = int | torch.Tensor  # a value read back, or a 0-d int64 on its device still to be read


class _TensorCache:
    """Whole-tensor fingerprints of input and parameter tensors, by identity and version (weakly held: an entry
    whose tensor is gone or was written since is never used); an entry may still be on its device
    (:meth:`settle` replaces it by its value once read)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ref, int, tuple, Fingerprint]] = {}
        self._unread: list[int] = []  # keys put with a device fingerprint since the last settle

    def get(self, t: torch.Tensor) -> Fingerprint | None:
        hit = self._seen.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[3]
        return None

    def put(self, t: torch.Tensor, fp: Fingerprint) -> None:
        key = id(t)

        def gone(ref: weakref.ref) -> None:  # drop the entry with its tensor (unless the id was reused meanwhile)
            if self._seen.get(key, (None,))[0] is ref:
                del self._seen[key]

        self._seen[key] = (weakref.ref(t, gone), t._version, tuple(t.shape), fp)
        if isinstance(fp, torch.Tensor):
            self._unread.append(key)

    def unread(self) -> list[torch.Tensor]:
        """The device fingerprints of live entries put since the last :meth:`settle`."""
        hits = [self._seen.get(k) for k in self._unread]
        return [hit[3] for hit in hits if hit is not None and isinstance(hit[3], torch.Tensor)]

    def settle(self, read: Mapping[int, int]) -> None:
        """Each live device fingerprint replaced by its value (``read``: id of the 0-d tensor -> value)."""
        for k in self._unread:
            hit = self._seen.get(k)
            if hit is not None and isinstance(hit[3], torch.Tensor):
                self._seen[k] = (*hit[:3], read[id(hit[3])])
        self._unread = []


class Reads(Mapping):
    """A read-only view of a parameter mapping that notes which names were read (the parameters a node used)."""

    def __init__(self, base: Mapping[str, torch.Tensor]) -> None:
        self.base, self.read = base, {}

    def __getitem__(self, k: str) -> torch.Tensor:
        v = self.base[k]
        self.read[k] = v
        return v

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


def reading(params: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``params`` as a :class:`Reads` view while a recorder is active, else itself."""
    return Reads(params) if _RECORDER.get() is not None else params


def read_of(params: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """The parameters read through a :func:`reading` view (all of ``params`` for a plain mapping)."""
    return params.read if isinstance(params, Reads) else params


def copies(copied: Mapping[str, torch.Tensor], originals: Mapping[str, torch.Tensor]) -> None:
    """Tell the active recorder that each of ``copied`` holds its ``originals``' bytes (clones made to take
    gradients), so that their fingerprints are the originals' (computed once) rather than computed again."""
    rec = _RECORDER.get()
    if rec is None:
        return
    for k, t in copied.items():
        src = originals.get(k)
        if not isinstance(src, torch.Tensor) or not isinstance(t, torch.Tensor):
            continue
        fp = rec.params.get(src)
        if fp is None:
            fp = whole(src)
            rec.params.put(src, fp)
        rec.params.put(t, fp)


@dataclass
class _First:
    label: str
    whole: dict[str, int]
    rows: dict[str, torch.Tensor]


@dataclass
class _Queued:
    """One evaluation reported and not yet settled: its key's host parts (node, kind, table id, role, setting,
    override id), its pass, the fingerprints of its inputs and parameters, and its outputs' per-row and whole
    fingerprints (on the device)."""

    head: tuple
    label: str
    inputs: list[tuple[str, tuple, str, Fingerprint]]
    params: list[tuple[str, Fingerprint]]
    rows: dict[str, torch.Tensor]
    whole: dict[str, torch.Tensor]

    def unread(self) -> list[torch.Tensor]:
        fps = [fp for *_, fp in self.inputs] + [fp for _, fp in self.params] + list(self.whole.values())
        return [fp for fp in fps if isinstance(fp, torch.Tensor)]


def _read(scalars: Sequence[torch.Tensor]) -> dict[int, int]:
    """``id -> value`` of 0-d int64 device tensors, read back in one transfer a device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for s in scalars:
        by_device.setdefault(s.device, []).append(s)
    read: dict[int, int] = {}
    for group in by_device.values():
        for s, v in zip(group, torch.stack(group).tolist(), strict=True):
            read[id(s)] = int(v) & MASK
    return read


def _to_host(firsts: Sequence[_First]) -> None:
    """The per-row fingerprints of ``firsts`` moved to host memory (8 bytes a row), one transfer a device: a pair
    compares whole fingerprints and reads rows only to name a mismatch's row, while a long run's unpaired first
    evaluations (a trajectory's every step: about 0.25 GB a 768p step) would otherwise fill the device."""
    parts = [(f, k, r) for f in firsts for k, r in f.rows.items() if r.device.type != "cpu"]
    for device in {r.device for *_, r in parts}:
        mine = [(f, k, r) for f, k, r in parts if r.device == device]
        flat = torch.cat([r.reshape(-1) for *_, r in mine]).cpu()
        for (f, k, r), piece in zip(mine, flat.split([r.numel() for *_, r in mine]), strict=True):
            f.rows[k] = piece.view(r.shape)


@dataclass
class Recorder:
    """The determinism record of one run (module docstring). ``first``, ``pairs`` and ``mismatches`` hold the
    evaluations settled so far: :meth:`flush` settles the queued ones (:meth:`failing` and :meth:`record` do)."""

    roles: dict[int, tuple[object, str]] = field(default_factory=dict)
    first: dict[tuple, _First] = field(default_factory=dict)
    evaluations: int = 0
    pairs: dict[str, int] = field(default_factory=dict)  # role -> pairs compared
    mismatches: list[dict] = field(default_factory=list)
    params: _TensorCache = field(default_factory=_TensorCache)
    queue: list[_Queued] = field(default_factory=list)

    def role(self, table: object, name: str) -> None:
        """Name the role of an op table (``candidate`` pairs fail; the others are reported)."""
        self.roles[id(table)] = (table, name)

    def role_of(self, table: object) -> str:
        """The role of ``table`` (``other`` for one never named, which is then held so that its id stays unique)."""
        hit = self.roles.get(id(table))
        if hit is None:
            self.roles[id(table)] = hit = (table, "other")
        return hit[1]

    def flush(self) -> None:
        """Read the queued evaluations' fingerprints back (one transfer a device) and settle them in order."""
        queue, self.queue = self.queue, []
        unread = {id(fp): fp for fp in self.params.unread()}
        unread.update((id(fp), fp) for q in queue for fp in q.unread())
        read = _read(list(unread.values()))
        self.params.settle(read)
        kept = [first for q in queue if (first := self._settle(q, read)) is not None]
        _to_host(kept)

    def _settle(self, q: _Queued, read: Mapping[int, int]) -> _First | None:
        """Key ``q``; keep it as the key's first evaluation (returned) or compare it with that one."""

        def value(fp: Fingerprint) -> int:
            return read[id(fp)] if isinstance(fp, torch.Tensor) else fp

        inputs = tuple((k, shape, dtype, value(fp)) for k, shape, dtype, fp in q.inputs)
        key = (*q.head, inputs, tuple((k, value(fp)) for k, fp in q.params))
        whole_read = {k: read[id(w)] for k, w in q.whole.items()}
        first = self.first.get(key)
        if first is None:
            self.first[key] = first = _First(q.label, whole_read, dict(q.rows))
            return first
        node, kind, _, role = q.head[:4]
        self.pairs[role] = self.pairs.get(role, 0) + 1
        for k, w in whole_read.items():
            if first.whole.get(k) == w and first.rows[k].shape == q.rows[k].shape:
                continue
            a, b = first.rows[k], q.rows[k].to(first.rows[k].device)
            row = None
            if a.shape == b.shape:
                diff = (a != b).nonzero()
                row = int(diff[0, 0]) if diff.numel() else None
            self.mismatches.append({"node": node, "kind": kind, "value": k, "role": role,
                                    "passes": [first.label, q.label], "row": row, "rows": int(a.numel())})  # fmt: skip
            break
        return None

    def failing(self) -> list[dict]:
        self.flush()
        return [m for m in self.mismatches if m["role"] == "candidate"]

    def record(self) -> dict:
        """The evidence block: what was compared and every mismatch (candidate ones fail); a run that evaluated no
        node twice on bit-identical inputs says so (``note``) rather than claim coverage."""
        self.flush()
        out = {
            "rule": RULE,
            "evaluations": self.evaluations,
            "keys": len(self.first),
            "pairs": dict(self.pairs),
            "mismatches": self.mismatches,
            "pass": not self.failing(),
        }
        return out if any(self.pairs.values()) else {**out, "note": NOTHING_COMPARED}


RULE = ("two evaluations of one node on bit-identical inputs, parameters, op table and variant give bit-identical "
        "outputs (per-row int64 fingerprints of the bytes)")  # fmt: skip
NOTHING_COMPARED = "no node was evaluated twice on bit-identical inputs in this run: nothing compared"


_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("h3gate_determinism", default=None)
_LABEL: contextvars.ContextVar[str] = contextvars.ContextVar("h3gate_determinism_label", default="unlabelled")
_SETTING: contextvars.ContextVar[str] = contextvars.ContextVar("h3gate_determinism_setting", default="")


@contextlib.contextmanager
def _bound(var: contextvars.ContextVar, value: object) -> Iterator[None]:
    """``var`` set to ``value`` within the block, restored on exit."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Report every node evaluation of the block to ``recorder``."""
    with _bound(_RECORDER, recorder):
        yield recorder


def active() -> Recorder | None:
    return _RECORDER.get()


def evaluation(label: str) -> contextlib.AbstractContextManager:
    """Label the evaluations of the block (the pass a mismatch names; not part of the key)."""
    return _bound(_LABEL, label)


def again() -> contextlib.AbstractContextManager:
    """Label the block as the repeat of the current pass (an evaluation run only to be compared)."""
    return evaluation(f"{_LABEL.get()} repeat")


def setting(name: str) -> contextlib.AbstractContextManager:
    """A setting that may change bytes (a provider variant): part of the key of every evaluation in the block."""
    return _bound(_SETTING, name)


def _key_part(rec: Recorder, t: torch.Tensor) -> Fingerprint:
    """The fingerprint of an input or parameter: cached, or computed now on its device and cached."""
    fp = rec.params.get(t)
    if fp is None:
        fp = whole(t)
        rec.params.put(t, fp)
    return fp


def observe(
    node_name: str,
    kind: str,
    table: object,
    override: object,
    inputs: Mapping[str, torch.Tensor | None],
    params: Mapping[str, torch.Tensor],
    outputs: Mapping[str, tuple[torch.Tensor, int | None]],
) -> None:
    """Report one evaluation of ``node_name`` (``outputs``: name -> (tensor, row axis)) to the active recorder:
    queued, its fingerprints computed on the device and read back with the queue's (:meth:`Recorder.flush`)."""
    rec = _RECORDER.get()
    if rec is None:
        return
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    ins = [(k, tuple(v.shape), str(v.dtype), _key_part(rec, v)) for k, v in tensors.items()]
    pks = [(k, _key_part(rec, v)) for k, v in params.items() if isinstance(v, torch.Tensor)]
    rows = {k: row_fingerprints(t, rd) for k, (t, rd) in outputs.items() if isinstance(t, torch.Tensor)}
    if override is not None:
        rec.roles.setdefault(-id(override), (override, "override"))  # held, so that its id stays unique
    head = (node_name, kind, id(table), rec.role_of(table), _SETTING.get(), id(override))
    rec.queue.append(_Queued(head, _LABEL.get(), ins, pks, rows, {k: whole(r) for k, r in rows.items()}))
    rec.evaluations += 1
    if len(rec.queue) >= FLUSH_EVERY:
        rec.flush()


@dataclass(frozen=True)
class Injection:
    """Add one ulp to one element of ``node``'s output (``forward``) or of the gradient its backward hands its
    first differentiable input (``backward``), in the ``call``-th such evaluation of the node (1-based): the element
    is column 0 of packed row ``row`` (of every batch item of a batched value, or of batch item ``item`` alone: a
    fault confined to one unrelated request of a batch placement)."""

    node: str
    call: int
    direction: str = "forward"
    row: int = 0
    item: int | None = None

    def label(self) -> str:
        where = f"row {self.row}" if self.item is None else f"row {self.row} of batch item {self.item}"
        return f"{self.direction}:{self.node}:{where}:one ulp in call {self.call} only"


ULP = re.compile(r"ulp@([1-9][0-9]{0,5})")
DIRECTIONS = ("forward", "backward")


def is_ulp(part: str) -> bool:
    """Whether one ``:``-separated part of a ``--fault`` spec is the kind ``ulp@K``."""
    return ULP.fullmatch(part) is not None


def injection_of(spec: str, node: str, row: int, rest: Sequence[str]) -> Injection | None:
    """The :class:`Injection` a ``--fault`` spec's parts after NODE and ROW name (``ulp@K`` and at most a direction),
    or None when none of them is ``ulp@K``; InputError naming the spec when ``ulp@K`` comes with anything else."""
    calls = [p for p in rest if is_ulp(p)]
    if not calls:
        return None
    others = [p for p in rest if not is_ulp(p)]
    if len(calls) > 1 or len(others) > 1 or any(p not in DIRECTIONS for p in others):
        raise InputError(f"--fault {spec!r}: ulp@K is the kind; only a direction may follow it")
    return Injection(node, int(ULP.fullmatch(calls[0]).group(1)), others[0] if others else "forward", row)


@dataclass
class _Injecting:
    spec: Injection
    calls: list[tuple[str, str]] = field(default_factory=list)  # (direction, evaluation label) of every counted call
    counts: dict[tuple[str, str], int] = field(default_factory=dict)  # (node, direction) -> calls so far
    fired: str | None = None

    def describe(self) -> str:
        """The injection's label and where it fired (the evaluation's pass), or that it never did."""
        if self.fired is not None:
            return f"{self.spec.label()} (the {self.fired} evaluation)"
        return f"{self.spec.label()} (never fired: {len(self.calls)} such calls of {self.spec.node})"

    def tick(self, node: str, direction: str) -> bool:
        n = self.counts.get((node, direction), 0) + 1
        self.counts[(node, direction)] = n
        if node == self.spec.node and direction == self.spec.direction:
            self.calls.append((direction, _LABEL.get()))
        hit = node == self.spec.node and direction == self.spec.direction and n == self.spec.call
        if hit:
            self.fired = _LABEL.get()
        return hit


_INJECT: contextvars.ContextVar[_Injecting | None] = contextvars.ContextVar("h3gate_inject", default=None)


@contextlib.contextmanager
def injecting(spec: Injection) -> Iterator[_Injecting]:
    """Apply ``spec`` to the evaluations of the block; the yielded state says which calls it counted and where it
    fired (a test hook)."""
    state = _Injecting(spec)
    token = _INJECT.set(state)
    try:
        yield state
    finally:
        _INJECT.reset(token)


def bump(t: torch.Tensor, row: int, row_dim: int | None, item: int | None = None) -> torch.Tensor:
    """A copy of ``t`` whose element at row ``row`` (along ``row_dim``; index 0 on every other axis but the batch
    axis 0, where every item's, or item ``item``'s alone) is one ulp larger in magnitude (its bits plus one)."""
    out = t.detach().contiguous().clone()
    if out.ndim == 0:
        out = out.reshape(1)
    index: list[int | slice] = [0] * out.ndim
    if row_dim is not None and row_dim < out.ndim:
        index[row_dim] = min(row, out.shape[row_dim] - 1)
        if row_dim > 0:
            index[0] = slice(None) if item is None else min(item, out.shape[0] - 1)
    bits(out)[tuple(index)] += 1
    out = out.reshape(t.shape)
    return out if not t.requires_grad else t + (out - t).detach()


def _judged(table: object) -> bool:
    """Whether ``table`` runs the judged execution (the recorder's ``candidate``): the only one an injection counts."""
    rec = _RECORDER.get()
    return rec is not None and rec.role_of(table) == "candidate"


def inject_forward(node_name: str, out: torch.Tensor, row_dim: int | None, table: object) -> torch.Tensor:
    """``out``, or its bumped copy when the active injection targets this forward call (of the candidate)."""
    state = _INJECT.get()
    if state is None or not isinstance(out, torch.Tensor) or not _judged(table):
        return out
    if not state.tick(node_name, "forward"):
        return out
    return bump(out, state.spec.row, row_dim, state.spec.item)


class _GradBump(torch.autograd.Function):
    """Identity forward; in the backward, counts the node's backward call and bumps it when it is the target."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, node_name: str, row_dim: int | None) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = (node_name, row_dim, _INJECT.get(), _LABEL.get())
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        node_name, row_dim, state, label = ctx.spec
        token = _LABEL.set(label)
        try:
            hit = state is not None and state.tick(node_name, "backward")
        finally:
            _LABEL.reset(token)
        return (bump(grad, state.spec.row, row_dim, state.spec.item) if hit else grad), None, None


def injects_backward(nodes) -> bool:
    """Whether the active injection targets the backward of one of ``nodes`` (grouped siblings then run alone)."""
    state = _INJECT.get()
    return state is not None and state.spec.direction == "backward" and state.spec.node in set(nodes)


def inject_backward(node_name: str, inputs: Mapping[str, torch.Tensor], row_dim: int | None, table: object) -> dict:
    """``inputs``, the first one that requires grad wrapped so that the active injection sees this node's backward
    (of the candidate)."""
    state = _INJECT.get()
    out = dict(inputs)
    if state is None or state.spec.direction != "backward" or not torch.is_grad_enabled() or not _judged(table):
        return out
    for k, v in out.items():
        if isinstance(v, torch.Tensor) and v.requires_grad:
            out[k] = _GradBump.apply(v, node_name, row_dim)
            break
    return out
