"""The parallel runtime (shoal/runtime.py): the one object the trainer, checkpoints, export and the
parity harness talk to, and the pure engine choice behind it (shoal/rules.py).

Comparisons in one process are exact (torch.equal): the runtime runs the same kernels in the same
order as the plain loop it replaces, and a norm computed from the same gradients is the same sum.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shoal import rules
from shoal.apply_plan import parallelize
from shoal.mesh import build_mesh
from shoal.models import Transformer
from shoal.plan import Plan
from shoal.rules import EngineChoice, choose_engine
from shoal.testing.asserts import full_tensors
from shoal.testing.parity import SMALL
from shoal.train.step import train_step

SRC = Path(__file__).resolve().parents[1] / "src" / "shoal"


@pytest.mark.parametrize("text, world, device, expected", [
    ("dp1", 1, "cpu", ("none", 0, 0, 0)),
    ("dp2", 2, "cpu", ("ddp", 0, 0, 0)),
    ("dp2", 2, "cuda", ("ddp", 0, 0, 0)),  # bf16 by default on GPUs: DDP under torch.autocast
    ("dp2,reduce=bf16", 2, "cpu", ("ddp", 0, 0, 0)),  # DDP's compression hook reduces in bf16
    ("dp1", 1, "cuda", ("autocast", 0, 0, 0)),  # one data rank in bf16: torch.autocast, no FSDP2 hooks
    ("dp1,precision=fp16", 1, "cpu", ("autocast", 0, 0, 0)),
    ("tp2", 2, "cuda", ("fsdp2", 2, 2, 2)),  # bf16 over a tensor-parallel model: FSDP2 casts its DTensors
    ("tp2", 4, "cpu", ("fsdp2", 2, 2, 2)),  # replicated over a tensor-parallel model
    ("tp2", 2, "cpu", ("none", 0, 0, 0)),
    ("fsdp2,zero=1", 2, "cpu", ("zero", 1, 2, 2)),
    ("fsdp2,zero=2,bucket=1", 2, "cuda", ("zero", 2, 1, 4)),
    ("fsdp2", 2, "cpu", ("fsdp2", 3, 1, 4)),
    ("fsdp2,bucket=3", 2, "cpu", ("fsdp2", 3, 3, 2)),
    ("fsdp2,zero=1,offload=on", 2, "cpu", ("fsdp2", 1, 2, 2)),
    ("fsdp2,tp2,zero=2", 4, "cpu", ("fsdp2", 2, 2, 2)),
    ("dp2,fsdp2,zero=2", 4, "cpu", ("zero", 2, 2, 2)),
])
def test_engine_choice_table(text, world, device, expected):
    """Which engine runs a plan, at what stage and grouping, for a 4-block model."""
    choice = choose_engine(rules.resolve(Plan.parse(text), world_size=world, device=device), num_layers=4)
    assert (choice.kind, choice.zero, choice.bucket, choice.units) == expected
    assert choice.describe()


def test_engine_choice_imports_no_torch():
    """The planner costs the same choice without torch.distributed (or torch) loaded."""
    code = "import sys, shoal.rules; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_trainer_reaches_the_parallel_layer_only_through_the_runtime():
    """No module of the trainer, checkpoints, export, sampling, CLI or parity harness imports an
    engine from shoal.parallel or asks for attributes the engines used to hang on the model."""
    users = [*(SRC / "train").glob("*.py"), *(SRC / "testing").glob("*.py"), *(SRC / "cli").glob("*.py")]
    for path in users:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                inside = node.module == "shoal.parallel" or node.module.startswith("shoal.parallel.")
                assert not inside, f"{path.name} imports {node.module}"
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr"):
                name = getattr(node.args[1], "value", None) if len(node.args) > 1 else None
                assert name not in ("loss_scaler", "no_sync"), f"{path.name} looks up model.{name}"


@pytest.mark.parametrize("clip", [0.5, 1e3], ids=["clipped", "under-the-threshold"])
def test_runtime_in_one_process_is_the_plain_loop(clip):
    """parallelize(model) with no plan: the same runtime interface, no process group; its step
    gives the plain loop's gradients, norm, clipped update and loss, bit for bit, with the gradient norm
    above the clipping threshold (scaled down) and below it (left as it is, never scaled up)."""
    batch = torch.randint(0, SMALL.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    x, y = batch[:, :-1], batch[:, 1:]

    torch.manual_seed(0)
    plain = Transformer(SMALL)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=False)
    loss = F.cross_entropy(plain(x).flatten(0, 1), y.flatten())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in plain.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)
    plain_opt.step()

    torch.manual_seed(0)
    runtime = parallelize(Transformer(SMALL))
    opt = torch.optim.AdamW(runtime.parameters(), lr=1e-2, foreach=False)
    seen = {}
    result = train_step(runtime, opt, [(x, y)], grad_clip=clip,
                        before_update=lambda rt: seen.update(full_tensors(rt, grads=True)))
    assert result.loss.item() == loss.item() and result.grad_norm.item() == norm.item() and result.applied
    assert (norm > clip) == (clip == 0.5)
    assert all(torch.equal(seen[n], g) for n, g in grads.items())
    after = full_tensors(runtime)
    assert all(torch.equal(after[n], p) for n, p in plain.named_parameters())
    assert set(runtime.state_dict(opt)) == {"model", "optimizer"}
    assert set(runtime.state_dict()["model"]) == set(plain.state_dict())
    assert all(torch.equal(runtime.full_weights()[n], v) for n, v in plain.state_dict().items())
    assert runtime.data_rank == (0, 1) and runtime.choice is None
    with pytest.raises(ValueError, match="does not fit the model: missing"):
        runtime.load_full_weights({"nope": torch.zeros(1)})


def _engines(plans):
    """Worker: the runtime's choice, and what actually runs (engine and forward module types)."""
    import torch.distributed as dist

    out = []
    for text in plans:
        plan = rules.resolve(Plan.parse(text), world_size=dist.get_world_size())
        runtime = parallelize(Transformer(SMALL), plan, build_mesh(plan))
        engine = runtime._engine  # the one look inside: is the choice what runs?
        out.append((runtime.choice.kind, type(engine).__name__, type(engine.model).__name__,
                    "data-parallel engine:" in runtime.describe()))
    return out


