"""OneS knowledge gathering (shoal.experiments.ones.gather): each method against its formula on hand-made
experts, the student's weights by name, and the shapes gathering refuses. Pure tensor math:
the expected values are exact (float64 inside, small integers and diagonal matrices here)."""

from __future__ import annotations

import pytest
import torch

from shoal.experiments.ones.gather import (
    check_fits,
    default_entries,
    default_k,
    default_rank,
    gather,
    largest_entries,
    student_config,
    student_weights,
    top_experts,
    truncated,
)
from shoal.models import Transformer
from shoal.models.config import PRESETS, ModelConfig
from shoal.testing.asserts import one_line_error

# Three "experts" of a 2x2 matrix each: diagonal, so their singular values are visible.
STACK = torch.tensor([[[3.0, 0.0], [0.0, 1.0]],
                      [[1.0, 0.0], [0.0, 2.0]],
                      [[0.0, 0.0], [0.0, 4.0]]])
USAGE = torch.tensor([0.2, 0.5, 0.3])


def test_sum_is_the_sum_over_experts():
    assert torch.equal(gather(STACK, "sum"), torch.tensor([[4.0, 0.0], [0.0, 7.0]]))


def test_mean_is_the_average_over_experts():
    assert torch.equal(gather(STACK, "mean"), torch.tensor([[4 / 3, 0.0], [0.0, 7 / 3]]))


def test_topk_sums_each_experts_largest_entries():
    # K = 1: each expert keeps its one entry of largest magnitude: 3 at (0,0), 2 at (1,1), 4 at (1,1)
    assert torch.equal(gather(STACK, "topk", k=1), torch.tensor([[3.0, 0.0], [0.0, 6.0]]))
    # K = 2 keeps both diagonals; expert 2's tie (two zeros) keeps the lower index: still the sum
    assert torch.equal(gather(STACK, "topk", k=2), gather(STACK, "sum"))
    # the default K = ceil(4 / 3) = 2
    assert torch.equal(gather(STACK, "topk"), gather(STACK, "topk", k=2))
    # signs: magnitude decides, the kept entry keeps its sign
    signed = torch.tensor([[[-5.0, 1.0], [2.0, -3.0]], [[0.5, -4.0], [1.0, 0.0]]])
    assert torch.equal(gather(signed, "topk", k=2), torch.tensor([[-5.0, -4.0], [1.0, -3.0]]))


def test_topk_against_its_formula_and_reduces_to_sum():
    gen = torch.Generator().manual_seed(0)
    stack = torch.randn(4, 6, 5, generator=gen, dtype=torch.float64)
    expected = torch.zeros(6, 5, dtype=torch.float64)
    for w in stack:  # TopK(W_e): zero every entry below the K-th largest magnitude
        threshold = w.abs().flatten().sort(descending=True).values[7 - 1]
        expected += torch.where(w.abs() >= threshold, w, torch.zeros_like(w))
    assert torch.equal(gather(stack, "topk", k=7), expected)
    assert torch.equal(largest_entries(stack, 7).ne(0).flatten(1).sum(1), torch.full((4,), 7))
    assert torch.allclose(gather(stack, "topk", k=30), gather(stack, "sum"), rtol=0, atol=0)
    assert default_entries(stack) == 8  # ceil(30 / 4)


def test_top_experts_averages_the_most_used_experts():
    # usage 0.2, 0.5, 0.3: k=2 keeps experts 1 and 2, k=1 expert 1 alone, k=3 all (= mean)
    assert top_experts(USAGE, 2).tolist() == [1, 2]
    assert torch.equal(gather(STACK, "top-experts", k=2, usage=USAGE), torch.tensor([[0.5, 0.0], [0.0, 3.0]]))
    assert torch.equal(gather(STACK, "top-experts", k=1, usage=USAGE), STACK[1])
    assert torch.allclose(gather(STACK, "top-experts", k=3, usage=USAGE), gather(STACK, "mean"))


