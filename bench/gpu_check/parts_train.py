"""Parts that run the trainer or the test suite: the CUDA-only tests, `shoal train` with no flags,
every one-process plan (loss, peak memory, the planner's memory beside it), and the throughput bench."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import summarize
from bench.gpu_check.context import REPO, Context, offline_env, read_jsonl, run_command, shoal_command, stream_command

CUDA_TESTS = ("tests/test_devices.py", "tests/test_fast_step.py")
"""The test files with tests skipped where torch sees no GPU; `-k` picks those tests."""
CUDA_TEST_FILTER = "cuda or gpu"
CUDA_TEST_TIMEOUT_S = 180
"""One CUDA test's limit: a test that hangs fails alone instead of taking the part's budget. The longest, the resume
test, starts `shoal train` three times (~30 s each on the H200 of 2026-11-27, compile included) and exports and
samples."""
TEST_OUTCOME = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def tests(ctx: Context) -> None:
    """The tests skipped without CUDA, run where it is, each test's outcome saved as it ends (a part stopped at
    its budget keeps the ones that ended); under pytest-timeout no one test may take more than
    CUDA_TEST_TIMEOUT_S (dry run: collected only)."""
    mode = ["--collect-only", "-q"] if ctx.dry else ["-v", "-rfE", "--durations=10"]
    if not ctx.dry and importlib.util.find_spec("pytest_timeout") is not None:
        mode.append(f"--timeout={CUDA_TEST_TIMEOUT_S}")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *mode, "-k", CUDA_TEST_FILTER, *CUDA_TESTS]
    outcomes: dict[str, str] = {}

    def on_line(line: str) -> None:
        found = TEST_OUTCOME.match(line)
        if found and not ctx.dry:
            test, outcome = found.group(1), found.group(2)
            outcomes[test] = outcome
            ctx.check(f"test {test}", outcome in ("PASSED", "SKIPPED", "XFAIL"), outcome.lower())

    status, text = stream_command(cmd, deadline=ctx.deadline, on_line=on_line)
    if ctx.dry:
        found = len(re.findall(r"^tests/\S+::\S+", text, re.MULTILINE))
        ctx.figures["collected"] = found
        ctx.check("CUDA tests collected", status == 0 and found > 0, f"{found} tests, `{' '.join(cmd[2:])}`")
        return
    reasons = dict(re.findall(r"^(?:FAILED|ERROR) (\S+) - (.*)$", text, re.MULTILINE))
    for check in ctx.checks:
        test = check["name"].removeprefix("test ")
        if not check["ok"] and test in reasons:
            check["detail"] += f": {reasons[test][:300]}"
    counts = {k: sum(v == k for v in outcomes.values()) for k in sorted(set(outcomes.values()))}
    ctx.figures.update(counts=counts, tail=text[-3000:])
    ended = "ran to the end" if status != 124 else "stopped at the part's deadline: the tests not listed did not end"
    ctx.check("CUDA tests pass", status == 0, f"{counts}; {ended}")


def default_train(ctx: Context) -> None:
    """`shoal train` with no flags, in a fresh working folder so that its runs/<time> lands there
    (dry run: the same reading of a run folder, on one written here)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-train-") as tmp:
        if ctx.dry:
            status, text = 0, ""
            _fake_run(Path(tmp, "runs", "dry-run"))
        else:
            status, text = _run_in(tmp, shoal_command("train"))
        runs = sorted(Path(tmp, "runs").glob("*")) if Path(tmp, "runs").exists() else []
        records = read_jsonl(runs[-1] / "metrics.jsonl") if runs and (runs[-1] / "metrics.jsonl").exists() else []
        found = runs[-1] / "summary.json" if runs else None
        summary = json.loads(found.read_text()) if found is not None and found.exists() else {}
    ctx.figures.update(exit_status=status, summary=summary, tail=text[-1500:] if status else "")
    ctx.check("shoal train runs to the end", status == 0 and bool(records), f"exit {status}, {len(records)} steps")
    if records:
        first, last = records[0]["loss"], records[-1]["loss"]
        ctx.check("loss falls", last < first, f"{first:.3f} -> {last:.3f}")
        ctx.check("metrics have step, loss, tokens_per_s",
                  all({"step", "loss", "tokens_per_s"} <= set(r) for r in records))


