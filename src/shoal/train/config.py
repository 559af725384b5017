"""The run config: what `shoal train` flags and a `--config FILE.toml` set, as small dataclasses.

One flat namespace of keys serves the flags, the TOML file and the run folder's `config.toml`:
`--global-batch 16` on the command line is `global_batch = 16` in the file. Each key belongs to
the small dataclass of the module that uses it (`OptimConfig` to optim.py, `DataConfig` to
data.py, `LoopConfig` to loop.py); `RunConfig` nests them.

Precedence: dataclass defaults < `--config` file < explicit flags. A resumed run takes its
config from the run folder; only the keys in `RESUMABLE` may change.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from shoal.data.text import DataConfig
from shoal.models import ModelShape, preset, shape_from_dict, shape_to_dict
from shoal.models.lora_config import LoRAConfig
from shoal.optim.config import OptimConfig
from shoal.plan import Plan


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """How long to train, on what batches, and how often to evaluate and save."""

    steps: int = 300
    """Total optimizer steps of the run (a resumed run continues up to this)."""
    global_batch: int = 16
    """Sequences per optimizer step, the same whatever the plan."""
    micro_batch: int | None = None
    """Sequences per forward on each data rank; None: the whole per-rank batch (no accumulation)."""
    seq_len: int = 128
    seed: int = 0
    ckpt_every: int = 100
    """Save a checkpoint every K steps (and at the end, unless `final_ckpt` is off); 0: only at the end."""
    final_ckpt: bool = True
    """Save a checkpoint at the last step. Off: a run that leaves nothing to resume from at its end, for
    benchmarks that time the steps (a large model's last checkpoint takes longer to write than its steps run);
    a run stopped by a signal still saves."""
    keep: int = 0
    """Keep only the K most recent checkpoints (older ones are deleted after each save); 0: all."""
    eval_every: int = 50
    """Held-out loss every K steps (and always at the end); 0: only at the end."""
    eval_batches: int = 4
    """Global batches of held-out data per evaluation."""
    hang_timeout: float = 0.0
    """Seconds a collective may wait once steps run before the run stops, naming the ranks that
    stopped answering and where each was; 0: automatic (ten times the slowest step, at least
    30 s). Start-up, evaluation and checkpoints get at least 600 s."""
    log_every: int = 10
    """Read the step's numbers (loss, gradient norm, memory) from the device every K steps, in one
    synchronisation: between reads the host queues work ahead of the GPU. metrics.jsonl still gets
    one record per step; a window's time is shared equally among its steps."""
    on_nonfinite: str = "stop"
    """A step whose loss or gradient norm is not finite is never applied (the update is gated on the
    device). stop: at the next step the figures are read, the run stops (exit 1) naming the step and
    the newest checkpoint; skip: it goes on, counting such steps, and stops after `max_bad_steps` in a
    row. fp16 loss-scale overflows are skipped and not counted under both (shoal.train.nonfinite)."""
    max_bad_steps: int = 10
    """--on-nonfinite skip: stop after this many non-finite steps in a row."""

    def __post_init__(self) -> None:
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"--on-nonfinite {self.on_nonfinite!r} is not valid; valid: stop, skip")
        for name in ("steps", "global_batch", "seq_len", "eval_batches", "log_every", "max_bad_steps"):
            _at_least(name, getattr(self, name), 1)
        for name in ("ckpt_every", "eval_every", "seed", "keep", "hang_timeout"):
            _at_least(name, getattr(self, name), 0)
        if self.micro_batch is not None:
            _at_least("micro_batch", self.micro_batch, 1)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything `shoal train` needs to know, before the world size is known."""

    model: str = "tiny"
    """A preset name or hf:<dir or config.json>."""
    set: tuple[str, ...] = ()
    """Model field overrides, key=value."""
    model_config: ModelShape | None = None
    """The resolved model shape (a transformer's, or another family's: shoal.models.adapter.Family); when
    given it wins over `model` and `set` (run folders store it)."""
    plan: str | None = None
    """A plan string (see DESIGN.md); None: data parallel over every process."""
    nproc: int | None = None
    """Local worker processes to start; None: one per visible GPU on GPUs, 2 on CPU. Ignored
    under torchrun, which gives the world."""
    device: str = "auto"
    """Where each process computes: cuda (one GPU per process, NCCL), cpu (gloo), or auto
    (cuda when torch sees a GPU, else cpu)."""
    tf32: bool = True
    """On GPUs that have them, float32 matmuls and convolutions run on TF32 tensor cores (10-bit
    mantissa inputs, float32 accumulation; what fp32 runs want). Off: full float32. No effect
    on CPUs or on bf16/fp16 compute."""
    max_restarts: int = 0
    """After a worker fails, restart every worker this many times at most, each time from the
    newest checkpoint that verifies (torch elastic's restarts). Under torchrun: torchrun's own
    --max-restarts, with --out."""
    out: str | None = None
    """The run folder; None: runs/<timestamp>."""
    dry_run: bool = False
    """Set up, run three steps on state that is thrown away, print each rank's memory beside the
    planner's prediction, and exit (shoal.train.dry_run); nothing is saved."""
    memory_check: bool = True
    """Before any worker starts, price the plan's memory per device on this machine (the
    planner's model: each GPU's memory, or the host's shared by the local processes on CPUs) and
    refuse a plan predicted not to fit, naming plans that fit. Off: run anyway (a warning)."""
    init: str | None = None
    """Start from pretrained weights: a Hugging Face folder of safetensors or a `shoal export`
    file/folder, each rank reading only its slices (shoal/models/safetensors_io.py); None: the seed's."""
    init_ignore: tuple[str, ...] = ()
    """Glob patterns (shoal names or file keys) of tensors `init` may lack or hold in excess;
    ignored missing tensors start from the seed's values."""
    lora: str | None = None
    """Train low-rank adapters on a frozen base instead of every weight: `r=16,alpha=32,dropout=0.05,
    targets=q,k,v,o,gate,up,down` (shoal.models.lora_config.LoRAConfig.parse); None: every weight trains."""
    lora_init: str | None = None
    """A peft adapter folder whose adapters the run starts from (`--init` of such a folder sets it, and `init` to
    the adapter's base); None: the adapters' own initial values."""
    loop: LoopConfig = field(default_factory=LoopConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        if self.nproc is not None:
            _at_least("nproc", self.nproc, 1)
        _at_least("max_restarts", self.max_restarts, 0)
        if self.device not in DEVICES:
            raise ValueError(f"--device {self.device!r} is not valid; valid: {', '.join(DEVICES)}")
        if self.data.path is not None and not self.data.path.strip():  # Path("") would be the working folder
            raise ValueError("--data '' names nothing; valid: a folder of .txt files, a .txt, .bin or .npy file, a "
                             "prepared folder or a mixture (DIR_A:0.7,DIR_B:0.3), or leave --data out")
        if self.lora is not None:
            LoRAConfig.parse(self.lora)  # a one-line ValueError for bad settings
        if self.lora_init is not None and self.lora is None:
            raise ValueError(f"lora_init {self.lora_init} names adapters to start from, and no lora settings were "
                             "given; valid: lora = \"r=...\" with it, or --init of the peft folder")
        if self.init_ignore and self.init is None:
            raise ValueError(f"--init-ignore {' '.join(self.init_ignore)} names tensors of --init's files, and "
                             "no --init was given; valid: --init PATH with it, or no --init-ignore")


# key -> (section, field name); section None is RunConfig itself.
KEYS: dict[str, tuple[str | None, str]] = {
    "model": (None, "model"), "set": (None, "set"), "plan": (None, "plan"), "nproc": (None, "nproc"),
    "device": (None, "device"), "tf32": (None, "tf32"), "out": (None, "out"),
    "max_restarts": (None, "max_restarts"), "memory_check": (None, "memory_check"),
    "dry_run": (None, "dry_run"), "init": (None, "init"), "init_ignore": (None, "init_ignore"),
    "lora": (None, "lora"), "lora_init": (None, "lora_init"),
    **{f.name: ("loop", f.name) for f in dataclasses.fields(LoopConfig)},
    **{f.name: ("optim", f.name) for f in dataclasses.fields(OptimConfig)},
    "data": ("data", "path"), "tokenizer": ("data", "tokenizer"), "val_fraction": ("data", "val_fraction"),
    "doc_mask": ("data", "doc_mask"),
}
RESUMABLE = ("steps", "plan", "nproc", "device", "tf32", "ckpt_every", "final_ckpt", "keep", "eval_every",
             "log_every", "micro_batch", "hang_timeout", "max_restarts", "memory_check", "dry_run", "on_nonfinite",
             "max_bad_steps", "lr", "min_lr", "grad_clip")
"""Keys a resumed run may change: none of them changes the loss curve beyond rounding (the plan's
precision aside, which the user then chose)."""
DEVICES = ("auto", "cpu", "cuda")
_SECTIONS = {"loop": LoopConfig, "optim": OptimConfig, "data": DataConfig}


def from_flat(values: dict[str, Any], base: RunConfig | None = None) -> RunConfig:
    """A RunConfig from flat keys (flag names with underscores), on top of `base`.

    Values are checked against each field's type; a wrong key or value is a one-line ValueError.
    """
    base = base or RunConfig()
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    for key, value in values.items():
        key = key.replace("-", "_")
        if key == "model_config":
            top[key] = _model_config(value)
            continue
        if key in ("resume", "config"):
            raise ValueError(f"config key {key!r}: --{key} is given on the command line, not in a config file; "
                             f"valid: shoal train --{key} {'DIR' if key == 'resume' else 'FILE'}")
        if key not in KEYS:
            close = difflib.get_close_matches(key, [*KEYS, "model_config"], n=3)
            raise ValueError(f"unknown config key {key!r}; valid: " + (f"{', '.join(close)}, or another of" if close
                             else "one of") + " the long flags' names with underscores (shoal train --help)")
        section, name = KEYS[key]
        cls = RunConfig if section is None else _SECTIONS[section]
        typed = _coerce(key, value, _field_type(cls, name))
        (top if section is None else sections[section])[name] = typed
    for name, changes in sections.items():
        if changes:
            top[name] = dataclasses.replace(getattr(base, name), **changes)
    return dataclasses.replace(base, **top)


def to_flat(cfg: RunConfig) -> dict[str, Any]:
    """The flat key -> value view of `cfg` (what `from_flat` reads back); None values left out."""
    out: dict[str, Any] = {}
    for key, (section, name) in KEYS.items():
        value = getattr(cfg if section is None else getattr(cfg, section), name)
        if value is not None:
            out[key] = list(value) if isinstance(value, tuple) else value
    model = cfg.model_config
    if model is not None:
        out["model_config"] = {k: v for k, v in shape_to_dict(model).items() if v is not None}
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    """The flat keys of a TOML config file; a one-line ValueError for a missing or malformed file."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ValueError(f"config file {str(path)!r} {what}; valid: a TOML file with keys such as steps = 100")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {' '.join(str(exc).split())}") from None


def dump_toml(values: dict[str, Any]) -> str:
    """Flat scalars and lists, then `model_config` as a table: enough TOML for `to_flat`'s output
    (tomllib reads but does not write)."""
    lines = ["# shoal run config (resolved). Reuse: shoal train --config this-file.toml", ""]
    tables = {k: v for k, v in values.items() if isinstance(v, dict)}
    lines += [f"{key} = {_toml_value(v)}" for key, v in values.items() if key not in tables]
    for name, table in tables.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


def resolve_model(cfg: RunConfig) -> ModelShape:
    """The model shape a run trains: the stored shape, or the preset / hf: config with --set."""
    if cfg.model_config is not None:
        return cfg.model_config
    if cfg.model.startswith("hf:"):
        from shoal.models.hf.families import config_from_hf

        base: ModelShape = config_from_hf(cfg.model.removeprefix("hf:"))
    else:
        base = preset(cfg.model)
    return base.with_overrides(list(cfg.set))


def model_of_init(init: str) -> str:
    """The model a run with `--init PATH` and no `--model` trains: the folder's own config.json
    (a Hugging Face folder or a `shoal export --hf`), else the default preset, whose shapes the
    weights are then checked against."""
    folder = Path(init)
    if (folder / "config.json").is_file():
        return f"hf:{folder}"
    return RunConfig.model


def parse_plan(text: str | None) -> Plan:
    """The run's Plan; None or "dp" mean data parallel over every process."""
    if text is None or text.strip() == "dp":
        return Plan()
    return Plan.parse(text)


# ----------------------------------------------------------------------------- helpers


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"--{name.replace('_', '-')} {value} is not valid; it must be >= {low}")


def _model_config(value: Any) -> ModelShape:
    if not isinstance(value, dict):
        raise ValueError(f"model_config must be a table of model fields, got {value!r}")
    return shape_from_dict(value)


def _field_type(cls: type, name: str) -> str:
    return str(next(f.type for f in dataclasses.fields(cls) if f.name == name))


def _coerce(key: str, value: Any, type_name: str) -> Any:
    """Check `value` (from TOML or argparse) against a field's annotation, as text."""
    if value is None and "None" in type_name:
        return None
    base = type_name.split("|")[0].strip()
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
    }.get(base)
    if base.startswith("tuple"):
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ValueError(f"config key {key} must be a list of strings, got {value!r}")
    if base == "bool" and value in ("on", "off"):  # as the flags take them
        return value == "on"
    if not ok:
        words = {"int": "a whole number", "float": "a number", "str": "a string in quotes"}
        valid = "true or false (or \"on\" / \"off\")" if base == "bool" else words.get(base, type_name)
        raise ValueError(f"config key {key} = {value!r} is not valid; it must be {valid}")
    return float(value) if base == "float" else value


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
