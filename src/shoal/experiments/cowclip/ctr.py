"""A CTR model as a user writes it (one embedding table per categorical field, their vectors concatenated into a
small MLP, one logit), the synthetic click data it learns (Zipf-distributed ids, a planted signal per field and id,
one pairwise interaction, labels drawn from the true logit's sigmoid) and the AUC that scores it. The model is a
plain module: it trains under the data axes (dp, fsdp) like any user's, with no adapter."""

from __future__ import annotations

import torch
from torch import nn


class CTRModel(nn.Module):
    """An embedding table per categorical field, concatenated into an MLP with one logit."""

    def __init__(self, num_fields: int, vocab: int, dim: int, hidden: tuple[int, ...]) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(vocab, dim) for _ in range(num_fields))
        for table in self.embeddings:
            assert isinstance(table, nn.Embedding)
            nn.init.normal_(table.weight, std=0.01)
        layers: list[nn.Module] = []
        width = num_fields * dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.mlp = nn.Sequential(*layers, nn.Linear(width, 1))

    def forward(self, ids_BF: torch.Tensor) -> torch.Tensor:
        x = torch.cat([table(ids_BF[:, f]) for f, table in enumerate(self.embeddings)], dim=1)
        return self.mlp(x).squeeze(1)


def click_data(*, fields: int, vocab: int, samples: int, test_samples: int, zipf: float, seed: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(train ids, train labels, test ids, test labels, the true logit's test AUC): Zipf ids, a
    planted additive signal per (field, id) plus one pairwise interaction of fields 0 and 1."""
    gen = torch.Generator().manual_seed(seed)
    n = samples + test_samples
    frequency = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** zipf
    ids = torch.stack([torch.multinomial(frequency, n, replacement=True, generator=gen)
                       for _ in range(fields)], dim=1)
    perm = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(fields)])
    ids = torch.gather(perm.T, 0, ids)  # frequent ids are not the low ones
    weights = torch.randn(fields, vocab, generator=gen) * 0.6
    latent = torch.randn(2, vocab, 4, generator=gen) * 0.6
    logit = weights[torch.arange(fields), ids].sum(1) + (latent[0, ids[:, 0]] * latent[1, ids[:, 1]]).sum(1) - 1.0
    labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
    s = samples
    return ids[:s], labels[:s], ids[s:], labels[s:], auc(logit[s:], labels[s:])


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the Mann-Whitney statistic, ties counted half."""
    order = torch.argsort(scores.double())
    ranks = torch.empty_like(order, dtype=torch.float64)
    sorted_scores = scores.double()[order]
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    ranks[order] = (ends - (counts.double() - 1) / 2)[inverse]  # average rank of each tie group, 1-based
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
