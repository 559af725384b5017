"""Comparisons for tests, each tolerance derived from the arithmetic it checks: `assert_rounding_close` holds a
parallel float32 result to the single process's own float32 error; `one_line_error` and `assert_user_error` check
that a mistake is reported in one line, `file_digests` that it lost nothing."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shoal.runtime import Runtime


def assert_close(actual: Any, expected: Any, *, rtol: float, atol: float, what: str = "value") -> None:
    """Recursive allclose over dicts/lists of tensors and floats, naming the first key that differs."""
    if isinstance(expected, Mapping):
        assert set(actual) == set(expected), f"{what}: keys differ: {sorted(set(actual) ^ set(expected))}"
        for key in expected:
            assert_close(actual[key], expected[key], rtol=rtol, atol=atol, what=f"{what}[{key}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{what}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, rtol=rtol, atol=atol, what=f"{what}[{i}]")
    else:
        a, e = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
        assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        if not torch.allclose(a, e, rtol=rtol, atol=atol):
            diff = (a - e).abs()
            raise AssertionError(
                f"{what}: max abs diff {diff.max().item():.3g} (rtol={rtol}, atol={atol}); "
                f"max |expected| {e.abs().max().item():.3g}"
            )


U32 = 2.0**-24
"""Unit roundoff of float32: the largest relative error of one rounding."""


SLACK = 8.0
"""How many times the single-process float32 error a parallel float32 run may be off the float64
truth (see `assert_rounding_close`). The error analysis there puts the ratio near 1, a tensor
now and then a few times that (another order of summation rounds as a random walk, not always
the same way); a real defect is off by orders of magnitude more."""


MOVED = 0.01
"""Share of the distance training moved a tensor by which a parallel run's final parameters may
differ from the float64 run's (see `assert_trained_close`); ordinary tensors differ by ~1e-4."""


FLOOR_ULPS = 16.0
"""Rounding errors below this many float32 ulps of the largest value are always accepted."""


def assert_rounding_close(actual: Any, ref32: Any, ref64: Any, *, what: str = "value") -> None:
    """`actual` (float32, computed in another order) is as close to the float64 truth `ref64` as
    the single-process float32 run `ref32` is, up to SLACK times, plus FLOOR_ULPS ulps; per tensor.

    Why this holds on any machine: a parallel run computes the same sums as the single process,
    split across ranks and added in another order. A float32 sum of n terms in any order is off
    by at most (n-1) u sum|x_i| (Higham, Accuracy and Stability of Numerical Algorithms, 4.2),
    and in practice by a similar random-walk amount whatever the order, so the parallel error
    is of the size of the single process's own error. That error is measured in each test, on the
    CPU it runs on with its kernels and thread count, rather than assumed from the machine the test
    was written on: the bound moves with the machine. A real defect (a missing average, a wrong shard) is off
    by orders of magnitude more than float32 rounding.
    """
    if isinstance(ref64, Mapping):
        assert set(actual) == set(ref64), f"{what}: keys differ: {sorted(set(actual) ^ set(ref64))}"
        for key in ref64:
            assert_rounding_close(actual[key], ref32[key], ref64[key], what=f"{what}[{key}]")
        return
    a, r32, r64 = (torch.as_tensor(v, dtype=torch.float64) for v in (actual, ref32, ref64))
    assert a.shape == r64.shape, f"{what}: shape {tuple(a.shape)} != {tuple(r64.shape)}"
    error = (a - r64).abs().max().item() if a.numel() else 0.0
    single = (r32 - r64).abs().max().item() if a.numel() else 0.0
    floor = FLOOR_ULPS * U32 * (r64.abs().max().item() if a.numel() else 0.0)
    bound = SLACK * single + floor
    if not error <= bound:
        raise AssertionError(f"{what}: off the float64 reference by {error:.3g} > {bound:.3g} ({SLACK:g} x the "
                             f"single-process float32 error {single:.3g} + {FLOOR_ULPS:g} ulps = {floor:.3g})")


def assert_user_error(capsys: Any, argv: list[str], *names: str) -> str:
    """`shoal` with `argv` exits 2 with exactly one stderr line that names every string in
    `names` (capsys: pytest's fixture); returns the line."""
    from shoal import cli

    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shoal: error: "), err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def file_digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under `folder`, by relative path: equal before and after a refused command
    when that command lost nothing there."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_error(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """The message of the ValueError that fn(*args, **kwargs) raises, checked to be one line."""
    try:
        fn(*args, **kwargs)
    except ValueError as exc:
        message = str(exc)
        assert "\n" not in message, message
        return message
    raise AssertionError(f"{getattr(fn, '__name__', fn)} raised no ValueError")


def full_tensors(source: Runtime | nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every trainable parameter (or its gradient) of a runtime or a plain module as a full,
    unsharded CPU tensor, keyed by name (a runtime's names are the user module's own). Collective
    for sharded ones."""
    out = {}
    for name, param in source.named_parameters():
        tensor = param.grad if grads else param
        if tensor is None:
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        out[name] = tensor.detach().cpu().clone()
    return out
