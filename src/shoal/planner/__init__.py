"""The planner: hardware specs, pure cost formulas for each parallel axis, and the search over plans. Plain
arithmetic on the model's shape and the plan: no tensors, no collectives, no torch import. What measures by running
torch (calibration on this machine, the recounts of the formulas' op counts) is shoal.calibration."""
