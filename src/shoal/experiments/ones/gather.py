"""Knowledge gathering (OneS, Xue et al. 2022, arXiv 2201.10890): the experts of each MoE layer
folded into the one dense feed-forward block of a student model. Pure tensor math on full
weights by name; no process group.

Each MoE layer holds E experts with stacked weights w1, w3 (E, F, D), w2 (E, D, F) and, with
biases, b1, b3 (E, F), b2 (E, D). The dense student's block has w1.weight, w3.weight (F, D),
w2.weight (D, F) and their biases, so every method below maps a stack W_e (e = 1..E) of one
expert matrix to one matrix of the same shape as an expert's:

- sum:  W = sum_e W_e                                    (the paper's summation)
- mean: W = (1/E) sum_e W_e                              (the paper's averaging)
- topk: W = sum_e TopK(W_e), TopK keeping the K entries of W_e of largest magnitude and setting
        the rest to zero (Top-K Knowledge Gathering, Top-KG). K defaults to ceil(F D / E), so that
        the E experts' kept entries together number one matrix's worth.
- svd:  W = sum_e U_e[:, :r] diag(s_e[:r]) V_e[:, :r]^T with W_e = U_e diag(s_e) V_e^T: each
        expert's best rank-r approximation (Eckart-Young), summed (SVD Knowledge Gathering,
        SVD-KG). r defaults to min(F, D) // E, so that the E experts' kept components together
        span one matrix's rank.
- top-experts: W = (1/k) sum_{e in S} W_e, S the k experts the teacher's router used most (their
        share of the kept token assignments on a few training batches). Not one of the paper's
        four: a baseline that selects whole experts by routing instead of entries or components
        within each. k defaults to the teacher's top_k; k = E is `mean`.

Sources: the paper's abstract and public summaries of it, which say that OneS proposes "four
knowledge gathering methods: summation, averaging, Top-K Knowledge Gathering (Top-KG) and SVD
Knowledge Gathering (SVD-KG)", that "Top-KG and SVD-KG aim to select the most crucial knowledge
from each expert", and that "the latter two methods extract the important parameters as far as
possible". topk and svd follow that description: select within each expert, then merge as
summation does. Both reduce to the paper's summation exactly when nothing is dropped (K = F D,
r = min(F, D)). Bias vectors have no singular values and their selection is not described: topk
and svd sum them (as `sum` does); top-experts averages the chosen experts' biases.

Every method fills exactly an expert's shape: the student's ffn_dim must be the experts' (and
its other shapes the teacher's), or `check_fits` refuses it. `none` gathers nothing: the student
starts from its seed's random weights (any shape), the baseline of the experiment.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from shoal.models.config import ModelConfig

GATHERS = ("sum", "mean", "topk", "svd", "top-experts", "none")
"""The ways a dense student starts: from the experts by one of five rules, or from its seed (none)."""

EXPERT_TO_DENSE = {"w1": "w1.weight", "w2": "w2.weight", "w3": "w3.weight",
                   "b1": "w1.bias", "b2": "w2.bias", "b3": "w3.bias"}
"""Stacked expert tensor -> the dense FeedForward tensor it becomes (shoal's names)."""

_EXPERT_NAME = re.compile(r"^(layers\.\d+\.feed_forward)\.experts\.(w1|w2|w3|b1|b2|b3)$")
_ROUTER_NAME = re.compile(r"^layers\.\d+\.feed_forward\.router\.")


def gather(stack: torch.Tensor, method: str, *, k: int | None = None,
           usage: torch.Tensor | None = None) -> torch.Tensor:
    """One expert tensor stacked over E experts (E, ...) -> one tensor (...) by `method`.

    k is topk's entries kept per expert matrix or svd's rank kept per expert (None: the defaults
    above), or top-experts' number of experts, which needs k and `usage` (E,), the router's share
    of assignments per expert. A bias (E, N) is summed by topk and svd."""
    E = stack.shape[0]
    work = stack.double()  # the sums and the SVD in float64: gathering adds no rounding of its own
    if method == "sum":
        out = work.sum(0)
    elif method == "mean":
        out = work.mean(0)
    elif method == "topk":
        out = work.sum(0) if stack.dim() < 3 else largest_entries(work, k or default_entries(stack)).sum(0)
    elif method == "svd":
        out = work.sum(0) if stack.dim() < 3 else truncated(work, k or default_rank(stack)).sum(0)
    elif method == "top-experts":
        if usage is None or k is None or not 1 <= k <= E:
            raise ValueError(f"top-experts gathering needs the router usage of the {E} experts and 1 <= k <= {E}; "
                             f"got k={k}")
        out = work[top_experts(usage, k)].mean(0)
    else:
        raise ValueError(f"gathering {method!r} is not valid; valid: {', '.join(GATHERS)}")
    return out.to(stack.dtype)


def largest_entries(stack_EMN: torch.Tensor, count: int) -> torch.Tensor:
    """Each matrix of the stack with only its `count` entries of largest magnitude kept, the rest
    zero (ties: the lower flat index is kept)."""
    flat = stack_EMN.flatten(1)
    order = torch.sort(flat.abs(), dim=1, descending=True, stable=True).indices[:, :count]
    keep = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, order, True)
    return torch.where(keep, flat, torch.zeros_like(flat)).view_as(stack_EMN)


