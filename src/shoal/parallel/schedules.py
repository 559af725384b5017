"""Pipeline-parallel schedules as pure tables: per rank, the ordered actions of one training step.

A table is data (`build_schedule`), so it can be printed (`format_table`), timed on paper
(`simulate`, `bubble_fraction`), charted (`save_gantt`) and checked (`peak_in_flight`,
`p2p_order_consistent`) without a process; shoal.parallel.pipeline executes it.

Terms: p = `num_ranks`, V = `vpp` model chunks per rank, m = `num_micro` micro-batches. Stages
0..p*V-1 are in model order; stage s lives on rank s % p (Megatron's interleaved placement).
An action is F (forward), B (backward; input gradients only when the backward is split) or W
(weight gradients, split backward only) of one stage on one micro-batch.

- gpipe: every forward, then every backward, both in micro-batch order (Huang et al. 2019).
- 1f1b: PipeDream-Flush / Megatron 1F1B: p - r - 1 warm-up forwards on rank r, then one
  forward one backward, then the cool-down backwards (Narayanan et al. 2021).
- interleaved: Megatron's interleaved 1F1B over V >= 2 chunks per rank (Narayanan et al. 2021,
  "Efficient Large-Scale Language Model Training on GPU Clusters").
- zb: ZB-H1 of Qi et al. 2023, "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shoal.plan import SCHEDULES
from shoal.rules import schedule_refusal

OPS = ("F", "B", "W")
_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
_GANTT_WIDTH = 12  # inches


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: `op` ("F", "B" or "W") of `stage` on micro-batch `micro`."""

    op: str
    stage: int
    micro: int

    def __post_init__(self) -> None:
        assert self.op in OPS, f"op {self.op!r} is not one of {OPS}"

    def __str__(self) -> str:
        """Op, micro-batch, stage: "F3.s2" is the forward of micro-batch 3 through stage 2."""
        return f"{self.op}{self.micro}.s{self.stage}"

    def short(self) -> str:
        """Op and micro-batch only ("F3"): enough where the rank (the row) holds one stage."""
        return f"{self.op}{self.micro}"


Table = list[list[Action]]
Timeline = list[list[tuple[float, float, Action]]]


def stage_rank(stage: int, num_ranks: int) -> int:
    """The rank that holds `stage`: rank r holds stages r, r + p, r + 2p, ..."""
    assert stage >= 0 and num_ranks >= 1, (stage, num_ranks)
    return stage % num_ranks


def split_backward(name: str) -> bool:
    """Whether schedule `name` splits the backward: B input gradients, W weight gradients (zb only);
    otherwise there is no W and B is the whole backward."""
    _check_name(name)
    return name == "zb"


def _check_name(name: str) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"sched={name!r} is not a pipeline schedule; valid: {', '.join(SCHEDULES)}")


def _check(name: str, num_ranks: int, num_micro: int, vpp: int) -> None:
    reason = schedule_refusal(name, num_ranks=num_ranks, num_micro=num_micro, vpp=vpp)
    if reason is not None:
        raise ValueError(reason)


def build_schedule(name: str, *, num_ranks: int, num_micro: int, vpp: int = 1) -> Table:
    """Per rank, the ordered list of actions it executes in one training step."""
    _check(name, num_ranks, num_micro, vpp)
    p, m = num_ranks, num_micro
    if name == "gpipe":
        return [[Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)] for r in range(p)]
    if name == "1f1b":
        return [_one_f_one_b([Action("F", r, i) for i in range(m)], [Action("B", r, i) for i in range(m)],
                             warm=min(p - r - 1, m)) for r in range(p)]
    if name == "zb":
        return [_zero_bubble_h1(r, p, m) for r in range(p)]
    return [_interleaved(r, p, m, vpp) for r in range(p)]


def _one_f_one_b(forwards: list[Action], backwards: list[Action], *, warm: int) -> list[Action]:
    """`warm` forwards, then one forward one backward while forwards remain, then the backwards left."""
    steady = len(forwards) - warm
    row = forwards[:warm]
    for k in range(steady):
        row += [forwards[warm + k], backwards[k]]
    return row + backwards[steady:]


def _zero_bubble_h1(rank: int, p: int, m: int) -> list[Action]:
    """1F1B with the backward split, each W deferred by `rank` backwards: a rank with fewer warm-up
    forwards keeps more weight gradients for later, so that every rank holds up to p micro-batches
    as rank 0 does under 1F1B, and the deferred Ws fill the cool-down bubble (Qi et al. 2023, sec. 3.1)."""
    row = []
    for a in _one_f_one_b([Action("F", rank, i) for i in range(m)], [Action("B", rank, i) for i in range(m)],
                          warm=min(p - rank - 1, m)):
        row.append(a)
        if a.op == "B" and a.micro >= rank:
            row.append(Action("W", rank, a.micro - rank))
    return row + [Action("W", rank, i) for i in range(max(m - rank, 0), m)]


