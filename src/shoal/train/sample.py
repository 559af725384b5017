"""`shoal sample`: continue a prompt with a trained run's latest checkpoint.

One process, no process group: the checkpoint (written by any number of ranks under any plan)
loads into a plain single-process model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import torch

from shoal.apply_plan import parallelize
from shoal.data.text import load_tokenizer
from shoal.models import ModelConfig, Transformer
from shoal.train.checkpoint import good_checkpoint, load_checkpoint
from shoal.train.config import resolve_model
from shoal.train.job import read_run_config
from shoal.train.task import task_for


def sample(run_dir: Path, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.8,
           top_k: int = 40, seed: int = 0, emit: Callable[[str], None] | None = None) -> str:
    """The prompt followed by up to `max_new_tokens` sampled tokens, as text; `emit`, where given, is handed
    that text piece by piece as the tokens are drawn (the prompt first), the pieces adding up to it."""
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens {max_new_tokens} must be >= 0")
    if not 0 <= temperature < math.inf:  # nan too
        raise ValueError(f"--temperature {temperature} must be a finite number >= 0 (0: always the likeliest token)")
    if top_k < 0:
        raise ValueError(f"--top-k {top_k} must be >= 0 (0: no limit)")
    cfg = read_run_config(run_dir)
    path = good_checkpoint(run_dir)
    shape = resolve_model(cfg)
    if not isinstance(shape, ModelConfig):
        raise ValueError(task_for(shape).message("sample", run_dir=str(run_dir)))
    if cfg.lora is not None:  # the checkpoint holds the adapters: the frozen base comes from its source
        from shoal.train.build import adapted_model
        from shoal.train.checkpoint import read_trainer_state

        model = cast(Transformer, adapted_model(shape, cfg.lora, read_trainer_state(path).get("lora_base")))
    else:
        model = Transformer(shape)
    load_checkpoint(path, runtime=parallelize(model), optimizer=None)
    model.eval()
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    ids = tokenizer.encode(prompt) or tokenizer.encode("\n")
    generator = torch.Generator().manual_seed(seed)
    say = emit or (lambda piece: None)
    say(prompt)
    new: list[int] = []
    shown = ""
    for token in generate(model, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                          generator=generator):
        new.append(token)
        text = tokenizer.decode(new)
        if not text.endswith("\ufffd"):  # a character whose bytes are not all drawn yet waits for them
            say(text[len(shown):])
            shown = text
    text = tokenizer.decode(new)
    say(text[len(shown):])
    return prompt + text


@torch.no_grad()
def generate(model: Transformer, ids: list[int], *, max_new_tokens: int, temperature: float, top_k: int,
             generator: torch.Generator) -> Iterator[int]:
    """Sample tokens one at a time, each as it is drawn (no key/value cache: the models here are small)."""
    window = model.config.max_seq_len
    seq = list(ids)
    for _ in range(max_new_tokens):
        logits_V = model(torch.tensor([seq[-window:]]))[0, -1].float()
        if temperature == 0:
            seq.append(int(logits_V.argmax()))
        else:
            logits_V = logits_V / temperature
            if 0 < top_k < logits_V.numel():
                kth = torch.topk(logits_V, top_k).values[-1]
                logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
            seq.append(int(torch.multinomial(logits_V.softmax(-1), 1, generator=generator)))
        yield seq[-1]
