"""Worked examples (importable as `examples.NAME` from the repository root)."""
