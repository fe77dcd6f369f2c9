"""h3gate: prove that two MiniMax-H3 executions run the same arithmetic, and find the first place they do not.

``import h3gate`` stays light (no torch, no Triton); ``h3gate.strict`` (``with h3gate.strict(model):``, the adapter
:mod:`h3gate.strict`) is imported on first use.
"""

from importlib import import_module

__version__ = "0.1.0"
__all__ = ["__version__", "strict"]
_LAZY = {"strict": "h3gate.strict"}  # attribute -> the module imported on first access (a callable module)


def __getattr__(name: str):
    """``h3gate.strict`` without ``import h3gate.strict``: import the module on first access."""
    if name in _LAZY:
        return import_module(_LAZY[name])
    raise AttributeError(f"module 'h3gate' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
