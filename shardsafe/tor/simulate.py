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
  recovery that starts meanwhile swaps the slow node too;
- the shrink policy (``shardsafe_shrink``, :mod:`.shrink`): a loss short of idle spares waits ``shrink_after_s``
  and re-forms the job without the nodes it is short of, at D' (restore ``reshard_restore_s`` from parity), so it
  runs at D'/D; each missing node's replacement arrives ``replace_wait_s`` after the detection, and the job grows
  back at the next commit after it arrived (restart, startup and ``reshard_restore_s``; nothing lost).

TOR of one replica = committed-or-running productive seconds at the horizon / the horizon. The result is the
mean over replicas with a 95 % confidence interval (normal approximation over independent replicas).
:func:`replay` plays one given sequence of failures instead of random ones, for checks by hand.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .classes import CLASSES, Cluster, Costs, Rates
from .project import PARITY_STRATEGIES, STRATEGIES, flush_every
from .shrink import SHRINK, dp_after_loss, shrinks, throughput_after_loss
from .errors import TorError

__all__ = ["SimResult", "simulate", "replay"]

# A grow is a planned restart of a healthy job: any failure during it takes the failure's tier.
_TIER_ORDER = {"grow": 0, "memory": 1, "parity": 2, "persistent": 3, "disk": 3}


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
    shrinks: int = 0
    grows: int = 0
    degraded_s: float = 0.0
    """Wall seconds the jobs trained at a reduced data-parallel size (all replicas)."""
    degraded_lost_s: float = 0.0
    """What those seconds lost: (1 - D'/D) of each."""

    @property
    def degraded_fraction(self) -> float:
        """Share of the wall time at a reduced data-parallel size."""
        return self.degraded_s / (self.horizon_s * self.replicas)

    @property
    def degraded_loss_fraction(self) -> float:
        """Share of the wall time lost to the reduced throughput (part of 1 - TOR)."""
        return self.degraded_lost_s / (self.horizon_s * self.replicas)

    def as_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "interval_s": self.interval_s, "horizon_s": self.horizon_s,
                "replicas": self.replicas, "seed": self.seed, "tor": self.tor, "ci95": self.ci95,
                "ci": [self.tor - self.ci95, self.tor + self.ci95], "events": self.events, "tiers": self.tiers,
                "failures_during_recovery": self.during_recovery, "replacement_waits": self.waits,
                "shrinks": self.shrinks, "grows": self.grows, "degraded_fraction": self.degraded_fraction,
                "degraded_loss_fraction": self.degraded_loss_fraction}