def default_entries(stack_EMN: torch.Tensor) -> int:
    """topk's default K: ceil(M N / E) entries per expert matrix."""
    E, M, N = stack_EMN.shape
    return -(-M * N // E)


def top_experts(usage: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k most used experts, most used first (ties: the lower index)."""
    order = sorted(range(usage.shape[0]), key=lambda e: (-float(usage[e]), e))
    return torch.tensor(order[:k], dtype=torch.long)


def truncated(stack_EMN: torch.Tensor, rank: int) -> torch.Tensor:
    """Each matrix of the stack replaced by its best rank-`rank` approximation (Eckart-Young)."""
    U, S, Vh = torch.linalg.svd(stack_EMN, full_matrices=False)
    r = min(rank, S.shape[-1])
    return U[..., :r] @ torch.diag_embed(S[..., :r]) @ Vh[..., :r, :]


def default_rank(stack_EMN: torch.Tensor) -> int:
    """svd's default rank: min(M, N) // E, at least 1."""
    E, M, N = stack_EMN.shape
    return max(1, min(M, N) // E)


def k_limit(method: str, teacher: ModelConfig) -> int | None:
    """The largest --gather-k `method` takes (the smallest is 1); None: it takes no k."""
    return {"topk": teacher.ffn_dim * teacher.dim, "svd": min(teacher.ffn_dim, teacher.dim),
            "top-experts": teacher.num_experts}.get(method)


def default_k(method: str, teacher: ModelConfig) -> int | None:
    """--gather-k when left out: topk keeps ceil(F D / E) entries of each expert matrix, svd
    min(F, D) // E components of each expert, top-experts as many experts as a token uses (top_k);
    the others take no k."""
    E = teacher.num_experts
    if method == "topk":
        return -(-teacher.ffn_dim * teacher.dim // E)
    if method == "svd":
        return max(1, min(teacher.ffn_dim, teacher.dim) // E)
    if method == "top-experts":
        return teacher.top_k
    return None


def student_config(teacher: ModelConfig, overrides: Sequence[str] = ()) -> ModelConfig:
    """The default student: the teacher's shape with every MoE layer's experts replaced by one
    dense FFN of an expert's width (num_experts=0), then `--set` overrides."""
    return teacher.replace(num_experts=0, num_shared_experts=0, num_prototypes=0, share_moe=False,
                           shared_gate=False).with_overrides(list(overrides))


def check_fits(teacher: ModelConfig, student: ModelConfig, method: str, k: int | None) -> None:
    """Refuse (ValueError, one line) a teacher without experts, and a student shape or k the
    gathering cannot fill."""
    if method not in GATHERS:
        raise ValueError(f"--gather {method!r} is not valid; valid: {', '.join(GATHERS)}")
    if teacher.num_experts == 0:
        raise ValueError("the teacher is a dense model (num_experts=0): there are no experts to distil; "
                         "valid: a run folder of an MoE model (num_experts >= 1)")
    if teacher.num_shared_experts or teacher.share_moe:
        raise ValueError("the teacher has shared experts or WideNet-shared MoE layers, which gathering does not "
                         "fold yet; valid: a teacher with num_shared_experts=0 and share_moe=false")
    if student.num_experts:
        raise ValueError(f"the student must be dense, got --set num_experts={student.num_experts}; valid: 0")
    if method == "none":
        return
    kept = ("num_layers", "dim", "num_heads", "num_kv_heads", "head_size", "vocab_size", "max_seq_len", "norm",
            "activation", "pos_emb", "bias", "qkv_bias", "qk_norm", "tie_embeddings", "ffn_dim", "moe_every")
    for name in kept:
        want, got = getattr(teacher, name), getattr(student, name)
        if name == "moe_every" or want == got:
            continue
        what = "the experts' width" if name == "ffn_dim" else "the teacher's"
        raise ValueError(f"--gather {method} fills a student of {what} {name}={want}, not {name}={got}; valid: "
                         f"{name}={want}, or --gather none (a randomly initialised student of any shape)")
    limit = k_limit(method, teacher)
    if limit is None and k is not None:
        raise ValueError(f"--gather-k {k} with --gather {method}, which takes no k; valid: --gather topk, svd "
                         "or top-experts")
    if limit is not None and k is not None and not 1 <= k <= limit:
        what = {"topk": "entries per expert matrix", "svd": "singular components per expert",
                "top-experts": "experts"}[method]
        raise ValueError(f"--gather-k {k}: {method} keeps 1..{limit} {what}; valid: 1..{limit}")


def student_weights(teacher: Mapping[str, torch.Tensor], method: str, *, k: int | None = None,
                    usage: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The dense student's full weights from the teacher's: every tensor copied by name, each MoE
    layer's experts gathered into its dense FFN, the routers dropped. `usage` maps a layer's
    index ("3") to its experts' router usage (top-experts only)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in teacher.items():
        match = _EXPERT_NAME.match(name)
        if match is None:
            if not _ROUTER_NAME.match(name):
                out[name] = tensor
            continue
        block, kind = match.groups()
        layer = block.split(".")[1]
        layer_usage = usage.get(layer) if usage is not None else None
        if method == "top-experts" and layer_usage is None:
            raise ValueError(f"top-experts gathering needs the router usage of layer {layer}; the teacher's metrics "
                             "record none")
        out[f"{block}.{EXPERT_TO_DENSE[kind]}"] = gather(tensor, method, k=k, usage=layer_usage)
    return out
