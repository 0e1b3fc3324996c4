"""Service-level objectives: which requests met them, attainment and goodput (DistServe's measure).

A serving user wants the rate a server sustains while most requests meet both a
time-to-first-token and a time-per-output-token objective, not one latency bound at any cost.
Per request, with the definitions of metrics.py (those of vLLM's serving benchmark):

- TTFT = first token time - arrival time;
- TPOT = (E2E - TTFT) / (output tokens - 1). A one-token answer has no decode phase, so it is
  judged on TTFT alone (vLLM's goodput counts its TPOT as 0).

A request meets the SLO when it finished with every token it asked for, TTFT <= the TTFT
objective and TPOT <= the TPOT objective. A request that was sent but never finished (rejected,
aborted, failed) or finished short of its tokens (aborted mid-stream) is a miss: a server must not
raise its attainment by turning work away. Of the requests sent:

- attainment = met / sent;
- goodput = met / duration (requests per second that met the SLO), duration being the run's
  (first arrival -> last finish, as for every throughput in metrics.py).

The latency percentiles beside them are over the requests that finished whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from jaxserve.bench.metrics import LatencyStats, RequestRecord

SLO_USAGE = "expected ttft=SECONDS,tpot=MILLISECONDS (both, positive), e.g. ttft=3,tpot=300"


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float     # most seconds from arrival to the first token
    tpot_s: float     # most seconds per output token after the first

    def __post_init__(self) -> None:
        for name, v in (("ttft_s", self.ttft_s), ("tpot_s", self.tpot_s)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"SLO {name} must be a positive finite number, got {v!r}")

    @classmethod
    def parse(cls, text: str) -> "SLO":
        """'ttft=S,tpot=MS': TTFT in seconds and TPOT in milliseconds, the units people quote them in."""
        fields: dict[str, float] = {}
        for part in str(text).split(","):
            key, sep, value = part.strip().partition("=")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "tpot") or key in fields:
                raise ValueError(f"bad SLO {text!r}: {SLO_USAGE}")
            try:
                fields[key] = float(value)
            except ValueError:
                raise ValueError(f"bad SLO {text!r}: {value.strip()!r} is not a number; {SLO_USAGE}") from None
        if set(fields) != {"ttft", "tpot"}:
            raise ValueError(f"bad SLO {text!r}: {SLO_USAGE}")
        try:
            return cls(ttft_s=fields["ttft"], tpot_s=fields["tpot"] / 1e3)
        except ValueError:
            raise ValueError(f"bad SLO {text!r}: {SLO_USAGE}") from None

    def __str__(self) -> str:
        return f"ttft={self.ttft_s:g},tpot={self.tpot_s * 1e3:g}"

    def as_dict(self) -> dict[str, float]:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s}


@dataclass(frozen=True, slots=True)
class Verdicts:
    """How each sent request fared: the counts add up to `sent`."""

    sent: int
    met: int
    missed_ttft: int      # finished whole, TTFT over the objective (TPOT may be over too)
    missed_tpot: int      # finished whole, TTFT met, TPOT over
    aborted: int          # finished with fewer tokens than asked
    failed: int           # sent, no record: rejected at the door, or failed

    @property
    def attainment(self) -> float:
        return self.met / self.sent if self.sent else math.nan


@dataclass(frozen=True, slots=True)
class SLOReport:
    """One run judged against one SLO."""

    slo: SLO
    verdicts: Verdicts
    duration_s: float
    ttft: LatencyStats               # of the requests that finished whole
    tpot: LatencyStats               # of those with >= 2 output tokens
    by_group: Mapping[str, Verdicts] = field(default_factory=dict)   # the workload's groups, e.g. chat / long

    @property
    def attainment(self) -> float:
        return self.verdicts.attainment

    @property
    def goodput(self) -> float:
        """Requests per second that met the SLO."""
        return self.verdicts.met / self.duration_s if self.duration_s > 0 else math.nan

    def as_dict(self) -> dict[str, Any]:
        v = self.verdicts
        return {"attainment": self.attainment, "goodput_rps": self.goodput, "duration_s": self.duration_s,
                "sent": v.sent, "met": v.met, "missed_ttft": v.missed_ttft, "missed_tpot": v.missed_tpot,
                "aborted": v.aborted, "failed": v.failed,
                "ttft_p50_s": self.ttft.median, "ttft_p99_s": self.ttft.p99,
                "tpot_p50_s": self.tpot.median, "tpot_p99_s": self.tpot.p99,
                "by_group": {g: {"sent": x.sent, "met": x.met, "attainment": x.attainment}
                             for g, x in self.by_group.items()}}


def verdict(record: RequestRecord | None, slo: SLO, asked_tokens: int) -> str:
    """One request's fate: "met", "missed_ttft" (TTFT over, whatever its TPOT), "missed_tpot",
    "aborted" (finished short of its tokens) or "failed" (no record: rejected, or failed)."""
    if record is None:
        return "failed"
    if record.output_len < asked_tokens:
        return "aborted"
    if record.ttft > slo.ttft_s:
        return "missed_ttft"
    tpot = record.tpot
    if tpot is not None and tpot > slo.tpot_s:
        return "missed_tpot"
    return "met"


def meets(record: RequestRecord | None, slo: SLO, asked_tokens: int) -> bool:
    return verdict(record, slo, asked_tokens) == "met"


def _verdicts(records: Mapping[str, RequestRecord], asked: Mapping[str, int], slo: SLO) -> Verdicts:
    counts = dict.fromkeys(("met", "missed_ttft", "missed_tpot", "aborted", "failed"), 0)
    for rid, n in asked.items():
        counts[verdict(records.get(rid), slo, n)] += 1
    return Verdicts(sent=len(asked), **counts)


def evaluate(records: Sequence[RequestRecord], asked: Mapping[str, int], slo: SLO,
             duration_s: float | None = None, groups: Mapping[str, str] | None = None) -> SLOReport:
    """Judge a run: `asked` maps every request sent to the output tokens it asked for (requests
    missing from `records` failed); `groups` maps request ids to a label to break the verdicts down
    by; `duration_s` defaults to the records' first arrival -> last finish."""
    by_id = {r.request_id: r for r in records}
    unknown = sorted(set(by_id) - set(asked))
    if unknown:
        raise ValueError(f"records of requests that were never sent: {unknown[:5]}")
    if duration_s is None:
        duration_s = (max(r.finished_time for r in records) - min(r.arrival_time for r in records)) if records else 0.0
    whole = [r for r in records if r.output_len >= asked[r.request_id]]
    by_group: dict[str, Verdicts] = {}
    if groups:
        for g in sorted(set(groups.values())):
            ids = {rid: n for rid, n in asked.items() if groups.get(rid) == g}
            by_group[g] = _verdicts(by_id, ids, slo)
    return SLOReport(
        slo=slo, verdicts=_verdicts(by_id, asked, slo), duration_s=duration_s,
        ttft=LatencyStats.of(r.ttft for r in whole),
        tpot=LatencyStats.of(t for r in whole if (t := r.tpot) is not None),
        by_group=by_group)


def goodput_rate(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The goodput headline: the highest rate tested whose attainment reached `target`
    ((rate, attainment) pairs; None when none did)."""
    passed = [rate for rate, att in points if att == att and att >= target]
    return max(passed) if passed else None
