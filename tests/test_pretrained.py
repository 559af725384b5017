"""Pretrained weights into any plan (`shoal train --init`, shoal/models/safetensors_io.py): a Hugging
Face Llama folder written by transformers (two shards and an index) gives transformers' own
logits under tp2, fsdp2, pp2, cp2 and fsdp2,tp2; shoal's own export comes back bitwise under other plans (MoE experts
too); each rank reads only its slices; dtypes are cast; bad input is refused in one line before
any worker starts.

Tolerances: loaded weights are copies of the file's values (no arithmetic), so weight
comparisons are exact. Logits: rtol 1e-5, atol 1e-5 in float32, as in test_hf_weights.py: the
same numbers and arithmetic as transformers, with some float ops in another order (rotate_half
vs pairs, SDPA vs eager; under tp the row-parallel sums add their halves in another order),
each moving logits of size ~1 by a few float32 ulps (~1e-7), far inside 1e-5.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a dev dependency: pyproject [dev])

from shoal import rules
from shoal.apply_plan import parallelize  # noqa: E402
from shoal.mesh import build_mesh  # noqa: E402
from shoal.models import ModelConfig, Transformer  # noqa: E402
from shoal.models.hf.families import load_model_config  # noqa: E402
from shoal.models.safetensors_io import open_pretrained  # noqa: E402
from shoal.plan import Plan  # noqa: E402
from shoal.testing.asserts import assert_user_error, full_tensors  # noqa: E402
from shoal.train.export import export_model  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)  # see the module docstring
MOE = ModelConfig(num_layers=2, dim=64, num_heads=8, num_kv_heads=4, ffn_dim=128, vocab_size=128, max_seq_len=64,
                  num_experts=4, top_k=2)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A random LlamaForCausalLM saved by transformers in two fp32 shards with an index, its
    logits on a fixed batch, and the tokens."""
    folder = tmp_path_factory.mktemp("hf") / "llama"
    hf_cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                      max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=300.0)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(hf_cfg)
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder), max_shard_size="250KB")  # ~370 KB of weights: two shards
    assert len(list(folder.glob("*.safetensors"))) == 2 and (folder / "model.safetensors.index.json").is_file()
    tokens = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.eval()(tokens).logits
    return {"folder": folder, "tokens": tokens, "logits": logits}


def _load_under(plan_text: str, path: str, cfg: ModelConfig, tokens: torch.Tensor | None) -> dict:
    """Worker: the model built on meta under plan_text, filled from `path`; its full weights,
    logits, the bytes this rank read and the bytes of the parameters it holds."""
    weights = open_pretrained(path, cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    plan = rules.resolve(Plan.parse(plan_text), world_size=dist.get_world_size())
    runtime = parallelize(model, plan, build_mesh(plan), weights=weights)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in runtime.parameters())
    logits = None
    if tokens is not None:
        with torch.no_grad():
            logits = runtime.eval()(tokens)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {"params": full_tensors(runtime), "logits": logits, "read": weights.bytes_read, "held": held}


@pytest.mark.parametrize(("plan", "world"), [("tp2", 2), ("fsdp2", 2), ("pp2", 2), ("cp2", 2), ("fsdp2,tp2", 4)])
def test_hf_folder_gives_transformers_logits(pools, hf_folder, plan, world):
    cfg = load_model_config(f"hf:{hf_folder['folder']}")
    total = sum(v.numel() * 4 for v in load_file(str(next(hf_folder["folder"].glob("*-00001-*")))).values()) + \
        sum(v.numel() * 4 for v in load_file(str(next(hf_folder["folder"].glob("*-00002-*")))).values())
    for rank, got in enumerate(pools(world).run(_load_under, plan, str(hf_folder["folder"]), cfg, hf_folder["tokens"])):
        torch.testing.assert_close(got["logits"], hf_folder["logits"], **TOL)
        # Each rank read its own slices: exactly the bytes it holds where the shards cut whole
        # query/key heads (every 2-rank plan here); under fsdp2,tp2 a shard of wk holds half a
        # head and the whole head is read (at most twice that slice), never whole tensors.
        if world == 2:
            assert got["read"] == got["held"], (plan, rank, got["read"], got["held"])
        else:
            assert got["held"] <= got["read"] <= 2 * got["held"] and got["read"] < total / 2, (rank, got["read"])


def test_shoal_export_round_trip_bitwise(pools, tmp_path):
    """shoal's own names (stacked experts as plain slices) into other plans: the same weights, bit for bit."""
    torch.manual_seed(0)
    source = parallelize(Transformer(MOE))
    export_model(source, tmp_path / "moe.safetensors")
    expected = full_tensors(source)
    for plan, world in (("tp2,ep2", 4), ("fsdp2,ep2", 2), ("fsdp2,zero=1", 2), ("fsdp2,zero=2", 2)):
        for got in pools(world).run(_load_under, plan, str(tmp_path / "moe.safetensors"), MOE, None):
            assert set(got["params"]) == set(expected), plan
            for name, value in got["params"].items():
                assert torch.equal(value, expected[name]), f"{plan}: {name} differs"


