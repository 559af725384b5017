"""Experiments built on shoal's core, each plugged in through its extension points, never by a branch of the
core named after it:

- mixer: image classification with the MLP-Mixer and Sparse-MLP (`--model mixer`, `--model sparse-mlp`): a
  model family (shoal.models.adapter.Family: adapter, presets, plan rule) with its own training task
  (shoal.train.task.Task: image data, accuracy, images/s);
- ones: OneS distillation of a trained MoE run into a dense student (`shoal distill`): a text task with a
  teacher and a distillation loss, carried by the run's Job.

- cowclip: CowClip's click-through-rate experiment: a CTR model as a user writes it, its synthetic click data
  and AUC (the optimizer itself is shoal.optim.cowclip); it trains through the public API like any user's
  module (bench/cowclip_ctr.py) and needs no extension point.

Importing this package registers every experiment's family; it imports no torch. The command line imports it
before it reads a flag, so that every preset and family is known.
"""

from __future__ import annotations

from shoal.experiments import mixer

__all__ = ["mixer"]
