"""Bad input: one line `shoal: error: <message naming the value>` on stderr, exit status 2, no
traceback, and nothing written over a good checkpoint.

Checks that stop in the parent process run in-process (cli.main); two run as real
`python -m shoal` processes to show the exit status and stderr of the actual command.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shoal import cli, rules
from shoal.cli import errors
from shoal.cli import train as train_cli
from shoal.testing.asserts import assert_user_error, file_digests

# These tests mean CPU/gloo with 2 processes, also on a machine with GPUs.
SMALL = ["--device", "cpu", "--set", "num_layers=2", "--set", "dim=64", "--set", "ffn_dim=128", "--global-batch", "8",
         "--seq-len", "32"]


@pytest.mark.parametrize("argv, names", [
    (["--model", "gpt-9000"], ["'gpt-9000'", "tiny"]),
    (["--plan", "dp2,,tp"], ["'dp2,,tp'"]),
    (["--plan", "tp3", "--nproc", "3"], ["tp=3", "8 attention heads", "valid: tp in 1, 2, 4"]),
    (["--plan", "pp2,sched=interleaved,vpp=1"], ["sched=interleaved", "vpp=1", "valid: sched=interleaved,vpp=2"]),
    (["--plan", "pp2,split=7"], ["split=7", "does not split 4 layers", "1..3"]),
    (["--plan", "dp3"], ["dp3", "world size is 2"]),
    (["--data", "/no/such/corpus"], ["'/no/such/corpus'"]),
    (["--data", ""], ["--data '' names nothing"]),  # not the working folder
    (["--data", "/no/such/a:0.7,"], ["'/no/such/a:0.7,' has an empty item"]),
    (["--data", ":0.7,/no/such/b:0.3"], ["weight '0.7' has no folder"]),
    (["--steps", "0"], ["--steps 0", ">= 1"]),
    (["--steps", "-1"], ["--steps -1", ">= 1"]),
    (["--global-batch", "3"], ["global batch 3", "multiples of 2"]),
    (["--micro-batch", "3"], ["--micro-batch 3", "valid: 1, 2, 4, 8"]),
    (["--set", "nope=1"], ["'nope'", "num_layers"]),
    (["--set", "num_layers=four"], ["num_layers='four'", "int"]),
    (["--set", "norm=batchnorm"], ["'batchnorm'", "rmsnorm"]),
    (["--seq-len", "4096"], ["--seq-len 4096", "max_seq_len=256"]),
    (["--lr", "-1"], ["--lr -1.0"]),
    (["--model", "tiny-moe", "--plan", "cp2"], ["cp=2", "Mixture-of-Experts", "num_experts=4"]),
    (["--tokenizer", "/no/such/tokenizer"], ["'/no/such/tokenizer'", "byte"]),
    (["--init", "/no/such/weights"], ["--init /no/such/weights: no such file or folder"]),  # and no warning first
    (["--bogus", "1"], ["--bogus"]),
    (["--steps", "ten"], ["'ten'"]),
    # An option that would do nothing without its axis is refused, naming the axis.
    (["--plan", "dp2,zero=2"], ["zero=2", "fsdp axis", "add fsdpN"]),
    (["--plan", "fsdp2,sched=1f1b"], ["sched=1f1b", "pp axis"]),
    (["--plan", "fsdp2,mb=4"], ["mb=4", "pp axis"]),
    (["--step", "5"], ["unrecognized argument(s) --step 5", "valid: --steps"]),  # no abbreviation; the near flag
    (["--global", "5"], ["unrecognized argument(s) --global 5", "valid: --global-batch"]),  # a flag cut short
    (["--doc_mask", "on"], ["--doc_mask on", "valid: --doc-mask"]),
    (["--tf32", "maybe"], ["'maybe'", "on, off"]),
    (["--log-every", "0"], ["--log-every 0", ">= 1"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) and v and v[0].startswith("-") else None)
def test_bad_train_flags(capsys, tmp_path, argv, names):
    assert_user_error(capsys, ["train", "--out", str(tmp_path / "run"), "--device", "cpu", *argv], *names)
    assert not (tmp_path / "run").exists()  # nothing written


def test_bad_config_files(capsys, tmp_path):
    assert_user_error(capsys, ["train", "--config", str(tmp_path / "none.toml")], "none.toml")
    assert_user_error(capsys, ["train", "--config", str(tmp_path)], str(tmp_path), "is a folder", "a TOML file")
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3\n")
    assert_user_error(capsys, ["train", "--config", str(bad)], "bad.toml", "not valid TOML")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("stepz = 3\n")
    assert_user_error(capsys, ["train", "--config", str(unknown)], "'stepz'", "steps")
    typed = tmp_path / "typed.toml"
    typed.write_text('steps = "many"\n')
    assert_user_error(capsys, ["train", "--config", str(typed)], "steps = 'many'", "a whole number")
    typed.write_text('plan = 5\n')
    assert_user_error(capsys, ["train", "--config", str(typed)], "plan = 5", "a string in quotes")
    typed.write_text('resume = "runs/x"\n')
    assert_user_error(capsys, ["train", "--config", str(typed)], "'resume'", "on the command line", "--resume DIR")
    typed.write_text('[model_config]\ndims = 3\n')
    assert_user_error(capsys, ["train", "--config", str(typed)], "'dims' in [model_config]", "dim")
    switch = tmp_path / "switch.toml"
    switch.write_text("doc_mask = 3\n")
    assert_user_error(capsys, ["train", "--config", str(switch)], "doc_mask = 3", "true or false", '"on" / "off"')
    from shoal.train.config import from_flat

    assert from_flat({"doc_mask": "on"}).data.doc_mask is True  # as the flag takes it
    assert from_flat({"doc_mask": "off", "tf32": "off"}).tf32 is False


def test_config_file_and_flags_layer(tmp_path):
    from shoal.train.config import dump_toml, from_flat, load_toml, to_flat

    path = tmp_path / "run.toml"
    path.write_text('steps = 40\nlr = 1e-3\nset = ["num_layers=2"]\nplan = "dp2"\n')
    cfg = from_flat({"steps": 7}, from_flat(load_toml(path)))  # flags win over the file
    assert (cfg.loop.steps, cfg.optim.lr, cfg.set, cfg.plan) == (7, 1e-3, ("num_layers=2",), "dp2")
    path.write_text(dump_toml(to_flat(cfg)))
    assert from_flat(load_toml(path)) == cfg  # the written config reads back the same


def test_resume_errors(capsys, tmp_path):
    assert_user_error(capsys, ["train", "--resume", str(tmp_path / "gone")], "gone", "no such run folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_user_error(capsys, ["train", "--resume", str(empty)], "empty", "config.toml")
    (empty / "config.toml").write_text('model = "tiny"\n')
    assert_user_error(capsys, ["train", "--resume", str(empty)], "empty", "no complete checkpoint")


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("cli") / "good"
    assert cli.main(["train", "--out", str(run), "--nproc", "1", "--steps", "2", "--ckpt-every", "1", *SMALL]) == 0
    return run


def test_a_good_run_is_never_overwritten(capsys, good_run):
    before = file_digests(good_run / "checkpoints")
    assert_user_error(capsys, ["train", "--out", str(good_run), *SMALL], str(good_run), "--resume")
    assert_user_error(capsys, ["train", "--resume", str(good_run), "--steps", "2", "--device", "cpu"],
                      "already at step 2")
    assert_user_error(capsys, ["train", "--resume", str(good_run), "--steps", "4", "--weight-decay", "0.2"],
                      "--weight-decay", "cannot change", "--steps")  # --lr may (after a divergence: test_nonfinite)
    assert_user_error(capsys, ["train", "--resume", str(good_run), "--steps", "4", "--doc-mask", "on"],
                      "--doc-mask cannot change", "(it was off)")  # as the flag is typed, not False
    assert_user_error(capsys, ["train", "--resume", str(good_run), "--steps", "4", "--out", str(good_run) + "x"],
                      "--out", "its own folder", "valid: leave --out out")
    assert file_digests(good_run / "checkpoints") == before


def _run_shoal(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "shoal", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_real_process_unknown_model():
    proc = _run_shoal("train", "--model", "gpt-9000")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("shoal: error: unknown model 'gpt-9000'")


def test_corrupt_checkpoints(capsys, good_run, tmp_path):
    """A truncated file, a block of zeros of the same size, a garbled trainer state or DCP index:
    each is found by the parent before any worker starts (the manifest records every file's
    size and CRC-32), with one line naming the file, exit 2, nothing written. These runs keep
    only their corrupt newest checkpoint, so there is nothing to fall back to."""
    latest = good_run / "checkpoints" / (good_run / "checkpoints" / "latest").read_text().strip()

    def broken(name: str) -> tuple[Path, Path]:
        run = tmp_path / name
        shutil.copytree(good_run, run)
        for older in (run / "checkpoints").glob("step_*"):
            if older.name != latest.name:
                shutil.rmtree(older)
        return run, run / "checkpoints" / latest.name

    truncated, ckpt = broken("truncated")
    data = sorted(ckpt.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    before = file_digests(truncated)
    proc = _run_shoal("train", "--resume", str(truncated), "--steps", "3", "--device", "cpu")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("shoal: error: run folder ") and data.name in proc.stderr
    assert "truncated" in proc.stderr and "no complete checkpoint that verifies" in proc.stderr
    assert file_digests(truncated) == before  # nothing written

    zeroed, ckpt = broken("zeroed")
    data = sorted(ckpt.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[: 64 * 1024] = bytes(min(64 * 1024, len(raw)))
    data.write_bytes(bytes(raw))
    assert_user_error(capsys, ["train", "--resume", str(zeroed), "--steps", "3", "--device", "cpu"],
                      data.name, "fails its checksum")

    garbled, ckpt = broken("garbled")
    (ckpt / "trainer_state.json").write_text("{not json")
    assert_user_error(capsys, ["train", "--resume", str(garbled), "--steps", "3", "--device", "cpu"], "corrupt",
                      "trainer_state.json")

    index, ckpt = broken("index")
    meta = ckpt / ".metadata"
    meta.write_bytes(bytes(b ^ 0x5A for b in meta.read_bytes()))  # same size, garbage content
    before = file_digests(index)
    assert_user_error(capsys, ["train", "--resume", str(index), "--steps", "3", "--nproc", "1", "--device", "cpu"],
                      ".metadata", "fails its checksum")
    assert file_digests(index) == before
    assert_user_error(capsys, ["export", "--run", str(index), "--out", str(tmp_path / "w.safetensors")], ".metadata")


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(capsys, good_run, tmp_path):
    """The newest checkpoint zeroed in place: resume warns, naming it and the one it uses instead,
    and continues from step 1 with the very losses the unbroken run had."""
    run = tmp_path / "fallback"
    shutil.copytree(good_run, run)
    data = sorted((run / "checkpoints" / "step_00000002").glob("*.distcp"))[0]
    data.write_bytes(bytes(data.stat().st_size))
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run), "--steps", "3", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if line.startswith("shoal: warning:")]
    assert len(warning) == 1 and "step_00000002" in warning[0] and "using step_00000001" in warning[0], err
    original = {r["step"]: r["loss"] for r in _metrics(good_run)}
    resumed = {r["step"]: r["loss"] for r in _metrics(run)}
    assert sorted(resumed) == [1, 2, 3] and resumed[2] == original[2]  # same process count: bit-exact


def _metrics(run: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_sample_errors(capsys, tmp_path, good_run):
    assert_user_error(capsys, ["sample", "--run", str(tmp_path), "--prompt", "x"], str(tmp_path), "config.toml")
    assert_user_error(capsys, ["sample", "--run", str(good_run), "--temperature", "-1"], "--temperature -1")
    for bad in ("nan", "inf"):
        assert_user_error(capsys, ["sample", "--run", str(good_run), "--temperature", bad], f"--temperature {bad}",
                          "a finite number >= 0")


def _fail_on_rank_1(_: object) -> int:
    import os

    if os.environ["RANK"] == "1":
        raise RuntimeError("first line\nthe last line says what broke")
    return int(os.environ["RANK"])


def test_launcher_names_the_failed_rank():
    """A worker that fails at run time ends the run with its rank and its error's last line."""
    from shoal.infra.launch import WorkerFailed, launch

    with pytest.raises(WorkerFailed, match=r"^rank 1 of 2 failed: the last line says what broke$"):
        launch(_fail_on_rank_1, None, nproc=2)


