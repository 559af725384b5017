"""One module per parallelism; each `apply_x(model, *, mesh, plan)` is a no-op at degree 1."""
