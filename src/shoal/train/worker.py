"""The workers of a run: `run_job(job)` starts them (or runs this torchrun rank), and `run_worker(job)`, the
entry point of every worker process, joins the process group, trains, and leaves it.

`run_worker(job)` runs in each worker, whether `shoal train --nproc N` started it through
torch's elastic launcher or `torchrun` did. It always joins a process group (gloo on CPU, NCCL
on GPUs), even alone, so that one code path serves every world size; the training itself is
`shoal.train.loop.Trainer`'s.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from shoal.infra import host_memory
from shoal.infra.launch import default_nproc, launch, under_torchrun
from shoal.infra.world import first_error, threads_per_rank, use_threads
from shoal.train import memory
from shoal.train.build import restart_count
from shoal.train.config import RunConfig
from shoal.train.dry_run import dry_run
from shoal.train.job import Job
from shoal.train.loop import Trainer
from shoal.train.preempt import StopSignals


def run_job(job: Job) -> dict[str, Any]:
    """Run `job` on its workers and return rank 0's result: its summary, {"error": message} for a mistake the
    workers found, "nonfinite" set (one line) when a non-finite step stopped it, "stopped" set after a signal
    stopped it with a checkpoint. Under torchrun this process is one rank; otherwise it starts `world_size`
    local worker processes (shoal.infra.launch, which raises WorkerFailed when one fails and Stopped when a
    second signal killed them)."""
    if under_torchrun():
        return run_worker(job) or {}
    with host_memory.for_workers(job.device):
        results = launch(run_worker, job, nproc=world_size(job.config, job.device),
                         max_restarts=job.config.max_restarts)
    return results.get(0) or {}


def world_size(cfg: RunConfig, device: str) -> int:
    """The run's number of processes: torchrun's world, --nproc, or one per GPU (2 on CPU)."""
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return cfg.nproc if cfg.nproc is not None else default_nproc(device)


def run_worker(job: Job) -> dict[str, Any] | None:
    """Train `job` on this rank. Returns rank 0's summary (None on other ranks), or
    {"error": message} on every rank when the job fails for a reason the user can fix."""
    signals = StopSignals()  # before anything slow: a signal during start-up stops after the first step
    device = init_distributed(job.device)
    if device.type == "cpu":
        host_memory.return_large_blocks()  # where jemalloc keeps freed pages (shoal.infra.host_memory)
    baseline_mb = memory.current_mb()  # the interpreter, torch and the process group: no model yet
    if dist.get_rank() != 0:  # the ranks' warnings repeat rank 0's: print them once, from rank 0
        warnings.simplefilter("ignore")
    done = False
    try:
        result = _train(job, device, signals, baseline_mb)
        done = True
        return result
    finally:
        signals.restore()
        # After an exception the process group is left open: closing it would tell the peers
        # "connection closed" before this rank's error reaches the launcher, which could then
        # name a peer; the sockets close when the process exits.
        if done:
            dist.destroy_process_group()


def _train(job: Job, device: torch.device, signals: StopSignals, baseline_mb: float) -> dict[str, Any] | None:
    trainer: Trainer | None = None
    error = None
    try:
        trainer = Trainer(job, device)
    except ValueError as exc:  # a user's mistake found only here (a corrupt checkpoint, ...)
        error = str(exc)
    error = first_error(error)
    if error is not None:
        return {"error": error}
    assert trainer is not None
    if job.config.dry_run:
        return dry_run(trainer, baseline_mb=baseline_mb)
    summary = trainer.run(signals)
    if trainer.nonfinite:
        return {**(summary or {}), "nonfinite": trainer.nonfinite}
    if trainer.stopped_by:
        return {**(summary or {}), "stopped": trainer.stopped_by}
    return summary


def init_distributed(device: str) -> torch.device:
    """Join the process group the launcher described in the environment, on "cpu" (gloo) or
    "cuda" (this local rank's GPU, NCCL); share the machine's cores among its ranks."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if device == "cuda":
        where = torch.device("cuda", local_rank)
        torch.cuda.set_device(where)
        # A gloo backend beside NCCL for CPU tensors: under offload=on the gradient shards live in
        # host memory, and the global gradient norm is all-reduced where they are.
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=where, **_attempt_store())
    else:
        where = torch.device("cpu")
        dist.init_process_group("gloo", **_attempt_store())
    return where


def _attempt_store() -> dict[str, Any]:
    """Under torch's elastic agent, a store of this attempt's own. The workers of every restart
    connect to the same agent store, and torch's env:// rendezvous adds no per-attempt prefix
    there: a restarted rank could read an address the previous attempt's dead peer published and
    fail with "Connection refused". Elsewhere: torch's default."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    return {"store": dist.PrefixStore(f"shoal/attempt_{restart_count()}/", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