def test_parallelize_runs_the_chosen_engine(pools):
    plans = ["dp2", "fsdp2,zero=1", "fsdp2", "dp2,precision=bf16", "tp2"]
    expected = [("ddp", "TorchDataEngine", "DistributedDataParallel", True),
                ("zero", "ZeroDataParallel", "ZeroDataParallel", True),
                ("fsdp2", "TorchDataEngine", "FSDPTransformer", True),
                ("ddp", "TorchDataEngine", "Autocast", True),  # DDP under torch.autocast
                ("none", "TorchDataEngine", "Transformer", True)]
    assert pools(2).run(_engines, plans) == [expected] * 2


def test_device_type_reads_the_group_backend(monkeypatch):
    """A GPU run's group is "cpu:gloo,cuda:nccl": the mesh goes on the GPU (main compared the
    backend with "nccl" and built the mesh on the CPU, which crashed every FSDP2/DTensor plan on
    a GPU). A pure gloo group on a GPU machine stays on the CPU."""
    import torch.distributed as dist

    from shoal.mesh import device_type

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_type() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert device_type() == "cuda"
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for backend, device in (("cpu:gloo,cuda:nccl", "cuda"), ("nccl", "cuda"), ("gloo", "cpu")):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert device_type() == device, backend


def test_engine_choice_is_frozen_data():
    choice = EngineChoice(kind="zero", zero=2, bucket=2, units=3)
    with pytest.raises(AttributeError):
        choice.kind = "ddp"  # type: ignore[misc]  # the point: a frozen field refuses assignment


class _Wrapped(torch.nn.Module):
    """A model whose forward returns an output object, as an unmodified transformers model does."""

    def __init__(self, inner: torch.nn.Module, form: str) -> None:
        super().__init__()
        self.inner, self.form = inner, form

    def forward(self, tokens: torch.Tensor) -> object:
        from transformers.modeling_outputs import CausalLMOutput

        logits = self.inner(tokens)
        return CausalLMOutput(logits=logits) if self.form == "output" else (logits,)


def test_default_loss_reads_an_output_objects_logits():
    """The default loss takes `.logits` from a forward's output object (transformers' CausalLMOutput) and gives
    the loss and gradients a logits-returning forward gives, bit for bit (the same kernels on the same values);
    an output it cannot read is refused in one line naming its type."""
    torch.manual_seed(0)
    inner = Transformer(SMALL)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 9))
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    plain = parallelize(inner)
    expected = plain.forward_backward(batch)
    grads = {n: p.grad.clone() for n, p in inner.named_parameters()}
    inner.zero_grad(set_to_none=True)
    wrapped = parallelize(_Wrapped(inner, "output"))
    assert torch.equal(wrapped.forward_backward(batch), expected)
    assert all(torch.equal(p.grad, grads[n]) for n, p in inner.named_parameters())
    with pytest.raises(TypeError, match=r"its forward returned tuple; valid: a forward that returns the logits"):
        parallelize(_Wrapped(inner, "tuple")).forward_backward(batch)


def test_a_transformers_model_under_tp_is_pointed_to_from_hf():
    from shoal.models.adapter import adapter_with

    class LookLikeTransformers(torch.nn.Linear):  # a config and generate(), as a transformers model has
        config = None

        def generate(self) -> None: ...

    with pytest.raises(ValueError, match=r"has none; valid: shoal's Transformer or Mixer \(a transformers model: load "
                                         r"its folder with shoal.from_hf\)"):
        adapter_with(LookLikeTransformers(2, 2), "tp")
    with pytest.raises(ValueError, match=r"Linear has none; valid: shoal's Transformer or Mixer, or the data axes"):
        adapter_with(torch.nn.Linear(2, 2), "tp")
