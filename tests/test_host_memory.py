"""The C allocator of CPU workers (shoal.infra.host_memory): jemalloc preloaded where one is found, the user's choice
kept, a bad SHOAL_ALLOCATOR refused in one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from shoal import cli
from shoal.infra import host_memory

JEMALLOC = host_memory.find_jemalloc()
needs_jemalloc = pytest.mark.skipif(JEMALLOC is None, reason=f"no libjemalloc here ({host_memory.NOT_FOUND})")


@pytest.fixture
def fake_jemalloc(tmp_path, monkeypatch):
    """A folder holding a file named like jemalloc, the only place searched; no allocator settings of the user."""
    (tmp_path / "libjemalloc.so.2").write_bytes(b"")
    monkeypatch.setattr(host_memory, "search_path", lambda: [tmp_path])
    for name in ("LD_PRELOAD", "SHOAL_ALLOCATOR", "MALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    return str(tmp_path / "libjemalloc.so.2")


def test_cpu_workers_get_jemalloc_where_one_is_found(fake_jemalloc, monkeypatch):
    assert host_memory.worker_env("cpu") == {"LD_PRELOAD": fake_jemalloc, "MALLOC_CONF": host_memory.KEEP_FREED}
    monkeypatch.setenv("SHOAL_ALLOCATOR", "jemalloc")
    assert host_memory.worker_env("cpu")["LD_PRELOAD"] == fake_jemalloc


def test_the_user_s_own_jemalloc_settings_are_kept(fake_jemalloc, monkeypatch):
    monkeypatch.setenv("MALLOC_CONF", "background_thread:true")
    assert host_memory.worker_env("cpu") == {"LD_PRELOAD": fake_jemalloc}


def test_gpu_workers_glibc_by_choice_and_the_user_s_own_preload_are_left_alone(fake_jemalloc, monkeypatch):
    assert host_memory.worker_env("cuda") == {}
    monkeypatch.setenv("SHOAL_ALLOCATOR", "glibc")
    assert host_memory.worker_env("cpu") == {}
    monkeypatch.setenv("SHOAL_ALLOCATOR", "auto")
    monkeypatch.setenv("LD_PRELOAD", "/opt/libtcmalloc.so")
    assert host_memory.worker_env("cpu") == {}


def test_no_jemalloc_found_is_glibc_unless_asked_for(tmp_path, monkeypatch):
    monkeypatch.setattr(host_memory, "search_path", lambda: [tmp_path])
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("SHOAL_ALLOCATOR", raising=False)
    assert host_memory.worker_env("cpu") == {}
    monkeypatch.setenv("SHOAL_ALLOCATOR", "jemalloc")
    with pytest.raises(ValueError, match=r"^SHOAL_ALLOCATOR=jemalloc: no libjemalloc found .*; valid: auto, glibc$"):
        host_memory.worker_env("cpu")


def test_for_workers_sets_the_environment_only_while_open(fake_jemalloc, monkeypatch):
    with host_memory.for_workers("cpu"):
        assert os.environ["LD_PRELOAD"] == fake_jemalloc
        assert host_memory.describe() == f"jemalloc ({fake_jemalloc}; MALLOC_CONF={host_memory.KEEP_FREED})"
    assert "LD_PRELOAD" not in os.environ and "MALLOC_CONF" not in os.environ


def test_a_bad_allocator_name_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SHOAL_ALLOCATOR", "tcmalloc")
    assert cli.main(["train", "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "shoal: error: SHOAL_ALLOCATOR='tcmalloc' is not an allocator; valid: auto, jemalloc, glibc"
    assert not (tmp_path / "run").exists()


@needs_jemalloc
def test_jemalloc_s_kept_memory_is_read_from_jemalloc():
    """Under jemalloc glibc's mallinfo2 reads nothing: the freed memory kept is jemalloc's resident pages less
    those allocated and its metadata, which rises when tensors are freed (it returns them after its decay time,
    10 s: 100 blocks of 256 KiB freed between blocks that stay are still held a moment later)."""
    code = ("import torch; from shoal.train import memory as m; blocks = [torch.empty(65536) for _ in range(201)]; "
            "before = m.allocator_held_mb(); del blocks[1::2]; print(m._mallinfo2() is None, before, "
            "m.allocator_held_mb())")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "LD_PRELOAD": str(JEMALLOC)},
                          capture_output=True, text=True, check=True)
    glibc_gone, before, after = done.stdout.split()
    assert glibc_gone == "True" and float(after) - float(before) >= 0.5 * 100 * 256 / 1024


@needs_jemalloc
def test_cpu_workers_jemalloc_keeps_freed_pages(monkeypatch):
    """KEEP_FREED reaches jemalloc in a worker's environment: its decay time reads -1, never return them."""
    for name in ("LD_PRELOAD", "SHOAL_ALLOCATOR", "MALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    with host_memory.for_workers("cpu"):
        env = dict(os.environ)
    code = ("import ctypes; from shoal.train import memory as m; "
            "print(ctypes.c_ssize_t(m._jemalloc_stat()('opt.dirty_decay_ms')).value)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["-1"]


@needs_jemalloc
def test_kept_small_blocks_and_returned_large_ones():
    """Under KEEP_FREED, once return_large_blocks has run, freeing 16 MiB blocks gives their memory back to the
    kernel at once and freeing 1 MiB blocks does not (the resident set falls by the one and not the other: 320
    and 200 MB, far beyond what the interpreter's own allocations move); under glibc it does nothing."""
    code = ("import torch; from shoal.infra import host_memory as h; from shoal.train import memory as m; "
            "print(h.return_large_blocks()); large = [torch.ones(2**22) for _ in range(20)]; "
            "small = [torch.ones(2**18) for _ in range(200)]; r0 = m.current_mb(); del large; r1 = m.current_mb(); "
            "del small; print(r0 - r1, r1 - m.current_mb())")
    env = {**os.environ, "LD_PRELOAD": str(JEMALLOC), "MALLOC_CONF": host_memory.KEEP_FREED}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    was_set, large, small = done.stdout.split()
    assert was_set == "True" and float(large) >= 0.9 * 320 and float(small) <= 0.1 * 200
    glibc = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    code = "from shoal.infra import host_memory as h; print(h.return_large_blocks())"
    done = subprocess.run([sys.executable, "-c", code], env=glibc, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False"]


@needs_jemalloc
def test_a_cpu_run_s_workers_run_on_jemalloc(tmp_path, capfd, monkeypatch):
    """The dry run's header names it, and its kept column is filled, which only jemalloc's statistics
    can do in a worker where glibc's malloc is not the one in use."""
    for name in ("LD_PRELOAD", "SHOAL_ALLOCATOR", "MALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    argv = ["train", "--dry-run", "--nproc", "1", "--device", "cpu", "--set", "num_layers=2", "--global-batch", "4",
            "--seq-len", "32", "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    text = capfd.readouterr().out
    assert f"host memory allocator: jemalloc ({JEMALLOC}; MALLOC_CONF={host_memory.KEEP_FREED})" in text
    (row,) = [line.split() for line in text.splitlines() if re.match(r"\s+0\s+\d", line)]
    assert len(row) == 9 and float(row[8]) >= 0
