"""Checkpoints that survive crashes and reshard: torch.distributed.checkpoint (DCP) underneath.

Layout of a run folder:

    run_dir/checkpoints/
        step_00000012/            one complete checkpoint
            .metadata             DCP's index (tensor shapes and where each shard lives)
            __0_0.distcp ...      DCP's data files (one or more per rank)
            trainer_state.json    `extra`: JSON trainer state (step, scheduler, plan, config...)
            manifest.json         written last: sha256 of trainer_state.json, size and CRC-32 of every file
        latest                    text file naming the newest complete checkpoint folder

Why it reshards: the model and optimizer state dicts come from the parallel runtime
(`Runtime.state_dict`, DCP's format: names without wrapper prefixes, sharded tensors as DTensors
with their global shapes and per-rank pieces). DCP stores each tensor once with its global shape, so a
checkpoint written by any number of ranks under any plan loads into any other layout: every
rank reads just the pieces its own (possibly sharded) parameters need.

Why it is crash-safe: every rank writes into `step_N.tmp-<random>`; rank 0 adds the trainer
state and the manifest, then renames the folder and replaces `latest` atomically (write a
temporary file, `os.replace`). A crash at any moment leaves either the previous `latest` or the
new one, never a half-written folder under a `step_N` name.

Why corruption is caught before any worker starts: the manifest holds every file's size and
CRC-32 (each rank checksums the files it wrote while they are still in the page cache), and
`newest_good_checkpoint` and `read_trainer_state(checksums=True)` re-read them: a checkpoint with a
zeroed block fails with one line naming the file, instead of deep inside DCP's reader. A corrupt
`latest` makes `newest_good_checkpoint` fall back to the newest checkpoint that verifies.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import sys
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shoal.infra import faults
from shoal.infra.world import broadcast_from_rank0, distributed, first_error, rank, world_size
from shoal.runtime import Runtime
from shoal.train.safe_load import SafeLoadPlanner, SafeReader, UnsafeCheckpointError

FORMAT = "shoal-checkpoint/1"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
DCP_METADATA = ".metadata"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


# ----------------------------------------------------------------------------- public API


def checkpoint_dir(run_dir: Path | str) -> Path:
    """The folder that holds a run's checkpoints."""
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: Path | str,
    step: int,
    *,
    runtime: Runtime,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
) -> Path:
    """Save the runtime's model, the optimizer and `extra` (JSON trainer state) as checkpoint
    `step`; returns its folder.

    Collective: every rank of the default process group calls it (or a single process with none).
    When it returns on any rank, the checkpoint is complete and `latest` names it.
    """
    if step < 0:
        raise ValueError(f"checkpoint step {step} must be >= 0")
    state_json = json.dumps(extra, sort_keys=True, indent=1)  # every rank: fail early and together
    root = checkpoint_dir(run_dir)
    final = root / f"step_{step:08d}"
    token, error = secrets.token_hex(4), None
    if rank() == 0:  # before the broadcast below: no rank has created the new folder yet
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale_temporaries(root)
        except OSError as exc:
            error = f"saving checkpoint {final} failed: {_one_line(exc)}"
    token, error = broadcast_from_rank0((token, error))  # rank 0's name for the folder, and its error
    if error is not None:
        raise RuntimeError(error)
    tmp = root / f"{final.name}.tmp-{token}"
    state = runtime.state_dict(optimizer)
    try:
        with _quiet_single_process():
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not distributed())
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException, raised on every rank
        raise RuntimeError(f"saving checkpoint {final} failed: {_one_line(exc)}") from None
    crcs, error = _gather_crcs(tmp, final, step)
    if error is not None:
        raise RuntimeError(error)
    if rank() == 0:  # dcp.save returns on rank 0 only after every rank's files are written
        try:
            _finish(tmp, final, root, step=step, state_json=state_json, has_optimizer=optimizer is not None,
                    crcs=crcs)
        except Exception as exc:  # report to every rank, not just this one
            error = f"saving checkpoint {final} failed: {_one_line(exc)}"
    error = broadcast_from_rank0(error)
    if error is not None:
        raise RuntimeError(error)
    return final