def test_bf16_file_into_fp32_and_back(hf_folder, tmp_path):
    cfg = load_model_config(f"hf:{hf_folder['folder']}")
    state = {}
    for file in hf_folder["folder"].glob("*.safetensors"):
        state.update({k: v.to(torch.bfloat16) for k, v in load_file(str(file)).items()})
    save_file(state, str(tmp_path / "model.safetensors"))
    weights = open_pretrained(tmp_path, cfg)
    assert "bfloat16 in the file, cast to float32 parameters" in weights.describe(torch.float32)
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize(model, weights=weights)
    assert model.norm.weight.dtype == torch.float32
    assert torch.equal(model.norm.weight, state["model.norm.weight"].float())  # bf16 -> fp32 is exact
    # fp32 file into bf16 parameters: each value rounded once, as .to(bfloat16) does.
    fp32 = open_pretrained(hf_folder["folder"], cfg)
    with torch.device("meta"):
        half = Transformer(cfg).to(torch.bfloat16)
    parallelize(half, weights=fp32)
    assert "float32 in the file, cast to bfloat16 parameters" in fp32.describe(torch.bfloat16)
    assert torch.equal(half.layers["1"].feed_forward.w2.weight, state["model.layers.1.mlp.down_proj.weight"])


def test_ignore_leaves_missing_tensors_to_the_seed(hf_folder, tmp_path):
    cfg = load_model_config(f"hf:{hf_folder['folder']}")
    state = {}
    for file in hf_folder["folder"].glob("*.safetensors"):
        state.update(load_file(str(file)))
    del state["lm_head.weight"]
    state["extra.bias"] = torch.zeros(3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\) the model needs \(lm_head.weight\); 1 unexpected "
                       r"\(extra.bias\)"):
        open_pretrained(tmp_path, cfg)
    weights = open_pretrained(tmp_path, cfg, ignore=["lm_head.*,extra.*"])
    with torch.device("meta"):
        model = Transformer(cfg)
    runtime = parallelize(model, seed=5, weights=weights)
    with torch.device("meta"):
        seeded = Transformer(cfg)
    parallelize(seeded, seed=5)
    assert torch.equal(model.output.weight, seeded.output.weight)  # the seed's values, as without --init
    assert torch.equal(model.norm.weight, state["model.norm.weight"])
    said = weights.describe(torch.float32)
    assert "ignored tensor(s) start from the seed instead: output.weight" in said
    assert "; 1 ignored tensor(s) of the file left unread: extra.bias" in said
    assert runtime is not None
    with pytest.raises(ValueError, match=r"--init-ignore lm_haed\.\* matches no tensor of the model or of --init "):
        open_pretrained(tmp_path, cfg, ignore=["lm_head.*,extra.*", "lm_haed.*"])  # a typo is not a no-op


def _bad_folders(src, tmp_path) -> dict:
    """Folders that --init refuses, each by one kind of fault."""
    out = {}
    missing = tmp_path / "missing_shard"
    shutil.copytree(src, missing)
    next(missing.glob("*-00002-*")).unlink()
    out["missing_shard"] = missing
    (tmp_path / "empty").mkdir()
    out["empty"] = tmp_path / "empty"
    ints = tmp_path / "ints"
    ints.mkdir()
    state = {}
    for file in src.glob("*.safetensors"):
        state.update(load_file(str(file)))
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int32)
    save_file(state, str(ints / "model.safetensors"))
    out["ints"] = ints
    return out


