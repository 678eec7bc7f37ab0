"""TOR at cluster scale, the check: a discrete-event Monte Carlo of the same cluster, failures and costs.

What the closed form (:mod:`.project`) approximates, this plays out event by event, seeded:

- failures of each class arrive as Poisson processes, per node (the job sees N x rate); a ``rack`` event takes
  every node of one random rack; a ``node`` event one random node;
- nodes belong to parity groups by the placement rule (spread: one member per rack; otherwise consecutive
  nodes); a group whose unhealed losses exceed m sends the job to the persistent tier. A lost member is healed
  when the recovery that replaced it ends and the next snapshot commits;
- every lost node is away ``repair_h``; a loss that finds fewer idle spares than it needs waits
  ``replace_wait_s``;
- a failure during a recovery restarts the recovery (detection again) with the worse of the two tiers;
- snapshots commit every tau productive seconds after a stall C; a restore resumes at the last committed
  snapshot (memory, parity), the last flushed one (persistent: every k-th snapshot) or the last disk checkpoint;
- fail-slow: the job runs at (1 - s) until the node is detected and then evicted at the next commit; any
  recovery that starts meanwhile swaps the slow node too.

TOR of one replica = committed-or-running productive seconds at the horizon / the horizon. The result is the
mean over replicas with a 95 % confidence interval (normal approximation over independent replicas).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .classes import CLASSES, Cluster, Costs, Rates
from .project import STRATEGIES, flush_every
from .errors import TorError

__all__ = ["SimResult", "simulate"]

_TIER_ORDER = {"memory": 1, "parity": 2, "persistent": 3, "disk": 3}


@dataclass(kw_only=True)
class SimResult:
    strategy: str
    interval_s: float
    horizon_s: float
    replicas: int
    seed: int
    tor: float
    ci95: float
    """Half-width of the 95 % confidence interval of ``tor``."""
    tors: list[float] = field(repr=False, default_factory=list)
    events: dict[str, int] = field(default_factory=dict)
    tiers: dict[str, int] = field(default_factory=dict)
    during_recovery: int = 0
    waits: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "interval_s": self.interval_s, "horizon_s": self.horizon_s,
                "replicas": self.replicas, "seed": self.seed, "tor": self.tor, "ci95": self.ci95,
                "ci": [self.tor - self.ci95, self.tor + self.ci95], "events": self.events, "tiers": self.tiers,
                "failures_during_recovery": self.during_recovery, "replacement_waits": self.waits}


class _Replica:
    """One simulated job. Productive progress while running is a function of effective running time E:
    cycles of (tau + C) each commit tau productive seconds at their end."""

    def __init__(self, strategy: str, cluster: Cluster, rates: Rates, costs: Costs, tau: float, stall: float,
                 rng: np.random.Generator, stats: SimResult) -> None:
        self.s, self.cl, self.rates, self.co = strategy, cluster, rates, costs
        self.tau, self.c, self.rng, self.stats = tau, stall, rng, stats
        self.m = cluster.parity_m if strategy == "shardsafe" else 0
        self.k = flush_every(costs, tau)
        n, r = cluster.nodes, cluster.rack_nodes
        self.racks = math.ceil(n / r)
        ids = np.arange(n)
        if cluster.spread:   # one member per rack: slot s of racks g*n..g*n+n-1
            self.group = (ids // r // cluster.group_nodes) * r + ids % r
        else:
            self.group = ids // cluster.group_nodes
        self.unhealed: dict[int, list[float]] = {}   # group -> heal times (inf until its recovery ends)
        self.away: list[float] = []                  # return times of nodes in repair
        self.job_rate = np.array([n * getattr(rates, c) / 3600.0 for c in CLASSES])
        self.total_rate = float(self.job_rate.sum())

    # -- progress -------------------------------------------------------------------------------------------
    def committed(self, e: float) -> float:
        # The epsilon: an eviction lands exactly on a commit, up to rounding.
        return math.floor(e / (self.tau + self.c) + 1e-9) * self.tau

    def progress(self, e: float) -> float:
        cyc = math.floor(e / (self.tau + self.c) + 1e-9)
        return cyc * self.tau + min(e - cyc * (self.tau + self.c), self.tau)

    # -- a failure's tier and its nodes ------------------------------------------------------------------------
    def _lose(self, t: float, nodes: np.ndarray) -> tuple[bool, bool, list[tuple[int, int]]]:
        """Nodes leave at t: (beyond m in some group, waits for a replacement, pending heal entries)."""
        self.away = [x for x in self.away if x > t]
        idle = max(0, self.cl.spares - len(self.away))
        wait = idle < len(nodes)
        self.away.extend([t + self.co.repair_h * 3600.0] * len(nodes))
        beyond, pending = False, []
        for g in self.group[nodes].tolist():
            lst = [h for h in self.unhealed.get(g, []) if h > t]
            lst.append(math.inf)
            self.unhealed[g] = lst
            pending.append((g, len(lst) - 1))
            beyond |= len(lst) > self.m
        return beyond, wait, pending

    def _restore_s(self, tier: str) -> float:
        return {"memory": self.co.restore_memory_s, "parity": self.co.restore_parity_s,
                "persistent": self.co.restore_persistent_s, "disk": self.co.disk_load_s}[tier]

    def run(self, horizon: float) -> float:
        co, rng = self.co, self.rng
        t, e, base = 0.0, 0.0, 0.0       # time, effective running time since the last resume, resume position
        rate = 1.0                        # (1 - s) while a node is slow
        recovering_until, tier = None, None
        pending: list[tuple[int, int]] = []
        slow_detect = evict_at = math.inf
        next_fail = rng.exponential(1.0 / self.total_rate) if self.total_rate > 0 else math.inf
        while True:
            if recovering_until is not None:
                t_next = min(next_fail, recovering_until, horizon)
            else:
                t_next = min(next_fail, slow_detect, evict_at, horizon)
                e += (t_next - t) * rate
            t = t_next
            if t >= horizon:
                return (base + (self.progress(e) if recovering_until is None else 0.0)) / horizon
            if recovering_until is not None and t == recovering_until and t < next_fail:
                heal = t + self.tau + self.c
                for g, i in pending:
                    self.unhealed[g][i] = heal
                pending, recovering_until, tier, e, rate = [], None, None, 0.0, 1.0
                continue
            if recovering_until is None and t == slow_detect:
                cyc = self.tau + self.c   # evict when the next snapshot commits
                evict_at, slow_detect = t + (math.floor(e / cyc) + 1 - e / cyc) * cyc / rate, math.inf
                continue
            if recovering_until is None and t == evict_at:
                node = np.array([int(rng.integers(self.cl.nodes))])
                base, tier, recovering_until, pending = self._fail_stop(t, e, base, "slow", node, None, pending)
                e, evict_at = 0.0, math.inf
                continue
            # a failure
            next_fail = t + rng.exponential(1.0 / self.total_rate)
            cname = CLASSES[int(rng.choice(len(CLASSES), p=self.job_rate / self.total_rate))]
            self.stats.events[cname] = self.stats.events.get(cname, 0) + 1
            if cname == "slow":
                if recovering_until is None and rate == 1.0:
                    rate, slow_detect = 1.0 - co.slowdown, t + co.slow_detect_s
                continue
            if cname == "node":
                nodes = np.array([int(rng.integers(self.cl.nodes))])
            elif cname == "rack":
                rk = int(rng.integers(self.racks))
                nodes = np.arange(rk * self.cl.rack_nodes, min(self.cl.nodes, (rk + 1) * self.cl.rack_nodes))
            else:
                nodes = np.array([], dtype=int)
            if recovering_until is not None:
                self.stats.during_recovery += 1
            base, tier, recovering_until, pending = self._fail_stop(t, e, base, cname, nodes, tier, pending,
                                                                    recovering=recovering_until is not None)
            e, rate, slow_detect, evict_at = 0.0, 1.0, math.inf, math.inf

    def _fail_stop(self, t: float, e: float, base: float, cname: str, nodes: np.ndarray, tier: str | None,
                   pending: list, *, recovering: bool = False) -> tuple[float, str, float, list]:
        """Roll back and start (or restart) a recovery; returns (resume position, tier, recovery end, pending)."""
        beyond, wait, new = self._lose(t, nodes) if len(nodes) else (False, False, [])
        if self.s == "disk":
            new_tier = "disk"
        elif cname == "process":
            new_tier = "memory"
        else:
            new_tier = "persistent" if beyond else "parity"
        if tier is not None and _TIER_ORDER[tier] > _TIER_ORDER[new_tier]:
            new_tier = tier
        if not recovering:
            base += self.committed(e)
        if new_tier == "persistent" and tier != "persistent":
            unit = self.k * self.tau
            base = math.floor(base / unit + 1e-9) * unit
        self.stats.tiers[new_tier] = self.stats.tiers.get(new_tier, 0) + 1
        self.stats.waits += int(wait)
        dur = self.co.recovery_s(self._restore_s(new_tier)) + (self.co.replace_wait_s if wait else 0.0)
        return base, new_tier, t + dur, pending + new


def simulate(strategy: str, cluster: Cluster, rates: Rates, costs: Costs, *, interval_s: float,
             horizon_s: float = 30 * 86400.0, replicas: int = 40, seed: int = 0) -> SimResult:
    """Mean TOR of ``replicas`` independent runs of ``horizon_s`` seconds, with its 95 % confidence interval.

    ``interval_s`` is the snapshot interval (for ``disk``: the checkpoint interval); take it from
    :func:`shardsafe.tor.project.project` to compare with the closed form at the same point.
    """
    if strategy not in STRATEGIES:
        raise TorError(f"strategy={strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if not (interval_s > 0 and math.isfinite(interval_s)):
        raise TorError(f"interval_s={interval_s!r}: expected seconds > 0")
    if not (horizon_s > 0 and math.isfinite(horizon_s)):
        raise TorError(f"horizon_s={horizon_s!r}: expected seconds > 0")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 2:
        raise TorError(f"replicas={replicas!r}: expected an int >= 2 (a confidence interval needs two)")
    stall = costs.disk_save_s if strategy == "disk" else costs.snapshot_stall_s
    stats = SimResult(strategy=strategy, interval_s=interval_s, horizon_s=horizon_s, replicas=replicas, seed=seed,
                      tor=0.0, ci95=0.0)
    root = np.random.SeedSequence(seed)
    tors = []
    for child in root.spawn(replicas):
        rep = _Replica(strategy, cluster, rates, costs, interval_s, stall, np.random.default_rng(child), stats)
        tors.append(rep.run(horizon_s))
    arr = np.asarray(tors)
    stats.tors = tors
    stats.tor = float(arr.mean())
    stats.ci95 = float(1.96 * arr.std(ddof=1) / math.sqrt(replicas))
    return stats
