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
    it needs, what there is and the plans that fit (or, when none does, `no_fit`'s reason); None
    when it fits."""
    need = estimate(plan, work, cluster, micro_batch=micro_batch)
    if need.fits:
        return None
    have = cluster.device.memory_bytes
    if cluster.device_type == "cpu":
        what = (f"plan {need.plan_text} needs about {_gb(_per_process(need, cluster))} GB per process (Python and "
                f"torch included); this machine has {_gb(have * cluster.per_node)} GB free for {cluster.per_node}")
    else:
        what = (f"plan {need.plan_text} needs about {_gb(need.mem_per_device_bytes)} GB per device; this machine's "
                f"GPUs have {_gb(have)} GB")
    fits = list(dict.fromkeys(e.plan_text for e in search(work, cluster).plans))[:top]  # fastest first, each once
    return f"{what}; plans that fit: {', '.join(fits)}" if fits else f"{what}; {no_fit(work, cluster)}"


def no_fit(work: Workload, cluster: Cluster, *, said: bool = False) -> str:
    """Why no plan fits `cluster`, in words: the least any plan needs here, and how many devices of this kind would
    hold the model (or what stops every count: the blocks FSDP gathers whole outgrowing one device). `said`: the
    caller's line already says that no plan fits."""
    unit, units = ("process", "processes") if cluster.device_type == "cpu" else ("device", "devices")
    least = smallest_need(work, cluster)
    need = f"{least.plan_text}, about {_gb(_per_process(least, cluster))} GB per {unit}" if least is not None else ""
    none_runs = f"no plan runs on {cluster.world_size}"
    if work.global_batch < cluster.world_size:  # the data and pipeline axes want a sequence per rank and stage
        none_runs += (f" {units} at a global batch of {work.global_batch} sequences (a larger global batch gives "
                      "the data and pipeline axes work)")
    if said:
        here = f"the least any plan needs: {need}" if need else none_runs
    else:
        here = f"no plan fits (the least: {need})" if need else none_runs
    count, last = devices_needed(work, cluster)
    size = _gb(cluster.device.memory_bytes)
    if count is not None:
        return f"{here}; about {count} {units} of {size} GB would hold it (fsdp, full recompute, one sequence each)"
    why = (f": the blocks FSDP gathers whole need about {_gb(last.memory['transient'])} GB alone at tp{last.plan.tp}"
           if last is not None else "")
    return f"{here}; no count of {units} of {size} GB would hold it{why}"


def _per_process(e: Estimate, cluster: Cluster) -> float:
    """An estimate's need per device, with the interpreter's baseline on CPUs (what the check compares)."""
    return e.mem_per_device_bytes + (CPU_PROCESS_BYTES if cluster.device_type == "cpu" else 0.0)


def smallest_need(work: Workload, cluster: Cluster) -> Estimate | None:
    """The plan the rules accept with the least memory per device on `cluster` (full recompute)."""
    best: Estimate | None = None
    for skeleton in structures(work, cluster):
        for plan, micro in variants(skeleton, work):
            candidate = dataclasses.replace(plan, ac="full")
            facts = rules.RunFacts(world_size=cluster.world_size, device=cluster.device_type, model=work.model,
                                global_batch=work.global_batch, seq_len=work.seq_len, micro_batch=micro)
            if rules.refusal(candidate, facts) is not None:
                continue
            e = estimate(candidate, work, cluster, micro_batch=micro)
            if best is None or e.mem_per_device_bytes < best.mem_per_device_bytes:
                best = e
    return best


def devices_needed(work: Workload, cluster: Cluster, *, limit: int = 65536) -> tuple[int | None, Estimate | None]:
    """The fewest devices like `cluster`'s on which the model fits sharded over data (and tensor
    parallel within a node, up to 8), with full recompute and one sequence per data rank, with that
    plan's estimate; (None, the last plan tried at the most tensor parallelism) beyond `limit`. The
    counts tried: powers of two within one node, then whole nodes (their count doubling), so that a
    node of 3 or 6 devices is priced as it is."""
    n, last = 1, None
    while n <= limit:
        per_node = min(n, cluster.per_node)
        bigger = dataclasses.replace(cluster, num_nodes=n // per_node, per_node=per_node)
        for tp in (t for t in (1, 2, 4, 8) if t <= per_node and n % t == 0):
            batch = n // tp
            facts = rules.RunFacts(world_size=n, device=cluster.device_type, model=work.model, global_batch=batch,
                                seq_len=work.seq_len)
            plan = rules.fill(Plan(fsdp=batch, tp=tp, ac="full"), facts)
            if rules.refusal(plan, facts) is None:
                last = estimate(plan, dataclasses.replace(work, global_batch=batch), bigger)
                if last.fits:
                    return n, last
        n = cluster.per_node if n < cluster.per_node < 2 * n else 2 * n  # from a power of two to one whole node
    return None, last


def _gb(nbytes: float) -> str:
    gb = nbytes / GB
    return f"{gb:,.0f}" if gb >= 100 else f"{gb:.3g}"
