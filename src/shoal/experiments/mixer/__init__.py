"""Image classification with the MLP-Mixer and Sparse-MLP (Lou et al. 2021, arXiv 2109.02008): the `mixer`
and `sparse-mlp` presets.

- config.py: the shape (`MixerConfig`) and the presets; model.py: the module (`Mixer`);
- family.py: its adapter (`MIXER`: dp, fsdp and ep) and the plans it refuses beyond those axes;
- images.py: the image sets and their batches; task.py: the training task (accuracy, images/s).

Importing this package registers the family (shoal.models.adapter.register_family): its presets, its module,
its adapter, its plan rule and its task. It imports no torch; the module and the task load on first use.
"""

from __future__ import annotations

from typing import Any

from shoal.experiments.mixer.config import MIXER_PRESETS, MixerConfig
from shoal.experiments.mixer.family import MIXER, plan_refusal
from shoal.models.adapter import Family, register_family

__all__ = ["MIXER", "MIXER_PRESETS", "MixerConfig"]


def _model() -> type:
    from shoal.experiments.mixer.model import Mixer

    return Mixer


def _task() -> Any:
    from shoal.experiments.mixer.task import IMAGES

    return IMAGES


register_family(Family(name="mixer", adapter=MIXER, config=MixerConfig, model=_model, presets=MIXER_PRESETS,
                       task=_task, plan_rule=plan_refusal))