def test_the_cause_is_named_not_the_rank_that_lost_it():
    """Failure times are whole seconds: rank 0's lost connection can tie with, or precede, rank 1's
    own error. The launcher names rank 1 either way; a run of only lost connections names the first."""
    from types import SimpleNamespace

    from shoal.infra.launch import _cause

    lost = SimpleNamespace(message="shoal.infra.watchdog.PeerGone: rank 0 waited 0 s: Connection closed by peer",
                           exitcode=1, timestamp=100)
    own = SimpleNamespace(message="RuntimeError: injected fault", exitcode=1, timestamp=100)
    assert _cause({0: lost, 1: own})[0] == 1
    assert _cause({0: lost, 1: SimpleNamespace(**{**vars(own), "timestamp": 101})})[0] == 1
    assert _cause({0: lost, 1: SimpleNamespace(**{**vars(lost), "timestamp": 99})})[0] == 1


def test_gpu_machine_defaults(monkeypatch, tmp_path, capsys):
    """On a machine with one GPU (simulated: torch reports one), `shoal train` with no flags runs
    one process on it, in bf16 with fp32 master weights and reduction (main refused it: "--nproc 2
    exceeds the 1 GPUs"); --nproc beyond the GPUs says how many there are and what else is valid;
    --device cpu keeps the CPU's defaults."""
    import torch

    from shoal.train.config import parse_plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    # The memory check prices the plan on the GPU torch names, with the memory it reports.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: type("P", (), {"total_memory": 80 * 2**30}))
    out = str(tmp_path / "run")
    job = train_cli.prepare_job(cli.build_parser().parse_args(["train", "--out", out]))
    assert job.device == "cuda" and train_cli.world_size(job.config, job.device) == 1
    plan = rules.resolve(parse_plan(job.config.plan), world_size=1, device=job.device)
    assert (plan.precision, plan.reduce) == ("bf16", "fp32")
    assert_user_error(capsys, ["train", "--out", out, "--nproc", "2"], "--nproc 2", "1 GPU(s)", "--device cpu")
    job = train_cli.prepare_job(cli.build_parser().parse_args(["train", "--out", out, "--device", "cpu"]))
    assert job.device == "cpu" and train_cli.world_size(job.config, job.device) == 2
    assert rules.resolve(parse_plan(job.config.plan), world_size=2, device=job.device).precision == "fp32"
    assert not (tmp_path / "run").exists()


