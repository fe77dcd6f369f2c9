"""Within-run determinism: two evaluations of one node on bit-identical inputs give bit-identical outputs.

The executor (:mod:`h3gate.graph.execute`) reports every node evaluation (forward: :func:`observe`; a node's VJP:
:func:`observe` with ``kind="vjp"``) to the :class:`Recorder` an engine entered with :func:`recording`. An evaluation
is keyed by (node, kind, the op table and override that ran it, the provider variant in force, the fingerprints of
its inputs, parameters and cotangent); the first evaluation of a key keeps its outputs' per-row fingerprints, every
later one is compared with them (a *pair*). Which pass an evaluation belongs to (chained, isolated, repeat, ...) is
a label (:func:`evaluation`) that names the pair and never enters the key.

Fingerprint of a tensor row: its elements' bits as integers (``int16`` for 2-byte dtypes, ``int32``, ``int64``),
times fixed pseudo-random odd 64-bit weights (one per column), summed in ``int64`` (arithmetic mod 2^64). A change
of one element by ``d != 0`` changes the sum by ``d * w mod 2^64 != 0`` (``w`` odd), so any single-element change is
seen; on a GPU one Triton pass a tensor (:mod:`h3gate.kernels.fingerprint`), elsewhere torch ops, the same values.

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
from h3gate.kernels.fingerprint import row_sums

_WIDTH = 4096  # row width of a whole-tensor fingerprint
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}
_MASK = (1 << 64) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A splitmix64-style finaliser on int64 tensors (wrapping arithmetic; arithmetic shifts, same on every device)."""
    x = x * -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
    x = torch.bitwise_xor(x, x >> 30) * -4658895280553007687
    x = torch.bitwise_xor(x, x >> 27) * -7723592293110705685
    return torch.bitwise_xor(x, x >> 31)


_WEIGHTS: dict[tuple[int, str, int], torch.Tensor] = {}


def weights(n: int, device: torch.device, salt: int = 0) -> torch.Tensor:
    """``n`` fixed pseudo-random odd int64 weights on ``device`` (cached)."""
    key = (n, str(device), salt)
    if key not in _WEIGHTS:
        j = torch.arange(n, dtype=torch.int64, device=device) + (salt << 40)
        _WEIGHTS[key] = torch.bitwise_or(_mix(_mix(j)), 1)
    return _WEIGHTS[key]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(_BITS[t.element_size()])


def _row_sums(m: torch.Tensor) -> torch.Tensor:
    """Per-row weighted sums (int64) of a 2-D integer tensor (:func:`h3gate.kernels.fingerprint.row_sums`: one
    pass on a GPU, torch ops elsewhere; the same values)."""
    return row_sums(m, weights(m.shape[1], m.device))


def whole(t: torch.Tensor) -> torch.Tensor:
    """One int64 fingerprint of the whole of ``t`` (a 0-d tensor on its device): its flat bits cut into rows of
    :data:`_WIDTH`, each row's sum weighted by a second set of odd weights (element weight: a product of odd
    numbers, so still odd)."""
    with torch.no_grad():
        flat = _bits(t).reshape(-1)
        body = flat.numel() - flat.numel() % _WIDTH
        rows = [_row_sums(flat[:body].view(-1, _WIDTH))] if body else []
        if body < flat.numel():
            rows.append(_row_sums(flat[body:].reshape(1, -1)))
        sums = torch.cat(rows) if rows else torch.zeros(1, dtype=torch.int64, device=flat.device)
        return (sums * weights(sums.numel(), sums.device, salt=1)).sum()


def row_fingerprints(t: torch.Tensor, row_dim: int | None) -> torch.Tensor:
    """Per-row exact integer fingerprint (module docstring): int64 of length ``t.shape[row_dim]``, on ``t``'s
    device; one entry (:func:`whole`) when ``row_dim`` is None or beyond ``t``'s axes."""
    if row_dim is None or t.ndim <= row_dim:
        return whole(t).reshape(1)
    with torch.no_grad():
        b = _bits(t)
        return _row_sums(b.movedim(row_dim, 0).reshape(b.shape[row_dim], -1))


