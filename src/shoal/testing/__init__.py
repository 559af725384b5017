"""Helpers for shoal's tests, and for a user who tests a plan of their own: `asserts` (comparisons whose
tolerances follow from the arithmetic, one-line errors), `parity` (a configuration on N gloo processes against
one process) and `fixtures` (things built offline)."""
