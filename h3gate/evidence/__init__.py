"""Evidence: provenance stamps, JSON Schema validation, atomic writes, and per-folder seals.

Every evidence document is ``{"kind", "schema_version", "provenance", **body}``, validated against
``schemas/<kind>.schema.json`` (JSON Schema 2020-12, ``$ref`` into ``common.schema.json``) before it is written.
"""
