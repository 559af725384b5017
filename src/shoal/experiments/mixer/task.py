"""Image classification as a training task (shoal.train.task): the image set `--data` names (the built-in
digits by default, shoal.experiments.mixer.images), cross-entropy on the classes, held-out loss and
accuracy, images/s, the Mixer's FLOPs per image.

Shape legend: B images, K classes.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from shoal.experiments.mixer.config import MixerConfig
from shoal.experiments.mixer.images import (
    DIGITS,
    HeldOutImages,
    ImageBatches,
    check_shape,
    correct_and_count,
    load_image_set,
    split_images,
)
from shoal.runtime import cross_entropy_sum
from shoal.train.task import Task, TaskData, TrainerView

if TYPE_CHECKING:
    from shoal.models import ModelShape
    from shoal.train.config import LoopConfig, RunConfig


class ImageTask(Task):
    """An image classifier (the Mixer presets) on labelled images."""

    sample = "image"
    rate_label = "img_s"
    eval_metrics = ("eval_accuracy",)
    noun = "an image Mixer"
    messages = MappingProxyType({
        "doc_mask": "--doc-mask on marks documents of text; the image Mixer has none; valid: --doc-mask off",
        "auto_plan": "--plan auto prices transformers; the image Mixer takes a plan of dp, fsdp and ep axes; "
                     "valid: e.g. --plan dp2, fsdp2 or ep2",
        "init": "--init loads pretrained transformer weights; the image Mixer starts from the seed's",
        "plan_search": "the planner ranks plans for transformers; the image model {model!r} trains under dp, fsdp "
                       "and ep: check one with --plan, e.g. --plan ep2",
        "plan_note": "the planner does not price image models (no time or memory prediction)",
        "planner": "the planner prices transformers; {model!r} is an image model",
        "sample": "run {run_dir!r} trained an image classifier; shoal sample generates text",
    })

    def check_model(self, cfg: RunConfig, model: ModelShape) -> None:
        """Nothing beyond the shape's own checks: an image classifier reads no sequences."""

    def sequence_length(self, loop: LoopConfig) -> int | None:
        return None

    def check_data(self, cfg: RunConfig, model: ModelShape) -> None:
        """The image set is there and fits the model's input and classes."""
        images, labels = load_image_set(cfg.data.path)
        _check(images, labels, cfg, model)

    def load_data(self, cfg: RunConfig, model: ModelShape) -> TaskData:
        """The image set, checked against the model, split into training and held-out images."""
        images, labels = load_image_set(cfg.data.path)
        _check(images, labels, cfg, model)
        (train_x, train_y), (val_x, val_y) = split_images(images, labels, cfg.data.val_fraction)
        return TaskData(ImageBatches(train_x, train_y, seed=cfg.loop.seed), HeldOutImages(val_x, val_y),
                        len(train_y), len(val_y))

    def samples_per_step(self, loop: LoopConfig) -> int:
        return loop.global_batch

    def flops_per_sample(self, model: ModelShape, loop: LoopConfig) -> float:
        return _mixer(model).flops_per_image()

    @torch.no_grad()
    def evaluate(self, trainer: TrainerView) -> dict[str, float]:
        """Held-out loss and accuracy over every held-out image."""
        held_out, loop, runtime = trainer.held_out, trainer.loop, trainer.runtime
        assert isinstance(held_out, HeldOutImages)
        runtime.eval()
        totals = torch.zeros(3, device=trainer.device)  # summed loss, right, counted
        for i in range(held_out.num_batches(loop.global_batch)):
            images, labels = (t.to(trainer.device) for t in held_out.batch(i, loop.global_batch, trainer.part))
            logits_BK = runtime(images)
            totals += torch.stack([cross_entropy_sum(logits_BK, labels), *correct_and_count(logits_BK, labels)])
        runtime.train()
        loss, right, counted = runtime.global_mean(totals).tolist()  # a mean over ranks: the ratios hold
        return {"eval_loss": loss / counted, "eval_accuracy": right / counted}

    def eval_words(self, record: dict[str, Any]) -> str:
        return f"held-out accuracy {record['eval_accuracy']:.2%} (loss {record['eval_loss']:.4f})"

    def describe(self, trainer: TrainerView) -> list[str]:
        m, cfg, loop = _mixer(trainer.model_cfg), trainer.cfg, trainer.loop
        kind = f"Sparse-MLP, {m.num_moe_layers} sparse block(s) of {m.num_experts} experts" if m.num_experts \
            else "dense Mixer"
        return [f"shoal: model {cfg.model}: {m.num_params() / 1e6:.2f}M parameters ({kind}), {m.num_layers} blocks, "
                f"{m.num_patches} patches of {m.patch_size}x{m.patch_size}, dim {m.dim}, {m.num_classes} classes",
                f"data: image set {cfg.data.path or 'digits (scikit-learn, built in)'}: "
                f"{trainer.num_train:,} training images, {trainer.num_held_out:,} held out",
                f"batch: {loop.global_batch} images per step; {trainer.local_batch} per data rank in "
                f"{trainer.num_micro} micro-batch(es) of {trainer.local_batch // trainer.num_micro}"]

    def random_batches(self, model: ModelShape, *, steps: int, global_batch: int, seq_len: int,
                       generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Uniform random images and labels (`seq_len` unused)."""
        m = _mixer(model)
        images = torch.rand((steps, global_batch, m.channels, m.image_size, m.image_size), generator=generator)
        labels = torch.randint(0, m.num_classes, (steps, global_batch), generator=generator)
        return list(zip(images, labels))


IMAGES = ImageTask()
"""The task of every MixerConfig (registered with its family: shoal.experiments.mixer)."""


def _check(images: Any, labels: Any, cfg: RunConfig, model: ModelShape) -> None:
    m = _mixer(model)
    check_shape(images, labels, channels=m.channels, image_size=m.image_size, num_classes=m.num_classes,
                data=cfg.data.path or DIGITS)


def _mixer(model: ModelShape) -> MixerConfig:
    assert isinstance(model, MixerConfig), f"the image task trains a MixerConfig, not a {type(model).__name__}"
    return model
