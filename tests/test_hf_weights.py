"""Weights to and from Hugging Face transformers' LlamaForCausalLM: both directions give the same
logits as shoal's own model, the name/layout mapping round-trips exactly, and `shoal export --hf`
writes a folder transformers loads.

Logit tolerance: rtol 1e-5, atol 1e-5 in float32. The two models hold the same numbers and do
the same arithmetic; only the order of some float ops differs (rotate_half vs interleaved pairs,
RMSNorm written two ways, SDPA vs eager attention), which moves logits of size ~1 by a few ulps
(measured max |diff| ~2e-7).
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a dev dependency: pyproject [dev])

from shoal import (
    cli,  # noqa: E402
    rules,
)
from shoal.apply_plan import parallelize  # noqa: E402
from shoal.models import ModelConfig, Transformer  # noqa: E402
from shoal.models.hf.families import hf_config, hf_to_shoal, load_model_config, shoal_to_hf  # noqa: E402
from shoal.testing.asserts import assert_rounding_close  # noqa: E402
from shoal.train.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from shoal.train.export import export_model, import_weights  # noqa: E402

TINY = ModelConfig(num_layers=2, dim=64, num_heads=8, num_kv_heads=4, ffn_dim=128, vocab_size=128, max_seq_len=32,
                   rope_theta=500.0)  # a small theta so the rotary angles differ a lot between pairs
TOL = dict(rtol=1e-5, atol=1e-5)  # see the module docstring


def _tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(seed))


def _hf_logits(folder, tokens_BT: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(tokens_BT).logits


def _shoal_logits(model: Transformer, tokens_BT: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens_BT)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_shoal_to_transformers_same_logits(tmp_path, tied):
    cfg = TINY.replace(tie_embeddings=tied)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    out = export_model(parallelize(model), tmp_path / "hf", hf=True)
    assert out == tmp_path / "hf"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    tokens = _tokens(cfg.vocab_size)
    expected, got = _shoal_logits(model, tokens), _hf_logits(out, tokens)
    print(f"max |logit diff| shoal->hf ({'tied' if tied else 'untied'}): {(got - expected).abs().max():.3g}")
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_transformers_to_shoal_same_logits(tmp_path, tied):
    hf_cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                      max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=300.0,
                                      tie_word_embeddings=tied)
    torch.manual_seed(1)
    hf_model = transformers.LlamaForCausalLM(hf_cfg)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf_model.save_pretrained(str(tmp_path / "hf"))
    cfg = load_model_config(f"hf:{tmp_path / 'hf'}")
    model = Transformer(cfg)
    import_weights(tmp_path / "hf", runtime=parallelize(model))
    tokens = _tokens(cfg.vocab_size, seed=1)
    with torch.no_grad():
        expected = hf_model.eval()(tokens).logits
    got = _shoal_logits(model, tokens)
    print(f"max |logit diff| hf->shoal ({'tied' if tied else 'untied'}): {(got - expected).abs().max():.3g}")
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mapping_round_trips_exactly(tied):
    cfg = TINY.replace(tie_embeddings=tied)
    shoal_sd = {k: v.clone() for k, v in Transformer(cfg).state_dict().items()}
    hf_sd = shoal_to_hf(shoal_sd, cfg)
    assert ("lm_head.weight" in hf_sd) is not tied  # transformers re-ties on load
    back = shoal_to_hf(hf_to_shoal(hf_sd, cfg), cfg)
    assert set(back) == set(hf_sd) and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    again = hf_to_shoal(hf_sd, cfg)
    assert set(again) == set(shoal_sd) and all(torch.equal(again[k], shoal_sd[k]) for k in shoal_sd)
    # The rotary reorder is a real permutation of q rows (not the identity) within each head.
    wq, q_proj = shoal_sd["layers.0.attention.wq.weight"], hf_sd["model.layers.0.self_attn.q_proj.weight"]
    E = cfg.head_dim
    assert torch.equal(q_proj[1], wq[2]) and torch.equal(q_proj[E // 2], wq[1]) and torch.equal(q_proj[E], wq[E])


def export_and_import_sharded(folder: str) -> dict:
    """Worker (2 ranks): export under fsdp2 and under shoal's ZeRO-1 engine with hf=True, then
    import the fsdp2 folder into a zeroed tensor-parallel model; its full weights and logits."""
    import torch.distributed as dist

    from shoal.mesh import build_mesh
    from shoal.plan import Plan
    from shoal.testing.asserts import full_tensors
    from shoal.testing.parity import case

    run = case(model=TINY)
    for plan_text, name in (("fsdp2", "fsdp"), ("fsdp2,zero=1", "zero")):
        plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size())
        export_model(parallelize(run.build_model(), plan, build_mesh(plan)), f"{folder}/{name}", hf=True)
    dist.barrier()  # rank 0 has written
    plan = rules.resolve(Plan.parse("tp2"), world_size=dist.get_world_size())
    runtime = parallelize(run.build_model(), plan, build_mesh(plan))
    with torch.no_grad():
        for p in runtime.parameters():
            p.zero_()
    import_weights(folder + "/fsdp", runtime=runtime)
    with torch.no_grad():
        logits = runtime(_tokens(TINY.vocab_size))
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {"params": full_tensors(runtime), "logits": logits}


def test_sharded_export_and_import(pools, tmp_path):
    """hf=True under FSDP2 and the ZeRO-1 engine writes exactly the single-process mapping; the
    folder imports into a tensor-parallel model with the same weights (exact: copies only)."""
    from safetensors.torch import load_file

    from shoal.testing.parity import case

    reference = case(model=TINY).build_model()
    expected = shoal_to_hf(reference.state_dict(), TINY)
    res = pools(2).run(export_and_import_sharded, str(tmp_path))
    for name in ("fsdp", "zero"):
        written = load_file(str(tmp_path / name / "model.safetensors"))
        assert set(written) == set(expected) and all(torch.equal(written[k], expected[k]) for k in expected), name
    for rank in res:
        for key, value in reference.state_dict().items():
            assert torch.equal(rank["params"][key], value), key
        # Same weights; tensor parallel reorders the sums inside a layer: as close to float64 as one process.
        tokens = _tokens(TINY.vocab_size)
        truth = _shoal_logits(copy.deepcopy(reference).double(), tokens)
        assert_rounding_close(rank["logits"], _shoal_logits(reference, tokens), truth, what="tp2 logits")


def test_unsupported_models_give_one_line_errors():
    for cfg, words in ((ModelConfig(pos_emb="learned"), "norm='rmsnorm'"),
                       (ModelConfig(norm="layernorm"), "norm='layernorm'"),
                       (ModelConfig(num_experts=4), "capacity_factor=1.25"),
                       (ModelConfig(qkv_bias=True, bias=True), "bias=True")):
        # Each lambda is called right here, within the iteration over cfg.
        for fn in (lambda: hf_config(cfg), lambda: shoal_to_hf({}, cfg), lambda: hf_to_shoal({}, cfg)):  # noqa: B023
            with pytest.raises(ValueError) as info:
                fn()
            message = str(info.value)
            assert words in message and "supported families" in message and "\n" not in message, message
    with pytest.raises(ValueError, match="do not fit the model config: missing"):
        hf_to_shoal({"model.embed_tokens.weight": torch.zeros(128, 64)}, TINY)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 2-step `shoal train` run of a small Llama-style model, in one process."""
    run = tmp_path_factory.mktemp("hfexport") / "run"
    argv = ["train", "--out", str(run), "--device", "cpu", "--nproc", "1", "--steps", "2", "--global-batch", "4",
            "--seq-len", "32",
            "--set", "num_layers=2", "--set", "dim=64", "--set", "ffn_dim=128", "--eval-every", "0",
            "--ckpt-every", "1"]
    assert cli.main(argv) == 0
    return run


