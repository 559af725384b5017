"""`--plan auto`: the planner's search on the world `shoal train` is about to start.

On CPUs the world is priced from this machine's calibration profile (measured once, quickly, if
there is none yet); on GPUs from the data sheet of the GPU torch sees, with torchrun's nodes.
The choice and its prediction are printed at start-up and kept for the run's summary.json.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any

from shoal.models.config import ModelConfig, parameters_text
from shoal.planner.cluster_file import parse_cluster
from shoal.planner.comm import CalibratedNetwork, Network
from shoal.planner.estimate import Estimate, Workload
from shoal.planner.hardware import DEVICES, Cluster, gpu_device
from shoal.planner.search import search


@dataclass(frozen=True, kw_only=True)
class AutoChoice:
    """The plan `--plan auto` picked, with what the planner predicts for it."""

    estimate: Estimate
    priced: int
    cluster: Cluster

    @property
    def plan_text(self) -> str:
        return self.estimate.plan_text

    def prediction(self) -> dict[str, Any]:
        """What summary.json keeps beside the measurement."""
        e = self.estimate
        return {"plan": e.plan_text, "micro_batch": e.micro_batch, "step_time_s": e.step_time_s,
                "tokens_per_s": e.tokens_per_s, "mem_per_device_gb": e.mem_per_device_bytes / 1e9, "mfu": e.mfu,
                "plans_priced": self.priced, "cluster": self.cluster.describe()}

    def describe(self) -> str:
        e = self.estimate
        micro = f", micro-batch {e.micro_batch}" if e.plan.pp == 1 else ""
        return (f"plan auto: {e.plan_text}{micro}, the fastest of {self.priced} plans priced for "
                f"{self.cluster.describe()}; predicted {e.step_time_s:.4g} s per step, {e.tokens_per_s:,.0f} tokens/s, "
                f"{e.mem_per_device_bytes / 1e9:.3g} GB per device")


def choose(model: ModelConfig, *, global_batch: int, seq_len: int, world_size: int, device: str,
           optimizer: str = "adamw") -> AutoChoice:
    """The fastest plan that fits, for `world_size` processes on `device` (ValueError if none does), its memory
    priced with `optimizer`'s state. Whether any plan fits is known from memory alone, before a CPU's calibration
    (a minute) is measured for the times."""
    from shoal.planner.fit import no_fit

    work = Workload(model=model, global_batch=global_batch, seq_len=seq_len, optimizer=optimizer)
    what = (f"plan auto: no plan for {world_size} {device} process(es) fits this model's "
            f"{parameters_text(model.num_params())} parameters with global batch {global_batch} x {seq_len}")
    memory = memory_cluster(world_size, device)
    if memory is not None and not search(work, memory, top=1).plans:
        raise ValueError(f"{what}; {no_fit(work, memory, said=True)}")
    cluster, network = local_world(world_size, device)
    result = search(work, cluster, network=network, top=1)
    if not result.plans:
        raise ValueError(f"{what} ({result.priced} priced); valid: more processes, a smaller batch or sequence")
    return AutoChoice(estimate=result.plans[0], priced=result.priced, cluster=cluster)


def local_world(world_size: int, device: str) -> tuple[Cluster, Network | None]:
    """The cluster this run will have: calibrated CPU processes, or the GPUs torch sees."""
    if device == "cpu":
        from shoal.calibration.calibrate import calibrate
        from shoal.planner.profile import load_profile, local_cluster, save_profile

        profile = load_profile()
        if profile is None:
            print("plan auto: no calibration profile for this machine yet; measuring it (quick mode, about a "
                  "minute; `shoal plan --calibrate` measures it fully)", file=sys.stderr, flush=True)
            profile = calibrate(world_sizes=sorted({1, 2, world_size}), quick=True)
            save_profile(profile)
        return local_cluster(profile, world_size), CalibratedNetwork(profile, world_size)
    import torch

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return gpu_cluster(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory,
                       world_size=world_size, per_node=per_node), None


def memory_cluster(world_size: int, device: str) -> Cluster | None:
    """The machine a run of `world_size` processes on `device` will have, as far as its memory goes
    (no calibration needed): each GPU's own memory, or the host's shared by the local processes on
    CPUs. None for a GPU the planner has no spec for."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if device == "cpu":
        from shoal.planner.fit import cpu_cluster

        return cpu_cluster(world_size, local=local)
    import torch

    try:
        return gpu_cluster(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory,
                           world_size=world_size, per_node=local)
    except ValueError:
        return None


def gpu_cluster(name: str, memory_bytes: int, *, world_size: int, per_node: int) -> Cluster:
    """The cluster of `world_size` GPUs named `name` (torch's device name), `per_node` to a node,
    with the memory the device reports (a V100 may have 16 or 32 GB)."""
    spec = gpu_device(name)
    if spec is None:
        raise ValueError(f"plan auto: no spec for GPU {name!r}; valid: {', '.join(d for d in DEVICES if d != 'cpu')} "
                         "(give a --plan, or price one with shoal plan --cluster FILE.toml)")
    per_node = min(per_node, world_size)
    cluster = parse_cluster(f"{max(1, world_size // per_node)}x{per_node}x{spec.name}")
    device = dataclasses.replace(cluster.device, memory_bytes=memory_bytes)
    return dataclasses.replace(cluster, device=device)
