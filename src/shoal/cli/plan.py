"""`shoal plan`: rank the plans for a model on a cluster by predicted step time, or price one plan.

The cluster is a spec (`64xA100-80GB`, `2x8xH100`, a TOML file) or `local`: this machine, priced
from the profile `shoal plan --calibrate` measured (shoal.calibration.calibrate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from shoal import rules
from shoal.models import ModelConfig, parameters_text
from shoal.models.lora_config import LoRAConfig, adapted_params, adapter_params, check_model
from shoal.plan import Plan
from shoal.planner.cluster_file import parse_cluster
from shoal.planner.comm import CalibratedNetwork, Network
from shoal.planner.estimate import Estimate, Workload, estimate
from shoal.planner.hardware import Cluster
from shoal.planner.memory import OPTIMIZER_MOMENTS
from shoal.planner.search import search

GiB = 2**30  # the table's memory, in the unit device memory is sized in (an "80GB" H100 holds 80 GiB)


def add_parser(sub: Any) -> None:
    """The `plan` subcommand's flags."""
    plan = sub.add_parser("plan", help="predict which parallel plan is fastest, before spending GPU hours",
                          description="Rank every valid plan for a model on a cluster by predicted step time, with "
                          "tokens/s, TFLOP/s and MFU per device and memory per device; or price one --plan.")
    plan.add_argument("--model", default="tiny", help="preset or hf:<dir or config.json> [tiny]")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a model field")
    plan.add_argument("--cluster", default="local", help="NxDEVICE (8 per node), NODESxPERxDEVICE, a .toml file, "
                      "or local: this machine from its calibration profile [local]")
    plan.add_argument("--nproc", type=int, default=None, help="processes with --cluster local [2]")
    plan.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step [16]")
    plan.add_argument("--seq-len", type=int, default=128, help="tokens per sequence [128]")
    plan.add_argument("--plan", default=None, help="price this one plan instead of searching (auto: search, as "
                      "without --plan)")
    plan.add_argument("--micro-batch", type=int, default=None, help="with --plan: sequences per accumulation "
                      "pass (no pipeline) [the whole local batch]")
    plan.add_argument("--lora", default=None, metavar="SETTINGS", help="price low-rank adapters on a frozen base, "
                      "as shoal train --lora takes them (r=16,alpha=32,targets=q,k,v,o,gate,up,down): gradients and "
                      "optimizer state for the adapters only [off: every weight trains]")
    plan.add_argument("--optimizer", default="adamw", help="price this optimizer's state, as shoal train "
                      "--optimizer takes it: adamw, lamb, cowclip (two moments a parameter), lars (one), muon (one "
                      "on the hidden matrices, two on the rest) [adamw]")
    plan.add_argument("--top", type=int, default=10, help="plans to show [10]")
    plan.add_argument("--json", action="store_true", help="print a JSON list of plans, best first")
    plan.add_argument("--explain", action="store_true", help="print each plan's time and memory terms")
    plan.add_argument("--calibrate", action="store_true", help="measure this machine (matmul rate, memory "
                      "bandwidth, gloo collectives at 1, 2 and 4 processes) and store the profile the local "
                      "cluster is priced from")
    plan.add_argument("--quick", action="store_true", help="with --calibrate: fewer sizes and repetitions (~1 min)")
    plan.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shoal.calibration.calibrate import calibrate
    from shoal.planner.profile import save_profile

    if args.top < 1:
        raise ValueError(f"--top {args.top} is not valid; valid: a count of plans >= 1")
    pricing = [f"--{k.replace('_', '-')}" for k in ("plan", "micro_batch", "json", "explain")
               if getattr(args, k) not in (None, False)]
    pricing += [f"--{k} {getattr(args, k)}" for k, default in (("model", "tiny"), ("cluster", "local"))
                if getattr(args, k) != default]  # calibration measures this machine's kernels, not a model's
    if args.calibrate and pricing:  # calibration measures this machine and prices nothing
        raise ValueError(f"--calibrate measures this machine and prices no plan; {', '.join(pricing)} would be "
                         "ignored; valid: shoal plan --calibrate [--quick] alone, then price plans")
    if args.quick and not args.calibrate:
        raise ValueError("--quick shortens --calibrate; valid: shoal plan --calibrate --quick")
    if args.calibrate:
        path = save_profile(calibrate(quick=args.quick))
        print(f"calibration profile written to {path}")
        return 0
    unpriced = _unpriced_model(args.model, args.set)
    if unpriced is not None:
        return _check_unpriced(args, unpriced)
    work = workload(args.model, args.set, global_batch=args.global_batch, seq_len=args.seq_len)
    if args.lora is not None:
        work = dataclasses.replace(work, lora=_lora(args.lora, work.model))
    if args.optimizer not in OPTIMIZER_MOMENTS:
        raise ValueError(f"--optimizer {args.optimizer!r} is not valid; valid: {', '.join(OPTIMIZER_MOMENTS)}")
    work = dataclasses.replace(work, optimizer=args.optimizer)
    cluster, network = resolve_cluster(args.cluster, args.nproc)
    started = time.perf_counter()
    if args.plan is not None and args.plan.strip() != "auto":  # auto: the search below, as with no --plan
        plans = [price(args.plan, work, cluster, network, micro_batch=args.micro_batch)]
        priced = 1
    else:
        if args.micro_batch is not None:
            raise ValueError("--micro-batch sets one plan's accumulation; give it with --plan, or leave it out "
                             "and the search tries every micro-batch size")
        result = search(work, cluster, network=network, top=args.top)
        if not result.plans:
            from shoal.planner.fit import no_fit

            raise ValueError(f"no plan fits {parameters_text(work.model.num_params())} parameters on "
                             f"{cluster.describe()} ({result.priced} priced, all over memory); "
                             f"{no_fit(work, cluster, said=True)}")
        plans, priced = result.plans, result.priced
    seconds = time.perf_counter() - started
    if args.json:
        print(json.dumps([e.to_json() for e in plans], indent=1))
        return 0
    print(cluster.describe())
    print(f"model {args.model}: {parameters_text(work.model.num_params())} parameters; global batch "
          f"{work.global_batch} x {work.seq_len} tokens; {priced} plan(s) priced in {seconds:.2f} s")
    if work.lora is not None:
        print(lora_line(work.lora, work.model))
    print(format_table(plans))
    print(f"train plan 1: {train_line(args, plans[0], cluster)}")
    if args.explain:
        for e in plans:
            print(explain(e))
    return 0