def latest_checkpoint(run_dir: Path | str) -> Path | None:
    """The newest complete checkpoint of a run, or None when it has none.

    `latest` decides; if it is missing or names a folder that is gone (a crash between two
    renames), the highest-numbered complete `step_N` folder is taken instead.
    """
    root = checkpoint_dir(run_dir)
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if target.name and (target / MANIFEST).is_file():
            return target
    steps = sorted(
        (int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else ())
        if (m := _STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()
    )
    return steps[-1][1] if steps else None


def newest_good_checkpoint(run_dir: Path | str) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint whose files verify, or None; one line per newer checkpoint skipped
    as corrupt, naming what is wrong with it). Reads every file of the checkpoints it checks."""
    root = checkpoint_dir(run_dir)
    latest = latest_checkpoint(run_dir)
    candidates = sorted((p for p in (root.iterdir() if root.is_dir() else ()) if _STEP_DIR.match(p.name)),
                        reverse=True)
    if latest is not None:  # `latest` first; older ones only if it fails
        candidates = [latest] + [p for p in candidates if p.name < latest.name]
    skipped: list[str] = []
    for path in candidates:
        error = _check_files(path, checksums=True)
        if error is None:
            return path, skipped
        skipped.append(f"checkpoint {path} {error}")
    return None, skipped


def good_checkpoint(run_dir: Path | str) -> Path:
    """The checkpoint to continue or read a run from: `newest_good_checkpoint`, with a one-line
    warning on stderr for each newer one skipped as corrupt; ValueError when none verifies."""
    path, skipped = newest_good_checkpoint(run_dir)
    if path is None:
        reason = f"; {skipped[0]}" if skipped else ""
        raise ValueError(f"run folder {str(run_dir)!r} holds no complete checkpoint that verifies{reason}")
    for line in skipped:
        print(f"shoal: warning: {line}; using {path.name}, the newest checkpoint that verifies", file=sys.stderr,
              flush=True)
    return path


def load_checkpoint(
    path: Path | str, *, runtime: Runtime, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Load checkpoint folder `path` into the runtime's model (and `optimizer`), resharding to
    their current layout; returns the saved `extra`. Collective like save.

    A missing, corrupt or incompatible checkpoint raises a one-line ValueError naming the path.
    """
    path = Path(path)
    state = runtime.state_dict(optimizer)
    model_keys = _union(set(state["model"]))  # a pipeline stage holds a subset: compare the whole model
    error = _check_files(path) or _check_compatible(path, state["model"], "optimizer" in state, model_keys)
    error = first_error(error)
    if error is not None:
        raise ValueError(f"checkpoint {path} {error}")
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(path), storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(),
                     no_dist=not distributed())
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException, raised on every rank
        raise ValueError(f"checkpoint {path} could not be read: {_one_line(exc)}") from None
    runtime.load_state_dict(state, optimizer)
    return json.loads((path / TRAINER_STATE).read_text())


def read_trainer_state(path: Path | str, *, checksums: bool = False) -> dict[str, Any]:
    """The `extra` saved with checkpoint `path`, after checking its files (sizes; with `checksums`
    also every file's CRC-32; no process group needed): lets a launcher validate `--resume`
    before starting workers."""
    path = Path(path)
    error = _check_files(path, checksums=checksums)
    if error is not None:
        raise ValueError(f"checkpoint {path} {error}")
    return json.loads((path / TRAINER_STATE).read_text())


def prune(run_dir: Path | str, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (never the one `latest` names);
    returns the folders removed. Call on one rank (rank 0)."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1 (the latest checkpoint is always kept)")
    root = checkpoint_dir(run_dir)
    latest = latest_checkpoint(run_dir)
    steps = sorted(p for p in (root.iterdir() if root.is_dir() else ()) if _STEP_DIR.match(p.name))
    removed = [p for p in steps[:-keep] if p != latest]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


# ----------------------------------------------------------------------------- saving


def _gather_crcs(folder: Path, final: Path, step: int) -> tuple[dict[str, int], str | None]:
    """CRC-32 of the data files this rank wrote (DCP names them `__<rank>_<i>.distcp`) and, on
    rank 0, of DCP's index: every rank's, and the lowest rank's error if any failed (collective)."""
    crcs, error = {}, None
    try:
        faults.point("checkpoint", step)  # test-only; a no-op unless SHOAL_FAULT names it
        mine = [p for p in folder.glob(f"__{rank()}_*") if p.is_file()]
        if rank() == 0 and (folder / DCP_METADATA).is_file():
            mine.append(folder / DCP_METADATA)
        crcs = {p.name: _crc32(p) for p in mine}
    except OSError as exc:
        error = (f"saving checkpoint {final.name} failed on rank {rank()}: {_one_line(exc)}; `latest` still "
                 "names the previous checkpoint")
    if world_size() == 1:
        return crcs, error
    gathered: list[tuple[dict[str, int], str | None] | None] = [None] * world_size()
    dist.all_gather_object(gathered, (crcs, error))
    errors = [g[1] for g in gathered if g is not None and g[1] is not None]
    return {k: v for g in gathered if g for k, v in g[0].items()}, (errors[0] if errors else None)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _finish(tmp: Path, final: Path, root: Path, *, step: int, state_json: str, has_optimizer: bool,
            crcs: dict[str, int]) -> None:
    """Rank 0, after DCP wrote its files: trainer state, manifest, rename, `latest`."""
    _write_synced(tmp / TRAINER_STATE, state_json.encode())
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {
        "format": FORMAT,
        "step": step,
        "torch": torch.__version__,
        "world_size": world_size(),
        "has_optimizer": has_optimizer,
        "trainer_state_sha256": hashlib.sha256(state_json.encode()).hexdigest(),
        "file_sizes": files,
        "file_crc32": crcs,
    }
    _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())  # last: marks tmp complete
    if final.exists():
        # Never replace a good folder by an incomplete one: point `latest` at the complete
        # temporary first, then swap the folders, then point `latest` at the final name.
        _point_latest(root, tmp.name)
        old = final.with_name(f"{final.name}.old-{secrets.token_hex(4)}")
        os.rename(final, old)
        os.rename(tmp, final)
        _point_latest(root, final.name)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
        _point_latest(root, final.name)
    _fsync_dir(root)
    _remove_stale_temporaries(root)  # one `latest` named while a crashed save swapped folders


