"""A fine-tune made entirely offline: full fine-tune against LoRA at r = 8, 16 and 64, under fsdp2 and tp2.

1. Data, from Python's pydoc topics (the built-in corpus): the topics are split by name into a held-out
   set (every HOLDOUT_EVERY-th) and the rest. Each section of a topic gives chat conversations: "What is
   <heading>?" answered by the section's first prose paragraph, and "Continue the Python reference on
   <heading>: <a paragraph's first words> ..." answered by the rest of that paragraph. The held-out
   topics' conversations are the held-out split; their text is in neither the pretraining corpus nor
   the tokenizer's training text.
2. A byte-level BPE tokenizer (`tokenizers`) trained on the pretraining text, with a chat template
   whose markers are special tokens; `shoal data prepare` writes the pretraining set (text) and the
   chat set (`--format chat`: the loss on the assistant's turns only).
3. Pretraining: a Llama built from a transformers config (`--model hf:`), on the pretraining set, under
   fsdp2 on 2 processes; `shoal export --hf` makes it the base folder (weights, config, tokenizer).
4. Fine-tuning from the base (`--init`), every arm the same steps, seed, batch and data: full (every
   weight) and LoRA (all seven projections, alpha = 2r, dropout 0), each under fsdp2 and tp2 on 2 gloo
   processes; the held-out loss is on the held-out conversations' answers (the loss mask), over as many
   whole batches as the held-out split fills, the same for every arm (heldout_loss_start: the first
   evaluation). Step times are per step (--log-every 1) after the first WARMUP steps; memory per rank is
   the dry run's (`--dry-run` of the arm's command). `--lr-probe RANK:LR` runs arms again at another lr
   under the first plan. The base's own held-out loss is one LoRA step at lr 1e-9 (B starts at zero).
5. The LoRA r=16 fsdp2 run's adapters exported with `shoal export --lora-adapter`, loaded with peft onto
   the base (transformers' from_pretrained), and greedy answers to held-out questions, beside the base's
   and the full fine-tune's (its `shoal export --hf`).

Prints one table (also bench/results/lora_finetune.json), writes docs/lora_finetune.png (held-out loss
over steps per arm) and bench/results/lora_finetune/generations.json. A run whose folder holds a
finished run of the same command is read, not retrained (`--fresh` retrains).

    python -m bench.lora_finetune [--pretrain-steps 200] [--steps 60] [--plans fsdp2 tp2] [--ranks 0 8 16 64]
        [--tp-ranks 0 16] [--lr-probe 16:0.03 16:0.003 0:0.003]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS, report, save_figure, train_run
from shoal.data.prepare import is_held_out
from shoal.train.metrics import read_metrics

DOCS = Path(__file__).resolve().parent.parent / "docs"
HOLDOUT_EVERY = 6
"""Every 6th pydoc topic (sorted by name) is held out: its conversations are the held-out split."""
SPECIALS = ("<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>")
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
LLAMA = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
"""The base model: a Llama of 4 layers of width 256 (head 64, grouped-query attention 4:2); the
vocabulary is the tokenizer's."""
WARMUP = 3
"""Steps left out of the step-time statistics (the first steps build caches and allocators)."""
_HEADING = re.compile(r"^(.+)\n([*=\-~^])\2{2,}\s*$", re.M)
ANSWER_CHARS = 480
"""An answer is cut at the last sentence end before this many characters (whole sentences)."""


# ---------------------------------------------------------------- data
def _prose(block: str) -> str | None:
    """A paragraph as one line, or None for code, grammar, tables and short fragments."""
    if block.startswith(" ") or "::=" in block or block.count("\n") == 0 and len(block) < 60:
        return None
    text = " ".join(block.split())
    return text if len(text) >= 60 else None


def _cut(text: str) -> str:
    if len(text) <= ANSWER_CHARS:
        return text
    head = text[:ANSWER_CHARS]
    end = max(head.rfind(". "), head.rfind(".) "))
    return head[: end + 1] if end > 100 else head.rsplit(" ", 1)[0] + " ..."


