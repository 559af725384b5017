"""OneS at small scale (Xue et al. 2022, arXiv 2201.10890): a tiny-moe teacher distilled into a
dense student of one expert's width, from each knowledge-gathering method and from random
initialisation, with the same distillation budget; beside them a dense model of the student's
shape trained on the data alone with the teacher's budget.

Per seed, each run is `python -m shoal train` / `python -m shoal distill` in its own subprocess
(one process on the CPU, the built-in corpus, the same global batch and sequence length):
  teacher   tiny-moe (4 layers, dim 128, 4 experts of width 256, top-2), TEACHER_STEPS steps
  dense     tiny-moe's shape with num_experts=0 (the student's shape), TEACHER_STEPS steps, and again
            with TEACHER_STEPS + STUDENT_STEPS steps (the students' attention and embeddings have had
            that many: the equal-steps reference)
  student   shoal distill --gather {sum, mean, topk, svd, top-experts, none}, STUDENT_STEPS steps, KD
            defaults
Reported per run: the held-out loss (the trainer's eval over EVAL_BATCHES global batches) at the
end and, for students, right after gathering (before any distillation step); the share of the
MoE's benefit a student keeps, (L_dense - L_student) / (L_dense - L_teacher) (the paper's
"MoE benefits"); and inference speed: forward tokens/s of teacher and student on one
(global batch x seq_len) batch, one thread, median of repeats interleaved teacher/student.

    python -m bench.ones_experiment [--seeds 0 1 2] [--fresh]

Resumable: a run found finished (bench_run.json, same command) is reused, and one interrupted
part-way is continued from its checkpoints (`--resume`), so the same command picks up where a
cut-off invocation stopped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import RESULTS, RUN_RECORD, measure_pair, report, train_run
from shoal.data.text import open_data
from shoal.experiments.ones.distill import STUDENT_INIT, load_teacher
from shoal.experiments.ones.gather import GATHERS, student_config
from shoal.models import ModelConfig, Transformer, get_preset
from shoal.train.config import RunConfig
from shoal.train.metrics import read_metrics

DOCS = Path(__file__).resolve().parent.parent / "docs"
TEACHER_STEPS, STUDENT_STEPS, BATCH, SEQ, EVAL_BATCHES = 1000, 250, 8, 32, 32
"""The scale that fit three seeds into about 75 minutes of a loaded 2-core machine (docs/ones_distill.md);
--teacher-steps and --student-steps change the first two."""
COMMON = ["--nproc", "1", "--global-batch", str(BATCH), "--seq-len", str(SEQ), "--eval-batches", str(EVAL_BATCHES),
          "--log-every", "10"]


def _eval_loss(run: Path) -> float:
    return float([r for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r][-1]["eval_loss"])


def initial_loss(run: Path, model: ModelConfig, seed: int) -> float | None:
    """The held-out loss of a student's gathered starting weights, on the trainer's eval batches."""
    from safetensors.torch import load_file

    path = run / STUDENT_INIT
    if not path.is_file():
        return None
    student = Transformer(model).eval()
    student.load_state_dict(load_file(str(path)))
    held_out = open_data(RunConfig().data, seq_len=SEQ, seed=seed).held_out
    with torch.no_grad():
        losses = [F.cross_entropy(student(x).flatten(0, 1), y.flatten()).item()
                  for x, y in (held_out.batch(i, BATCH) for i in range(EVAL_BATCHES))]
    return statistics.fmean(losses)


def speed(teacher_run: Path, teacher_cfg: ModelConfig) -> dict[str, float]:
    """Forward tokens/s of the teacher (its checkpoint) and the student's dense shape (speed does
    not depend on the weights' values)."""
    torch.set_num_threads(1)
    teacher = load_teacher(_checkpoint(teacher_run), teacher_cfg)
    student = Transformer(student_config(teacher_cfg)).eval()
    x = torch.randint(0, teacher_cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))

    def forward(model: Any) -> Any:
        def run() -> None:
            with torch.no_grad():
                model(x)
        return run

    timed = measure_pair({"teacher": forward(teacher), "student": forward(student)}, warmup=3, repeats=30)
    return {name: BATCH * SEQ / t["time_s"]["median"] for name, t in timed.items()}


