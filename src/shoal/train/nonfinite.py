"""What the trainer does with steps whose loss or gradient went non-finite, and with loss spikes.

Every step is gated on the device (shoal.train.step): a non-finite step changes no weight and no
optimizer state. The host learns of it at the next step it reads the device's figures (every
`log_every` steps, and always before a checkpoint or an evaluation), where `Guard.check` applies
the run's policy (`--on-nonfinite`):
- stop (default): the run stops there, writing no checkpoint, with one line naming the first bad
  step, what went non-finite, the newest checkpoint and the command that resumes with a lower lr.
- skip: bad steps are skipped and counted (metrics.jsonl, summary.json); the run stops anyway after
  `max_bad_steps` bad steps in a row.
fp16's loss-scale overflows (the scaled gradients overflowed while the loss was finite and the
scale above 1: the scale's warm-up) are skipped under both and never count as bad steps.

Loss spikes: a finite loss above median + SPIKE_K x MAD of the last SPIKE_WINDOW finite losses
(once SPIKE_MIN_HISTORY are known; MAD floored at SPIKE_FLOOR x |median|, so that a flat curve
does not flag rounding) is marked `loss_spike` in metrics.jsonl, listed in summary.json's
`loss_spikes`, and named on the progress output: a warning, so that a user sees a spike before it
becomes a NaN.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

SPIKE_K = 6.0
SPIKE_WINDOW = 50
SPIKE_MIN_HISTORY = 20
SPIKE_FLOOR = 1e-3
POLICIES = ("stop", "skip")


@dataclass
class Guard:
    """The run's policy over the figures it reads; the same on every rank (the figures are global)."""

    mode: str = "stop"
    max_bad_steps: int = 10
    bad_in_a_row: int = 0
    bad_steps: list[int] = field(default_factory=list)
    overflow_steps: int = 0
    spikes: list[int] = field(default_factory=list)
    _history: deque[float] = field(default_factory=lambda: deque(maxlen=SPIKE_WINDOW))

    def check(self, records: list[dict[str, Any]]) -> str | None:
        """Mark each record (its `skipped`, `nonfinite`, `loss_spike` fields; non-finite values are
        still floats here: metrics.jsonl writes them as null) and return, when the run must stop, what
        went wrong in words (the trainer adds the checkpoint and the command)."""
        stop = None
        for r in records:
            if not r.pop("_applied"):
                r["skipped"] = True
            if r.pop("_overflow"):
                self.overflow_steps += 1
                r["loss_scale_overflow"] = True
                continue
            what = [key for key in ("loss", "grad_norm") if not math.isfinite(r[key])]
            if r.get("skipped") or what:
                self.bad_steps.append(r["step"])
                self.bad_in_a_row += 1
                words = _words(what, r)
                if stop is None and self.mode == "stop":
                    stop = f"step {r['step']}: {words}, not applied"
                elif stop is None and self.bad_in_a_row >= self.max_bad_steps:
                    stop = (f"step {r['step']}: {words}, {self.bad_in_a_row} bad steps in a row "
                            f"(--max-bad-steps {self.max_bad_steps}), none applied")
                continue
            self.bad_in_a_row = 0
            self._spike(r)
        return stop

    def _spike(self, r: dict[str, Any]) -> None:
        loss = float(r["loss"])
        if len(self._history) >= SPIKE_MIN_HISTORY:
            median = statistics.median(self._history)
            mad = statistics.median(abs(x - median) for x in self._history)
            threshold = median + SPIKE_K * max(mad, SPIKE_FLOOR * abs(median))
            if loss > threshold:
                r["loss_spike"] = True
                r["loss_spike_threshold"] = threshold
                self.spikes.append(r["step"])
        self._history.append(loss)

    def summary(self) -> dict[str, Any]:
        """What summary.json adds: the bad steps (skipped), the fp16 overflows, the loss spikes."""
        return {"on_nonfinite": self.mode, "nonfinite_steps": self.bad_steps, "loss_scale_overflows":
                self.overflow_steps, "loss_spikes": self.spikes}


def _words(what: list[str], r: dict[str, Any]) -> str:
    if not what:
        return "the update was refused on the device"
    names = {"loss": "the loss", "grad_norm": "the gradient norm"}
    return " and ".join(f"{names[k]} went non-finite ({r[k]})" for k in what)


def strict(record: dict[str, Any]) -> dict[str, Any]:
    """`record` for strict JSON: every non-finite float (at any depth) becomes None, and the
    top-level keys that held one are listed in `nonfinite`."""
    flagged: list[str] = []
    out = {}
    for key, value in record.items():
        clean = _finite(value)
        if clean != value or (isinstance(value, float) and math.isnan(value)):
            flagged.append(key)
        out[key] = clean
    if flagged:
        out["nonfinite"] = sorted(set(out.get("nonfinite", [])) | set(flagged))
    return out


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
