"""Gate engines: each runs its executions and returns a report body and a verdict (no CLI, no printing)."""
