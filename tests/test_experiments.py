"""Experiments plug into the core through its extension points (shoal/experiments): a model family registered
in shoal.models.adapter, a training task (shoal.train.task); the core names none of them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from shoal.experiments.mixer import MIXER, MixerConfig
from shoal.experiments.mixer.task import IMAGES
from shoal.models import ModelConfig, build_model, preset, shape_from_dict, shape_to_dict
from shoal.models.adapter import TRANSFORMER, adapter_of_config, families, family_of_config
from shoal.train.task import TEXT, task_for

SRC = Path(__file__).resolve().parents[1] / "src" / "shoal"


def test_the_core_names_no_experiment():
    """Outside shoal/experiments no module names the Mixer: what differs for it, the core asks its family and task."""
    named = [f"{path.relative_to(SRC)}:{n}" for path in sorted(SRC.rglob("*.py")) if "experiments" not in path.parts
             for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"[Mm]ixer|MIXER", line)]
    assert named == []


def test_the_mixer_family_is_found_by_its_shape_and_presets():
    shape = MixerConfig(num_layers=2)
    family = family_of_config(shape)
    assert family is not None and family.adapter is MIXER is adapter_of_config(shape)
    assert family_of_config(ModelConfig()) is families()[0] and adapter_of_config(ModelConfig()) is TRANSFORMER
    assert preset("sparse-mlp").num_experts == 4 and task_for(shape) is IMAGES and task_for(ModelConfig()) is TEXT
    assert type(build_model(shape)).__name__ == "Mixer"
    assert shape_from_dict(shape_to_dict(shape)) == shape and shape_to_dict(shape)["family"] == "mixer"
    assert "family" not in shape_to_dict(ModelConfig())  # a transformer's stored shape names no family


def test_importing_the_experiments_loads_no_torch():
    """The command line imports shoal.experiments before it reads a flag: registering loads no torch."""
    code = "import sys, shoal.experiments; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
