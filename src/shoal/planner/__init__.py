"""The planner: hardware specs, pure cost formulas for each parallel axis, the search over plans,
and calibration on this machine. The formulas and the search are plain arithmetic on the model's
shape and the plan (no tensors, no collectives); only `calibrate` runs torch, in its own processes,
and `counts`, which recounts from the code the op counts the formulas use (for tests)."""
