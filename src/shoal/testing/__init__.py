"""Helpers for shoal's tests, and for a user who tests a plan of their own: `asserts` (comparisons whose
tolerances follow from the arithmetic, one-line errors), `parity` (a configuration on N gloo processes against
one process) and `fixtures` (things built offline). Importing it registers every experiment (shoal.experiments),
so that a case may take any family's shape and a message lists every family."""

import shoal.experiments  # noqa: F401  (registers the experiments' families)