def test_bad_input_refused_before_any_worker(hf_folder, tmp_path, capsys):
    folder = hf_folder["folder"]
    bad = _bad_folders(folder, tmp_path)
    base = ["train", "--model", f"hf:{folder}", "--steps", "1", "--seq-len", "32", "--nproc", "2",
            "--out", str(tmp_path / "run")]
    assert_user_error(capsys, [*base, "--set", "ffn_dim=128", "--init", str(folder)],
                      "model.layers.0.mlp.gate_proj.weight", "(96, 64)", "(128, 64)")
    assert_user_error(capsys, [*base, "--init", str(bad["missing_shard"])], "model-00002-of-00002.safetensors",
                      "missing")
    assert_user_error(capsys, [*base, "--init", str(bad["empty"])], "holds no weights")
    (bad["empty"] / "checkpoints").mkdir()  # a run folder: its weights are in its checkpoints
    assert_user_error(capsys, [*base, "--init", str(bad["empty"])], "is a run folder", "shoal export --run")
    (bad["empty"] / "checkpoints").rmdir()
    assert_user_error(capsys, [*base, "--model", "tiny-moe", "--init", str(folder)], "holds a dense model's weights",
                      "but the model is Mixture-of-Experts")
    config = tmp_path / "run.toml"  # the config-file key is the same check
    config.write_text(f'init = "{bad["empty"]}"\ninit_ignore = ["lm_head.*"]\n')
    assert_user_error(capsys, [*base, "--config", str(config)], "holds no weights")
    assert_user_error(capsys, [*base, "--init", str(bad["ints"])], "model.norm.weight", "I32")
    not_weights = tmp_path / "run.toml"  # a file that is no safetensors file: what would be valid
    assert_user_error(capsys, [*base, "--init", str(not_weights)], "is not a safetensors file",
                      "first 8 bytes are no header's length", "valid: a .safetensors file")
    assert_user_error(capsys, ["train", "--resume", str(tmp_path), "--init", str(folder)], "--init", "--resume")
    assert_user_error(capsys, [*base, "--init-ignore", "lm_head.*"], "--init-ignore lm_head.*", "no --init")
    assert not (tmp_path / "run").exists()


def test_cli_init_then_export_gives_the_files_back(hf_folder, tmp_path, capfd):
    """End to end: --init the Hugging Face folder under pp2, train one step whose update cannot
    move any weight (lr 1e-30: |lr * Adam's update| <= 1e-30, below half an ulp of every weight,
    whose magnitudes are > 1e-20), export the checkpoint with --hf: the files' tensors come back
    bit for bit, so every slice went where it belongs, and the log states the dtypes."""
    from shoal import cli

    folder, run = hf_folder["folder"], tmp_path / "run"
    argv = ["train", "--model", f"hf:{folder}", "--init", str(folder), "--plan", "pp2", "--nproc", "2",
            "--steps", "1", "--seq-len", "32", "--global-batch", "4", "--lr", "1e-30", "--weight-decay", "0",
            "--eval-batches", "1", "--out", str(run)]
    assert cli.main(argv) == 0
    assert "init: weights from" in capfd.readouterr().out
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "back"), "--hf"]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(back) == set(index)
    for key, file in index.items():
        original = load_file(str(folder / file))[key]
        assert torch.equal(back[key], original), key


def test_init_alone_takes_the_model_from_the_folders_config(hf_folder, tmp_path, monkeypatch):
    """`--init FOLDER` without `--model` trains the folder's own config.json (what `--model
    hf:FOLDER` gives); a `--model` given on the command line or in the config file wins."""
    from shoal import cli
    from shoal.cli import train as train_cli
    from shoal.train.config import model_of_init

    folder = hf_folder["folder"]

    def job(*argv: str, init: str = str(folder)):
        run = str(tmp_path / "run")
        args = ["train", "--init", init, "--device", "cpu", "--seq-len", "32", "--out", run, *argv]
        return train_cli.prepare_job(cli.build_parser().parse_args(args))

    chosen = job().config
    assert chosen.model == f"hf:{folder}" and chosen.model_config == load_model_config(f"hf:{folder}")
    monkeypatch.chdir(folder.parent)
    relative = job(init=folder.name).config
    assert relative.init == str(folder)  # config.toml records where the weights came from, from anywhere
    config = tmp_path / "run.toml"
    config.write_text('model = "tiny"\n')
    with pytest.raises(ValueError, match="is --model the same model"):  # tiny's shapes are not the folder's
        job("--config", str(config))
    assert model_of_init(str(tmp_path)) == "tiny"  # no config.json: the default preset


def test_init_without_config_json_says_the_model_is_the_default_preset(tmp_path, capsys):
    """`--init` of a folder with weights but no config.json and no --model trains the default preset: a
    warning says so once the weights fit it, and a refusal of weights that do not fit says it in its one line."""
    from shoal import cli
    from shoal.cli import train as train_cli
    from shoal.models import preset

    torch.manual_seed(0)
    folder = tmp_path / "weights"
    folder.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(folder / "model.safetensors"))
    args = ["train", "--init", str(folder), "--device", "cpu", "--out", str(tmp_path / "run")]
    assert_user_error(capsys, args, "is --model the same model", "(the model is the default preset tiny: no "
                      "config.json beside the weights; --model names another)")
    with torch.device("meta"):
        names = [name for name, _ in Transformer(preset("tiny")).named_parameters()]
    state = {name: p.detach().clone() for name, p in Transformer(preset("tiny")).named_parameters()}
    assert sorted(state) == sorted(names)
    save_file(state, str(folder / "model.safetensors"))  # shoal's names and tiny's shapes: they fit
    train_cli.prepare_job(cli.build_parser().parse_args(args))
    err = capsys.readouterr().err
    assert err.startswith(f"shoal: warning: --init {folder} has no config.json") and "default preset tiny" in err