def _fake_run(run: Path) -> None:
    run.mkdir(parents=True)
    rows = [{"step": i, "loss": 5.0 - i, "tokens_per_s": 1e3, "mem_peak_mb": 10.0} for i in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"final_loss": 3.0}))


def _pythonpath() -> str:
    return str(REPO / "src")


def _run_in(cwd: str, cmd: list[str], timeout_s: float = 900) -> tuple[int, str]:
    import os
    import subprocess

    env = offline_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_pythonpath(), env.get("PYTHONPATH", "")) if p)
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return 124, f"(no result after {timeout_s:.0f} s)"
    return done.returncode, (done.stdout + done.stderr)[-4000:]


# ----------------------------------------------------------------------------- one-process plans


PLANS = ("", "reduce=bf16", "fsdp1,offload=on", "compile=off", "ac=selective", "ac=full", "precision=fp16",
         "precision=fp32,compile=off", "tp1", "fsdp1,zero=1", "fsdp1,zero=2", "fsdp1,zero=3")
"""The one-process plans to try on a GPU ("" is the default: bf16, compile on), those no GPU run has reached
first; those the plan rules refuse at world size 1 (options of an fsdp axis of degree 1) are listed as
refused, not run."""
PLAN_START_S = 55
"""What one plan's run takes on an H200 (start, compile and 20 steps took 35-45 s on 2026-11-27; 60 steps ~2 s
more): a plan starts only while this much of the part's time is left, and the rest are listed as not run."""
PLAN_MODEL = ("tiny", ("num_layers=12", "dim=768", "num_heads=12", "num_kv_heads=12", "ffn_dim=2048",
                       "vocab_size=256", "max_seq_len=1024"), 16, 1024)
"""(preset, --set overrides, global batch, seq len): the 85M shape of bench/gpu_throughput.py."""
PLAN_STEPS = 60
"""Steps per plan: tokens/s is the median of the second half, its spread beside it. At 6 (3 timed steps) the first
H200 run read the default plan and tp1, the same plan, 30% apart; at 20 the second read the default plan 218K
tokens/s in one part and 314K in another; a step of the 85M shape takes ~50 ms, so 40 more cost ~2 s a plan beside
its ~35 s start and compile."""
DEFAULT_PLAN = "dp1"
"""What the planner prices for `shoal train` without --plan on one GPU (the device's defaults fill the rest)."""
MEMORY_TOLERANCE = 0.25
"""The memory goal: the measured peak of live tensors (torch.cuda.max_memory_allocated, what shoal's metrics
record on a GPU) within 25% of the planner's tensors (its total less the caching allocator's slack,
memory.FRAGMENTATION, which an allocated peak does not hold; the issue's long-run aim is closer)."""


def planner_cluster(device_name: str | None) -> str:
    """The planner's device for the GPU this runs on (H200 before H100: the name has both digits)."""
    name = (device_name or "").upper()
    return "1xH200" if "H200" in name else "1xA100-80GB" if "A100" in name else "1xH100-80GB"


def predicted(plan: str, model: tuple, device_name: str | None) -> dict[str, Any]:
    """The planner's step time and memory for one plan on one device of this kind (pure, no GPU)."""
    from shoal.cli.plan import price, workload
    from shoal.planner.cluster_file import parse_cluster

    preset, sets, batch, seq = model
    work = workload(preset, list(sets), global_batch=batch, seq_len=seq)
    e = price(plan or DEFAULT_PLAN, work, parse_cluster(planner_cluster(device_name)), None)
    return {"step_time_s": e.step_time_s, "mem_per_device_gb": e.mem_per_device_bytes / 1e9,
            "tensors_gb": sum(e.memory.values()) / 1e9,
            "tokens_per_s": e.tokens_per_s, "mfu": e.mfu}


