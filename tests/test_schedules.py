"""Pipeline schedules as pure tables: every schedule runs each (stage, micro-batch) once on its
rank, in dependency order, without deadlock, with the known memory and bubble figures and the
message order NCCL needs. Pure: no processes, no torch.

Bubble figures are compared exactly: the simulations run on Fraction costs, so the timeline is
exact and its float is the correctly rounded value, as is the formula's int / int.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from shoal.parallel.schedules import (
    SCHEDULES,
    Action,
    bubble_fraction,
    build_schedule,
    format_table,
    p2p_order_consistent,
    peak_in_flight,
    save_gantt,
    simulate,
    split_backward,
    stage_rank,
)

V = 2  # chunks per rank under interleaved


def _cases() -> list[tuple[str, int, int, int]]:
    cases = []
    for name, p, m in itertools.product(SCHEDULES, (1, 2, 4), (1, 2, 4, 8)):
        vpp = V if name == "interleaved" else 1
        if name != "interleaved" or m % p == 0:
            cases.append((name, p, m, vpp))
    return cases


CASES = _cases()
IDS = [f"{name}-p{p}-m{m}-v{vpp}" for name, p, m, vpp in CASES]
every_case = pytest.mark.parametrize("name,p,m,vpp", CASES, ids=IDS)


def _table(name: str, p: int, m: int, vpp: int) -> list[list[Action]]:
    return build_schedule(name, num_ranks=p, num_micro=m, vpp=vpp)


@every_case
def test_every_stage_and_micro_batch_runs_once_on_its_rank(name, p, m, vpp):
    table = _table(name, p, m, vpp)
    ops = ("F", "B", "W") if split_backward(name) else ("F", "B")
    expected = sorted(Action(op, s, i) for op in ops for s in range(p * vpp) for i in range(m))
    assert sorted(a for row in table for a in row) == expected
    assert all(stage_rank(a.stage, p) == r for r, row in enumerate(table) for a in row)


@every_case
def test_forward_precedes_backward_precedes_weight_gradient_on_each_rank(name, p, m, vpp):
    for row in _table(name, p, m, vpp):
        index = {a: i for i, a in enumerate(row)}
        for a in row:
            if a.op == "B":
                assert index[Action("F", a.stage, a.micro)] < index[a], a
            if a.op == "W":
                assert index[Action("B", a.stage, a.micro)] < index[a], a


@every_case
def test_simulate_finishes_and_respects_dependencies(name, p, m, vpp):
    table = _table(name, p, m, vpp)
    timeline = simulate(table)
    assert [[a for _, _, a in row] for row in timeline] == table  # every action ran, in the rank's order
    end = {a: e for row in timeline for _, e, a in row}
    last = p * vpp - 1
    for row in timeline:
        for (_, prev_end, _), (start, _, _) in zip(row, row[1:]):
            assert start >= prev_end  # one action at a time
        for start, _, a in row:
            needs = {"F": [("F", a.stage - 1)] if a.stage > 0 else [],
                     "B": [("F", a.stage)] + ([("B", a.stage + 1)] if a.stage < last else []),
                     "W": [("B", a.stage)]}[a.op]
            assert all(start >= end[Action(op, s, a.micro)] for op, s in needs), a


def test_simulate_reports_a_deadlock():
    backward_first = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]]
    with pytest.raises(AssertionError, match="deadlock"):
        simulate(backward_first)


def test_simulate_rejects_unknown_costs():
    with pytest.raises(ValueError, match="valid keys: F, B, W"):
        simulate(_table("1f1b", 2, 2, 1), costs={"X": 1.0})


def _expected_peaks(name: str, p: int, m: int, vpp: int) -> list[int]:
    if name == "gpipe":
        return [m] * p
    if name == "1f1b":
        return [min(p - r, m) for r in range(p)]
    if name == "zb":
        # ZB-H1 (Qi et al. 2023, sec. 3.1): rank r defers its Ws by r backwards so that every rank
        # holds up to p micro-batches, 1F1B's rank-0 figure: the peak over ranks equals 1F1B's, the
        # later ranks hold more than under 1F1B.
        return [min(p, m)] * p
    # interleaved: Megatron's warm-up forwards plus the first steady-state one, at most all m*V.
    return [min((p - r - 1) * 2 + (vpp - 1) * p + 1, m * vpp) for r in range(p)]


@every_case
def test_peak_in_flight_is_the_known_bound(name, p, m, vpp):
    table = _table(name, p, m, vpp)
    assert peak_in_flight(table) == _expected_peaks(name, p, m, vpp)
    if name == "zb":
        assert max(peak_in_flight(table)) == max(peak_in_flight(_table("1f1b", p, m, 1)))


@every_case
def test_warm_up_runs_the_forwards_megatron_runs(name, p, m, vpp):
    if name == "gpipe":
        return
    for r, row in enumerate(_table(name, p, m, vpp)):
        leading = next((i for i, a in enumerate(row) if a.op != "F"), len(row))
        assert leading == _expected_peaks("1f1b" if name == "zb" else name, p, m, vpp)[r]  # warm-up + 1


def test_zb_h1_defers_weight_gradients_by_rank():
    F, B, W = (lambda s, i, op=op: Action(op, s, i) for op in "FBW")
    assert build_schedule("zb", num_ranks=2, num_micro=2) == [
        [F(0, 0), F(0, 1), B(0, 0), W(0, 0), B(0, 1), W(0, 1)],
        [F(1, 0), B(1, 0), F(1, 1), B(1, 1), W(1, 0), W(1, 1)],
    ]


@every_case
def test_bubble_matches_the_formula(name, p, m, vpp):
    table = _table(name, p, m, vpp)
    if name == "zb":
        one_f_one_b = bubble_fraction(simulate(_table("1f1b", p, m, 1), costs={"F": Fraction(1), "B": Fraction(2)}))
        bubble = bubble_fraction(simulate(table, costs={"F": Fraction(1), "B": Fraction(1), "W": Fraction(1)}))
        if p >= 2:
            assert bubble < one_f_one_b
        if m >= p:  # ZB-H1's (p-1)(F+B-W) idle time per rank over 3m + p - 1 unit ticks
            assert bubble == (p - 1) / (3 * m + p - 1)
        return
    costs = {"F": Fraction(1, vpp), "B": Fraction(2, vpp)}  # a chunk does 1/V of a stage's work
    assert bubble_fraction(simulate(table, costs=costs)) == (p - 1) / (vpp * m + p - 1)


def test_bubble_fraction_of_a_measured_timeline():
    a = Action("F", 0, 0)
    measured = [[(10.0, 11.0, a), (12.0, 13.0, a)], [(11.0, 13.0, a)]]  # busy 4 of 2 ranks x 3 s
    assert bubble_fraction(measured) == pytest.approx(1 / 3, rel=1e-12)
    with pytest.raises(ValueError, match="no actions"):
        bubble_fraction([[], []])


@every_case
def test_point_to_point_messages_arrive_in_send_order(name, p, m, vpp):
    assert p2p_order_consistent(_table(name, p, m, vpp))


def test_point_to_point_order_catches_a_swap():
    table = build_schedule("1f1b", num_ranks=2, num_micro=2)
    table[1] = [Action("F", 1, 1), Action("B", 1, 1), Action("F", 1, 0), Action("B", 1, 0)]
    assert not p2p_order_consistent(table)


def test_format_table_gpipe():
    expected = ("r0 | F0 F1 .  .  B0 B1\n"
                "r1 | .  F0 F1 B0 B1 .")
    assert format_table(build_schedule("gpipe", num_ranks=2, num_micro=2)) == expected


def test_format_table_names_chunks_and_stays_short():
    rows = format_table(build_schedule("interleaved", num_ranks=2, num_micro=2, vpp=2)).splitlines()
    assert rows[0].startswith("r0 | F0a F1a F0b F1b")
    assert rows[1].startswith("r1 | .   F0a F1a F0b")
    assert max(len(row) for row in format_table(build_schedule("zb", num_ranks=4, num_micro=8)).splitlines()) <= 90


def test_action_prints_op_micro_and_stage():
    assert str(Action("F", 2, 3)) == "F3.s2"
    assert Action("W", 2, 3).short() == "W3"


@pytest.mark.parametrize("kwargs,message", [
    ({"name": "pipedream"}, "sched='pipedream' is not a pipeline schedule; valid: gpipe, 1f1b, interleaved, zb"),
    # The schedule's counts are the plan's (pp ranks, mb micro-batches, vpp): one rule in shoal.rules.
    ({"name": "interleaved", "vpp": 1}, "sched=interleaved with vpp=1: interleaved schedules run vpp >= 2"),
    ({"name": "1f1b", "vpp": 2}, "sched=1f1b with vpp=2: interleaved schedules run vpp >= 2 chunks per rank, the "
                                 "others one; valid: sched=interleaved,vpp=2 or another sched with vpp=1"),
    ({"name": "zb", "vpp": 2}, "sched=zb with vpp=2"),
    ({"name": "interleaved", "vpp": 2, "num_micro": 6}, "micro-batches in multiples of pp=4; mb=6"),
    ({"name": "gpipe", "num_micro": 0}, "mb=0 is not a count; valid: an integer >= 1"),
    ({"name": "gpipe", "num_ranks": 0}, "pp=0 is not a count"),
])
def test_user_mistakes_are_one_line_errors(kwargs, message):
    args = {"num_ranks": 4, "num_micro": 8, "vpp": 1} | kwargs
    name = args.pop("name")
    with pytest.raises(ValueError) as info:
        build_schedule(name, **args)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_split_backward_only_under_zb():
    assert [split_backward(name) for name in SCHEDULES] == [False, False, False, True]
    with pytest.raises(ValueError, match="valid: gpipe, 1f1b, interleaved, zb"):
        split_backward("pipedream")


def test_save_gantt_writes_a_png(tmp_path):
    path = tmp_path / "pipeline.png"
    save_gantt(simulate(build_schedule("zb", num_ranks=4, num_micro=8)), path, title="zb p=4 m=8")
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