class _Replica:
    """One simulated job. Productive progress while running is a function of effective running time E:
    cycles of (tau + C) each commit tau productive seconds at their end."""

    def __init__(self, strategy: str, cluster: Cluster, rates: Rates | None, costs: Costs, tau: float, stall: float,
                 rng: np.random.Generator, stats: SimResult) -> None:
        self.s, self.cl, self.rates, self.co = strategy, cluster, rates, costs
        self.tau, self.c, self.rng, self.stats = tau, stall, rng, stats
        self.m = cluster.parity_m if strategy in PARITY_STRATEGIES else 0
        self.shrink = strategy == SHRINK
        self.missing = 0                  # nodes the job runs without (shrink policy)
        self.arrivals: list[float] = []   # when the replacements of missing nodes arrive
        self.arrived = 0                  # replacements that arrived: the job grows back at the next commit
        self.resizing = False             # the recovery under way re-forms the job at another size
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
        self.job_rate = np.array([n * getattr(rates, c) / 3600.0 if rates else 0.0 for c in CLASSES])
        self.total_rate = float(self.job_rate.sum())

    # -- progress -------------------------------------------------------------------------------------------
    def committed(self, e: float) -> float:
        # The epsilon: an eviction lands exactly on a commit, up to rounding.
        return math.floor(e / (self.tau + self.c) + 1e-9) * self.tau

    def progress(self, e: float) -> float:
        cyc = math.floor(e / (self.tau + self.c) + 1e-9)
        return cyc * self.tau + min(e - cyc * (self.tau + self.c), self.tau)

    def theta(self) -> float:
        """D'/D: throughput without the missing nodes."""
        return throughput_after_loss(self.cl, self.missing) if self.missing else 1.0

    # -- a failure's tier and its nodes ------------------------------------------------------------------------
    def _lose(self, t: float, nodes: np.ndarray) -> tuple[bool, int, list[tuple[int, int]]]:
        """Nodes leave at t: (beyond m in some group, how many no idle spare replaces, pending heal entries)."""
        self.away = [x for x in self.away if x > t]
        idle = max(0, self.cl.spares - len(self.away))
        short = max(0, len(nodes) - idle)
        self.away.extend([t + self.co.repair_h * 3600.0] * len(nodes))
        beyond, pending = False, []
        for g in self.group[nodes].tolist():
            lst = [h for h in self.unhealed.get(g, []) if h > t]
            lst.append(math.inf)
            self.unhealed[g] = lst
            pending.append((g, len(lst) - 1))
            beyond |= len(lst) > self.m
        return beyond, short, pending

    def _restore_s(self, tier: str) -> float:
        return {"memory": self.co.restore_memory_s, "parity": self.co.restore_parity_s,
                "persistent": self.co.restore_persistent_s, "disk": self.co.disk_load_s}[tier]

    def run(self, horizon: float, schedule: Sequence[tuple[float, str, Sequence[int]]] | None = None) -> float:
        """TOR of one job over ``horizon`` seconds; ``schedule`` (time, class, node ids) replaces the random
        failures (:func:`replay`)."""
        co, rng, st = self.co, self.rng, self.stats
        cyc = self.tau + self.c
        t, e, base = 0.0, 0.0, 0.0       # time, effective running time since the last resume, resume position
        slow = False                      # a slow node paces the job at (1 - s)
        recovering_until, tier = None, None
        pending: list[tuple[int, int]] = []
        slow_detect = evict_at = math.inf
        plan = sorted(schedule or [], key=lambda x: x[0])

        def draw_next(now: float) -> float:
            if schedule is not None:
                return plan[0][0] if plan else math.inf
            return now + rng.exponential(1.0 / self.total_rate) if self.total_rate > 0 else math.inf

        next_fail = draw_next(0.0)
        while True:
            theta = self.theta()
            rate = theta * ((1.0 - co.slowdown) if slow else 1.0)
            grow_at = math.inf
            if recovering_until is None and self.arrived:   # grow back when the next snapshot commits
                grow_at = t + ((math.floor(e / cyc + 1e-9) + 1) * cyc - e) / rate
            arrive = self.arrivals[0] if self.arrivals else math.inf
            if recovering_until is not None:
                t_next = min(next_fail, recovering_until, arrive, horizon)
            else:
                t_next = min(next_fail, slow_detect, evict_at, grow_at, arrive, horizon)
                e += (t_next - t) * rate
                if self.missing:
                    st.degraded_s += t_next - t
                    st.degraded_lost_s += (t_next - t) * (1.0 - theta)
            t = t_next
            if t >= horizon:
                return (base + (self.progress(e) if recovering_until is None else 0.0)) / horizon
            if t == arrive and t < next_fail:
                self.arrivals.pop(0)
                self.arrived += 1
                continue
            if recovering_until is not None and t == recovering_until and t < next_fail:
                heal = t + self.tau + self.c
                for g, i in pending:
                    self.unhealed[g][i] = heal
                pending, recovering_until, tier, e, slow, self.resizing = [], None, None, 0.0, False, False
                continue
            if recovering_until is None and t == grow_at:
                # The next commit after the replacement arrived: stop there (nothing lost) and re-form at D.
                base += self.committed(e)
                self.missing -= self.arrived
                self.arrived, self.resizing, tier = 0, True, "grow"
                recovering_until = t + co.restart_s + co.startup_s + co.reshard_restore_s
                e, slow, slow_detect, evict_at = 0.0, False, math.inf, math.inf
                st.grows += 1
                continue
            if recovering_until is None and t == slow_detect:
                # evict when the next snapshot commits
                evict_at, slow_detect = t + (math.floor(e / cyc) + 1 - e / cyc) * cyc / rate, math.inf
                continue
            if recovering_until is None and t == evict_at:
                node = np.array([int(rng.integers(self.cl.nodes))])
                base, tier, recovering_until, pending = self._fail_stop(t, e, base, "slow", node, None, pending)
                e, evict_at = 0.0, math.inf
                continue
            # a failure (the draws keep their order: a seed gives the same failures as before the shrink policy)
            if schedule is not None:
                _, cname, ids = plan.pop(0)
                nodes = np.asarray(list(ids), dtype=int)
                next_fail = draw_next(t)
            else:
                next_fail = draw_next(t)
                cname = CLASSES[int(rng.choice(len(CLASSES), p=self.job_rate / self.total_rate))]
                nodes = self._nodes_of(cname)
            st.events[cname] = st.events.get(cname, 0) + 1
            if cname == "slow":
                if recovering_until is None and not slow:
                    slow, slow_detect = True, t + co.slow_detect_s
                continue
            if recovering_until is not None:
                st.during_recovery += 1
            base, tier, recovering_until, pending = self._fail_stop(t, e, base, cname, nodes, tier, pending,
                                                                    recovering=recovering_until is not None)
            e, slow, slow_detect, evict_at = 0.0, False, math.inf, math.inf

    def _nodes_of(self, cname: str) -> np.ndarray:
        """The nodes a random failure of class ``cname`` takes: one random node, or every node of one rack."""
        if cname == "node":
            return np.array([int(self.rng.integers(self.cl.nodes))])
        if cname == "rack":
            rk = int(self.rng.integers(self.racks))
            return np.arange(rk * self.cl.rack_nodes, min(self.cl.nodes, (rk + 1) * self.cl.rack_nodes))
        return np.array([], dtype=int)

    def _fail_stop(self, t: float, e: float, base: float, cname: str, nodes: np.ndarray, tier: str | None,
                   pending: list, *, recovering: bool = False) -> tuple[float, str, float, list]:
        """Roll back and start (or restart) a recovery; returns (resume position, tier, recovery end, pending)."""
        co = self.co
        beyond, short, new = self._lose(t, nodes) if len(nodes) else (False, 0, [])
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
        wait = shrinking = False
        if short:
            if self.shrink and shrinks(co) and dp_after_loss(self.cl, self.missing + short) > 0:
                # Re-form without them after the launcher's wait; their replacements come replace_wait_s after
                # the detection (what the spares policy would have waited for).
                self.missing += short
                self.arrivals = sorted(self.arrivals + [t + co.detect_s + co.replace_wait_s] * short)
                shrinking = True
                self.stats.shrinks += 1
            else:
                wait = True
        self.stats.waits += int(wait)
        # A failure during a re-formation still lands at the new size: its restore re-partitions.
        self.resizing = self.resizing or shrinking
        restore = self._restore_s(new_tier)
        if self.resizing and new_tier != "persistent":
            restore = co.reshard_restore_s
        dur = (co.recovery_s(restore) + (co.replace_wait_s if wait else 0.0)
               + (co.shrink_after_s if shrinking else 0.0))
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