def _checkpoint(run: Path) -> Path:
    from shoal.train.checkpoint import latest_checkpoint

    path = latest_checkpoint(run)
    assert path is not None, run
    return path


def _resume(py: list[str], command: str, run_dir: Path, steps: int) -> list[str]:
    return py + [command, "--resume", str(run_dir), "--steps", str(steps)]


def _finished(command: list[str], run_dir: Path) -> bool:
    record = run_dir / RUN_RECORD
    return record.is_file() and json.loads(record.read_text())["command"][1:] == command[1:]


def run_seed(seed: int, out: Path, fresh: bool, teacher_steps: int, student_steps: int,
             collect: bool = False, gathers: Sequence[str] = GATHERS) -> list[dict[str, Any]]:
    """The seed's rows, training what is not finished; `collect`: train nothing, the finished runs' rows."""
    py = [sys.executable, "-m", "shoal"]
    seed_flags = ["--seed", str(seed)]
    teacher_cfg = get_preset("tiny-moe")
    student_M = student_config(teacher_cfg).num_params() / 1e6

    def run(name: str, command: list[str], run_dir: Path, steps: int, **kw: Any) -> tuple[Path, float] | None:
        if collect and not _finished(py + command, run_dir):
            return None
        return train_run(name, py + command, run_dir, fresh=fresh, resume=_resume(py, command[0], run_dir, steps),
                         **kw)

    teacher_dir = out / f"seed{seed}" / "teacher"
    teacher = run("teacher", ["train", "--model", "tiny-moe", "--steps", str(teacher_steps), "--eval-every",
                              str(teacher_steps), "--out", str(teacher_dir), *COMMON, *seed_flags],
                  teacher_dir, teacher_steps, keep_checkpoints=True)
    dense_dir = out / f"seed{seed}" / "dense"
    dense = run("dense", ["train", "--model", "tiny-moe", "--set", "num_experts=0", "--steps", str(teacher_steps),
                          "--eval-every", str(teacher_steps), "--out", str(dense_dir), *COMMON, *seed_flags],
                dense_dir, teacher_steps)
    long_dir, total = out / f"seed{seed}" / "dense_long", teacher_steps + student_steps
    dense_long = run("dense_long", ["train", "--model", "tiny-moe", "--set", "num_experts=0", "--steps", str(total),
                                    "--eval-every", str(total), "--out", str(long_dir), *COMMON, *seed_flags],
                     long_dir, total)
    if teacher is None or dense is None or dense_long is None:
        return []  # collecting: the students' measures need all three
    l_teacher, l_dense = _eval_loss(teacher[0]), _eval_loss(dense[0])
    rows = [{"seed": seed, "run": "teacher (tiny-moe)", "steps": teacher_steps, "held_out": l_teacher,
             "params_M": teacher_cfg.num_params() / 1e6, "wall_s": teacher[1]},
            {"seed": seed, "run": "dense, data only", "steps": teacher_steps, "held_out": l_dense,
             "params_M": student_M, "wall_s": dense[1]},
            {"seed": seed, "run": "dense, data only, teacher + student steps", "steps": total,
             "held_out": _eval_loss(dense_long[0]), "params_M": student_M, "wall_s": dense_long[1]}]
    for method in gathers:
        run_dir = out / f"seed{seed}" / f"student_{method}"
        student = run(method, ["distill", "--teacher", str(teacher[0]), "--gather", method, "--steps",
                               str(student_steps), "--eval-every", str(student_steps), "--out", str(run_dir), *COMMON,
                               *seed_flags], run_dir, student_steps)
        if student is None:
            continue
        loss = _eval_loss(student[0])
        start = initial_loss(student[0], student_config(teacher_cfg), seed)
        rows.append({"seed": seed, "run": f"student, gather {method}", "steps": student_steps, "held_out": loss,
                     "held_out_at_start": start, "moe_benefit_kept": (l_dense - loss) / (l_dense - l_teacher),
                     "params_M": student_M, "wall_s": student[1]})
    rates = speed(teacher[0], teacher_cfg)
    for row in rows:
        row["forward_tok_s"] = rates["teacher"] if row["run"].startswith("teacher") else rates["student"]
    return rows


