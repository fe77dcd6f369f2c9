"""Adapters that put other runtimes under h3gate's gate (each an optional dependency, imported lazily)."""