def sections(topic: str) -> list[tuple[str, list[str]]]:
    """(heading, prose paragraphs) of each section of a pydoc topic."""
    marks = list(_HEADING.finditer(topic))
    out = []
    for i, m in enumerate(marks):
        body = topic[m.end(): marks[i + 1].start() if i + 1 < len(marks) else len(topic)]
        paragraphs = [p for p in (_prose(b.strip("\n")) for b in re.split(r"\n\s*\n", body)) if p]
        if paragraphs:
            out.append((m.group(1).strip(), paragraphs))
    return out


def conversations(topic: str) -> list[list[dict[str, str]]]:
    """The chat conversations drawn from one topic (see the module docstring)."""
    out = []
    for heading, paragraphs in sections(topic):
        out.append([{"role": "user", "content": f"What is {heading}?"},
                    {"role": "assistant", "content": _cut(paragraphs[0])}])
        for p in paragraphs[1:]:
            words = p.split()
            if len(words) >= 16:
                out.append([{"role": "user",
                             "content": f"Continue the Python reference on {heading}: {' '.join(words[:8])} ..."},
                            {"role": "assistant", "content": _cut(" ".join(words[8:]))}])
    return out


def interleave(train: list[Any], held: list[Any], holdout: float) -> list[Any]:
    """train and held in one list whose positions `shoal data prepare --holdout holdout` holds out
    (one shard: prepare.is_held_out(0, j, holdout)) are exactly held's; train is cut to fit."""
    out, t, h = [], iter(train), iter(held)
    for j in range(len(train) + len(held)):
        nxt = next(h, None) if is_held_out(0, j, holdout) else next(t, None)
        if nxt is None:
            break
        out.append(nxt)
    return out


def write_data(work: Path) -> dict[str, Any]:
    """The pretraining text, the chat jsonl and the held-out questions under `work`; their counts."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    held_names = {n for i, n in enumerate(names) if i % HOLDOUT_EVERY == HOLDOUT_EVERY // 2}
    pretrain = [topics[n] for n in names if n not in held_names]
    (work / "pretrain.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in pretrain))
    train = [c for n in names if n not in held_names for c in conversations(topics[n])]
    held = [c for n in names if n in held_names for c in conversations(topics[n])]
    holdout = len(held) / (len(held) + len(train))
    rows = interleave(train, held, holdout)
    chosen = [r for j, r in enumerate(rows) if is_held_out(0, j, holdout)]
    assert chosen == held[: len(chosen)], "the held-out positions must hold the held-out conversations"
    (work / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in rows))
    (work / "heldout.json").write_text(json.dumps(chosen, indent=1))
    return {"holdout": holdout, "topics": len(names), "held_out_topics": sorted(held_names),
            "train_conversations": len(rows) - len(chosen), "held_out_conversations": len(chosen),
            "pretrain_chars": sum(map(len, pretrain))}


def train_tokenizer(work: Path, vocab_size: int) -> Path:
    """A byte-level BPE trained on the pretraining text, with the chat template; its folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = work / "tokenizer"
    if (folder / "tokenizer.json").is_file():
        return folder
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [json.loads(line)["text"] for line in (work / "pretrain.jsonl").read_text().splitlines()]
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[0])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(folder))
    return folder


