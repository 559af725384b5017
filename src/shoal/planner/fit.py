"""Will a run fit in this machine's memory? The check `shoal train` makes before any worker starts.

The planner's memory model (shoal.planner.estimate) prices the resolved plan on the machine the
run will have: each GPU's own memory, or on CPUs the host's memory shared by the local
processes. Memory needs no calibration profile (it is arithmetic on the model, the plan and the
batch), so the check costs well under a second, and what it suggests comes from the same
search `shoal plan` runs. Pure: no torch.
"""

from __future__ import annotations

import dataclasses

from shoal import rules
from shoal.plan import Plan
from shoal.planner.estimate import CPU_PROCESS_BYTES, Estimate, Workload, estimate
from shoal.planner.hardware import DEVICES, Cluster, available_memory_bytes, host_memory_bytes
from shoal.planner.search import search, structures, variants

GB = 1e9


def cpu_cluster(world_size: int, *, local: int, memory_bytes: int | None = None) -> Cluster:
    """`world_size` CPU processes, `local` to a machine, sharing its memory (`memory_bytes`: the
    machine's; default what this one has free now, which other jobs on it may have taken)."""
    local = max(1, min(local, world_size))
    base = DEVICES["cpu"]
    free = memory_bytes or min(host_memory_bytes(), available_memory_bytes())
    device = dataclasses.replace(base, memory_bytes=free // local, per_node=local)
    return Cluster(device=device, num_nodes=max(1, world_size // local), per_node=local, intra=base.intra,
                   inter=base.inter)


def memory_refusal(plan: Plan, work: Workload, cluster: Cluster, *, micro_batch: int | None = None,
                   top: int = 3) -> str | None:
    """One line when the (resolved) plan is predicted not to fit `cluster`'s devices, naming what
    it needs, what there is and the plans that fit (or, when none does, the smallest need and how
    many devices of this kind would hold the model); None when it fits."""
    need = estimate(plan, work, cluster, micro_batch=micro_batch)
    if need.fits:
        return None
    have = cluster.device.memory_bytes
    cpu = cluster.device_type == "cpu"
    text = need.plan_text
    if cpu:
        local = cluster.per_node
        each = need.mem_per_device_bytes + CPU_PROCESS_BYTES
        what = (f"plan {text} needs about {_gb(each)} GB per process (Python and torch included), "
                f"{_gb(each * local)} GB for its {local} process(es) on this machine; "
                f"this machine has {_gb(have * local)} GB free")
    else:
        what = (f"plan {text} needs about {_gb(need.mem_per_device_bytes)} GB per device; this machine's GPUs "
                f"have {_gb(have)} GB")
    fits = list(dict.fromkeys(e.plan_text for e in search(work, cluster).plans))[:top]  # fastest first, each once
    if fits:
        return f"{what}; plans that fit: {', '.join(fits)}"
    least = smallest_need(work, cluster)
    count = devices_needed(work, cluster)
    least_text = f"the smallest need on {cluster.world_size} is about {_gb(least.mem_per_device_bytes)} GB per " \
                 f"{'process' if cpu else 'device'} ({least.plan_text})" if least is not None else \
                 f"no plan runs on {cluster.world_size}"
    more = (f"about {count} {'processes' if cpu else 'devices'} of {_gb(have)} GB each would hold it (sharded, "
            "full recompute, one sequence per data rank)") if count else \
        f"no count of devices of {_gb(have)} GB up to 65,536 would hold it"
    return f"{what}; no plan fits: {least_text}; {more}"


def smallest_need(work: Workload, cluster: Cluster) -> Estimate | None:
    """The plan the rules accept with the least memory per device on `cluster` (full recompute)."""
    best: Estimate | None = None
    for skeleton in structures(work, cluster):
        for plan, micro in variants(skeleton, work):
            candidate = dataclasses.replace(plan, ac="full")
            facts = rules.Facts(world_size=cluster.world_size, device=cluster.device_type, model=work.model,
                                global_batch=work.global_batch, seq_len=work.seq_len, micro_batch=micro)
            if rules.refusal(candidate, facts) is not None:
                continue
            e = estimate(candidate, work, cluster, micro_batch=micro)
            if best is None or e.mem_per_device_bytes < best.mem_per_device_bytes:
                best = e
    return best


def devices_needed(work: Workload, cluster: Cluster, *, limit: int = 65536) -> int | None:
    """The fewest devices like `cluster`'s (a power of two) on which the model fits sharded over
    data (and tensor parallel within a node, up to 8), with full recompute and one sequence per
    data rank; None beyond `limit`."""
    n = 1
    while n <= limit:
        per_node = min(n, cluster.per_node)
        bigger = dataclasses.replace(cluster, num_nodes=n // per_node, per_node=per_node)
        for tp in (t for t in (1, 2, 4, 8) if t <= per_node and n % t == 0):
            batch = n // tp
            facts = rules.Facts(world_size=n, device=cluster.device_type, model=work.model, global_batch=batch,
                                seq_len=work.seq_len)
            plan = rules.fill(Plan(fsdp=batch, tp=tp, ac="full"), facts)
            if rules.refusal(plan, facts) is None and \
                    estimate(plan, dataclasses.replace(work, global_batch=batch), bigger).fits:
                return n
        n *= 2
    return None


def _gb(nbytes: float) -> str:
    gb = nbytes / GB
    return f"{gb:,.0f}" if gb >= 100 else f"{gb:.3g}"
