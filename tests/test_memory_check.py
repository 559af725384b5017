"""The memory check `shoal train` makes before any worker starts (shoal/planner/fit.py): a plan the
planner's memory model predicts won't fit is refused in one line naming what it needs, what the
machine has and plans that fit, or, when none fits, the smallest need and how many devices would
hold the model. The memory model itself is tested against hand counts in test_planner.py."""

from __future__ import annotations

import pytest

from shoal import cli, rules
from shoal.models.config import get_preset
from shoal.plan import Plan
from shoal.planner import fit
from shoal.planner.estimate import CPU_PROCESS_BYTES, Workload, estimate


def _resolved(text: str, work: Workload, world: int) -> Plan:
    return rules.resolve(Plan.parse(text), world_size=world, model=work.model, global_batch=work.global_batch,
                         seq_len=work.seq_len)


def test_refusal_names_the_need_the_machine_and_plans_that_fit():
    """A machine sized between fsdp2's need and dp2's: dp2 is refused, fsdp2 named as fitting."""
    work = Workload(model=get_preset("gpt3-1.3b"), global_batch=4, seq_len=256)
    probe = fit.cpu_cluster(2, local=2, memory_bytes=10**15)
    dp2, fsdp2 = (estimate(_resolved(t, work, 2), work, probe) for t in ("dp2", "fsdp2"))
    assert fsdp2.mem_per_device_bytes < dp2.mem_per_device_bytes
    machine = int(fsdp2.mem_per_device_bytes + dp2.mem_per_device_bytes)  # per process: halfway, times 2 processes
    cluster = fit.cpu_cluster(2, local=2, memory_bytes=machine)
    assert fit.memory_refusal(_resolved("fsdp2", work, 2), work, cluster) is None
    line = fit.memory_refusal(_resolved("dp2", work, 2), work, cluster)
    assert line is not None and "\n" not in line
    each = dp2.mem_per_device_bytes + CPU_PROCESS_BYTES  # with the interpreter's share
    assert line.startswith(f"plan dp2 needs about {fit._gb(each)} GB per process (Python and torch included)")
    assert f"this machine has {fit._gb(machine // 2 * 2)} GB free for 2; plans that fit: " in line
    named = line.split("plans that fit: ")[1].split(", ")
    assert named and len(set(named)) == len(named) and "dp2" not in named
    for text in named:  # each named plan fits by the same model
        assert estimate(_resolved(text, work, 2), work, cluster).fits


