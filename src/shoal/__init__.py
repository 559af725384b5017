"""shoal: hybrid-parallel training of dense and Mixture-of-Experts transformers.

The public API, each name imported on first use so that `import shoal` stays light (no torch):
- `Plan`: the parallel strategy as data (`Plan.parse("fsdp2,tp2")`); `rules`: which plans run and the
  values an option left out takes (`rules.resolve(plan, world_size=...)`);
- `build_mesh(plan)`: the named DeviceMesh of a resolved plan; `parallelize(model, plan, mesh)`: the model
  split by the plan, as a `Runtime` (the one object a training loop sees);
- `train_step(runtime, optimizer, micro_batches)`: one optimizer step, as `shoal train` runs it;
- `Transformer`, `ModelConfig`, `preset(name)`: shoal's reference model (`preset` also knows the presets of
  the model families shoal.experiments registers); `from_hf(path)`: a Hugging Face folder as one process's
  model, equal to transformers' own.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and the layer contracts see; at run time __getattr__ imports each
    from shoal import experiments, rules  # noqa: F401  (experiments: what `preset` imports first)
    from shoal.apply_plan import parallelize
    from shoal.mesh import build_mesh
    from shoal.models import ModelConfig, Transformer, preset
    from shoal.models.hf_folder import from_hf
    from shoal.plan import Plan
    from shoal.runtime import Runtime
    from shoal.train.step import train_step

_WHERE = {
    "Plan": "shoal.plan",
    "rules": "shoal",
    "build_mesh": "shoal.mesh",
    "parallelize": "shoal.apply_plan",
    "Runtime": "shoal.runtime",
    "train_step": "shoal.train.step",
    "Transformer": "shoal.models",
    "ModelConfig": "shoal.models",
    "preset": "shoal.models",
    "from_hf": "shoal.models.hf_folder",
}

__all__ = ["ModelConfig", "Plan", "Runtime", "Transformer", "build_mesh", "from_hf", "parallelize", "preset", "rules",
           "train_step"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'shoal' has no attribute {name!r}")
    if name == "rules":
        return importlib.import_module("shoal.rules")
    if name == "preset":  # every family's presets, the experiments' too (their registration imports no torch)
        importlib.import_module("shoal.experiments")
    return getattr(importlib.import_module(_WHERE[name]), name)
