"""Memory while loading pretrained weights (`--init`, shoal/models/safetensors_io.py) on each rank.

Writes a Hugging Face Llama folder of a few hundred MB (tensor by tensor, never the whole model in
one process), then on 1 and 2 gloo processes builds the model on the meta device and loads it
under a plan, sampling each rank's resident memory every millisecond. Reports per rank: the
parameters it holds (its shard), the largest single tensor of the model, and the peak growth of
anonymous memory (what the load allocates) and of file-backed memory (mapped file pages, given
back when the files close) over the meta model's baseline. The claim checked: the anonymous
growth is at most the rank's shard plus the largest tensor.

    PYTHONPATH=src python -m bench.init_memory [--dim 768 --layers 8 --vocab 32000]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import torch

from shoal import rules
from shoal.models import ModelConfig, Transformer
from shoal.models.hf.families import hf_config, hf_layout, hf_shape, to_hf_tensor
from shoal.models.init import fill_slice_
from shoal.models.safetensors_io import write_streaming

MiB = 2**20


def write_folder(cfg: ModelConfig, folder: Path) -> int:
    """A LlamaForCausalLM folder of `cfg` with the seed's values; returns the largest tensor's bytes."""
    import json

    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    specs = {n: model.init_spec(n, len(s)) for n, s in shapes.items()}
    by_hf = {entry.name: entry for entry in hf_layout(cfg)}

    def seed_values(name: str) -> torch.Tensor:
        return fill_slice_(torch.empty(shapes[name]), specs[name], seed=0, name=name, shape=shapes[name],
                           offset=(0,) * len(shapes[name]))

    def fetch(hf: str) -> torch.Tensor:
        return to_hf_tensor(by_hf[hf], [seed_values(p) for p in by_hf[hf].parts], cfg)

    entries = [(hf, torch.float32, hf_shape(e, [shapes[p] for p in e.parts])) for hf, e in by_hf.items()]
    folder.mkdir(parents=True, exist_ok=True)
    write_streaming(folder / "model.safetensors", entries, fetch, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(cfg)))
    return max(4 * torch.Size(s).numel() for s in shapes.values())


def _status() -> tuple[int, int]:
    """(RssAnon, RssFile) of this process in bytes."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:")):
            key, kb, _ = line.split()
            values[key] = int(kb) * 1024
    return values["RssAnon:"], values["RssFile:"]


def load_and_measure(plan_text: str | None, folder: str, cfg: ModelConfig) -> dict:
    """On this rank: the meta model loaded under `plan_text` (None: one process) and its memory."""
    from shoal.apply_plan import parallelize
    from shoal.mesh import build_mesh
    from shoal.models.safetensors_io import open_pretrained
    from shoal.plan import Plan

    weights = open_pretrained(folder, cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    mesh = plan = None
    if plan_text is not None:
        import torch.distributed as dist

        plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size())
        mesh = build_mesh(plan)
    base = _status()
    peak = list(base)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            anon, file = _status()
            peak[0], peak[1] = max(peak[0], anon), max(peak[1], file)
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    runtime = parallelize(model, plan, mesh, weights=weights)
    seconds = time.perf_counter() - t0
    weights.close()
    done.set()
    thread.join()
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
               for p in runtime.parameters())
    after = _status()
    return {"held": held, "read": weights.bytes_read, "anon": peak[0] - base[0], "file": peak[1] - base[1],
            "anon_after": after[0] - base[0], "s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    cfg = ModelConfig(num_layers=args.layers, dim=args.dim, num_heads=12, num_kv_heads=4, ffn_dim=2048,
                      vocab_size=args.vocab, max_seq_len=256)
    from shoal.infra.pool import WorkerPool

    with tempfile.TemporaryDirectory() as tmp:
        largest = write_folder(cfg, Path(tmp) / "hf")
        total = 4 * cfg.num_params()
        print(f"model: {cfg.num_params() / 1e6:.0f}M parameters, {total / MiB:.0f} MiB fp32, "
              f"largest tensor {largest / MiB:.1f} MiB")
        print(f"{'plan':<10} {'rank':>4} {'shard MiB':>9} {'read MiB':>8} {'anon peak MiB':>13} "
              f"{'bound MiB':>9} {'file peak MiB':>13} {'s':>5}")
        runs: list[tuple[str, list[dict]]] = [("one", [load_and_measure(None, str(Path(tmp) / "hf"), cfg)])]
        for plan in ("fsdp2", "tp2", "pp2"):  # fresh processes: no memory freed by an earlier load to reuse
            pool = WorkerPool(2)
            try:
                runs.append((plan, pool.run(load_and_measure, plan, str(Path(tmp) / "hf"), cfg)))
            finally:
                pool.close()
        for plan, ranks in runs:
            for rank, r in enumerate(ranks):
                bound = r["held"] + largest
                print(f"{plan:<10} {rank:>4} {r['held'] / MiB:>9.1f} {r['read'] / MiB:>8.1f} "
                      f"{r['anon'] / MiB:>13.1f} {bound / MiB:>9.1f} {r['file'] / MiB:>13.1f} {r['s']:>5.2f}"
                      + ("" if r["anon"] <= bound else "  OVER"))


if __name__ == "__main__":
    main()
