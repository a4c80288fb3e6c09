"""Renderers: the only place that knows about display (units, tables, wording of numbers)."""