def replay(strategy: str, cluster: Cluster, costs: Costs, *, interval_s: float, horizon_s: float,
           failures: Sequence[tuple[float, str, Sequence[int]]]) -> SimResult:
    """One job that meets exactly ``failures``, a list of (time in seconds, class, node ids) -- e.g. ``[(1000.0,
    "node", [3])]`` -- instead of random ones: the simulator's mechanics on a case that can be worked out by
    hand (tests pin them that way). A ``slow`` entry slows the job; its eviction takes a random node (seeded).
    Returns a one-replica :class:`SimResult` (``ci95`` 0)."""
    if strategy not in STRATEGIES:
        raise TorError(f"strategy={strategy!r}: expected one of {', '.join(STRATEGIES)}")
    for f in failures:
        if len(f) != 3 or f[1] not in CLASSES or (f[1] in ("node", "rack") and not len(f[2])):
            raise TorError(f"replay failure {f!r}: expected (seconds, class, node ids) with a class of "
                           f"{', '.join(CLASSES)} (node and rack name the nodes they take)")
    stall = costs.disk_save_s if strategy == "disk" else costs.snapshot_stall_s
    stats = SimResult(strategy=strategy, interval_s=interval_s, horizon_s=horizon_s, replicas=1, seed=0,
                      tor=0.0, ci95=0.0)
    rep = _Replica(strategy, cluster, None, costs, interval_s, stall, np.random.default_rng(0), stats)
    stats.tor = rep.run(horizon_s, schedule=list(failures))
    stats.tors = [stats.tor]
    return stats