def test_cli_export_hf_loads_in_transformers(tiny_run, tmp_path, capsys):
    out = tmp_path / "hf_model"
    assert cli.main(["export", "--run", str(tiny_run), "--out", str(out), "--hf"]) == 0
    assert str(out) in capsys.readouterr().out
    cfg = load_model_config(f"hf:{out}")
    model = Transformer(cfg)
    load_checkpoint(latest_checkpoint(tiny_run), runtime=parallelize(model), optimizer=None)
    tokens = _tokens(cfg.vocab_size, seed=2)
    got, expected = _hf_logits(out, tokens), _shoal_logits(model, tokens)
    print(f"max |logit diff| shoal export --hf: {(got - expected).abs().max():.3g}")
    torch.testing.assert_close(got, expected, **TOL)
    # The plain export and an explicit --step still work.
    flat = tmp_path / "w.safetensors"
    assert cli.main(["export", "--run", str(tiny_run), "--step", "2", "--out", str(flat)]) == 0
    assert flat.is_file()
    # Files get the mode a plain open() gives (0666 less the umask), not safetensors' 0600.
    umask = os.umask(0)
    os.umask(umask)
    for path in (flat, out / "model.safetensors", out / "config.json"):
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path
    # An existing --out is refused unless --force, and nothing is written.
    before = flat.read_bytes()
    _one_error_line(capsys, ["export", "--run", str(tiny_run), "--out", str(flat)], str(flat), "--force")
    assert flat.read_bytes() == before
    assert cli.main(["export", "--run", str(tiny_run), "--step", "1", "--out", str(flat), "--force"]) == 0
    assert flat.read_bytes() != before  # step 1's weights now
    # --force replaces a Hugging Face folder whole (nothing of the old one stays), never a folder with a file or
    # a folder that holds the run.
    (out / "stale.safetensors").write_bytes(b"old")
    assert cli.main(["export", "--run", str(tiny_run), "--out", str(out), "--hf", "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0  # the byte tokenizer's EOS
    _one_error_line(capsys, ["export", "--run", str(tiny_run), "--out", str(out), "--force"], str(out), "is a folder")
    _one_error_line(capsys, ["export", "--run", str(tiny_run), "--out", str(tiny_run.parent), "--hf", "--force"],
                    "holds the run folder")
    # Nor anything the run folder already holds (its checkpoints, one of them, its config), nor a new path among
    # its checkpoints: all refused with nothing touched. A new file elsewhere in the run folder is fine.
    owned = sorted(str(p) for p in tiny_run.rglob("*"))
    step = sorted((tiny_run / "checkpoints").glob("step_*"))[-1]
    for target, hf in ((tiny_run / "checkpoints", True), (step, True), (tiny_run / "config.toml", False),
                       (tiny_run / "checkpoints" / "x.safetensors", False)):
        _one_error_line(capsys, ["export", "--run", str(tiny_run), "--out", str(target), "--force", *["--hf"] * hf],
                        str(target), "would replace part of the run folder")
    assert sorted(str(p) for p in tiny_run.rglob("*")) == owned
    inside = tiny_run / "export.safetensors"
    assert cli.main(["export", "--run", str(tiny_run), "--out", str(inside)]) == 0
    inside.unlink()
    assert tiny_run.is_dir() and not list(tmp_path.glob(".*"))


def _one_error_line(capsys, argv: list[str], *names: str) -> None:
    capsys.readouterr()
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shoal: error: "), lines
    assert all(name in lines[0] for name in names), lines[0]


def test_cli_export_errors(tiny_run, tmp_path, capsys):
    _one_error_line(capsys, ["export", "--run", "/nonexistent", "--out", "x"], "'/nonexistent'", "no such run folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    for command in (["export", "--run", str(empty), "--out", "x"], ["sample", "--run", str(empty), "--prompt", "a"]):
        _one_error_line(capsys, command, "is not a shoal run folder: it has no config.toml")  # the same for both
    shutil.copy(tiny_run / "config.toml", empty / "config.toml")  # a run folder without a checkpoint
    _one_error_line(capsys, ["export", "--run", str(empty), "--out", "x"], "no complete checkpoint")
    _one_error_line(capsys, ["export", "--run", str(tiny_run), "--out", str(tmp_path / "new") + "/"], "is a folder",
                    "--hf")  # a trailing slash names a folder: not a file called "new"
    assert not (tmp_path / "new").exists()
    _one_error_line(capsys, ["export", "--run", str(tiny_run), "--step", "7", "--out", "x"], "--step 7", "valid: 1, 2")
    assert not os.path.exists("x")


@pytest.mark.parametrize("family", ["gpt2", "mixtral"])
def test_cli_export_hf_of_fused_layouts(tmp_path, capsys, family):
    """Checkpoints whose Hugging Face tensors are not one shoal tensor each (GPT-2's fused, transposed
    c_attn; Mixtral's per-expert tensors of shoal's stacked experts) stream out as folders that
    transformers loads with equal logits."""
    from shoal.train.checkpoint import save_checkpoint
    from shoal.train.config import from_flat, to_flat
    from shoal.train.job import with_model

    shape = dict(num_layers=1, dim=32, num_heads=4, ffn_dim=64, vocab_size=64, max_seq_len=32)
    if family == "gpt2":
        cfg = ModelConfig(**shape, norm="layernorm", activation="gelu", pos_emb="learned", bias=True,
                          tie_embeddings=True)
    else:
        cfg = ModelConfig(**shape, num_kv_heads=2, num_experts=4, top_k=2, capacity_factor=0.0)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():  # non-trivial norms and biases
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.rand_like(p) - 0.5)
    run_cfg = with_model(from_flat({"model": "tiny"}), cfg)
    save_checkpoint(tmp_path / "run", 1, runtime=parallelize(model), optimizer=None,
                    extra={"step": 1, "config": to_flat(run_cfg)})
    out = tmp_path / "hf"
    assert cli.main(["export", "--run", str(tmp_path / "run"), "--out", str(out), "--hf"]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = _tokens(cfg.vocab_size, seed=3)
    got, expected = reloaded(tokens).logits.detach(), _shoal_logits(model, tokens)
    print(f"max |logit diff| shoal export --hf ({family}): {(got - expected).abs().max():.3g}")
    torch.testing.assert_close(got, expected, **TOL)


def test_export_checkpoint_without_stored_config(tmp_path):
    """A checkpoint saved outside `shoal train` stores no model shape: --hf says so, config= gives it."""
    from safetensors.torch import load_file

    from shoal.train.checkpoint import save_checkpoint
    from shoal.train.export import export_checkpoint

    model = Transformer(TINY)
    path = save_checkpoint(tmp_path / "run", 1, runtime=parallelize(model), optimizer=None, extra={"step": 1})
    with pytest.raises(ValueError, match="stores no run config") as info:
        export_checkpoint(path, tmp_path / "hf", hf=True)
    assert "\n" not in str(info.value) and not (tmp_path / "hf").exists()
    out = export_checkpoint(path, tmp_path / "hf", hf=True, config=TINY)
    written, expected = load_file(str(out / "model.safetensors")), shoal_to_hf(model.state_dict(), TINY)
    assert set(written) == set(expected) and all(torch.equal(written[k], expected[k]) for k in expected)
