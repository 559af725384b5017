"""MoE layer throughput against a naive loop over experts and against DeepSpeed's and fairscale's
MoE layers, and the all-to-all bytes of expert parallelism against the analytic volume.

1. Throughput: forward + backward of one MoE layer (SwiGLU experts of width F, top-2, capacity
   factor 1.25; fairscale's Top2Gate fixes its capacity at 2*ceil(N/E) per group, i.e. factor 2)
   on N tokens of width D, tokens/s (median of repeats, one process, one thread), for E = 8, 16:
   shoal's MoELayer; a naive layer (for each expert, select its tokens by mask, run its FFN,
   scatter-add back: what a first implementation writes); DeepSpeed's `deepspeed.moe.layer.MoE`
   and fairscale's `MOELayer` + `Top2Gate`, when installed (`DS_BUILD_OPS=0 pip install
   --no-build-isolation deepspeed==0.19.8`, `pip install --no-deps fairscale==0.4.13`), each with
   an expert of the same shape. Ratios shoal / peer.
2. All-to-all bytes under ep2 (2 gloo processes): the bytes shoal's dispatcher sends per step per
   device and direction, against the analytic T*k*h (each token's k choices, h = D values of 4
   bytes, tokens T per device) and the padded volume E*C*h that a capacity-padded dispatcher
   (GShard, DeepSpeed, fairscale) sends whatever the routing.

    python -m bench.moe_layer [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bench.common import launch, report, summarize
from shoal.infra.launch import free_port
from shoal.moe.dispatch import capacity
from shoal.moe.layer import MoELayer

D, FFN, K, CAP = 256, 512, 2, 1.25


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, FFN, bias=False), nn.Linear(FFN, D, bias=False)
        self.w3 = nn.Linear(D, FFN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class NaiveMoE(nn.Module):
    """Top-2 softmax routing (no capacity) and a Python loop over experts with masks."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(D, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU() for _ in range(num_experts))

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x_ND).softmax(-1).topk(K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x_ND)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, expert(x_ND[token]) * weights[token, slot, None])
        return out


def _time(layer: nn.Module, x: torch.Tensor, repeats: int) -> dict[str, float]:
    def step() -> None:
        x.grad = None
        out = layer(x)
        (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()

    for _ in range(2):
        step()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return summarize([x.shape[0] / s for s in samples])  # tokens/s


class _Grouped(nn.Module):
    """fairscale's MOELayer takes (groups, tokens, D) with the groups a multiple of the experts."""

    def __init__(self, layer: nn.Module, groups: int) -> None:
        super().__init__()
        self.layer, self.groups = layer, groups

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.layer(x_ND.view(self.groups, -1, x_ND.shape[-1])).reshape(x_ND.shape)


def _peers(num_experts: int) -> dict[str, nn.Module]:
    peers: dict[str, nn.Module] = {}
    try:
        from deepspeed.moe.layer import MoE as DeepSpeedMoE

        peers["deepspeed"] = DeepSpeedMoE(hidden_size=D, expert=SwiGLU(), num_experts=num_experts, ep_size=1, k=K,
                                          capacity_factor=CAP, eval_capacity_factor=CAP, min_capacity=0)
    except Exception as exc:  # not installed, or it failed to build: say so in the table
        peers["deepspeed"] = exc  # type: ignore[assignment]  # the table shows the error in its place
    try:
        from fairscale.nn import MOELayer, Top2Gate

        peers["fairscale"] = _Grouped(MOELayer(Top2Gate(D, num_experts),
                                               nn.ModuleList(SwiGLU() for _ in range(num_experts))), num_experts)
    except Exception as exc:
        peers["fairscale"] = exc  # type: ignore[assignment]  # the table shows the error in its place
    return peers


def throughput(tokens: int, experts: list[int], repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    if not dist.is_initialized():  # DeepSpeed and fairscale ask for a process group even alone
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    rows = []
    for E in experts:
        torch.manual_seed(0)
        x = torch.randn(tokens, D, requires_grad=True)
        layers = {"shoal": MoELayer(D, FFN, num_experts=E, top_k=K, capacity_factor=CAP), "naive loop": NaiveMoE(E)}
        layers.update(_peers(E))
        results = {}
        for name, layer in layers.items():
            if isinstance(layer, Exception):
                results[name] = f"not run: {type(layer).__name__}: {str(layer).splitlines()[0][:60]}"
                continue
            results[name] = _time(layer, x, repeats)
        shoal = results["shoal"]["median"]
        for name, r in results.items():
            row = {"E": E, "layer": name}
            if isinstance(r, str):
                row["note"] = r
            else:
                row.update({"tokens_per_s": r["median"], "range": f"{r['min']:.0f}-{r['max']:.0f}",
                            "shoal / this": shoal / r["median"]})
            rows.append(row)
    return rows


def _a2a_bytes(tokens: int, num_experts: int, capacity_factor: float) -> dict[str, float]:
    from shoal.parallel.expert import AllToAllDispatcher, apply_expert_parallel, ep_mesh

    torch.manual_seed(0)
    layer = MoELayer(D, FFN, num_experts=num_experts, top_k=K, capacity_factor=capacity_factor)
    apply_expert_parallel(layer, ep_mesh(2, 2, "cpu"))
    sent = []
    original = AllToAllDispatcher.communicate

    def counted(self, tokens_MD, splits_E):  # bytes to the other rank, forward direction
        rank = dist.get_rank()
        local = num_experts // 2
        per_rank = splits_E.view(2, local).sum(1)
        sent.append(float(per_rank[1 - rank]) * D * tokens_MD.element_size())
        return original(self, tokens_MD, splits_E)

    AllToAllDispatcher.communicate = counted  # type: ignore[method-assign]  # counts the bytes sent, for this bench
    torch.manual_seed(1 + dist.get_rank())
    layer(torch.randn(1, tokens, D)).sum().backward()
    cap = capacity(tokens, num_experts, K, capacity_factor)
    return {"sent_to_other": sent[0], "analytic_Tkh_half": tokens * K * D * 4 / 2,
            "padded_ECh_half": (num_experts * cap * D * 4 / 2) if cap else float("nan")}


def a2a_table(tokens: int) -> list[dict]:
    rows = []
    for E in (8, 16):
        for cf in (1.25, 0.0):
            per_rank = launch(_a2a_bytes, 2, tokens, E, cf)
            r = per_rank[0]
            rows.append({"E": E, "capacity_factor": cf, "sent MiB": r["sent_to_other"] / 2**20,
                         "analytic T*k*h/2 MiB": r["analytic_Tkh_half"] / 2**20,
                         "padded E*C*h/2 MiB": r["padded_ECh_half"] / 2**20,
                         "sent / analytic": r["sent_to_other"] / r["analytic_Tkh_half"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    tokens = 1024 if args.quick else 4096
    report("moe_layer", throughput(tokens, [8] if args.quick else [8, 16], 3 if args.quick else 7),
           notes=f"forward+backward of one layer, N={tokens} tokens, D={D}, F={FFN}, top-{K}, capacity {CAP} "
                 "(naive loop: no capacity); tokens/s median of repeats, 1 thread")
    report("moe_all_to_all", a2a_table(tokens),
           notes="ep2: bytes one rank sends the other in the dispatch all-to-all (the combine sends as many back); "
                 "T*k*h/2: the analytic volume to the other half of the experts under even routing; E*C*h/2: what "
                 "a capacity-padded dispatcher sends")


if __name__ == "__main__":
    main()