def test_svd_sums_each_experts_top_singular_components():
    # rank 1 keeps each expert's largest singular value: diag(3,0), diag(0,2), diag(0,4) -> sum
    assert torch.allclose(gather(STACK, "svd", k=1), torch.tensor([[3.0, 0.0], [0.0, 6.0]]))
    # full rank is the plain sum
    assert torch.allclose(gather(STACK, "svd", k=2), gather(STACK, "sum"))
    # a general matrix: the sum of torch's own rank-r reconstructions (Eckart-Young)
    gen = torch.Generator().manual_seed(0)
    stack = torch.randn(4, 6, 5, generator=gen, dtype=torch.float64)
    expected = torch.stack([_rank_r(w, 2) for w in stack]).sum(0)
    assert torch.allclose(gather(stack, "svd", k=2), expected, atol=1e-12)
    assert torch.allclose(gather(stack, "svd", k=5), gather(stack, "sum"), atol=1e-12)
    assert torch.linalg.matrix_rank(truncated(stack, 2)[0]) == 2
    assert default_rank(stack) == 1  # min(6, 5) // 4


@pytest.mark.parametrize("method", ["svd", "topk"])
def test_svd_and_topk_sum_bias_vectors(method):
    biases = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert torch.equal(gather(biases, method, k=1), torch.tensor([4.0, 6.0]))


def _rank_r(w: torch.Tensor, r: int) -> torch.Tensor:
    U, S, Vh = torch.linalg.svd(w)
    return sum(S[i] * torch.outer(U[:, i], Vh[i]) for i in range(r))  # type: ignore[return-value]


TEACHER = ModelConfig(num_layers=2, dim=16, num_heads=2, ffn_dim=24, vocab_size=32, max_seq_len=8,
                      num_experts=4, top_k=2, moe_every=2)


def test_student_weights_fill_the_dense_model_by_name():
    torch.manual_seed(0)
    teacher = Transformer(TEACHER).state_dict()
    student = Transformer(student_config(TEACHER))
    weights = student_weights(teacher, "mean")
    assert set(weights) == set(student.state_dict())
    student.load_state_dict(weights)  # shapes fit
    experts_w2 = teacher["layers.1.feed_forward.experts.w2"]
    assert torch.equal(weights["layers.1.feed_forward.w2.weight"], experts_w2.double().mean(0).float())
    assert torch.equal(weights["layers.0.feed_forward.w1.weight"], teacher["layers.0.feed_forward.w1.weight"])
    assert torch.equal(weights["layers.1.attention.wq.weight"], teacher["layers.1.attention.wq.weight"])


def test_default_student_and_k():
    moe = PRESETS["tiny-moe"]
    student = student_config(moe)
    assert student.num_experts == 0 and student.ffn_dim == moe.ffn_dim and student.dim == moe.dim
    assert default_k("topk", moe) == -(-moe.ffn_dim * moe.dim // moe.num_experts)
    assert default_k("top-experts", moe) == moe.top_k
    assert default_k("svd", moe) == min(moe.ffn_dim, moe.dim) // moe.num_experts
    assert default_k("mean", moe) is None


@pytest.mark.parametrize("method, sets, k, names", [
    ("svd", ["ffn_dim=100"], None, ["ffn_dim=100", "ffn_dim=24", "--gather none"]),
    ("mean", ["dim=32"], None, ["dim=32", "dim=16"]),
    ("top-experts", [], 5, ["--gather-k 5", "1..4"]),
    ("svd", [], 17, ["--gather-k 17", "1..16"]),
    ("topk", [], 385, ["--gather-k 385", "1..384"]),
    ("topk", [], 0, ["--gather-k 0", "1..384"]),
    ("sum", [], 2, ["--gather-k 2", "topk, svd or top-experts"]),
    ("avg", [], None, ["'avg'", "sum, mean, topk, svd, top-experts, none"]),
])
def test_refuses_what_gathering_cannot_fill(method, sets, k, names):
    message = one_line_error(check_fits, TEACHER, student_config(TEACHER, sets), method, k)
    for name in names:
        assert name in message, (name, message)


def test_refuses_a_dense_teacher_and_accepts_any_shape_from_random_init():
    dense = TEACHER.replace(num_experts=0)
    assert "num_experts" in one_line_error(check_fits, dense, student_config(dense), "mean", None)
    check_fits(TEACHER, student_config(TEACHER, ["ffn_dim=100", "num_layers=1"]), "none", None)