def shoal(*argv: str) -> None:
    """`python -m shoal ARGV`, its output shown only when it fails."""
    done = subprocess.run([sys.executable, "-m", "shoal", *argv], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"shoal {' '.join(argv)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def prepare(work: Path, name: str, fmt: str, holdout: float) -> Path:
    out = work / f"data_{name}"
    if not (out / "manifest.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        shoal("data", "prepare", str(work / f"{name}.jsonl"), "--tokenizer", str(work / "tokenizer"),
              "--out", str(out), "--format", fmt, "--holdout", f"{holdout:.6f}", "--workers", "1")
    return out


# ---------------------------------------------------------------- runs
def common_flags(args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "shoal", "train", "--nproc", "2", "--device", "cpu", "--seed", "0",
            "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len), "--keep", "1"]


def pretrain(work: Path, args: argparse.Namespace) -> Path:
    """Pretrain the base and export it (weights, config, tokenizer); the base folder."""
    from transformers import LlamaConfig

    vocab = json.loads((work / "data_pretrain" / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    config = work / "llama_config"
    config.mkdir(exist_ok=True)
    LlamaConfig(vocab_size=vocab, **LLAMA).save_pretrained(str(config))
    run_dir = work / "pretrain"
    steps = args.pretrain_steps
    command = [*common_flags(args), "--model", f"hf:{config}", "--data", str(work / "data_pretrain"),
               "--plan", "fsdp2", "--steps", str(steps), "--lr", "3e-3", "--eval-every", str(steps),
               "--log-every", "10", "--ckpt-every", str(steps), "--out", str(run_dir)]
    run_dir, _ = train_run("pretrain", command, run_dir, fresh=args.fresh, keep_checkpoints=True)
    base = work / "base"
    if args.fresh or not (base / "config.json").is_file():
        shoal("export", "--run", str(run_dir), "--hf", "--out", str(base), "--force")
    return base


def arm_name(rank: int, plan: str, lr: float | None = None) -> str:
    """full_PLAN, loraR_PLAN, or with an lr other than the default, e.g. lora16-lr0.03_PLAN."""
    kind = "full" if rank == 0 else f"lora{rank}"
    return f"{kind}{'' if lr is None else f'-lr{lr:g}'}_{plan}"


def finetune(rank: int, plan: str, base: Path, work: Path, args: argparse.Namespace, eval_batches: int, *,
             lr: float | None = None, steps: int | None = None, name: str | None = None) -> tuple[Path, float]:
    """One arm: rank 0 is the full fine-tune; `lr` other than the arm's default; its run folder and wall seconds."""
    run_dir = work / (name or arm_name(rank, plan, lr))
    steps = steps or args.steps
    peak = lr if lr is not None else args.full_lr if rank == 0 else args.lora_lr
    command = [*common_flags(args), "--model", f"hf:{base}", "--init", str(base), "--data", str(work / "data_chat"),
               "--plan", plan, "--steps", str(steps), "--lr", str(peak),
               "--warmup-steps", str(max(1, steps // 10)), "--eval-every", str(min(steps, args.eval_every)),
               "--eval-batches", str(eval_batches), "--log-every", "1", "--ckpt-every", str(steps),
               "--out", str(run_dir)]
    if rank:
        command += ["--lora", f"r={rank},alpha={2 * rank},dropout=0"]
    keep = (rank == 0 or rank == args.show_rank) and plan == args.plans[0] and lr is None  # for the generations
    return train_run(run_dir.name, command, run_dir, fresh=args.fresh, keep_checkpoints=keep)


def base_loss(base: Path, work: Path, args: argparse.Namespace, eval_batches: int) -> float:
    """The base's held-out loss on the same batches: one LoRA step at lr 1e-9 (B starts at zero, so the adapted
    model is the base, and the step moves B by about 1e-9), then the evaluation."""
    run_dir, _ = finetune(8, args.plans[0], base, work, args, eval_batches, lr=1e-9, steps=1, name="base_eval")
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval_loss" in r][-1]["eval_loss"]


def counts(base: Path, rank: int) -> tuple[int, int]:
    """(trainable parameters, all parameters) of an arm: shoal's count of the adapters (r (in + out) per adapted
    projection) or, for the full fine-tune, every parameter."""
    from shoal.models.hf.families import config_from_hf
    from shoal.models.lora_config import LoRAConfig, adapter_params

    cfg = config_from_hf(base)
    total = cfg.num_params()
    return (total, total) if rank == 0 else (adapter_params(cfg, LoRAConfig(r=rank, alpha=2 * rank)), total)


def row(rank: int, plan: str, run_dir: Path, wall: float) -> dict[str, Any]:
    records = read_metrics(run_dir / "metrics.jsonl")
    times = [r["step_time_s"] for r in records if "step_time_s" in r and r["step"] >= WARMUP]
    evals = [r for r in records if "eval_loss" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    q = statistics.quantiles(times, n=4)
    return {"arm": run_dir.name.split("_")[0], "plan": plan,
            "heldout_loss_start": round(evals[0]["eval_loss"], 4) if len(evals) > 1 else None,
            "heldout_loss": round(evals[-1]["eval_loss"], 4),
            "train_loss_last": round(records[-1]["loss"], 4),
            "step_ms_median": round(1e3 * statistics.median(times), 1),
            "step_ms_iqr": f"{1e3 * q[0]:.0f}-{1e3 * q[2]:.0f}",
            "mem_peak_mb": round(max(r.get("mem_peak_mb", 0.0) for r in records), 1),
            "mem_predicted_mb": summary.get("mem_predicted_mb"),
            "predicted_terms_mb": summary.get("mem_predicted_terms_mb"),
            "wall_s": round(wall, 1)}


_DRY_ROW = re.compile(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)", re.M)


def dry_run(command: list[str], run_dir: Path, fresh: bool) -> dict[str, float]:
    """The busiest rank's measured parameters / gradients / optimizer state / step peak above the baseline (MB)
    from `shoal train --dry-run` of the arm's command (its output kept in the run folder as dry_run.txt)."""
    text_path = run_dir / "dry_run.txt"
    cut = command.index("--out")
    dry = [*command[:cut], *command[cut + 2:], "--dry-run"]
    header = "# " + " ".join(dry[1:]) + "\n"
    if fresh or not text_path.is_file() or not text_path.read_text().startswith(header):
        done = subprocess.run(dry, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"dry run failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
        text_path.write_text(header + done.stdout)
    rows = [tuple(float(v) for v in m.groups()) for m in _DRY_ROW.finditer(text_path.read_text())]
    assert rows, f"no per-rank table in {text_path}"
    busiest = max(rows, key=lambda r: r[6] - r[4])
    return {"params_mb": busiest[1], "grads_mb": busiest[2], "optim_mb": busiest[3],
            "step_peak_mb": busiest[6] - busiest[4]}


# ---------------------------------------------------------------- peft and generation
def generate(base: Path, work: Path, adapter: Path, full: Path, questions: list[str], max_new: int) -> list[dict]:
    """Greedy answers of the base, the full fine-tune (its --hf export) and the base with the peft adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    stop = [tok.convert_tokens_to_ids(SPECIALS[1]), tok.eos_token_id]
    models = {"base": AutoModelForCausalLM.from_pretrained(str(base)),
              "full": AutoModelForCausalLM.from_pretrained(str(full)),
              "lora (peft)": PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(adapter))}
    out = []
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        answers = {}
        for name, model in models.items():
            model.eval()
            with torch.no_grad():
                gen = model.generate(input_ids=ids, max_new_tokens=max_new, do_sample=False, eos_token_id=stop,
                                     pad_token_id=tok.eos_token_id)
            answers[name] = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip()
        out.append({"question": q, **answers})
    return out


def plot(runs: dict[str, list[dict[str, Any]]], path: Path, base: float | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, plan in zip(axes, ("fsdp2", "tp2")):
        for name, records in runs.items():
            if name.endswith(plan):
                evals = [r for r in records if "eval_loss" in r]
                ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o--" if "-lr" in name else "o-",
                        ms=3, label=name.split("_")[0])
        if base is not None:
            ax.axhline(base, color="grey", lw=1, ls=":", label="the base, before fine-tuning")
            ax.set_ylim(top=base + 0.2)  # a diverged arm (an lr probe) is left above the frame
        ax.set_title(f"{plan}, 2 gloo processes")
        ax.set_xlabel("fine-tuning step")
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("held-out loss on the answers (nats/token)")
    path = save_figure(fig, path)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrain-steps", type=int, default=200)
    parser.add_argument("--steps", type=int, default=60, help="fine-tuning steps of every arm")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048, help="the BPE tokenizer's vocabulary")
    parser.add_argument("--full-lr", type=float, default=1e-3, help="peak lr of the full fine-tune")
    parser.add_argument("--lora-lr", type=float, default=1e-2, help="peak lr of the LoRA arms")
    parser.add_argument("--eval-every", type=int, default=15)
    parser.add_argument("--plans", nargs="+", default=["fsdp2", "tp2"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[0, 8, 16, 64], help="0: the full fine-tune")
    parser.add_argument("--tp-ranks", type=int, nargs="+", default=None, help="the arms run under tp2 [--ranks]")
    parser.add_argument("--lr-probe", nargs="*", default=[], metavar="RANK:LR",
                        help="arms run again at another lr, under the first plan (0: the full fine-tune)")
    parser.add_argument("--show-rank", type=int, default=16, help="the LoRA arm exported to peft for generation")
    parser.add_argument("--questions", type=int, default=4, help="held-out questions answered")
    parser.add_argument("--name", default="lora_finetune")
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args()
    work = RESULTS / args.name
    work.mkdir(parents=True, exist_ok=True)
    info = write_data(work)
    print(f"data: {info['train_conversations']} training conversations, {info['held_out_conversations']} held out "
          f"(topics {', '.join(info['held_out_topics'])})", flush=True)
    train_tokenizer(work, args.vocab)
    prepare(work, "pretrain", "text", 0.05)
    chat = prepare(work, "chat", "chat", info["holdout"])
    held_tokens = json.loads((chat / "manifest.json").read_text())["splits"]["eval"]["tokens"]
    eval_batches = max(1, held_tokens // ((args.seq_len + 1) * args.global_batch))
    base = pretrain(work, args)
    rows, runs = [], {}
    for plan in args.plans:
        for rank in args.ranks if plan == args.plans[0] or args.tp_ranks is None else args.tp_ranks:
            run_dir, wall = finetune(rank, plan, base, work, args, eval_batches)
            command = json.loads((run_dir / "bench_run.json").read_text())["command"]
            r = row(rank, plan, run_dir, wall)
            n, total = counts(base, rank)
            r.update(trainable=n, trainable_share=round(n / total, 4))
            r.update({f"dry_{k}": v for k, v in dry_run(command, run_dir, args.fresh).items()})
            rows.append(r)
            runs[arm_name(rank, plan)] = read_metrics(run_dir / "metrics.jsonl")
    for probe in args.lr_probe:  # RANK:LR, under the first plan
        rank, lr = int(probe.split(":")[0]), float(probe.split(":")[1])
        run_dir, wall = finetune(rank, args.plans[0], base, work, args, eval_batches, lr=lr)
        r = row(rank, args.plans[0], run_dir, wall)
        r.update(arm=arm_name(rank, args.plans[0], lr).split("_")[0], trainable=counts(base, rank)[0])
        rows.append(r)
        runs[arm_name(rank, args.plans[0], lr)] = read_metrics(run_dir / "metrics.jsonl")
    rows.append({"arm": "base", "plan": args.plans[0], "heldout_loss": round(base_loss(base, work, args,
                                                                                       eval_batches), 4)})
    report(args.name, rows, notes=f"Llama {LLAMA}, vocab {args.vocab}; {args.steps} fine-tuning steps of "
           f"{args.global_batch} x {args.seq_len} tokens; held-out loss over {eval_batches} batches "
           f"({held_tokens} held-out tokens); {info}")
    print(f"plot: {plot(runs, DOCS / f'{args.name}.png', rows[-1]['heldout_loss'])}")
    full_dir, lora_dir = work / arm_name(0, args.plans[0]), work / arm_name(args.show_rank, args.plans[0])
    adapter, full = work / "adapter", work / "full_hf"
    shutil.rmtree(adapter, ignore_errors=True)  # (--force replaces --out, not a --lora-adapter folder)
    shoal("export", "--run", str(lora_dir), "--lora-adapter", str(adapter))
    shoal("export", "--run", str(full_dir), "--hf", "--out", str(full), "--force")
    held = json.loads((work / "heldout.json").read_text())
    questions = [c[0]["content"] for c in held if c[0]["content"].startswith("What is")][: args.questions]
    answers = generate(base, work, adapter, full, questions, max_new=48)
    references = {c[0]["content"]: c[1]["content"] for c in held}
    for a in answers:
        a["reference"] = references[a["question"]]
        print(json.dumps(a, indent=1))
    (work / "generations.json").write_text(json.dumps(answers, indent=1))


if __name__ == "__main__":
    main()