class _TensorCache:
    """Whole-tensor fingerprints of input and parameter tensors, by identity and version (weakly held: an entry
    whose tensor is gone or was written since is never used)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ref, int, tuple, int]] = {}

    def get(self, t: torch.Tensor) -> int | None:
        hit = self._seen.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[3]
        return None

    def put(self, t: torch.Tensor, fp: int) -> None:
        key = id(t)

        def gone(ref: weakref.ref) -> None:  # drop the entry with its tensor (unless the id was reused meanwhile)
            if self._seen.get(key, (None,))[0] is ref:
                del self._seen[key]

        self._seen[key] = (weakref.ref(t, gone), t._version, tuple(t.shape), fp)


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
            fp = int(whole(src)) & _MASK
            rec.params.put(src, fp)
        rec.params.put(t, fp)


@dataclass
class _First:
    label: str
    whole: dict[str, int]
    rows: dict[str, torch.Tensor]


@dataclass
class Recorder:
    """The determinism record of one run (module docstring)."""

    roles: dict[int, tuple[object, str]] = field(default_factory=dict)
    first: dict[tuple, _First] = field(default_factory=dict)
    evaluations: int = 0
    pairs: dict[str, int] = field(default_factory=dict)  # role -> pairs compared
    mismatches: list[dict] = field(default_factory=list)
    params: _TensorCache = field(default_factory=_TensorCache)

    def role(self, table: object, name: str) -> None:
        """Name the role of an op table (``candidate`` pairs fail; the others are reported)."""
        self.roles[id(table)] = (table, name)

    def role_of(self, table: object) -> str:
        """The role of ``table`` (``other`` for one never named, which is then held so that its id stays unique)."""
        hit = self.roles.get(id(table))
        if hit is None:
            self.roles[id(table)] = hit = (table, "other")
        return hit[1]

    def failing(self) -> list[dict]:
        return [m for m in self.mismatches if m["role"] == "candidate"]

    def record(self) -> dict:
        """The evidence block: what was compared and every mismatch (candidate ones fail); a run that evaluated no
        node twice on bit-identical inputs says so (``note``) rather than claim coverage."""
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


def _input_key(rec: Recorder, values: Mapping[str, torch.Tensor | None]) -> list[tuple[str, tuple, str, object]]:
    """(name, shape, dtype, fingerprint) of each input: a cached int, or a device scalar still to be read."""
    out = []
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            hit = rec.params.get(v)
            out.append((k, tuple(v.shape), str(v.dtype), hit if hit is not None else whole(v)))
    return out


def _params_key(rec: Recorder, params: Mapping[str, torch.Tensor]) -> list[tuple[str, int | torch.Tensor]]:
    out: list[tuple[str, int | torch.Tensor]] = []
    for k, v in params.items():
        if isinstance(v, torch.Tensor):
            hit = rec.params.get(v)
            out.append((k, hit if hit is not None else whole(v)))
    return out


def observe(
    node_name: str,
    kind: str,
    table: object,
    override: object,
    inputs: Mapping[str, torch.Tensor | None],
    params: Mapping[str, torch.Tensor],
    outputs: Mapping[str, tuple[torch.Tensor, int | None]],
) -> None:
    """Report one evaluation of ``node_name`` (``outputs``: name -> (tensor, row axis)) to the active recorder."""
    rec = _RECORDER.get()
    if rec is None:
        return
    ins = _input_key(rec, inputs)
    pks = _params_key(rec, params)
    outs = {k: row_fingerprints(t, rd) for k, (t, rd) in outputs.items() if isinstance(t, torch.Tensor)}
    scalars = [fp for *_, fp in ins if isinstance(fp, torch.Tensor)]
    scalars += [fp for _, fp in pks if isinstance(fp, torch.Tensor)]
    scalars += [whole(r) for r in outs.values()]
    host = [int(x) & _MASK for x in torch.stack([x.to(scalars[0].device) for x in scalars]).tolist()] if scalars else []
    it = iter(host)
    in_key = []
    for (k, shape, dtype, fp), t in zip(ins, [v for v in inputs.values() if isinstance(v, torch.Tensor)], strict=True):
        value = next(it) if isinstance(fp, torch.Tensor) else fp
        rec.params.put(t, value)
        in_key.append((k, shape, dtype, value))
    p_key = []
    for (k, fp), t in zip(pks, [v for v in params.values() if isinstance(v, torch.Tensor)], strict=True):
        value = next(it) if isinstance(fp, torch.Tensor) else fp
        rec.params.put(t, value)
        p_key.append((k, value))
    out_whole = {k: next(it) for k in outs}
    rec.evaluations += 1
    role = rec.role_of(table)
    key = (node_name, kind, id(table), role, _SETTING.get(), id(override), tuple(in_key), tuple(p_key))
    first = rec.first.get(key)
    label = _LABEL.get()
    if first is None:
        # per-row fingerprints (8 bytes a row) are kept in host memory, whatever the role: a pair compares the whole
        # fingerprints (host integers) and reads the rows only to name a mismatch's row, while a long run's unpaired
        # first evaluations (a trajectory's every step: about 0.25 GB a 768p step) would otherwise fill the device
        kept = {k: v.to("cpu") for k, v in outs.items()}
        rec.first[key] = _First(label, out_whole, kept)
        if override is not None:
            rec.roles.setdefault(-id(override), (override, "override"))  # held, so that its id stays unique
        return
    rec.pairs[role] = rec.pairs.get(role, 0) + 1
    for k, w in out_whole.items():
        if first.whole.get(k) == w and first.rows[k].shape == outs[k].shape:
            continue
        a, b = first.rows[k], outs[k].to(first.rows[k].device)
        if a.shape != b.shape:
            row = None
        else:
            diff = (a != b).nonzero()
            row = int(diff[0, 0]) if diff.numel() else None
        rec.mismatches.append(
            {
                "node": node_name,
                "kind": kind,
                "value": k,
                "role": role,
                "passes": [first.label, label],
                "row": row,
                "rows": int(a.numel()),
            }  # fmt: skip
        )
        break


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
    _bits(out)[tuple(index)] += 1
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
