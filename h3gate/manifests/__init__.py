"""Manifest models (pydantic, ``extra="forbid"``) and the YAML loader, one module per manifest kind."""