def test_device_errors(monkeypatch, tmp_path, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_user_error(capsys, ["train", "--out", str(tmp_path / "r"), "--device", "cuda"], "--device cuda",
                      "no GPU", "valid: auto, cpu")
    assert_user_error(capsys, ["train", "--out", str(tmp_path / "r"), "--device", "tpu"], "--device 'tpu'",
                      "valid: auto, cpu, cuda")
    assert not (tmp_path / "r").exists()


def test_a_long_error_is_cut_and_kept_whole_in_the_run_folder(capsys, tmp_path):
    message = "checkpoint x could not be read: " + "detail " * 80
    assert errors.fail(message, 2, tmp_path) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and line.startswith("shoal: error: checkpoint x could not be read")
    shown = line.removeprefix("shoal: error: ").split(" ... (whole message in ")[0]
    assert len(shown) <= errors.MAX_ERROR and line.endswith(f"{tmp_path / 'error.log'})")
    assert (tmp_path / "error.log").read_text().strip() == " ".join(message.split())
    assert errors.fail("short", 2, tmp_path) == 2 and capsys.readouterr().err.strip() == "shoal: error: short"


def test_help_and_version(capsys):
    """Every subcommand has a description and every flag help text with its default; --version."""
    for command in ("train", "sample", "export"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = capsys.readouterr().out
        entries = [e for e in re.split(r"\n  (?=-)", text.split("options:")[1]) if e.startswith("--")]
        assert entries and text.split("options:")[0].count("\n") > 3, command  # usage plus a description
        for entry in entries:
            assert "[" in entry or "(required" in entry, (command, entry)
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.startswith("shoal ")


def test_the_models_page_says_which_presets_train():
    """Every preset is in the presets table of docs/models.md, and every one is marked as training in this version."""
    from shoal.models import PRESETS

    page = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `") and "trains" not in line]
    for name in PRESETS:
        row = next((r for r in rows if f"`{name}`" in r.split("|")[1]), None)
        assert row is not None, name
        assert row.split("|")[3].strip().startswith("yes"), row


def test_data_and_tokenizer_paths_are_kept_absolute(tmp_path, monkeypatch):
    """config.toml keeps --data's folders (a mixture's each, weights kept) and a tokenizer folder absolute, so a
    run resumes from any working folder; a path that does not exist is left as typed for its own refusal."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "tok").mkdir()
    monkeypatch.chdir(tmp_path)
    data = train_cli._absolute_paths(cli_data(path="a", tokenizer="tok"))
    assert (data.path, data.tokenizer) == (str(tmp_path / "a"), str(tmp_path / "tok"))
    mixed = train_cli._absolute_paths(cli_data(path="a:0.7,b:0.3", tokenizer="byte"))
    assert (mixed.path, mixed.tokenizer) == (f"{tmp_path / 'a'}:0.7,{tmp_path / 'b'}:0.3", "byte")
    assert train_cli._absolute_paths(cli_data(path="gone:1,a:1", tokenizer="byte")).path == "gone:1,a:1"
    assert train_cli._same_path("data", "a:0.7,b:0.3") == mixed.path  # --resume with the same mixture typed again


def cli_data(**fields):
    from shoal.data.text import DataConfig

    return DataConfig(**fields)


def test_a_misspelled_flag_of_a_nested_command_names_the_near_ones(capsys, tmp_path):
    assert_user_error(capsys, ["data", "prepare", str(tmp_path), "--tokenizer", "byte", "--out", str(tmp_path / "o"),
                               "--hold-out", "0.1"], "--hold-out 0.1", "valid: --holdout", "shoal data prepare --help")
    assert_user_error(capsys, ["sample", "--run", str(tmp_path), "--max-new-token", "5"], "valid: --max-new-tokens")


def test_a_runs_config_with_another_model_or_set_trains_what_the_flags_name(tmp_path):
    """A run folder's config.toml holds the shape it trained (model_config); reused with --config, --model names
    another model (its preset, not the stored shape) and --set changes the stored shape: flags override the file."""
    from shoal.models import PRESETS
    from shoal.train.config import from_flat
    from shoal.train.job import with_model, write_run_config

    write_run_config(tmp_path, with_model(from_flat({"model": "tiny"}), PRESETS["tiny"]))
    config = str(tmp_path / "config.toml")

    def model_of(*flags: str) -> object:
        args = cli.build_parser().parse_args(["train", "--config", config, "--out", str(tmp_path / "r"), *flags])
        return train_cli.prepare_job(args).config.model_config

    assert model_of() == PRESETS["tiny"]
    assert model_of("--model", "small") == PRESETS["small"]
    assert model_of("--model", "small", "--set", "dim=64") == PRESETS["small"].replace(dim=64)
    assert model_of("--set", "dim=64") == PRESETS["tiny"].replace(dim=64)


def test_resuming_at_another_precision_says_so(good_run, capsys):
    """A resumed run may change its plan's precision (the user's choice), and is told that it does: one warning
    naming both; the same precision says nothing."""
    def resume(*flags: str) -> str:
        args = cli.build_parser().parse_args(["train", "--resume", str(good_run), "--steps", "3", *flags])
        train_cli.prepare_job(args)  # validates and prices; trains nothing
        return capsys.readouterr().err

    said = resume("--plan", "precision=bf16")
    assert said.count("shoal: warning:") == 1 and "trained in fp32 and goes on in bf16" in said
    assert "warning" not in resume("--plan", "precision=fp32") and "warning" not in resume()


def test_final_checkpoint_off_keeps_the_periodic_ones_only(tmp_path):
    """--final-ckpt off: the periodic checkpoints are written, the one at the last step is not (3 steps, every 2:
    step 2 only); on (the default) the last step's is written too."""
    run = tmp_path / "no-final"
    assert cli.main(["train", "--out", str(run), "--nproc", "1", "--steps", "3", "--ckpt-every", "2",
                     "--final-ckpt", "off", *SMALL]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step")) == ["step_00000002"]
