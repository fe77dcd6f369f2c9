"""Build a report: check the inputs and ``--out`` before any work, read and plan, draw every figure, and write
``index.html`` with the PNGs into a temporary folder that then replaces ``--out`` (nothing half-written)."""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from h3gate.errors import InputError
from h3gate.evidence.writer import new_file_mode, prepare_out
from h3gate.paths import display
from h3gate.report.figures import require_matplotlib, to_png
from h3gate.report.loader import SEAL_NAME, Inventory, check_inputs, load_inventory
from h3gate.report.page import GENERATOR, Rendered, render_page
from h3gate.report.plan import Entry, Section, figure_set, plan

INDEX = "index.html"
TRACEBACK = "h3gate-traceback.txt"  # a crash's traceback goes to --out (h3gate.errors.crash_folder)
Step = Callable[[str], None]


@dataclass
class Prepared:
    """Everything known before drawing: the inputs read, the page planned."""

    out: Path
    inventory: Inventory
    sections: list[Section]
    others: list[Entry]

    @property
    def figures(self) -> list[dict[str, str]]:
        return figure_set(self.sections)


def _is_previous_report(folder: Path) -> bool:
    """A folder this command wrote before: ``index.html`` marked by the generator, the rest PNGs (or a traceback)."""
    index = folder / INDEX
    if all(p.name == TRACEBACK for p in folder.iterdir()):
        return True  # only the traceback of a run that crashed
    try:
        head = index.read_text(encoding="utf-8", errors="replace")[:2000] if index.is_file() else ""
    except OSError:
        return False
    if f'content="{GENERATOR}"' not in head:
        return False
    return all(p.is_file() and (p.suffix == ".png" or p.name in (INDEX, TRACEBACK)) for p in folder.iterdir())


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or path.is_relative_to(folder)


def check_out(out: Path, inputs: list[Path]) -> Path:
    """``--out`` must be a new or empty folder, or a previous report (replaced whole), and lie outside every input
    folder and every sealed folder (a report there would change the evidence and break its seal)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {display(out)}: exists and is not a folder")
    target = out.resolve()
    for path in inputs:
        folder = path.resolve()
        if path.is_dir() and _inside(target, folder):
            raise InputError(f"--out {display(out)}: lies inside the input {display(path)}; write the report elsewhere")
    for folder in (target, *target.parents):
        if (folder / SEAL_NAME).is_file():
            raise InputError(f"--out {display(out)}: lies inside the sealed folder {display(folder)} (it would break "
                             "the seal); write the report elsewhere")  # fmt: skip
    if out.is_dir() and any(out.iterdir()) and not _is_previous_report(out):
        raise InputError(f"--out {display(out)}: holds files that are not an h3gate report; give a new or empty folder")
    return prepare_out(out)


def prepare(paths: list[Path], out: Path, step: Step | None = None) -> Prepared:
    """Check matplotlib, the inputs and ``--out``, then read every input and plan the page (nothing is drawn)."""
    require_matplotlib()
    check_inputs(paths)
    out = check_out(out, paths)
    inventory = load_inventory(paths, step)
    sections, others = plan(inventory)
    return Prepared(out, inventory, sections, others)


def _png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    width, height = struct.unpack(">II", png[16:24])
    return width, height


def _dir_mode() -> int:
    """The mode ``mkdir`` gives a new folder under the process umask (``mkdtemp`` makes 0700 folders)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o777 & ~umask


def _write(out: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` into a temporary sibling folder, then swap it in for ``out`` (a previous report is removed)."""
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=parent))
    except OSError as exc:
        raise InputError(f"--out {display(out)}: cannot write there ({exc.strerror or exc})") from None
    old = None
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
            os.chmod(tmp / name, new_file_mode())
        os.chmod(tmp, _dir_mode())
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=parent))
            os.replace(out, old / "report")
        os.replace(tmp, out)
    except BaseException:
        if old is not None and (old / "report").exists() and not out.exists():
            os.replace(old / "report", out)  # put the previous report back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(old)


def render(prepared: Prepared, step: Step | None = None) -> Path:
    """Draw every planned figure, assemble the page and write it; returns ``out/index.html``."""
    rendered: dict[str, Rendered] = {}
    files: dict[str, bytes] = {}
    try:
        for section in prepared.sections:
            for entry in section.entries:
                for spec in entry.figures:
                    if step is not None:
                        step(spec.id)
                    png = to_png(spec.draw())
                    rendered[spec.id] = Rendered(png, *_png_size(png))
                    files[f"{spec.id}.png"] = png
    finally:
        prepared.inventory.wait_seals()  # the seals were verified meanwhile, in a worker process
    generated = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    text = render_page(prepared.inventory, prepared.sections, prepared.others, rendered, generated)
    files[INDEX] = text.encode("utf-8")
    _write(prepared.out, files)
    return prepared.out / INDEX
