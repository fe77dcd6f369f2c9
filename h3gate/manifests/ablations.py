"""The RFC section 6 ablation matrix as data (``manifests/ablations.yaml``).

Every row changes one factor of the strict arm and declares what must happen:

* ``PASS`` - the probe arm is byte-equal to the strict arm on every compared tensor;
* ``EXPECTED_DRIFT`` - the first drift (in execution order) matches ``signature``;
* ``REJECTED`` - the engine refuses to compare the arms (e.g. mis-owned metadata) and says why;
* ``NA`` - the factor does not exist in H3, justified by a check where one exists.

A signature field that is absent is not checked; ``any`` says the RFC promises only "the first affected" one and the
engine records whichever it observes. ``row`` is a packed row: an integer, or ``<group>[k]`` resolved against the
layout (``text``, ``video``, ``audio`` index tensors; ``video_target`` / ``audio_target`` skip condition rows;
``media[k]`` is packed row ``text_tokens + k``, the k-th row after the text block).

Rows are keyed by ablation id (``A0``, ``H17``, ``H-C4``) and kept in file order. What a row's ``probe`` / ``strict``
name is checked against the registries of :mod:`h3gate.ablate.registry` (by ``ablate`` and ``validate``); ``ranks``
is a distributed row's world size.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, StrictInt, field_validator, model_validator

from h3gate.manifests.loader import load_yaml
from h3gate.manifests.model_config import Strict
from h3gate.paths import MANIFESTS

ABLATIONS_FILE = MANIFESTS / "ablations.yaml"
Result = Literal["PASS", "EXPECTED_DRIFT", "REJECTED", "NA"]
RESULTS: tuple[str, ...] = ("PASS", "EXPECTED_DRIFT", "REJECTED", "NA")
Run = Literal["forward", "trajectory", "backward", "distributed", "check"]
ABLATION_ID = re.compile(r"^[A-Z][A-Z0-9]*(-[A-Z0-9]+)*$")  # A0, H17, H-C4
ROW_SYMBOL = re.compile(r"^(text|video|audio|video_target|audio_target|media)\[(-?\d+)\]$")
ANY = "any"


class Signature(Strict):
    """Where the first drift must land. Absent fields are not checked; ``any`` is recorded, not checked."""

    node: str | None = Field(default=None, min_length=1)
    layer: StrictInt | Literal["any"] | None = None
    step: StrictInt | Literal["any"] | None = None
    row: StrictInt | str | None = None
    modality: Literal["video", "text", "audio", "any"] | None = None

    @field_validator("row")
    @classmethod
    def _row(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, str) and value != ANY and not ROW_SYMBOL.match(value):
            raise ValueError(
                f"{value!r} must be an integer, 'any', or <group>[k] with group text, video, audio, video_target, "
                "audio_target, media"
            )
        if isinstance(value, int) and value < 0:
            raise ValueError("must be >= 0")
        return value

    @field_validator("layer", "step")
    @classmethod
    def _non_negative(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be >= 0")
        return value


class Expected(Strict):
    result: Result
    reason: str | None = Field(default=None, min_length=1)
    signature: Signature | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Expected:
        if self.result in ("NA", "REJECTED") and not self.reason:
            raise ValueError(f"reason: required when result is {self.result}")
        if self.result == "EXPECTED_DRIFT" and (self.signature is None or self.signature.node is None):
            raise ValueError("signature.node: required when result is EXPECTED_DRIFT")
        if self.result != "EXPECTED_DRIFT" and self.signature is not None:
            raise ValueError(f"signature: only an EXPECTED_DRIFT row has one (result is {self.result})")
        return self


class AblationRow(Strict):
    """One row: the RFC's words, how the engine runs it, and what it must observe."""

    section: Literal["6.1", "6.2", "6.3"]
    factor: str = Field(min_length=1)
    interpretation: str = Field(min_length=1)
    strict_arm: str = Field(min_length=1)
    probe_arm: str = Field(min_length=1)
    run: Run
    probe: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    strict: str | None = Field(default=None, pattern=r"^[a-z][a-z0-9_]*$")
    ranks: StrictInt = Field(default=1, ge=1)  # a distributed row's world size (its plans run on this many ranks)
    anchors: list[Literal["first", "last"]] = []
    expected: Expected

    @model_validator(mode="after")
    def _ranks(self) -> AblationRow:
        if self.run == "distributed" and self.ranks < 2:
            raise ValueError("ranks: a distributed row needs ranks >= 2")
        if self.run != "distributed" and self.ranks != 1:
            raise ValueError(f"ranks: only a distributed row runs on {self.ranks} ranks")
        return self


class AblationManifest(Strict):
    rows: dict[str, AblationRow]

    @field_validator("rows")
    @classmethod
    def _ids(cls, rows: dict[str, AblationRow]) -> dict[str, AblationRow]:
        bad = [k for k in rows if not ABLATION_ID.match(k)]
        if bad:
            raise ValueError(f"ablation id {bad[0]!r}: expected capitals, digits and dashes (e.g. A0, H17, H-C4)")
        if not rows:
            raise ValueError("no ablation rows")
        return rows


def load_ablations(path: str | Path | None = None) -> dict[str, AblationRow]:
    """Every row of ``manifests/ablations.yaml`` (or ``path``) by ablation id, in file (RFC) order."""
    return load_yaml(Path(path) if path is not None else ABLATIONS_FILE, AblationManifest).rows