def workload(model: str, sets: list[str], *, global_batch: int, seq_len: int) -> Workload:
    """The model shape (preset or hf:, with --set) and batch, checked."""
    from shoal.train.config import RunConfig, resolve_model

    if global_batch < 1 or seq_len < 1:
        raise ValueError(f"--global-batch {global_batch} and --seq-len {seq_len} must both be >= 1")
    cfg = resolve_model(RunConfig(model=model, set=tuple(sets)))
    if not isinstance(cfg, ModelConfig):
        from shoal.train.task import task_for

        raise ValueError(task_for(cfg).message("planner", model=model))
    if seq_len > cfg.max_seq_len:  # as shoal train refuses it
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}; "
                         f"valid: 1..{cfg.max_seq_len} (or --set max_seq_len={seq_len})")
    return Workload(model=cfg, global_batch=global_batch, seq_len=seq_len)


def _lora(text: str, model: ModelConfig) -> LoRAConfig:
    """--lora's settings, checked against the model (one-line ValueErrors)."""
    lora = LoRAConfig.parse(text)
    check_model(lora, model)
    return lora


def lora_line(lora: LoRAConfig, model: ModelConfig) -> str:
    """What the adapters train: their parameters, their share r (in + out) / (in x out) of the projections they
    adapt, and of the whole model."""
    from shoal.planner.compute import step_weight_flops

    adapters, adapted = adapter_params(model, lora), adapted_params(model, lora)
    ratio = step_weight_flops(model, lora) / step_weight_flops(model)
    return (f"LoRA {lora.text()}: {parameters_text(adapters)} trainable parameters, {adapters / adapted:.2%} of the "
            f"{parameters_text(adapted)} they adapt, {adapters / model.num_params():.2%} of the model; gradients "
            f"and optimizer state priced for them alone; the step's weight products {ratio:.3f} of a full "
            "fine-tune's (frozen weights: no weight gradient; the adapters' products beside)")


def _unpriced_model(model: str, sets: list[str]) -> Any:
    """The model's shape when the planner does not price it (another family than the text transformer's);
    None for a transformer."""
    from shoal.train.config import RunConfig, resolve_model

    if model.startswith("hf:"):
        return None
    cfg = resolve_model(RunConfig(model=model, set=tuple(sets)))
    return None if isinstance(cfg, ModelConfig) else cfg


