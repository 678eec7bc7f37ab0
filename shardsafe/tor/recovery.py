"""What one failure event costs, the pieces both recovery policies share (waiting for a spare, :mod:`.project`;
continuing at a smaller data-parallel size, :mod:`.shrink`): the parts of an event's cost, the probability that a
loss finds no idle spare or loses more than m members of a parity group, and the persistent flush cadence."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .classes import Cluster, Costs, Rates

# Parts of one event's cost, in report order; their sum is the event's wall-time cost D_c. `degraded` is the
# throughput lost at a reduced data-parallel size, `grow` the restart and restore that return to full size
# (both only under the shrink policy); `replacement_wait` under it is the launcher's wait before it shrinks.
PARTS = ("detection", "restart", "startup", "restore", "replacement_wait", "lost_work", "slowdown", "degraded",
         "grow")


@dataclass(kw_only=True)
class ClassCost:
    """One failure class under one strategy: how often, through which tiers, and what one event costs."""

    name: str
    per_hour: float
    """Events per hour for the whole job (N x rate)."""
    tiers: dict[str, float]
    """Probability of each restore tier (memory, parity, persistent, disk)."""
    parts: dict[str, float]
    """Expected seconds per event by :data:`PARTS` (tier-weighted)."""
    p_no_spare: float = 0.0
    p_beyond_m: float = 0.0
    p_shrink: float = 0.0
    """Shrink policy: probability that an event of this class shrinks the job (no idle spare, and it can)."""
    degraded_wall_s: float = 0.0
    """Shrink policy: expected wall seconds per event at the reduced size (``parts["degraded"]`` is what they
    lose: 1 - D'/D of them)."""

    @property
    def seconds(self) -> float:
        return math.fsum(self.parts.values())

    @property
    def fraction(self) -> float:
        """Share of T_obs this class takes: Lambda_c x D_c."""
        return self.per_hour / 3600.0 * self.seconds


# ---------------------------------------------------------------------------------------------------------------
# Probabilities: spares and more than m losses in a group
# ---------------------------------------------------------------------------------------------------------------

def node_loss_rate(cluster: Cluster, rates: Rates) -> float:
    """Rate (per second) at which one given node leaves the job: its own loss, its rack's events (each takes
    ``rack_nodes`` nodes, so a node is hit at rack_nodes x the per-node rack rate), and evictions after
    fail-slow."""
    return (rates.node + cluster.rack_nodes * rates.rack + rates.slow) / 3600.0


def away_distribution(cluster: Cluster, rates: Rates, costs: Costs, kmax: int) -> list[float]:
    """P(k nodes are away in repair) for k = 0..kmax.

    Every lost node is away ``repair_h``. Single-node losses (node, fail-slow evictions) and rack events (each
    takes ``rack_nodes`` nodes at once) are Poisson, so the count away is compound Poisson (an M^X/G/inf
    queue): mean mu_1 + r mu_r with mu_1 = N (rate_node + rate_slow) x repair and mu_r = N rate_rack x repair
    rack events. Rack batches make its tail much heavier than a plain Poisson of the same mean (at 256 nodes
    with 8 spares, a node loss waits about 6x more often). Panjer's recursion:
    p(0) = exp(-mu_1 - mu_r), k p(k) = mu_1 p(k-1) + r mu_r p(k-r).
    """
    rep = costs.repair_h
    mu1 = cluster.nodes * (rates.node + rates.slow) * rep
    mur = cluster.nodes * rates.rack * rep
    r = cluster.rack_nodes
    p = [math.exp(-(mu1 + mur))]
    for k in range(1, kmax + 1):
        v = mu1 * p[k - 1] + (r * mur * p[k - r] if k >= r else 0.0)
        p.append(v / k)
    return p


_NO_SPARE_MEMO: dict[tuple, float] = {}


def p_no_spare(cluster: Cluster, rates: Rates, costs: Costs, need: int = 1) -> float:
    """Probability that a loss needing ``need`` nodes finds fewer than that idle: idle spares = spares - away,
    and a loss sees the stationary distribution of the nodes away (PASTA), :func:`away_distribution`."""
    room = cluster.spares - need            # the loss waits when more than this many are away
    if room < 0:
        return 1.0
    # Memoised: the interval search calls this hundreds of times with the same inputs (it does not depend on
    # the interval), and the recursion is O(spares x rack_nodes).
    key = (cluster.nodes, cluster.rack_nodes, room, rates.node, rates.rack, rates.slow, costs.repair_h)
    v = _NO_SPARE_MEMO.get(key)
    if v is None:
        if len(_NO_SPARE_MEMO) > 4096:
            _NO_SPARE_MEMO.clear()
        v = _NO_SPARE_MEMO[key] = max(0.0, min(1.0, 1.0 - math.fsum(away_distribution(cluster, rates, costs, room))))
    return v


def _binom_tail(n: int, k: int, q: float) -> float:
    """P(Binomial(n, q) >= k)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    return max(0.0, min(1.0, math.fsum(math.comb(n, i) * q ** i * (1 - q) ** (n - i) for i in range(k, n + 1))))


def p_beyond_m(cluster: Cluster, rates: Rates, window_s: float, lost_members: int = 1) -> float:
    """Probability that a group which just lost ``lost_members`` members loses more than m in all before it is
    healed ``window_s`` later: at least m - lost_members + 1 of its other n - lost_members members leave within
    the window, each independently with q = 1 - exp(-node loss rate x window). 1 when lost_members > m."""
    m, n = cluster.parity_m, cluster.group_nodes
    if lost_members > m:
        return 1.0
    q = -math.expm1(-node_loss_rate(cluster, rates) * window_s)
    return _binom_tail(n - lost_members, m - lost_members + 1, q)


# ---------------------------------------------------------------------------------------------------------------
# Per-class cost of one event
# ---------------------------------------------------------------------------------------------------------------

def flush_every(costs: Costs, interval_s: float) -> int:
    """k: the holders flush every k-th snapshot, the first one at least ``persist_interval_s`` after the last (the
    flush cadence is what the persistent storage can take, so a longer snapshot interval cannot shorten it)."""
    return max(1, math.ceil(costs.persist_interval_s / interval_s - 1e-9))


def _recovery_parts(costs: Costs, restore_s: float, wait_s: float, lost_s: float) -> dict[str, float]:
    return {"detection": costs.detect_s, "restart": costs.restart_s, "startup": costs.startup_s,
            "restore": restore_s, "replacement_wait": wait_s, "lost_work": lost_s, "slowdown": 0.0,
            "degraded": 0.0, "grow": 0.0}
