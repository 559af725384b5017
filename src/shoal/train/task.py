"""What a training task gives the loop and the commands: `Task`, as torchtitan's TrainSpec.

The loop (shoal.train.loop) and the commands (shoal.cli) ask a run's task, never its model's class, for what
differs from one task to another: its data (training and held-out batches), its loss, what an evaluation
measures, what its throughput counts (tokens/s, images/s), the training FLOPs of one sample, the lines that
describe a run, and the checks a run passes before any worker starts. `Task` itself is the language model of
shoal's Transformer on token sequences (`TEXT`), the default; an experiment's task (shoal.experiments)
subclasses it and overrides what differs. A run finds its task through its model's family (`task_for`, as the
family registered it: shoal.models.adapter.Family), or carries it in its Job (shoal.train.job) when the task
changes the training of a family's model (a distillation's loss).

What the core gives the text transformer alone (`TEXT_ONLY`: document masks, the planner, Hugging Face
weights, sampling) is refused for another family's model in one line, in its task's words (`Task.message`).

Shape legend: B batch, T sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

import torch

from shoal.data.text import Batches
from shoal.loss import LossFn
from shoal.models.adapter import ModelShape, family_of_config
from shoal.models.config import ModelConfig

if TYPE_CHECKING:
    from shoal.runtime import Runtime
    from shoal.train.config import LoopConfig, RunConfig

TEXT_ONLY: Mapping[str, str] = MappingProxyType({
    "doc_mask": "--doc-mask on marks documents of text; this model has none; valid: --doc-mask off",
    "auto_plan": "--plan auto prices transformers; this model takes a plan of data axes; valid: e.g. --plan dp2",
    "init": "--init loads pretrained transformer weights; this model starts from the seed's",
    "plan_search": "the planner ranks plans for transformers; the model {model!r} is not one: check one plan with "
                   "--plan, e.g. --plan dp2",
    "plan_note": "the planner does not price this model (no time or memory prediction)",
    "planner": "the planner prices transformers; {model!r} is not one",
    "export_hf": "checkpoint {checkpoint} holds {noun}; --hf writes transformers' language models only; valid: the "
                 "plain export (one safetensors file)",
    "sample": "run {run_dir!r} trained {noun}; shoal sample generates text",
})
"""What the core gives the text transformer alone, by name, each with the one line that refuses it for another
family's model (a format string; {noun} is the task's). A task's `messages` may word any of them its own way."""


@dataclass(frozen=True)
class TaskData:
    """A run's samples, split into training and held-out batches (each batch a pure function of (seed, step))."""

    train: Batches
    held_out: Batches | None
    """None: no held-out split (a prepared dataset without one, with --eval-every 0)."""
    num_train: int
    """Training samples (tokens, images)."""
    num_held_out: int
    """Held-out samples."""
    held_out_sources: dict[str, Batches] | None = None
    """A mixture's held-out batches per source (each drawn from that source alone), by short name."""


class TrainerView(Protocol):
    """What a task reads of the trainer that runs it (shoal.train.loop.Trainer)."""

    cfg: RunConfig
    loop: LoopConfig
    model_cfg: ModelShape
    device: torch.device
    runtime: Runtime
    held_out: Any
    """The held-out batches the task's `load_data` gave."""
    part: tuple[int, int]
    """This rank's slice of every global batch: (index, count) over the data ranks."""
    local_batch: int
    num_micro: int
    num_train: int
    num_held_out: int

    def evaluate(self, held_out: Any) -> float:
        """The mean loss per target over held-out batches."""
        ...