def test_no_plan_fits_says_the_smallest_need_and_the_devices_it_takes():
    work = Workload(model=get_preset("llama3-70b"), global_batch=16, seq_len=128)
    cluster = fit.cpu_cluster(2, local=2, memory_bytes=24 * 10**9)
    line = fit.memory_refusal(_resolved("dp2", work, 2), work, cluster)
    least = fit.smallest_need(work, cluster)
    count, holds = fit.devices_needed(work, cluster)
    assert least is not None and count is not None and holds is not None and holds.fits
    # the least need is charged the interpreter's baseline, as the plan's own need is: the two compare
    assert line is not None and f"no plan fits (the least: {least.plan_text}, about " \
        f"{fit._gb(least.mem_per_device_bytes + CPU_PROCESS_BYTES)} GB per process)" in line
    assert f"about {count} processes of 12 GB would hold it" in line
    assert fit.devices_needed(work, cluster, limit=count // 2)[0] is None  # the fewest power of two that holds it


@pytest.mark.parametrize("per_node", [3, 6])
def test_nodes_of_devices_not_a_power_of_two_are_counted_in_whole_nodes(per_node):
    """With 3 or 6 devices a node the counts tried are powers of two within a node, then whole nodes (a 4-device
    world of 3-device nodes cannot be built), and the fewest that holds the model is named (it was an internal
    error: "a group of 4 ranks ... the world has 3")."""
    work = Workload(model=get_preset("llama3-70b"), global_batch=16, seq_len=128)
    cluster = fit.cpu_cluster(per_node, local=per_node, memory_bytes=per_node * 12 * 10**9)
    count, holds = fit.devices_needed(work, cluster)
    assert count is not None and count % per_node == 0 and holds is not None and holds.fits
    assert fit.devices_needed(work, cluster, limit=count - 1)[0] is None  # none fewer holds it
    assert f"about {count} processes of 12 GB would hold it" in fit.no_fit(work, cluster)


def test_no_count_of_devices_holds_a_model_whose_gathered_blocks_outgrow_one():
    """llama3-405b on 12 GB processes two to a machine: a block FSDP gathers whole (at the most tensor
    parallelism a machine of 2 allows) outgrows a process at any count, and the line says so."""
    work = Workload(model=get_preset("llama3-405b"), global_batch=16, seq_len=128)
    cluster = fit.cpu_cluster(2, local=2, memory_bytes=24 * 10**9)
    count, last = fit.devices_needed(work, cluster, limit=1024)
    assert count is None and last is not None and last.plan.tp == 2
    assert last.memory["transient"] > cluster.device.memory_bytes  # the gathered blocks alone
    line = fit.no_fit(work, cluster)
    assert "no count of processes of 12 GB would hold it: the blocks FSDP gathers whole need about" in line
    assert line.endswith("GB alone at tp2")


def test_shoal_train_refuses_before_start_and_no_memory_check_runs_anyway(tmp_path, monkeypatch, capsys):
    """With the machine made small, the default run is refused before any worker starts (no run
    folder); --no-memory-check warns and trains."""
    monkeypatch.setattr(fit, "host_memory_bytes", lambda: 10**6)
    flags = ["--device", "cpu", "--nproc", "1", "--steps", "1", "--set", "num_layers=1", "--global-batch", "2",
             "--seq-len", "16", "--eval-every", "0"]
    assert cli.main(["train", "--out", str(tmp_path / "a"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shoal: error: plan dp1") and "needs about" in err and "\n" not in err
    assert not (tmp_path / "a").exists()
    assert cli.main(["train", "--out", str(tmp_path / "b"), "--no-memory-check", *flags]) == 0
    assert "shoal: warning: --no-memory-check" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["llama3-70b", "llama3-405b"])
def test_giant_presets_are_refused_on_this_kind_of_machine(model, capsys):
    """Refused on two CPU processes, whatever this machine's memory (under a terabyte), never allocated."""
    assert cli.main(["train", "--model", model, "--device", "cpu", "--nproc", "2", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shoal: error: plan dp2 needs about") and "no plan fits" in err and "\n" not in err


def test_the_check_counts_what_the_machine_has_free_and_each_process_baseline(monkeypatch):
    """On CPUs the check prices a plan against the memory free now (other jobs may hold the rest),
    each process charged the interpreter's baseline besides the planner's terms."""
    from shoal.calibration.auto_plan import memory_cluster
    from shoal.planner import hardware

    monkeypatch.setattr(fit, "host_memory_bytes", lambda: 64 * 2**30)
    monkeypatch.setattr(fit, "available_memory_bytes", lambda: 8 * 2**30)
    cluster = memory_cluster(2, "cpu")
    assert cluster is not None and cluster.device.memory_bytes == 4 * 2**30
    work = Workload(model=get_preset("tiny"), global_batch=4, seq_len=128)
    need = estimate(_resolved("dp2", work, 2), work, cluster).mem_per_device_bytes
    tight = fit.cpu_cluster(2, local=2, memory_bytes=int(2 * (need + CPU_PROCESS_BYTES / 2)))
    assert not estimate(_resolved("dp2", work, 2), work, tight).fits  # the terms fit, not with the baseline
    assert hardware.available_memory_bytes() > 0


def test_plan_auto_refuses_a_model_no_plan_holds_before_calibrating(monkeypatch, capsys):
    """--plan auto on llama3-405b: refused from memory alone, in one line with the least need, before a CPU
    calibration (a minute) is measured for plan times it would not use."""
    from shoal.calibration import auto_plan

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated for a model no plan holds")

    monkeypatch.setattr(auto_plan, "local_world", no_calibration)
    assert cli.main(["train", "--model", "llama3-405b", "--plan", "auto", "--device", "cpu", "--nproc", "2",
                     "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shoal: error: plan auto: no plan for 2 cpu process(es) fits") and "\n" not in err
    assert "; the least any plan needs: " in err and "would hold it" in err