def _short(run: str) -> str:
    return (run.replace("student, gather ", "student: ").replace("dense, data only", "dense")
            .replace(", teacher + student steps", " (T+S steps)"))


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    """Left: held-out loss at the end of every run but the randomly initialised student, each seed a
    dot, the median a bar, the teacher's and the equal-steps dense model's medians as lines. Right:
    each student's held-out loss before and after distillation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def losses(name: str, key: str = "held_out") -> list[float]:
        return [r[key] for r in rows if r["run"] == name and r.get(key) is not None]

    runs = list(dict.fromkeys(r["run"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), width_ratios=[3, 2])
    shown = [name for name in runs if name != "student, gather none"]
    for i, name in enumerate(shown):
        color = "tab:red" if name.startswith("teacher") else "tab:gray" if "dense" in name else "tab:blue"
        left.scatter([i] * len(losses(name)), losses(name), color=color, s=18, zorder=3)
        left.hlines(statistics.median(losses(name)), i - 0.3, i + 0.3, color=color, lw=2)
    for name, color in ((runs[0], "tab:red"), ("dense, data only, teacher + student steps", "tab:gray")):
        if losses(name):
            left.axhline(statistics.median(losses(name)), color=color, ls="--", lw=0.8)
    left.set_xticks(range(len(shown)), [_short(n) for n in shown], rotation=30, ha="right")
    left.set_ylabel("held-out loss (nats/byte)")
    left.set_title("at the end (dots: seeds; bars: median)")
    students = [name for name in runs if name.startswith("student")]
    for i, name in enumerate(students):
        right.scatter([i] * len(losses(name, "held_out_at_start")), losses(name, "held_out_at_start"),
                      marker="x", color="tab:orange", zorder=3, label="before distillation" if i == 0 else None)
        right.scatter([i] * len(losses(name)), losses(name), color="tab:blue", s=18, zorder=3,
                      label="after distillation" if i == 0 else None)
    right.set_xticks(range(len(students)), [_short(n).replace("student: ", "") for n in students], rotation=30,
                     ha="right")
    right.set_title("students: gathered start and end")
    right.legend(loc="best")
    steps = {r["run"]: r["steps"] for r in rows}
    fig.suptitle(f"OneS on the built-in corpus: tiny-moe teacher {steps[runs[0]]} steps, students "
                 f"{steps.get('student, gather none', '?')} distillation steps, seeds "
                 f"{', '.join(str(s) for s in sorted({r['seed'] for r in rows}))}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of the medians over seeds, one line per run (docs/ones_distill.md): held-out
    loss, its gaps to the same seed's teacher and equal-steps dense model, the MoE benefit kept."""
    def loss_of(seed: int, prefix: str) -> float:
        return next(r["held_out"] for r in rows if r["seed"] == seed and r["run"].startswith(prefix))

    gaps = [{**r, "vs_teacher": r["held_out"] - loss_of(r["seed"], "teacher"),
             "vs_long": r["held_out"] - loss_of(r["seed"], "dense, data only, teacher")} for r in rows]
    # The share is defined only where the teacher beat the dense model of the student's shape.
    for r in gaps:
        if r.get("moe_benefit_kept") is not None and loss_of(r["seed"], "teacher") >= loss_of(r["seed"], "dense"):
            r["moe_benefit_kept"] = None
    undefined = sorted({r["seed"] for r in rows if loss_of(r["seed"], "teacher") >= loss_of(r["seed"], "dense")})

    def med(name: str, key: str, sign: str = "") -> str:
        """The median over seeds and, with several, their range."""
        values = [r[key] for r in gaps if r["run"] == name and r.get(key) is not None]
        if not values:
            return "-"
        spread = f" ({min(values):{sign}.3f} to {max(values):{sign}.3f})" if len(values) > 1 else ""
        return f"{statistics.median(values):{sign}.3f}{spread}"

    def share(name: str) -> str:
        if not name.startswith("student"):
            return "-"
        return med(name, "moe_benefit_kept", "+") if any(r["run"] == name and r.get("moe_benefit_kept") is not None
                                                          for r in gaps) else "undefined"

    lines = ["| run | steps | seeds | parameters | held-out loss | minus teacher's | minus dense T+S's | at start | "
             "MoE benefit kept | forward tokens/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["run"] for r in rows):
        first = next(r for r in rows if r["run"] == name)
        speed = statistics.median(r["forward_tok_s"] for r in rows if r["run"] == name)
        seeds_run = len([r for r in rows if r["run"] == name])
        lines.append(f"| {name} | {first['steps']} | {seeds_run} | {first['params_M']:.2f}M | "
                     f"{med(name, 'held_out')} | "
                     f"{med(name, 'vs_teacher', '+')} | {med(name, 'vs_long', '+')} | "
                     f"{med(name, 'held_out_at_start')} | {share(name)} | {speed:,.0f} |")
    seeds = sorted({r["seed"] for r in rows})
    note = (f" MoE benefit kept: undefined in seed(s) {', '.join(map(str, undefined))}, where the teacher's held-out "
            "loss was not below the dense model's (the share's denominator L_dense - L_teacher <= 0)."
            if undefined else "")
    return "\n".join(lines) + (f"\n\nMedians over seeds {', '.join(map(str, seeds))} (in brackets: lowest to highest "
                               f"seed).{note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", type=Path, help="the runs' folder [runs/<name>, the name as below]")
    parser.add_argument("--fresh", action="store_true", help="retrain runs found finished")
    parser.add_argument("--teacher-steps", type=int, default=TEACHER_STEPS, help="teacher and dense model steps")
    parser.add_argument("--student-steps", type=int, default=STUDENT_STEPS, help="distillation steps per student")
    parser.add_argument("--gathers", nargs="+", choices=GATHERS, default=list(GATHERS),
                        help="the students' gathering methods, in the order they are trained [all]")
    parser.add_argument("--collect", action="store_true", help="train nothing: the rows, plot and results of the "
                        "runs found finished (an experiment cut off part-way through a seed)")
    parser.add_argument("--table", action="store_true", help="print the saved rows' markdown table, redraw "
                        "their plot and exit")
    args = parser.parse_args()
    # Another budget than the default's keeps its own runs, results and plot, named by its steps.
    default = (args.teacher_steps, args.student_steps) == (TEACHER_STEPS, STUDENT_STEPS)
    name = "ones_experiment" if default else f"ones_experiment_{args.teacher_steps}_{args.student_steps}"
    figure = DOCS / ("ones_distill.png" if default else f"ones_distill_{args.teacher_steps}_{args.student_steps}.png")
    if args.table:
        saved = json.loads((RESULTS / f"{name}_rows.json").read_text())
        print(table(saved))
        plot(saved, figure)
        return
    rows: list[dict[str, Any]] = []
    for seed in args.seeds:
        rows += run_seed(seed, args.out or Path("runs") / name, args.fresh, args.teacher_steps, args.student_steps,
                         collect=args.collect, gathers=args.gathers)
        report(name, rows, notes=f"teacher/dense {args.teacher_steps} steps, students "
               f"{args.student_steps} distillation steps, batch {BATCH} x {SEQ} tokens, one CPU process each")
        plot(rows, figure)  # after every seed: a cut-off run leaves what it finished
        (RESULTS / f"{name}_rows.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