class Task:
    """The language model on token sequences: next-token cross-entropy, held-out loss, tokens/s. A subclass is
    another task; each method says what the loop or a command asks of it."""

    sample = "token"
    """What one sample of the data is: the throughput counts them (metrics.jsonl's "{sample}s_per_s")."""
    rate_label = "tok_s"
    """The progress bar's name for the throughput."""
    eval_metrics: tuple[str, ...] = ()
    """What an evaluation records beside eval_loss; the summary keeps the last value of each (final_<name>)."""
    command = "train"
    """The `shoal` command that continues a stopped run of this task."""
    noun = "a text transformer"
    """The model this task trains, as a message names it."""
    messages: Mapping[str, str] = MappingProxyType({})
    """This task's own words for refusing a feature of TEXT_ONLY (format strings, as there)."""

    @property
    def rate_key(self) -> str:
        """The throughput's key in metrics.jsonl and the summary."""
        return f"{self.sample}s_per_s"

    def message(self, feature: str, **words: object) -> str:
        """The one line that refuses `feature` (a key of TEXT_ONLY) for this task's model."""
        return self.messages.get(feature, TEXT_ONLY[feature]).format(noun=self.noun, **words)

    # ------------------------------------------------------------------ before any worker starts
    def check_model(self, cfg: RunConfig, model: ModelShape) -> None:
        """What the run's settings must meet of the model before its plan is checked (a one-line ValueError)."""
        m = _text(model)
        if cfg.loop.seq_len > m.max_seq_len:
            raise ValueError(f"--seq-len {cfg.loop.seq_len} exceeds the model's max_seq_len={m.max_seq_len}; "
                             f"valid: 1..{m.max_seq_len} (or --set max_seq_len={cfg.loop.seq_len})")

    def sequence_length(self, loop: LoopConfig) -> int | None:
        """The length of the sequences a sample is part of, which the rules check plans against (None: none)."""
        return loop.seq_len

    def check_data(self, cfg: RunConfig, model: ModelShape) -> None:
        """The run's data is there and fits the model (a one-line ValueError); after the plan is checked."""
        from shoal.data.text import load_tokenizer, open_data

        m, loop = _text(model), cfg.loop
        top = open_data(cfg.data, seq_len=loop.seq_len, seed=loop.seed, max_id=True,
                        held_out=loop.eval_every > 0).max_id
        if top >= m.vocab_size:
            vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
            raise ValueError(f"the data holds token id {top} but the model's vocab_size is {m.vocab_size}; "
                             f"use --set vocab_size={max(top + 1, vocab)}")

    # ------------------------------------------------------------------ the workers
    def load_data(self, cfg: RunConfig, model: ModelShape) -> TaskData:
        """Prepared datasets and mixtures through memory maps, other inputs whole (shoal.data.text.open_data)."""
        from shoal.data.text import open_data

        data = open_data(cfg.data, seq_len=cfg.loop.seq_len, seed=cfg.loop.seed, held_out=cfg.loop.eval_every > 0)
        return TaskData(data.train, data.held_out, data.num_train, data.num_held_out, data.held_out_sources)

    def samples_per_step(self, loop: LoopConfig) -> int:
        """Samples of one optimizer step (the throughput's numerator)."""
        return loop.global_batch * loop.seq_len

    def flops_per_sample(self, model: ModelShape, loop: LoopConfig) -> float:
        """Training FLOPs of one sample (the model FLOPs utilisation's numerator)."""
        return _text(model).flops_per_token(loop.seq_len)

    def loss_fn(self) -> LossFn | None:
        """The loss of a micro-batch (shoal.runtime.Runtime.forward_backward); None: cross-entropy on the targets."""
        return None

    def prepare(self) -> None:
        """Once this rank has joined the process group, before the trainer builds anything."""

    def attach(self, trainer: TrainerView) -> None:
        """Once the trainer is built (model, optimizer, data), before its first step."""

    def step_targets(self, trainer: TrainerView, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """What this rank's batch gives the loss as targets: the batch's own here."""
        return targets

    def evaluate(self, trainer: TrainerView) -> dict[str, float]:
        """An evaluation's record: the mean held-out loss per target."""
        return {"eval_loss": trainer.evaluate(trainer.held_out)}

    def eval_words(self, record: dict[str, Any]) -> str:
        """An evaluation's line under the progress bar."""
        return f"held-out loss {record['eval_loss']:.4f}"

    def describe(self, trainer: TrainerView) -> list[str]:
        """The start of a run's description: the model, the data, the batch."""
        m, cfg, loop = _text(trainer.model_cfg), trainer.cfg, trainer.loop
        data = cfg.data.path or "built-in corpus (Python's pydoc topics)"
        lora = []
        if cfg.lora is not None:  # low-rank adapters on a frozen base (shoal.models.lora)
            from shoal.models.lora_config import LoRAConfig, adapted_params, adapter_params
            from shoal.planner.compute import step_weight_flops

            settings = LoRAConfig.parse(cfg.lora)
            adapters, adapted = adapter_params(m, settings), adapted_params(m, settings)
            ratio = step_weight_flops(m, settings) / step_weight_flops(m)
            lora = [f"lora: {settings.text()}: {adapters / 1e6:.2f}M trainable parameters ({adapters / adapted:.2%} of "
                    f"the {adapted / 1e6:.2f}M they adapt), the rest frozen; the step's weight products "
                    f"{ratio:.3f} of a full fine-tune's (no weight gradient for frozen weights)"
                    + (f"; adapters from {cfg.lora_init}" if cfg.lora_init else "")]
        return [f"shoal: model {cfg.model}: {m.num_params() / 1e6:.2f}M parameters, {m.num_layers} layers, dim "
                f"{m.dim}, {m.num_heads} heads, vocab {m.vocab_size}", *lora,
                f"data: {data}, tokenizer {cfg.data.tokenizer}: {trainer.num_train:,} training tokens, "
                f"{trainer.num_held_out:,} held out",
                f"batch: {loop.global_batch} sequences x {loop.seq_len} tokens per step; {trainer.local_batch} per "
                f"data rank in {trainer.num_micro} micro-batch(es) of {trainer.local_batch // trainer.num_micro}"]

    def notes(self, trainer: TrainerView) -> list[str]:
        """The end of a run's description (after the plan and the run folder)."""
        return []

    # ------------------------------------------------------------------ tests
    def random_batches(self, model: ModelShape, *, steps: int, global_batch: int, seq_len: int,
                       generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`steps` global batches of seeded random samples, (inputs, targets) each (shoal.testing.parity)."""
        seq = torch.randint(0, _text(model).vocab_size, (steps, global_batch, seq_len + 1), generator=generator)
        return [(s_BT[:, :-1], s_BT[:, 1:]) for s_BT in seq]


TEXT = Task()
"""The language model's task, every ModelConfig's."""


def task_for(model: ModelShape) -> Task:
    """The task that trains `model`: its family's (shoal.models.adapter.Family.task), else the language model's."""
    family = family_of_config(model)
    task = family.task() if family is not None and family.task is not None else TEXT
    assert isinstance(task, Task), f"{family.name if family else model}: a family's task is a shoal.train.task.Task"
    return task


def _text(model: ModelShape) -> ModelConfig:
    assert isinstance(model, ModelConfig), f"the text task trains a ModelConfig, not a {type(model).__name__}"
    return model
