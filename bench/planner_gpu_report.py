"""The planner's one-GPU predictions against a GPU check report's measured runs, priced from that report's own
calibration: its device profile (cuda-profile-*.toml) and its host's seconds per op.

The host's figure is the profile's when its calibration measured one (`op_overhead_us` in the TOML,
`host_us_per_op` in the JSON: bench/gpu_check/calibrate_cuda.measure_host); a report from before that
measurement gives it through its engine part instead (bench/engine_overhead.py on that GPU: the plain fp32
forward and backward of a deep tiny model, host-bound, over the planner's ops of that model). Measured runs are
the calibrate part's table and the plans part's rows (`shoal train` of the 85M shape on one GPU,
bench/gpu_check/parts_train.PLAN_MODEL). Each is priced three ways: the device alone (no host term, as the
planner priced GPUs before it priced their host); with the host priced, for the code as it is; and with the host
priced for the data engine those runs had when the report was written, where `--engine-then` names it (one
process at 16 bits ran FSDP2 of degree 1 before it ran autocast).

    python -m bench.planner_gpu_report --from-report docs/gpu_check/H200_2026-11-27 --engine-then fsdp2
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from shoal.cli.plan import price, workload
from shoal.plan import Plan
from shoal.planner.cluster_file import load_cluster
from shoal.planner.costs import GradientReduction, model_ops
from shoal.planner.estimate import Framework, Workload
from shoal.planner.hardware import US, Cluster
from shoal.rules import EngineChoice

PLAN_MODEL = ("tiny", ("num_layers=12", "dim=768", "num_heads=12", "num_kv_heads=12", "ffn_dim=2048",
                       "vocab_size=256", "max_seq_len=1024"), 16, 1024)
"""bench/gpu_check/parts_train.PLAN_MODEL (which imports torch): the 85M shape the report's plans trained."""
ENGINE_LAYERS = 12
"""bench/engine_overhead.LAYERS: the blocks of the deep tiny model the engine part times."""
ENGINE_TABLE = "one forward and backward of 12 tiny blocks (host-bound)"
CALIBRATE_TABLE = "one-GPU predictions against measured runs (85M shape)"


@dataclasses.dataclass(frozen=True)
class _EngineThen(GradientReduction):
    """The data engine a report's runs had: `kind` for a plan of one data rank at 16 bits (others as now)."""

    kind: str = "fsdp2"

    def engine(self, plan: Plan, choice: EngineChoice) -> EngineChoice:
        if choice.kind != "autocast":
            return choice
        return EngineChoice(kind=self.kind, zero=2, bucket=1, units=1) if self.kind == "fsdp2" else choice


def _parts(report: Path) -> dict[str, dict[str, Any]]:
    """Every part of every gpu_check*.json under `report`, the later file's where two hold one."""
    parts: dict[str, dict[str, Any]] = {}
    for path in sorted(report.glob("gpu_check*.json")):
        for name, part in json.loads(path.read_text()).get("parts", {}).items():
            if part.get("status") not in (None, "not run"):
                parts.setdefault(name, {}).update(part)
    return parts


def host_seconds_per_op(report: Path, cluster: Cluster) -> tuple[float, str]:
    """(host seconds per op, where it comes from) for the report's GPU (ValueError if the report has none)."""
    if cluster.device.op_overhead > 0:
        return cluster.device.op_overhead, "the profile's op_overhead_us"
    for path in report.glob("cuda-profile-*.json"):
        measured = json.loads(path.read_text()).get("host_us_per_op")
        if measured:
            return measured * US, f"{path.name}: host_us_per_op"
    rows = _parts(report).get("engine", {}).get("tables", {}).get(ENGINE_TABLE, [])
    plain = [r["ms"] for r in rows if r.get("contender") == "plain fp32"]
    if plain:
        ops = model_ops(ENGINE_LAYERS)
        return plain[0] * 1e-3 / ops, (f"engine part: plain fp32 forward and backward {plain[0]:.2f} ms over "
                                       f"{ops:g} planner ops")
    raise ValueError(f"{report}: no host figure (no op_overhead_us in the profile, no host_us_per_op in its JSON, "
                     "no engine part); valid: a report with a calibrate or engine part")


