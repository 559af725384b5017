"""The training loop of one rank: train, evaluate, checkpoint, report.

`Trainer(job, device)` is one rank's model (through its parallel runtime, shoal/runtime.py, and
nothing else), optimizer, data and run folder, set up by shoal.train.build; `run()` trains it.
shoal.train.worker starts a worker process and runs it.

Rank 0 alone prints and writes the run folder's files (config, metrics, plot, summary);
checkpoints are collective. Batch `s` is a pure function of (seed, s), so resuming at step s
continues the exact sequence of batches an unbroken run would have seen.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shoal import rules
from shoal.infra import faults, host_memory
from shoal.infra.watchdog import Watchdog
from shoal.infra.world import broadcast_from_rank0
from shoal.loss import LossFn
from shoal.models import ModelConfig
from shoal.moe.collect import records as moe_records
from shoal.optim.builder import build_optimizer
from shoal.optim.lamb_lars import gather_trust, trust_summary
from shoal.optim.schedule import build_scheduler
from shoal.optim.sharded_norms import local_tensor
from shoal.plan import Plan
from shoal.train import memory
from shoal.train.build import (
    build_runtime,
    check_same_base,
    checkpoint_to_continue,
    lora_base,
    pretrained_weights,
    resolve_plan,
    restart_count,
    restore,
    set_matmul_precision,
)
from shoal.train.checkpoint import latest_checkpoint, prune, save_checkpoint
from shoal.train.config import to_flat
from shoal.train.dry_run import memory_prediction
from shoal.train.job import Job, default_run_dir, write_run_config
from shoal.train.metrics import MetricsWriter, format_summary, peak_flops, summarize, write_summary
from shoal.train.nonfinite import SPIKE_K, SPIKE_WINDOW, Guard
from shoal.train.preempt import StopSignals
from shoal.train.step import StepResult, split_micro, train_step
from shoal.train.task import Task, task_for

Window = list[tuple[float, StepResult, float]]
"""Steps run since the numbers were last read from the device: (learning rate, result, seconds
spent getting the step's batch) each."""


class Trainer:
    """One rank's model, optimizer, data and run folder, for the run's task (shoal.train.task)."""

    def __init__(self, job: Job, device: torch.device) -> None:
        cfg = job.config
        self.prediction = job.prediction
        assert cfg.model_config is not None, "the CLI resolves the model before launching"
        self.task: Task = job.task if job.task is not None else task_for(cfg.model_config)
        self.task.prepare()
        self.cfg, self.loop, self.model_cfg, self.device = cfg, cfg.loop, cfg.model_config, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.run_dir = Path(broadcast_from_rank0(job.run_dir or default_run_dir()))
        self.plan, self.plan_notes = resolve_plan(cfg, self.model_cfg, self.world, device)
        set_matmul_precision(device, tf32=cfg.tf32)

        self.start, self.restart = 0, restart_count()
        path = checkpoint_to_continue(self.run_dir, restart=self.restart, resume=job.resume,
                                      resume_from=job.resume_from, rank=self.rank)
        self.lora_base = broadcast_from_rank0(lora_base(cfg, self.loop.seed) if self.rank == 0 else None)
        if path is not None and self.lora_base is not None:
            check_same_base(path, self.lora_base)
        weights = pretrained_weights(cfg, self.model_cfg, path)
        self.runtime = build_runtime(self.model_cfg, self.plan, device, seed=self.loop.seed, weights=weights,
                                     lora=cfg.lora, adapters=self._peft_adapters(path))
        dtype = next(self.runtime.parameters()).dtype
        self.init_note = weights.describe(dtype) if weights is not None else None
        self.part = self.runtime.data_rank
        self.local_batch = self.loop.global_batch // self.part[1]
        self.num_micro = rules.micro_batches(self.plan, local_batch=self.local_batch, micro_batch=self.loop.micro_batch)
        batch = self.loop.global_batch  # the batch scaling rule of --lr-scaling, if any
        self.optimizer = build_optimizer(self.runtime, cfg.optim, global_batch=batch)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.loop.steps, global_batch=batch)

        data = self.task.load_data(cfg, self.model_cfg)
        self.batches, self.held_out, self.held_out_sources = data.train, data.held_out, data.held_out_sources
        self.fetch_s = 0.0  # the last step's time getting its batch (host, before the device sees it)
        self.num_train, self.num_held_out = data.num_train, data.num_held_out
        self.loss_fn: LossFn | None = self.task.loss_fn()
        """The loss of a micro-batch (Runtime.forward_backward); None: cross-entropy on the targets."""

        self.stopped_by: str | None = None
        self.guard = Guard(mode=self.loop.on_nonfinite, max_bad_steps=self.loop.max_bad_steps)
        self.nonfinite: str | None = None
        """Why the run stopped on a non-finite step, in one line (shoal.train.nonfinite); None: it did not."""
        if path is not None:
            self.start = restore(path, self.runtime, self.optimizer, self.scheduler)
        self.task.attach(self)

    # ------------------------------------------------------------------ the run
    def run(self, signals: StopSignals | None = None) -> dict[str, Any] | None:
        """Train to the last step, or until a signal (SIGTERM, SIGINT) asks every rank to stop:
        then after the current step, with a checkpoint. Collective failures are diagnosed."""
        watchdog = Watchdog(timeout_s=self.loop.hang_timeout) if self.world > 1 else None
        try:
            return self._run(signals, watchdog)
        except RuntimeError as exc:
            if watchdog is None or not _collective_failure(exc):
                raise
            raise watchdog.diagnose(exc, time.monotonic() - watchdog.since) from None
        finally:
            if watchdog is not None:
                watchdog.close()

    def _run(self, signals: StopSignals | None, watchdog: Watchdog | None) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        lead = self.rank == 0
        writer = self._open_run_folder() if lead else None
        peak = peak_flops(self.device, self.world) if lead else (1.0, "")
        bar = self._progress_bar() if lead else None
        window: Window = []
        t_window = time.perf_counter()
        memory.reset_peak()
        mark = watchdog.at if watchdog is not None else (lambda phase, step: None)
        if watchdog is not None:
            watchdog.started(self.start)
            watchdog.in_step, watchdog.detail = self.runtime.step_words, self.runtime.where
            self.runtime.on_progress(watchdog.poke)
        n = self.start
        for s in range(self.start, self.loop.steps):
            faults.at_step(s)
            mark("step", s)
            self.runtime.record_timeline(s == self.loop.steps - 1)  # pp: the last step's bubble and chart
            lr = self.optimizer.param_groups[0]["lr"]
            window.append((lr, self.train_one(s), self.fetch_s))
            if bar is not None:
                for source, epoch in getattr(self.batches, "new_epochs", lambda *_: [])(s, self.loop.global_batch):
                    bar.write(f"step {s + 1}: source {source} starts epoch {epoch} (a new order of its sequences)")
            n = s + 1
            eval_due = _due(n, self.loop.eval_every, self.loop.steps) and self.held_out is not None
            ckpt_due = _due(n, self.loop.ckpt_every, self.loop.steps) and (n < self.loop.steps or self.loop.final_ckpt)
            self.stopped_by = signals.agreed() if signals is not None else None  # every rank, the same step
            ckpt_due = ckpt_due or self.stopped_by is not None
            if not (eval_due or ckpt_due or _due(n, self.loop.log_every, self.loop.steps)):
                continue  # the host runs ahead; nothing waits for the device
            records = self._read(window, first_step=n - len(window) + 1, seconds=time.perf_counter() - t_window)
            if watchdog is not None:
                watchdog.step_took(records[-1]["step_time_s"])
            if self.restart and records[0]["step"] == self.start + 1:
                records[0]["restart"] = self.restart  # metrics.jsonl shows where a restarted run took over
            window = []
            stop = self.guard.check(records)  # every rank: the figures are global
            if stop is not None:
                self.nonfinite = self._stop_line(stop)
                if writer is not None and bar is not None:
                    _log(writer, bar, records, False, self.task)
                break  # no evaluation, no checkpoint of this state
            if eval_due:
                mark("evaluation", n)
                records[-1].update(self.task.evaluate(self))
                if self.held_out_sources:
                    records[-1]["eval_loss_by_source"] = {name: self.evaluate(batches)
                                                          for name, batches in self.held_out_sources.items()}
            if writer is not None and bar is not None:
                _log(writer, bar, records, eval_due, self.task)
            if ckpt_due:
                mark("checkpoint write", n)
                if not self._checkpoint(n, writer, bar):
                    break
            t_window = time.perf_counter()  # evaluation and checkpoints are not step time
            memory.reset_peak()
            if self.stopped_by:
                break
        return self._finish(writer, bar, peak=peak, seconds=time.perf_counter() - t0, last=n)

    def _progress_bar(self) -> Any:
        """Rank 0's progress bar on stderr (tqdm)."""
        from tqdm import tqdm

        return tqdm(total=self.loop.steps, initial=self.start, desc="train", unit="step", file=sys.stderr,
                    dynamic_ncols=True,
                    mininterval=0.5 if sys.stderr.isatty() else 15.0)  # a log file: a line every 15 s

    def _checkpoint(self, n: int, writer: MetricsWriter | None, bar: Any) -> bool:
        """Save the checkpoint after step `n` (collective); rank 0 prunes old ones and redraws the plot.
        Refused (False, the run stops) when a weight is not finite: an update whose loss and gradient
        were finite can still overflow the weights, and no checkpoint (nor `latest`) may hold that."""
        if not self._weights_finite():
            self.nonfinite = self._stop_line(f"after step {n}: a weight went non-finite (an update overflowed it)")
            return False
        extra = self._trainer_state(n) | ({"stopped_by": self.stopped_by} if self.stopped_by else {})
        path = save_checkpoint(self.run_dir, n, runtime=self.runtime, optimizer=self.optimizer, extra=extra)
        if writer is not None and bar is not None:
            if self.loop.keep:
                prune(self.run_dir, self.loop.keep)
            writer.plot()
            bar.write(f"step {n}: checkpoint {path}")
        return True

    def _weights_finite(self) -> bool:
        """Every rank's weights finite: one flag all-reduced over the world (a checkpoint step syncs anyway)."""
        flags = [torch.isfinite(local_tensor(p).detach()).all() for p in self.runtime.parameters()]
        ok = torch.stack(flags).all().to(self.device, torch.int32) if flags else torch.ones((), dtype=torch.int32,
                                                                                              device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    def _stop_line(self, what: str) -> str:
        """The one line a run stopped on a non-finite state ends with: what, the newest checkpoint, the command."""
        newest = latest_checkpoint(self.run_dir)
        lr = self.cfg.optim.lr
        if newest is None:
            return (f"{what}; no checkpoint of it (--on-nonfinite {self.loop.on_nonfinite}), none written before it; "
                    f"start again with a lower lr, e.g. --lr {lr / 10:g}")
        return (f"{what}; no checkpoint of it (--on-nonfinite {self.loop.on_nonfinite}); newest checkpoint {newest}; "
                f"continue with a lower lr: shoal {self.task.command} --resume {self.run_dir} --lr {lr / 10:g}")

    def _finish(self, writer: MetricsWriter | None, bar: Any, *, peak: tuple[float, str], seconds: float,
                last: int) -> dict[str, Any] | None:
        """After the last step: the pipeline's measured bubble (collective over the stages), then on
        rank 0 the summary, printed and written to the run folder."""
        last_timed = (self.plan.pp > 1 and self.stopped_by is None and self.nonfinite is None
                      and self.start < self.loop.steps)
        chart = self.run_dir / "pipeline.png" if self.rank == 0 else None
        figures = self.runtime.pipeline_summary(chart) if last_timed else None
        if writer is None or bar is None:
            return None
        bar.close()
        writer.plot()
        writer.close()
        flops = self.task.flops_per_sample(self.model_cfg, self.loop)
        summary = summarize(writer.records, flops_per_sample=flops, peak=peak, wall_s=seconds,
                            warmup=self.loop.log_every, start=self.start, total=self.loop.steps,
                            rate_key=self.task.rate_key, final=self.task.eval_metrics)
        summary.update(run_dir=str(self.run_dir), plan=str(self.plan), device=self.device.type,
                       world_size=self.world, precision=_precision_words(self.plan))
        summary["skipped_steps"] = sum(1 for r in writer.records if r.get("skipped"))
        summary.update(self.guard.summary())
        predicted = memory_prediction(self)  # beside mem_peak_mb: every run is a data point on the model's error
        if predicted is not None:
            summary.update(mem_predicted_mb=round(predicted["total"], 1),
                           mem_predicted_terms_mb={k: round(v, 1) for k, v in predicted.items() if k != "total"})
        if self.prediction is not None and summary.get("tokens_per_s"):
            measured = self.loop.global_batch * self.loop.seq_len / summary["tokens_per_s"]
            summary.update(predicted=self.prediction, step_time_s=measured,
                           measured_over_predicted_step_time=measured / self.prediction["step_time_s"])
        if figures is not None:
            summary.update(figures)
            print(f"pipeline ({self.plan.sched}, {self.plan.micro_batches} micro-batches): measured bubble "
                  f"{figures['pipeline_bubble']:.1%} of the last step (formula (p-1)/(v*m+p-1) = "
                  f"{figures['pipeline_bubble_formula']:.1%}); chart {chart}", flush=True)
        write_summary(self.run_dir, summary)
        print(format_summary(summary) + f"\n  run folder {self.run_dir}", flush=True)
        if self.stopped_by:
            print(f"shoal: stopped by {self.stopped_by} after step {last}, with its checkpoint; "
                  f"continue with: shoal {self.task.command} --resume {self.run_dir}", flush=True)
        return summary

    def train_one(self, s: int) -> StepResult:
        """Optimizer step `s` (0-based). Queues the work without waiting for the device."""
        _seed_step(self.loop.seed, s, self.part[0], self.device)  # dropout masks: resumable, per data rank
        started = time.perf_counter()
        inputs, targets = self.batches.batch(s, self.loop.global_batch, self.part)
        self.fetch_s = time.perf_counter() - started
        inputs, targets = self._to_device(inputs), self._to_device(targets)
        micro = split_micro(inputs, self.task.step_targets(self, inputs, targets), self.num_micro)
        return train_step(self.runtime, self.optimizer, micro, grad_clip=self.cfg.optim.grad_clip or None,
                          scheduler=self.scheduler, loss_fn=self.loss_fn)

    def _read(self, window: Window, *, first_step: int, seconds: float) -> list[dict[str, Any]]:
        """The metrics records of a window of steps, read from the device in one synchronisation;
        the window's time is shared equally among its steps, its peak memory is the highest rank's."""
        values = torch.stack([torch.stack((r.loss.to(self.device).float(), r.grad_norm.to(self.device).float(),
                                           r.applied.to(self.device).float(), r.overflow.to(self.device).float()))
                              for _, r, _ in window]).tolist()
        mem = torch.tensor([memory.peak_mb()], device=self.device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        step_time = seconds / len(window)
        rate = {self.task.rate_key: self.task.samples_per_step(self.loop) / step_time}
        records = [{"step": first_step + i, "loss": loss, "lr": lr, **rate, "step_time_s": step_time,
                    "data_time_s": fetch, "mem_peak_mb": float(mem.item()),
                    "grad_norm": norm, "_applied": applied > 0, "_overflow": overflow > 0}  # Guard.check reads these
                   for i, ((lr, _, fetch), (loss, norm, applied, overflow)) in enumerate(zip(window, values))]
        # the last step's trust ratios (LAMB, LARS) or update RMS (Muon), over every rank's tensors: collective
        records[-1].update(trust_summary(gather_trust(self.optimizer, self.runtime.named_parameters()),
                                          getattr(self.optimizer, "stat_name", "trust")))
        if window[0][1].moe:  # MoE load figures (this rank's), read in one synchronisation
            flat = torch.cat([v for _, r, _ in window for v in r.moe.values()]).tolist()
            for record, (_, r, _) in zip(records, window):
                stats = {}
                for name, v in r.moe.items():
                    stats[name], flat = flat[:v.numel()], flat[v.numel():]
                record.update(moe_records(stats))
        return records

    def _to_device(self, tokens: torch.Tensor) -> torch.Tensor:
        """Host to device; on GPUs from pinned memory without blocking the host."""
        if self.device.type == "cuda":
            return tokens.pin_memory().to(self.device, non_blocking=True)
        return tokens

    @torch.no_grad()
    def evaluate(self, held_out: Any) -> float:
        """Mean loss per target over `eval_batches` global batches of held-out data (the same ones each time):
        each batch's mean weighted by its count of targets, which fine-tuning's masks make uneven (a mean of the
        batches' means let a batch of a few targets weigh as much as a full one, and one of none add a 0)."""
        from shoal.runtime import num_targets

        self.runtime.eval()
        total = torch.zeros(2, device=self.device)  # sum of (batch mean x its count), sum of counts
        for i in range(self.loop.eval_batches):
            inputs, targets = held_out.batch(i, self.loop.global_batch, self.part)
            micro = split_micro(inputs.to(self.device), targets.to(self.device), self.num_micro)
            loss = self.runtime.eval_loss(micro)
            count = num_targets(targets).to(self.device, torch.float32)  # this rank's part of the batch
            # averaged over the data ranks: the batch's mean loss, and a count proportional to the batch's
            mean_loss, mean_count = self.runtime.global_mean(torch.stack([loss.float(), count]))
            total += torch.stack([mean_loss * mean_count, mean_count])
        self.runtime.train()
        weighted, counted = total.tolist()
        return weighted / counted if counted > 0 else float("nan")

    # ------------------------------------------------------------------ the run folder
    def _open_run_folder(self) -> MetricsWriter:
        """Rank 0: create the folder, write the resolved config, say what will happen."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_run_config(self.run_dir, self.cfg)
        print(self._describe(), flush=True)
        return MetricsWriter(self.run_dir, start_step=self.start, sample=self.task.sample)

    def _describe(self) -> str:
        loop = self.loop
        lines = [
            *self.task.describe(self),
            self.runtime.describe(),
            *([f"  host memory allocator: {host_memory.describe()}"] if self.device.type == "cpu" else []),
            *self._pooling_note(),
            *([self.init_note] if self.init_note else []),
            *(f"  default {note}" for note in self.plan_notes),
            f"run folder: {self.run_dir}"
            + (f" (resuming at step {self.start} of {loop.steps})" if self.start else f" ({loop.steps} steps)")
            + (f"; restart {self.restart} after a failure" if self.restart else ""),
            *self.task.notes(self),
        ]
        return "\n".join(lines)

    def _pooling_note(self) -> list[str]:
        """A load-balancing loss pooled over a forward's tokens (transformers' Mixtral, Qwen2-MoE) pools each of
        the pipeline's micro-batches: the curve is one process's with that micro-batch, which the user is told."""
        mb = self.plan.micro_batches if self.plan.pp > 1 else 1
        if not getattr(self.model_cfg, "aux_loss_pooled", False) or mb <= 1:
            return []
        return [f"  note: the load-balancing loss pools each of the pipeline's {mb} micro-batches, as transformers' "
                f"Trainer does with accumulation: the loss is one process's with --micro-batch "
                f"{self.local_batch // mb}, not with the whole batch pooled (mb=1 pools it whole)"]

    def _peft_adapters(self, checkpoint: Path | None) -> dict[str, torch.Tensor] | None:
        """A new run's adapters from the peft folder it starts from (`--init` of one), full, by shoal name."""
        if self.cfg.lora_init is None or checkpoint is not None or not isinstance(self.model_cfg, ModelConfig):
            return None
        from shoal.train.peft_io import read_peft_adapters

        return read_peft_adapters(self.cfg.lora_init, self.model_cfg)

    def _trainer_state(self, step: int) -> dict[str, Any]:
        state = {"step": step, "scheduler": self.scheduler.state_dict(), "plan": str(self.plan),
                 "world_size": self.world, "config": to_flat(self.cfg)}
        scaler = self.runtime.loss_scaler  # fp16: same scale on every rank
        if scaler is not None:
            state["loss_scaler"] = scaler.state_dict()
        if self.lora_base is not None:  # the checkpoint holds the adapters; the frozen base is this
            state["lora_base"] = self.lora_base
        return state


def _collective_failure(exc: RuntimeError) -> bool:
    """A collective that timed out or lost a peer (gloo's and NCCL's errors), not shoal's own."""
    text = str(exc)
    return isinstance(exc, dist.DistBackendError) or any(
        marker in text for marker in ("gloo", "Timed out", "Connection closed", "Connection reset", "NCCL"))


def _due(n: int, every: int, last: int) -> bool:
    return n == last or (every > 0 and n % every == 0)


def _seed_step(seed: int, step: int, index: int, device: torch.device) -> None:
    """Seed the generators a step draws from (the CPU's, and on a GPU this rank's device's) by (seed, step, data
    rank). Those two alone: torch.manual_seed also seeds every other device type, queueing each with a captured
    stack trace, which costs a small model's step a share of its host time."""
    value = int(np.random.SeedSequence([seed, step, index]).generate_state(1)[0])
    torch.default_generator.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.manual_seed(value)  # the current device: this rank's (shoal.train.worker.init_distributed)


def _precision_words(plan: Plan) -> str:
    if plan.precision == "fp32":
        return "fp32"
    if plan.data_ranks == 1 and plan.cp == 1:  # one data rank: no gradient is reduced
        return f"{plan.precision} compute, fp32 master weights"
    return f"{plan.precision} compute, fp32 master weights, gradients reduced in {plan.reduce}"


def _log(writer: MetricsWriter, bar: Any, records: list[dict[str, Any]], eval_due: bool, task: Task) -> None:
    """Rank 0: the records into metrics.jsonl, the latest on the progress bar."""
    for record in records:
        writer.log(record)
    last = records[-1]
    bar.set_postfix(loss=f"{last['loss']:.3f}", **{task.rate_label: f"{last[task.rate_key]:,.0f}"}, refresh=False)
    bar.update(len(records))
    overflows = [r["step"] for r in records if r.get("loss_scale_overflow")]
    if overflows:
        bar.write(f"step{'s' if len(overflows) > 1 else ''} {', '.join(map(str, overflows))}: skipped, the fp16 "
                  "gradients overflowed (the loss scale halves at each; a few in the first steps are usual)")
    for r in records:
        if r.get("skipped") and not r.get("loss_scale_overflow"):
            bar.write(f"step {r['step']}: skipped, non-finite (loss {r['loss']}, gradient norm {r['grad_norm']}); "
                      "no weight or optimizer state changed")
        if r.get("loss_spike"):
            bar.write(f"shoal: warning: step {r['step']}: loss spike, {r['loss']:.4g} above "
                      f"{r['loss_spike_threshold']:.4g} (median + {SPIKE_K:g} x MAD of the last {SPIKE_WINDOW} steps); "
                      "a NaN may follow")
    if eval_due:
        bar.write(f"step {last['step']}: {task.eval_words(last)}")
