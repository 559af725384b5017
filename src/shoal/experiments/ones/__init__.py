"""OneS (Xue et al. 2022, arXiv 2201.10890): a trained MoE run distilled into a dense student.

- gather.py: each MoE layer's experts folded into one dense FFN (pure tensor math);
- kd.py: the knowledge-distillation loss and how the teacher's logits travel with the targets;
- distill.py: the student planned and written before any worker starts, its task (`DistillTask`, which a
  Job carries to the workers) and `distill`, the Python entry of `shoal distill` (shoal.cli.distill).

It registers nothing: the student is a ModelConfig, and its task travels in its Job.
"""