def measured_runs(report: Path) -> list[dict[str, Any]]:
    """{"plan", "tokens_per_s", "part"} of each one-GPU `shoal train` run of the report: the calibrate part's
    table and the plans part's rows (its table, or the lines its log kept where the part ran out of time)."""
    parts, runs = _parts(report), []
    for row in parts.get("calibrate", {}).get("tables", {}).get(CALIBRATE_TABLE, []):
        if "measured tokens/s" in row:
            runs.append({"plan": row["plan"], "tokens_per_s": row["measured tokens/s"], "part": "calibrate"})
    plans = parts.get("plans", {})
    rows = [r for table in plans.get("tables", {}).values() for r in table]
    for line in plans.get("error", "").splitlines():
        head, _, text = line.strip().partition(": ")
        if head.startswith("plan ") and text.startswith("{"):
            rows.append(ast.literal_eval(text))
    runs += [{"plan": r["plan"], "tokens_per_s": r["tokens_per_s"], "part": "plans"}
             for r in rows if r.get("status") == "ok" and "tokens_per_s" in r]
    return runs


def predictions(report: Path, engine_then: str | None) -> tuple[list[dict[str, Any]], str]:
    """One row per measured run: measured tokens/s, each prediction and measured / predicted."""
    profile = next(iter(sorted(report.glob("cuda-profile-*.toml"))), None)
    if profile is None:
        raise ValueError(f"{report}: no cuda-profile-*.toml; valid: a report whose calibrate part ran")
    calibrated = load_cluster(profile)
    host, source = host_seconds_per_op(report, calibrated)
    device_only = dataclasses.replace(calibrated, device=dataclasses.replace(calibrated.device, op_overhead=0.0))
    with_host = dataclasses.replace(calibrated, device=dataclasses.replace(calibrated.device, op_overhead=host))
    preset, sets, batch, seq = PLAN_MODEL
    work = workload(preset, list(sets), global_batch=batch, seq_len=seq)
    then = (dataclasses.replace(work, framework=Framework(gradients=_EngineThen(kind=engine_then)))
            if engine_then else None)
    ways: list[tuple[str, Cluster, Workload]] = [("device only", device_only, work), ("host priced", with_host, work)]
    ways += [(f"host priced, engine {engine_then}", with_host, then)] if then else []
    rows = []
    for run in measured_runs(report):
        plan = "dp1" if run["plan"] == "(default)" else f"dp1,{run['plan']}"
        row: dict[str, Any] = {"plan": run["plan"], "part": run["part"], "measured tokens/s": run["tokens_per_s"]}
        for label, cluster, w in ways:
            e = price(plan, w, cluster, None)
            row[f"measured / predicted ({label})"] = run["tokens_per_s"] / e.tokens_per_s
            if label == "host priced":
                row["predicted host-bound"] = e.time.get("host_bound", 0.0) > 0
        rows.append(row)
    return rows, f"host {host / US:.1f} us per op ({source})"


def markdown(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row.get(k, ''):.3g}" if isinstance(row.get(k), float)
                                       else str(row.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-report", type=Path, required=True, help="a docs/gpu_check/<device>_<date> folder")
    parser.add_argument("--engine-then", choices=("fsdp2",), default=None,
                        help="price also the data engine one process at 16 bits ran when the report was written")
    args = parser.parse_args()
    rows, host = predictions(args.from_report, args.engine_then)
    print(f"{args.from_report}: {host}\n")
    print(markdown(rows))
    for label in [k for k in rows[0] if k.startswith("measured / predicted")]:
        errors = [abs(r[label] - 1) for r in rows]
        print(f"\n{label}: median |error| {statistics.median(errors):.0%}, worst {max(errors):.0%}, "
              f"within 15%: {sum(e <= 0.15 for e in errors)}/{len(errors)}", end="")
    print()


if __name__ == "__main__":
    main()
