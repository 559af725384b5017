"""E feed-forward experts with stacked weights, run over tokens already grouped by expert.

Three ways to compute the same thing (`Experts.path`):
- "grouped": one grouped GEMM per matrix over the jagged groups (`grouped_mm`); no loop, no
  padding, no host sync. The default on CUDA for bf16 activations.
- "padded": each expert's rows copied into an (E, C, D) buffer, one batched matmul per matrix;
  C is the capacity when there is one (no host sync), else the largest count (one sync).
  The default on CUDA otherwise.
- "loop": a Python loop of E matmuls over the split (reads the counts to the host).
"auto" picks per call; on CPU it runs CPU_PATH. All paths agree to float32 rounding.

Shape legend: M sorted rows, D model dim, F expert hidden dim, E experts, C rows per expert
in the padded buffer, I/O a matrix's input/output width.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

PATHS = ("auto", "grouped", "padded", "loop")
CPU_PATH = "loop"
"""What "auto" runs on CPU: the fastest forward + backward of the three paths in bench/moe_experts_cpu.py
(docs/measurements.md). On CPU torch's grouped_mm is itself a loop of matmuls, and it also wants 16-byte
aligned rows."""

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
Weights = dict[str, torch.Tensor]
"""Name -> the stacked tensor (the padded and grouped paths) or one expert's slice of it (the loop): w1 and w2
always, w3 and the biases b1, b2, b3 where the experts have them (and what a subclass adds, shoal.models.lora)."""
WEIGHT_NAMES = ("w1", "w2", "w3", "b1", "b2", "b3")


class Experts(nn.Module):
    """E independent FFNs, each the dense FeedForward's math: SwiGLU w2(silu(w1 x) * w3 x)
    (Shazeer 2020) or GELU w2(gelu_tanh(w1 x)). Weights are stacked, w1/w3 (E, F, D) and
    w2 (E, D, F), so a whole layer is one parameter per matrix, sliceable by expert.

    `forward(tokens_MD, tokens_per_expert)` takes rows sorted by expert: the first
    tokens_per_expert[0] rows go to expert 0, and so on. Rows past the sum are not computed:
    their output is zero and no gradient reaches them (the dispatcher parks dropped choices there).
    """

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, *, activation: str = "swiglu",
                 bias: bool = False, init_std: float = 0.02, num_layers: int = 1) -> None:
        super().__init__()
        if activation not in ("swiglu", "gelu"):
            raise ValueError(f"activation={activation!r}; valid: 'swiglu', 'gelu'")
        for name, value in (("num_experts", num_experts), ("dim", dim), ("ffn_dim", ffn_dim)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        E, D, Fh = num_experts, dim, ffn_dim
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(E, Fh, D))
        self.w2 = nn.Parameter(torch.empty(E, D, Fh))
        self.w3 = nn.Parameter(torch.empty(E, Fh, D)) if activation == "swiglu" else None
        self.b1 = nn.Parameter(torch.empty(E, Fh)) if bias else None
        self.b2 = nn.Parameter(torch.empty(E, D)) if bias else None
        self.b3 = nn.Parameter(torch.empty(E, Fh)) if bias and activation == "swiglu" else None
        self.path = "auto"
        """One of PATHS; "auto" chooses per call by device and dtype."""
        self.init_weights(init_std, num_layers)

    @torch.no_grad()
    def init_weights(self, std: float, num_layers: int) -> None:
        """As the dense layers: normal(0, std) for w1/w3, std / sqrt(2 * num_layers) for the
        residual output w2 (GPT-2), zero biases."""
        nn.init.normal_(self.w1, std=std)
        nn.init.normal_(self.w2, std=std / math.sqrt(2 * num_layers))
        if self.w3 is not None:
            nn.init.normal_(self.w3, std=std)
        for b in (self.b1, self.b2, self.b3):
            if b is not None:
                nn.init.zeros_(b)

    def choose_path(self, tokens_MD: torch.Tensor) -> str:
        """The path "auto" takes for these tokens."""
        if tokens_MD.device.type != "cuda":
            return CPU_PATH
        # The grouped kernel wants bf16 and 16-byte aligned rows.
        aligned = tokens_MD.shape[-1] % 8 == 0 and self.w1.shape[1] % 8 == 0
        if _grouped_mm is not None and tokens_MD.dtype == torch.bfloat16 and aligned:
            return "grouped"
        return "padded"

    def forward(self, tokens_MD: torch.Tensor, tokens_per_expert: torch.Tensor, *,
                capacity: int | None = None) -> torch.Tensor:
        """y_MD for rows grouped by expert. `capacity`, when known, bounds every count (the padded
        path pads to it instead of reading the largest count back from the device)."""
        assert tokens_per_expert.shape == (self.num_experts,), tokens_per_expert.shape
        device = tokens_MD.device.type
        if torch.is_autocast_enabled(device):  # 16 bits without FSDP2 (shoal.parallel.precision.Autocast): the
            tokens_MD = tokens_MD.to(torch.get_autocast_dtype(device))  # products' dtype, so the grouped kernel runs
        path = self.choose_path(tokens_MD) if self.path == "auto" else self.path
        if path == "grouped":
            return self._grouped(tokens_MD, tokens_per_expert)
        if path == "padded":
            return self._padded(tokens_MD, tokens_per_expert, capacity)
        if path == "loop":
            return self._loop(tokens_MD, tokens_per_expert)
        raise ValueError(f"Experts.path={self.path!r}; valid: {', '.join(PATHS)}")

    def _weights(self) -> Weights:
        """The tensors the experts compute with, by name (a local view where expert parallelism set one)."""
        return {name: w for name in WEIGHT_NAMES if (w := getattr(self, name)) is not None}

    def _mlp(self, linear: Linear, x: torch.Tensor, weights: Weights) -> torch.Tensor:
        h = self._project(linear, x, weights, "w1")
        if "w3" in weights:
            h = F.silu(h) * self._project(linear, x, weights, "w3")
        else:
            h = F.gelu(h, approximate="tanh")
        return self._project(linear, h, weights, "w2")

    def _project(self, linear: Linear, x: torch.Tensor, weights: Weights, matrix: str) -> torch.Tensor:
        """x through matrix `matrix` (w1, w2 or w3) and its bias."""
        return linear(x, weights[matrix], weights.get("b" + matrix[1:]))

    def _loop(self, x_MD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        counts = counts_E.tolist()  # host sync on CUDA: the split sizes
        # Each stacked weight split into its experts once (unbind): indexing w[e] per expert would
        # write, in backward, every expert's gradient into zeros the size of the whole stack and add
        # those E tensors up (E times the stack's memory traffic, per matrix and layer).
        split = {name: w.to(x_MD.dtype).unbind(0) for name, w in self._weights().items()}
        outputs = []
        for e, x_e in enumerate(x_MD[:sum(counts)].split(counts)):
            outputs.append(self._mlp(F.linear, x_e, {name: w[e] for name, w in split.items()}))
        # The tail in the products' dtype (autocast may have changed it), so cat keeps that dtype.
        outputs.append(outputs[-1].new_zeros(x_MD.shape[0] - sum(counts), x_MD.shape[1]))
        return torch.cat(outputs)

    def _padded(self, x_MD: torch.Tensor, counts_E: torch.Tensor, capacity: int | None) -> torch.Tensor:
        E, (M, D) = self.num_experts, x_MD.shape
        # Host sync on CUDA in dropless mode only: the buffer's size is the largest count.
        C = capacity if capacity is not None else int(counts_E.max())
        first_row_E = torch.cumsum(counts_E, 0) - counts_E
        # Buffer slot (e, c) holds sorted row first_row[e] + c while c < counts[e], else zeros.
        slot_C = torch.arange(C, device=x_MD.device)
        row_EC = (first_row_E[:, None] + slot_C).clamp(max=M - 1)
        filled_EC = slot_C < counts_E[:, None]
        x_ECD = torch.where(filled_EC[..., None], x_MD[row_EC], 0)

        def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            y = torch.bmm(x, w.to(x.dtype).transpose(1, 2))
            return y if b is None else y + b.to(x.dtype)[:, None, :]

        y_ECD = self._mlp(linear, x_ECD, self._weights())
        expert_M, valid_M = _row_experts(counts_E, M)
        slot_M = torch.arange(M, device=x_MD.device) - first_row_E[expert_M]
        y_MD = y_ECD.reshape(E * C, D)[(expert_M * C + slot_M).clamp(0, E * C - 1)]
        return torch.where(valid_M[:, None], y_MD, 0)

    def _grouped(self, x_MD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        assert _grouped_mm is not None
        M = x_MD.shape[0]
        offsets_E = torch.cumsum(counts_E, 0).to(torch.int32)
        expert_M, valid_M = _row_experts(counts_E, M)
        valid_M1 = valid_M[:, None]

        # The kernel leaves rows past the last offset uninitialised, in the output and in the
        # input's gradient: zero them on both sides of every product.
        def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            y = _grouped_mm(torch.where(valid_M1, x, 0), w.to(x.dtype).transpose(-2, -1), offs=offsets_E)
            if b is not None:
                y = y + b.to(x.dtype)[expert_M]
            return torch.where(valid_M1, y, 0)

        return self._mlp(linear, x_MD, self._weights())


def _row_experts(counts_E: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert_M, valid_M): each sorted row's expert (clamped to E-1 past the groups) and
    whether it lies within the groups."""
    ends_E = torch.cumsum(counts_E, 0)
    expert_M = torch.searchsorted(ends_E, torch.arange(num_rows, device=counts_E.device), right=True)
    valid_M = expert_M < counts_E.shape[0]
    return expert_M.clamp(max=counts_E.shape[0] - 1), valid_M