def _check_unpriced(args: argparse.Namespace, model: Any) -> int:
    """`shoal plan` for a model the planner does not price: it checks one --plan against shoal.rules (the
    refusal `shoal train` gives) and says whether it runs, in the words of the model's task."""
    from shoal.train.task import task_for

    task = task_for(model)
    if args.plan is None:
        raise ValueError(task.message("plan_search", model=args.model))
    if args.cluster == "local":
        world, device = args.nproc or 2, "cpu"
    else:
        cluster = resolve_cluster(args.cluster, args.nproc)[0]
        world, device = cluster.world_size, cluster.device_type
    facts = rules.RunFacts(world_size=world, device=device, model=model, global_batch=args.global_batch,
                        micro_batch=args.micro_batch)
    plan, _ = rules.resolve_noting(Plan.parse(args.plan), facts)
    print(f"plan {plan} runs model {args.model} on {world} process(es); {task.message('plan_note')}")
    return 0


def resolve_cluster(spec: str, nproc: int | None) -> tuple[Cluster, Network | None]:
    """The cluster a spec names, and the network to price it on (the calibrated one for `local`)."""
    from shoal.planner.profile import load_profile, local_cluster

    if spec != "local":
        if nproc is not None:
            raise ValueError(f"--nproc {nproc} is for --cluster local; a cluster spec such as {spec!r} names its size")
        return parse_cluster(spec), None
    world = nproc if nproc is not None else 2
    if world < 1:
        raise ValueError(f"--nproc {world} is not valid; it must be >= 1")
    profile = load_profile()
    if profile is None:
        raise ValueError("--cluster local needs this machine's profile; run `shoal plan --calibrate` first "
                         "(about 3 minutes; --quick: 1), or give a cluster spec such as 8xA100-80GB")
    return local_cluster(profile, world), CalibratedNetwork(profile, world)


def price(text: str, work: Workload, cluster: Cluster, network: Network | None, *,
          micro_batch: int | None = None) -> Estimate:
    """One plan's estimate, after the checks `shoal train` runs (shoal.rules: the same one-line
    refusal), with the defaults it chose said on stderr."""
    facts = rules.RunFacts(world_size=cluster.world_size, device=cluster.device_type, model=work.model,
                        global_batch=work.global_batch, seq_len=work.seq_len, micro_batch=micro_batch)
    plan, notes = rules.resolve_noting(Plan.parse(text), facts)
    for note in notes:
        print(f"shoal: note: {note}", file=sys.stderr)
    return estimate(plan, work, cluster, micro_batch=micro_batch, network=network)


def train_line(args: argparse.Namespace, e: Estimate, cluster: Cluster) -> str:
    """The `shoal train` line that runs plan `e` as it was priced: its micro-batch (a pipeline's is in the plan)."""
    flags = [f"--model {args.model}", *(f"--set {s}" for s in args.set), f"--plan {e.plan_text}",
             f"--global-batch {args.global_batch}", f"--seq-len {args.seq_len}"]
    if e.plan.pp == 1 and e.micro_batch * e.plan.data_ranks != args.global_batch:
        flags.append(f"--micro-batch {e.micro_batch}")
    if args.lora is not None:
        flags.append(f"--lora {args.lora}")
    if args.optimizer != "adamw":
        flags.append(f"--optimizer {args.optimizer}")
    if cluster.num_nodes > 1:
        return f"torchrun --nnodes {cluster.num_nodes} --nproc-per-node {cluster.per_node} ... -m shoal train " \
               + " ".join(flags)
    return f"shoal train --nproc {cluster.world_size} " + " ".join(flags)


def format_table(plans: list[Estimate]) -> str:
    head = f"{'#':>3}  {'plan':<44} {'mbs':>4} {'step s':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>8}"
    rows = [head]
    for i, e in enumerate(plans, 1):
        fits = "" if e.fits else "  (over memory)"
        rows.append(f"{i:>3}  {e.plan_text:<44} {e.micro_batch:>4} {e.step_time_s:>9.4g} {e.tokens_per_s:>10.4g} "
                    f"{e.tflops_per_device:>8.3g} {e.mfu:>6.1%} {e.mem_per_device_bytes / GiB:>8.3g}{fits}")
    return "\n".join(rows)


def explain(e: Estimate) -> str:
    """A plan's terms: where the step time goes and what fills the memory."""
    lines = [f"\n{e.plan_text} (engine {e.engine}, micro-batch {e.micro_batch}):"]
    lines += [f"  time   {k:<22} {v:10.4g} s  {v / e.step_time_s:6.1%}" for k, v in e.time.items() if v]
    lines += [f"  data   {k:<22} {v:10.4g} s  (before overlap)" for k, v in e.traffic.items() if v]
    lines += [f"  memory {k:<22} {v / GiB:10.4g} GiB" for k, v in e.memory.items() if v]
    return "\n".join(lines)
