"""torchvision for SGLang's import chain, when no torchvision wheel works beside the installed torch.

SGLang 0.5.23 imports torchvision at import time from modules the MiniMax-H3 DiT never calls: the config registry
(``sglang.srt.configs``: ``deepseek_ocr`` takes ``torchvision.transforms.InterpolationMode`` and
``transforms.functional``; ``internvl_utils`` takes ``torchvision.transforms`` and
``transforms.functional.InterpolationMode``), and transformers' image processors, which import
``torchvision.transforms.v2.functional`` once they see a torchvision. Nothing of torchvision runs in the DiT.

``make install-sglang`` installs the torchvision that pairs with the installed torch when one imports here (PyPI's
for a CUDA torch, the CPU index's ``+cpu`` build for a CPU torch). PyPI's torchvision is the CUDA build: on a CPU
torch its ``_C`` extension cannot load and ``import torchvision`` raises (``torchvision::nms`` does not exist). Where
no working torchvision is installed, :func:`ensure_torchvision` puts an import-time shim in front of the import
system instead: a ``torchvision`` package (and any submodule asked for) whose attributes are placeholders. A
placeholder can be named, subscripted, subclassed and used in annotations (what import-time code does); calling
or instantiating it raises ``RuntimeError`` naming the attribute, so nothing computes with it silently. Its
``__version__`` is ``0.0+h3gate.shim`` (transformers then keeps its PIL defaults). :func:`torchvision_record` says
which of the two ran (it goes into the runtime record).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

SHIM_VERSION = "0.0+h3gate.shim"
_state: dict[str, str] = {}


class _Placeholder:
    """A torchvision attribute that exists for imports only."""

    def __init__(self, path: str) -> None:
        self._path = path

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._path}.{name}")

    def __getitem__(self, key: Any) -> _Placeholder:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._path}: torchvision is not installed here (h3gate's import shim stands in for it)")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (_Unusable,)

    def __repr__(self) -> str:
        return f"<h3gate torchvision shim: {self._path}>"


class _Unusable:
    """Base of classes that subclass a torchvision placeholder: instantiating one raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{type(self).__name__}: needs torchvision, which is not installed here (h3gate shim)")


class _ShimModule(types.ModuleType):
    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


class _ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``torchvision`` and every ``torchvision.*`` with a :class:`_ShimModule` package."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _ShimModule(spec.name)
        module.__path__ = []
        module.__version__ = SHIM_VERSION
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _drop_torchvision_modules() -> None:
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]


def ensure_torchvision() -> str:
    """An importable ``torchvision``: the installed one when it imports, else the shim. Idempotent; returns the
    record string (``"0.28.0"`` or ``"shim: <why>"``)."""
    if "record" in _state:
        return _state["record"]
    try:
        module = importlib.import_module("torchvision")
        _state["record"] = str(getattr(module, "__version__", "unknown"))
        return _state["record"]
    except ModuleNotFoundError as exc:
        if exc.name != "torchvision":
            raise
        why = "not installed"
    except Exception as exc:  # an installed build that does not load beside this torch (CUDA wheel on a CPU torch)
        why = f"installed build does not import ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    _drop_torchvision_modules()
    sys.meta_path.insert(0, _ShimFinder())
    importlib.invalidate_caches()
    _state["record"] = f"shim: {why}"
    return _state["record"]


def torchvision_record() -> str | None:
    """What :func:`ensure_torchvision` settled on, or None before it ran."""
    return _state.get("record")