def train_plan(plan: str, model: tuple, device: str, steps: int) -> dict[str, Any]:
    """One `shoal train` run of `plan` for `steps` steps: last loss, median tokens/s, peak memory."""
    preset, sets, batch, seq = model
    with tempfile.TemporaryDirectory(prefix="gpu-check-plan-") as out:
        cmd = shoal_command("train", "--nproc", "1", "--device", device, "--model", preset,
                            *[a for s in sets for a in ("--set", s)], "--global-batch", str(batch),
                            "--seq-len", str(seq),
                            "--steps", str(steps), "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
                            "--ckpt-every", "0", "--final-ckpt", "off", "--out", out,
                            *(["--plan", plan] if plan else []))
        status, text = _run_in(out, cmd, timeout_s=300)
        path = Path(out) / "metrics.jsonl"
        records = read_jsonl(path) if path.exists() else []
    if status or not records:
        return {"status": "failed", "error": text.strip().splitlines()[-1][:300] if text.strip() else f"exit {status}"}
    later = summarize([r["tokens_per_s"] for r in records[len(records) // 2:]])
    return {"status": "ok", "first_loss": records[0]["loss"], "last_loss": records[-1]["loss"],
            "tokens_per_s": later["median"], "tokens_per_s_iqr_rel": later["iqr_rel"],
            "peak_gb": max(r["mem_peak_mb"] for r in records) * 2**20 / 1e9}


PLANS_TABLE = "one-process plans (85M shape, 16 x 1024)"


def plans(ctx: Context, device_name: str | None) -> None:
    """Every one-process plan for a few steps, with the planner's memory and time beside the measured."""
    model = PLAN_MODEL
    rows = []
    for plan in PLANS:
        try:
            pred = predicted(plan, PLAN_MODEL, device_name)  # the GPU's prediction, even in a dry run
        except ValueError as exc:  # the plan rules refuse it at world size 1: say so, as the trainer would
            rows.append({"plan": plan, "status": "refused by the plan rules", "error": str(exc)[:160]})
            continue
        if ctx.dry:  # the plan priced and checked for a GPU (above); training is for the GPU
            rows.append({"plan": plan or "(default)", "predicted_gb": pred["mem_per_device_gb"],
                         "predicted_tokens_per_s": pred["tokens_per_s"]})
            continue
        if ctx.seconds_left() < PLAN_START_S:
            rows.append({"plan": plan or "(default)", "status": "not run: the part's time ran out",
                         "predicted_gb": pred["mem_per_device_gb"], "predicted_tokens_per_s": pred["tokens_per_s"]})
            continue
        got = train_plan(plan, model, ctx.device, PLAN_STEPS)
        row = {"plan": plan or "(default)", "status": got["status"]}
        if got["status"] == "ok":
            row.update(first_loss=got["first_loss"], last_loss=got["last_loss"], tokens_per_s=got["tokens_per_s"],
                       tokens_per_s_iqr_rel=got["tokens_per_s_iqr_rel"], peak_gb=got["peak_gb"])
        else:
            row["error"] = got["error"]
        row.update(predicted_gb=pred["mem_per_device_gb"], predicted_tensors_gb=pred["tensors_gb"],
                   predicted_tokens_per_s=pred["tokens_per_s"])
        if got["status"] == "ok" and not ctx.dry:
            row["peak / predicted tensors"] = got["peak_gb"] / pred["tensors_gb"]
            row["tokens/s measured / predicted"] = got["tokens_per_s"] / pred["tokens_per_s"]
        rows.append(row)
        ctx.tables[PLANS_TABLE] = rows  # saved with the checks below
        print(f"  plan {row['plan']}: {row}", flush=True)
        ctx.check(f"plan {row['plan']} trains", got["status"] == "ok" and math.isfinite(got.get("last_loss", math.nan)),
                  row.get("error", f"loss {row.get('first_loss', 0):.3f} -> {row.get('last_loss', 0):.3f}"))
        if "peak / predicted tensors" in row:
            ratio = row["peak / predicted tensors"]
            ctx.check(f"plan {row['plan']} memory: allocated peak / predicted tensors",
                      abs(ratio - 1) <= MEMORY_TOLERANCE,
                      f"{row['peak_gb']:.2f} / {pred['tensors_gb']:.2f} GB = {ratio:.2f}", goal=True)
    ctx.tables[PLANS_TABLE] = rows
    not_run = [r["plan"] for r in rows if str(r.get("status", "")).startswith("not run")]
    if not_run:
        ctx.figures["plans not run (the part's time ran out)"] = not_run
    priced = [r for r in rows if "predicted_gb" in r]
    ctx.check("one-process plans priced for one GPU", len(priced) >= 6, f"{len(priced)} of {len(PLANS)} plans "
              f"(refused: {', '.join(r['plan'] for r in rows if r not in priced) or 'none'})")


# ----------------------------------------------------------------------------- throughput


THROUGHPUT_CONTESTANTS = {"85m": ("loop-compiled", "shoal", "shoal-ac-selective"), "1.9b": ("loop-compiled", "shoal")}
"""The contestants the bench's goals name (the others add about a minute each: run the bench itself for them). At
1.9b each contestant's start and cold compile take most of the part's 240 s, so the recompute contestant is left
out there; docs/measurements.md has the parts' wall times."""
THROUGHPUT_WINDOWS = {"85m": (10, 3), "1.9b": (5, 3)}
"""(steps per timed window, windows) per shape: a 1.9b step takes a third of a second, so its windows are
shorter; the figure is the median window."""


def throughput(ctx: Context, shape: str) -> None:
    """bench/gpu_throughput.py at one shape with its goals (dry run: its CPU smoke run, eager only)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-tput-") as tmp:
        result = Path(tmp) / "result.json"
        steps, windows = THROUGHPUT_WINDOWS[shape]
        args = ["--shapes", shape, "--only", ",".join(THROUGHPUT_CONTESTANTS[shape]), "--steps", str(steps),
                "--repeats", str(windows)]
        cmd = [sys.executable, str(REPO / "bench" / "gpu_throughput.py"), *args, "--json", str(result)]
        if ctx.dry:  # the bench's own CPU smoke run is `--device cpu --quick`; here its arguments and our reading
            status, text = run_command([*cmd, "--help"], timeout_s=120)
            result.write_text(json.dumps(_fake_throughput(shape)))
        else:
            status, text = run_command(cmd, timeout_s=1800)
        data = json.loads(result.read_text()) if result.exists() else {}
    ctx.check("gpu_throughput ran", status == 0 and bool(data),
              f"exit {status}" + (f": {text[-300:]}" if status else ""))
    for name, res in data.get("shapes", {}).items():
        rows = []
        for who, row in res["contestants"].items():
            entry = {"contestant": who, "status": row["status"]}
            if row["status"] == "ok":
                entry.update(tokens_per_s=row["tokens_per_s"]["median"], mfu=row["mfu"], peak_gib=row["peak_gib"])
            else:
                entry["note"] = row.get("reason") or row.get("error")
            rows.append(entry)
        ctx.tables[f"throughput at {name}"] = rows
        ctx.figures[name] = {"ratios": res["ratios"], "goals": res["goals"]}
        for goal in res["goals"]:
            if goal["met"] is not None and not ctx.dry:
                ctx.check(f"{name}: {goal['figure']} {'>=' if goal['at_least'] else '<='} {goal['bound']}", goal["met"],
                          f"{goal['value']:.3f}", goal=True)


def _fake_throughput(shape: str) -> dict[str, Any]:
    row = {"status": "ok", "tokens_per_s": {"median": 1.0}, "mfu": 0.5, "peak_gib": 1.0}
    return {"shapes": {shape: {"contestants": {n: row for n in THROUGHPUT_CONTESTANTS[shape]}, "ratios": {},
                               "goals": [{"figure": "shoal MFU", "bound": 0.55, "at_least": True, "value": 0.5,
                                          "met": False}]}}}