def _interleaved(rank: int, p: int, m: int, vpp: int) -> list[Action]:
    """Megatron's interleaved 1F1B on one rank: forwards walk micro-batches in groups of p through
    chunk 0, then chunk 1, ...; backwards the same groups from the last chunk down."""
    total = m * vpp

    def nth(op: str, k: int) -> Action:
        chunk = (k // p) % vpp
        chunk = vpp - 1 - chunk if op == "B" else chunk
        return Action(op, chunk * p + rank, (k // (p * vpp)) * p + k % p)

    warm = min((p - rank - 1) * 2 + (vpp - 1) * p, total)
    return _one_f_one_b([nth("F", k) for k in range(total)], [nth("B", k) for k in range(total)], warm=warm)


def _is_split(table: Table) -> bool:
    return any(a.op == "W" for row in table for a in row)


def _needs(a: Action, last_stage: int) -> list[Action]:
    """The actions `a` waits for (on any rank): the data it consumes and the backward it continues."""
    if a.op == "F":
        return [Action("F", a.stage - 1, a.micro)] if a.stage > 0 else []
    if a.op == "B":
        return [Action("F", a.stage, a.micro)] + ([Action("B", a.stage + 1, a.micro)] if a.stage < last_stage else [])
    return [Action("B", a.stage, a.micro)]


def simulate(table: Table, *, costs: dict[str, float] | None = None) -> Timeline:
    """Per rank, (start, end, action) of each action when every action starts as soon as its rank is
    free and its inputs are done (zero communication time). Costs default to F=1, B=2 (a whole
    backward), or F=B=W=1 when the table splits the backward; `costs` overrides any of them."""
    unknown = set(costs or {}) - set(OPS)
    if unknown:
        raise ValueError(f"costs for {sorted(unknown)}: not an op; valid keys: {', '.join(OPS)}")
    cost: dict[str, float] = {"F": 1, "B": 1, "W": 1} if _is_split(table) else {"F": 1, "B": 2, "W": 0}
    cost.update(costs or {})
    last_stage = max((a.stage for row in table for a in row), default=0)
    end: dict[Action, float] = {}
    timeline: Timeline = [[] for _ in table]
    clock: list[float] = [0] * len(table)  # ints, so Fraction costs give exact times
    done = [0] * len(table)
    while any(done[r] < len(row) for r, row in enumerate(table)):
        progressed = False
        for r, row in enumerate(table):
            while done[r] < len(row) and all(n in end for n in _needs(row[done[r]], last_stage)):
                a = row[done[r]]
                start = max([clock[r]] + [end[n] for n in _needs(a, last_stage)])
                clock[r] = end[a] = start + cost[a.op]
                timeline[r].append((start, end[a], a))
                done[r] += 1
                progressed = True
        waiting = [str(row[done[r]]) for r, row in enumerate(table) if done[r] < len(row)]
        assert progressed, f"the schedule deadlocks: every rank waits, at {waiting}"
    return timeline


def bubble_fraction(timeline: Timeline) -> float:
    """The idle share of the step: 1 - busy time / (ranks * makespan), the makespan running from
    the first start to the last end on any rank. Works on simulated and measured timelines."""
    spans = [(start, end) for row in timeline for start, end, _ in row]
    if not spans:
        raise ValueError("timeline has no actions; valid: one list of (start, end, action) per rank, not all empty")
    makespan = max(e for _, e in spans) - min(s for s, _ in spans)
    if makespan == 0:
        return 0.0
    busy = sum(e - s for s, e in spans)
    return float((len(timeline) * makespan - busy) / (len(timeline) * makespan))


def peak_in_flight(table: Table) -> list[int]:
    """Per rank, the most (stage, micro-batch) pairs held at once, walking the rank's actions in
    order: from the forward until the last backward action (W under a split backward, else B),
    a proxy for the activation memory the schedule needs."""
    release = "W" if _is_split(table) else "B"
    peaks = []
    for row in table:
        held: set[tuple[int, int]] = set()
        peak = 0
        for a in row:
            if a.op == "F":
                held.add((a.stage, a.micro))
                peak = max(peak, len(held))
            elif a.op == release:
                held.discard((a.stage, a.micro))
        peaks.append(peak)
    return peaks


def _p2p_streams(table: Table) -> dict[tuple[int, int], tuple[list, list]]:
    """Per ordered pair of ranks (a, b): the messages a sends to b in a's order, and those b
    receives from a in b's order. A message is (kind, stage it goes to, micro-batch)."""
    p = len(table)
    last_stage = max((a.stage for row in table for a in row), default=0)
    streams: dict[tuple[int, int], tuple[list, list]] = {(a, b): ([], []) for a in range(p) for b in range(p)}
    for rank, row in enumerate(table):
        for a in row:
            s, m = a.stage, a.micro
            if a.op == "F" and s < last_stage:  # sends its activation on
                streams[rank, stage_rank(s + 1, p)][0].append(("activation", s + 1, m))
            if a.op == "F" and s > 0:  # receives it right before
                streams[stage_rank(s - 1, p), rank][1].append(("activation", s, m))
            if a.op == "B" and s > 0:
                streams[rank, stage_rank(s - 1, p)][0].append(("gradient", s - 1, m))
            if a.op == "B" and s < last_stage:
                streams[stage_rank(s + 1, p), rank][1].append(("gradient", s, m))
    return streams


def p2p_order_consistent(table: Table) -> bool:
    """Whether, between every ordered pair of ranks, the receiver takes the messages in the order
    they were sent: what NCCL needs, as it matches sends to receives by issue order, not by tag.
    Sends go out in the sender's action order, each receive right before the action consuming it
    (a rank holding consecutive stages, as under p=1 interleaved, counts as a pair with itself)."""
    return all(sent == received for sent, received in _p2p_streams(table).values())


def _cell(a: Action, num_ranks: int, chunks: int) -> str:
    if chunks == 1:
        return a.short()
    if chunks > 26:  # past "z": the stage itself
        return str(a)
    return a.short() + "abcdefghijklmnopqrstuvwxyz"[a.stage // num_ranks]


def format_table(table: Table) -> str:
    """The schedule as a grid, one row per rank, one column per tick of `simulate` with every action
    costing one tick, "." where the rank idles. A cell is op and micro-batch ("F3", "B3", "W3");
    where a rank holds V > 1 chunks, a letter names the chunk: "F3a" runs stage r, "F3b" stage r + p."""
    timeline = simulate(table, costs={"F": 1, "B": 1, "W": 1})
    chunks = 1 + max((a.stage for row in table for a in row), default=0) // len(table)
    labels = [{int(start): _cell(a, len(table), chunks) for start, _, a in row} for row in timeline]
    ticks = max((int(end) for row in timeline for _, end, _ in row), default=0)
    width = max((len(s) for row in labels for s in row.values()), default=1)
    lines = []
    for r, row in enumerate(labels):
        cells = " ".join(row.get(t, ".").ljust(width) for t in range(ticks))
        lines.append(f"r{r:<{len(str(len(table) - 1))}} | {cells}".rstrip())
    return "\n".join(lines)


def save_gantt(timeline: Timeline, path: str | Path, *, title: str) -> None:
    """Draw `timeline` as a Gantt chart PNG at `path`: ranks down the y axis (rank 0 on top), time
    along x from the first start, F/B/W in their colours (a rank's later chunks paler), micro-batch
    numbers where they fit; the title gains the bubble fraction."""
    from matplotlib.figure import Figure  # lazy: charts are rare; Figure renders with Agg, no pyplot state
    from matplotlib.patches import Patch

    t0 = min((s for row in timeline for s, _, _ in row), default=0.0)
    makespan = max((e for row in timeline for _, e, _ in row), default=t0) - t0 or 1.0
    fig = Figure(figsize=(_GANTT_WIDTH, 1.2 + 0.45 * len(timeline)))
    ax = fig.add_subplot()
    for r, row in enumerate(timeline):
        for start, end, a in row:
            ax.broken_barh([(start - t0, end - start)], (r - 0.4, 0.8), facecolors=_COLOURS[a.op], edgecolor="white",
                           alpha=1 / (1 + 0.6 * (a.stage // len(timeline))))  # later chunks paler
            label = str(a.micro)
            if (end - start) / makespan * _GANTT_WIDTH * 72 >= 6 * len(label) + 2:  # points wide vs ~6 a digit
                ax.text(start - t0 + (end - start) / 2, r, label, ha="center", va="center", fontsize=8, color="white")
    ax.set_yticks(range(len(timeline)), [f"rank {r}" for r in range(len(timeline))])
    ax.set_ylim(len(timeline) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, makespan)
    ax.set_xlabel("time from the step's first action")
    ops = [op for op in OPS if any(a.op == op for row in timeline for _, _, a in row)]
    ax.legend(handles=[Patch(color=_COLOURS[op], label=op) for op in ops], loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"{title} (bubble {bubble_fraction(timeline):.1%})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