def _point_latest(root: Path, name: str) -> None:
    tmp = root / f"{LATEST}.tmp-{secrets.token_hex(4)}"
    _write_synced(tmp, (name + "\n").encode())
    os.replace(tmp, root / LATEST)


def _remove_stale_temporaries(root: Path) -> None:
    """Folders left by saves that crashed (never the one `latest` names)."""
    pointer = root / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else ""
    for p in root.iterdir():
        if (".tmp-" in p.name or ".old-" in p.name) and p.name != named:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a folder be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------- loading checks


def _check_files(path: Path, *, checksums: bool = False) -> str | None:
    """What is wrong with the files of checkpoint `path` (None when all is in order). Sizes
    always; with `checksums`, every file's CRC-32 too (reads the whole checkpoint)."""
    if not path.is_dir():
        return "does not exist" if not path.exists() else "is not a folder"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return f"is incomplete or not a shoal checkpoint: {MANIFEST} is missing"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"is corrupt: {MANIFEST} is not valid JSON"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        return f"has an unknown format {found!r}; valid: {FORMAT}"
    for name, size in manifest.get("file_sizes", {}).items():
        file = path / name
        if not file.is_file():
            return f"is corrupt: {name} is missing"
        if file.stat().st_size != size:
            return f"is corrupt: {name} has {file.stat().st_size} bytes, expected {size} (truncated or overwritten)"
    if not (path / DCP_METADATA).is_file():
        return f"is corrupt: the DCP index {DCP_METADATA} is missing"
    try:
        state = (path / TRAINER_STATE).read_bytes()
    except FileNotFoundError:
        return f"is corrupt: {TRAINER_STATE} is missing"
    if hashlib.sha256(state).hexdigest() != manifest.get("trainer_state_sha256"):
        return f"is corrupt: {TRAINER_STATE} checksum mismatch"
    if checksums:  # a manifest without file_crc32 lists none: sizes only
        for name, crc in manifest.get("file_crc32", {}).items():
            if not (path / name).is_file():
                return f"is corrupt: {name} is missing"
            if _crc32(path / name) != crc:
                return f"is corrupt: {name} fails its checksum (same size, different bytes)"
    return None


def _check_compatible(path: Path, model_sd: dict[str, Any], has_optimizer: bool, model_keys: set[str]) -> str | None:
    """Compare the checkpoint's tensor index with this model (`model_keys`: its names on all
    ranks): names missing on either side and global shapes."""
    try:
        saved = SafeReader(str(path)).read_metadata().state_dict_metadata
    except UnsafeCheckpointError as exc:
        return f"is not loaded: its DCP index {DCP_METADATA} {exc}"
    except Exception as exc:
        return f"is corrupt: its DCP index {DCP_METADATA} cannot be read ({_one_line(exc)})"
    saved_model = {k.removeprefix("model."): v for k, v in saved.items() if k.startswith("model.")}
    missing = [k for k in model_sd if k not in saved_model]
    if missing:
        return (f"does not match this model: it lacks {len(missing)} parameter(s) such as {missing[0]!r} "
                f"(it holds {len(saved_model)} model tensors)")
    extra = sorted(set(saved_model) - model_keys)
    if extra:
        return f"does not match this model: it holds {len(extra)} tensor(s) this model lacks, such as {extra[0]!r}"
    for key, value in model_sd.items():
        want = tuple(value.size()) if isinstance(value, torch.Tensor) else None
        have = getattr(saved_model[key], "size", None)
        if want is not None and have is not None and tuple(have) != want:
            return f"does not match this model: {key} has shape {tuple(have)} in the checkpoint, {want} in the model"
    if has_optimizer and not any(k.startswith("optimizer.") for k in saved):
        return "holds no optimizer state; load it with optimizer=None (weights only)"
    return None


# ----------------------------------------------------------------------------- helpers


def _union(keys: set[str]) -> set[str]:
    """The union of every rank's `keys`."""
    if world_size() == 1:
        return keys
    gathered: list[set[str] | None] = [None] * world_size()
    dist.all_gather_object(gathered, keys)
    return set().union(*(g for g in gathered if g is not None))


def _one_line(exc: BaseException) -> str:
    """An exception in one line; for DCP's, the first failing rank's own exception."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (inner, _) = min(exc.failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {_one_line(inner)}"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process save/load that it assumes a single process: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield
