"""The top level is the public API: each name of `shoal.__all__` resolves to the object its home module defines,
and `import shoal` (and asking it for the plan and the rules) loads no torch."""

from __future__ import annotations

import subprocess
import sys

import shoal


def test_every_public_name_is_its_home_modules_object():
    from shoal import apply_plan, mesh, models, plan, rules, runtime
    from shoal.models import hf_folder as hf_model
    from shoal.train import step

    home = {"Plan": plan.Plan, "rules": rules, "build_mesh": mesh.build_mesh, "parallelize": apply_plan.parallelize,
            "Runtime": runtime.Runtime, "train_step": step.train_step, "Transformer": models.Transformer,
            "ModelConfig": models.ModelConfig, "preset": models.preset, "from_hf": hf_model.from_hf}
    assert sorted(shoal.__all__) == sorted(home)
    for name, obj in home.items():
        assert getattr(shoal, name) is obj, name


def test_import_shoal_and_plan_rules_load_no_torch():
    code = ("import sys, shoal; p = shoal.rules.resolve(shoal.Plan.parse('fsdp2'), world_size=2); "
            "print(p, sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "fsdp2,precision=fp32,compile=off []"
