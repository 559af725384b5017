"""The search: every valid plan for a model on a cluster, pruned on memory, ranked by predicted step time.

Structures (the degrees of tp, cp, pp, ep and the split of the data ranks into dp x fsdp) are
enumerated from the divisors of the world size; for each, the options that trade time for memory
are tried cheapest first, and the first that fits is kept: activation recompute none, then
selective, then full (recompute only ever adds time). GPipe is left out: it takes 1F1B's time
with more memory. Micro-batch counts are pp times a power of two (and the whole local batch);
ZeRO stages, schedules and gradient-accumulation passes are all kept, since none is always
faster. Every plan kept has passed shoal.rules, the same check `shoal train`, `shoal plan --plan`
and parallelize run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from shoal import rules
from shoal.plan import Plan
from shoal.planner.comm import Network
from shoal.planner.estimate import Estimate, Workload, estimate
from shoal.planner.hardware import Cluster

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """Ranked plans that fit, best first, and how many candidates were priced."""

    plans: list[Estimate]
    priced: int
    rejected_memory: int


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_degrees(cluster: Cluster) -> list[int]:
    """Tensor-parallel degrees kept inside one node: its collectives every block need the fastest
    links (Narayanan et al. 2021, 3.3). Which degrees divide the model is the rules' question."""
    return [t for t in divisors(cluster.world_size) if t <= cluster.per_node]


def _facts(work: Workload, cluster: Cluster, micro_batch: int | None = None) -> rules.RunFacts:
    return rules.RunFacts(world_size=cluster.world_size, device=cluster.device_type, model=work.model,
                       global_batch=work.global_batch, seq_len=work.seq_len, micro_batch=micro_batch)


def structures(work: Workload, cluster: Cluster) -> Iterator[Plan]:
    """Every resolved plan skeleton (degrees, options at their defaults) the rules accept. A
    skeleton the rules refuse is refused for its degrees, so none of its variants could run."""
    cfg, world = work.model, cluster.world_size
    for tp in _tp_degrees(cluster):
        for cp in divisors(world // tp):
            for pp in divisors(world // (tp * cp)):
                data = world // (tp * cp * pp)
                for fsdp in divisors(data):
                    for ep in (divisors(data) if cfg.num_experts else [1]):
                        skeleton = Plan(dp=data // fsdp, fsdp=fsdp, tp=tp, cp=cp, pp=pp, ep=ep)
                        try:
                            yield rules.resolve_noting(skeleton, _facts(work, cluster))[0]
                        except ValueError:
                            continue


def variants(skeleton: Plan, work: Workload) -> Iterator[tuple[Plan, int | None]]:
    """(plan, micro-batch size) for each schedule, micro-batch count, ZeRO stage and accumulation
    worth pricing (the rules then refuse those that cannot run)."""
    local = work.global_batch // skeleton.data_ranks
    zeros = (1, 2, 3) if skeleton.fsdp > 1 else (skeleton.zero,)
    for zero in zeros:
        base = dataclasses.replace(skeleton, zero=zero)
        if skeleton.pp == 1:
            for b in divisors(local):
                if b == local or b & (b - 1) == 0:  # powers of two, and no accumulation
                    yield base, b
            continue
        for mb in divisors(local):
            per_stage = mb // skeleton.pp
            if mb < skeleton.pp or (mb != local and (mb % skeleton.pp or per_stage & (per_stage - 1))):
                continue
            for sched, vpp in (("1f1b", 1), ("zb", 1), ("interleaved", 2)):
                yield dataclasses.replace(base, mb=mb, sched=sched, vpp=vpp), None


def search(work: Workload, cluster: Cluster, *, network: Network | None = None,
           top: int | None = None) -> SearchResult:
    """Every valid plan that fits in memory, ranked by predicted step time (fastest first)."""
    kept: list[Estimate] = []
    priced = rejected = 0
    for skeleton in structures(work, cluster):
        for plan, micro in variants(skeleton, work):
            facts = _facts(work, cluster, micro)
            plan = dataclasses.replace(plan, vocab=rules.default_vocab(plan, facts))  # as `--plan` text resolves it
            for ac in RECOMPUTE:
                candidate = dataclasses.replace(plan, ac=ac)
                if rules.refusal(candidate, facts) is not None:
                    break
                priced += 1
                result = estimate(candidate, work, cluster, micro_batch=micro, network=network)
                if result.fits:
                    kept.append(result)
                    break
                rejected += 1
    kept.sort(key=lambda e: (e.step_time_s, e.mem_per_device_bytes))
    return SearchResult(plans=kept[:top] if top else kept, priced=priced, rejected_memory=rejected)
