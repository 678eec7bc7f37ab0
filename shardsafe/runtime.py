"""The per-rank shardsafe runtime shared by the engine adapters.

:class:`BaseRuntime` is the contract the adapters drive (and a test double implements); :class:`Runtime` is
the real one: it connects to (or starts) the node's holder, creates the snapshot agreement group, restores at
start, and snapshots after optimizer steps. Adapters only supply a :class:`StateAdapter` and call
``try_restore`` once, ``before_step`` / ``after_step`` around every optimizer step, ``on_exit``, ``flush`` and
``close``. Nothing here raises into the training loop once training runs: snapshot failures are logged,
recorded as TOR events and skipped.
"""
from __future__ import annotations

import logging
import os
import subprocess
import time
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any, Optional

from . import collectives, fingerprint, teardown
from .collectives import mesh_advice
from .hierarchy import Hierarchy, Topology
from .payload import checksum
from .payload import manifest as mf
from . import env
from .config import ConfigError, ShardsafeConfig
from .persist import PersistentStore
from .parity.exchange import ExchangeError, ParityExchange, gather_places, plan_parity
from .parity.placement import inventory_of, migrate, settled, settled_ranks, slot_ranks
from .parity.recovery import MemberRecovery
from .parity.topology import TopologyError
from .fatal import install_excepthook
from .faults import Injector, current_attempt
from .holder import early_open
from .holder.client import HolderClient, HolderUnavailable, connect_or_start
from .holder.paths import HolderPaths
from .holder.protocol import HolderFailure
from .jobid import claim
from .ordinals import next_ordinal
from .protection import Cause, Protection, Reporter, budget_problem
from .snapshot.reshard_restore import Resize, drop_old_layout
from .snapshot.inventory import gather_held, held_from_parts, held_part, node_checks, node_listing
from .snapshot.restore import Collectives, RestoreResult, new_timeline, restore_from_holder
from .snapshot.pipeline import GlooAgreement, LocalAgreement, PipelineHooks, SnapshotPipeline
from .snapshot.state import StateAdapter
from .tor.events import EventLog, NullEventLog

log = logging.getLogger(__name__)


def _event_log(cfg: ShardsafeConfig, rank: int):
    if not cfg.run_dir:
        return NullEventLog()
    try:
        return EventLog(cfg.run_dir, source="trainer", rank=rank, node=cfg.node, attempt=current_attempt())
    except Exception as e:  # accounting never takes training down
        log.warning("[rank %d] TOR event log unavailable: %s", rank, e)
        return NullEventLog()


class _ScopedEvents:
    """The event log of a process's second and later engines: every event names the engine (``engine``)."""

    def __init__(self, inner: Any, scope: str):
        self._inner, self._scope = inner, scope

    def emit(self, kind: str, **fields: Any) -> bool:
        return self._inner.emit(kind, **{"engine": self._scope, **fields})


class BaseRuntime(ABC):
    """What an engine adapter drives, one per rank: the calls of a training loop's life.

    :class:`Runtime` implements it over the node's holder; a test double implements the abstract members and
    inherits the defaults. Adapters use these members and nothing else of a runtime.
    """

    events: Any = NullEventLog()
    """The TOR event log (``emit(kind, **fields)``); writes nothing without a run directory."""
    restored: Optional[RestoreResult] = None
    """What :meth:`try_restore` did, once it ran."""
    last_stall_s: float = 0.0
    """Seconds the last :meth:`before_step` waited for the pending snapshot copy."""

    @abstractmethod
    def try_restore(self, adapter: StateAdapter) -> RestoreResult:
        """Collective, once before training: put the newest recoverable snapshot back through ``adapter.apply``.
        ``version`` -1 in the result: nothing was restored (a fresh start)."""

    def before_step(self, step: int) -> float:
        """Right before the optimizer step ``step`` mutates the state: wait for the pending copy; the stall (s)."""
        return 0.0

    @abstractmethod
    def after_step(self, step: int, adapter: StateAdapter) -> None:
        """After the optimizer step ``step`` (counters updated): snapshot every ``interval`` steps, asynchronously."""

    def on_exit(self, step: int, adapter: StateAdapter) -> None:
        """The loop leaves after ``step`` (a signal, a time limit): make sure that step is kept."""

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until the last submitted snapshot is sealed and voted on; True if it committed."""
        return True

    def banner(self) -> str:
        """Collective-free, after :meth:`try_restore`: the protection state rank 0 states at start ("protected
        (...)" or "NOT protected: why"). Raises for ``on_unprotected: fail`` when the run cannot be protected."""
        return f"run by {type(self).__name__}, which keeps no protection state"

    @property
    def stall_total_s(self) -> float:
        """Seconds the training loop has spent blocked by snapshots so far."""
        return 0.0

    def close(self) -> None:
        """Finish the snapshot in flight and let go of the holder. Idempotent."""


class Runtime(BaseRuntime):
    """Args:
        cfg: the validated shardsafe config.
        rank, world_size: global rank and size (torch.distributed must be initialised when world_size > 1).
        coords: this rank's parallel coordinates ``{"dp", "tp", "pp", ...}``: parity groups are data-parallel
            peers with equal other coordinates, on distinct nodes (default: every rank a DP peer).
        scope: which engine of the process this runtime protects ("" for the first; :func:`engine_scope`). A
            program that builds several engines (HF's one engine per hyperparameter trial, an actor and a
            critic side by side) keeps each one's snapshots apart in the holder and the persistent tier,
            so an engine never restores another's state.

    Raises:
        ConfigError: the parity settings cannot be placed on this layout; on every rank, before training.
    """

    def __init__(self, cfg: ShardsafeConfig, *, rank: int, world_size: int, coords: dict[str, int] | None = None,
                 scope: str = ""):
        # From here on a ConfigError or RestoreError that ends the process leaves a record for the launcher, which
        # then stops instead of restarting (shardsafe.fatal); what the config leaves to the environment is filled in.
        install_excepthook()
        cfg = cfg.resolved()
        self.cfg, self.rank, self.world_size, self.scope = cfg, rank, world_size, scope
        # The persistent tier keeps each engine's versions in its own directory under the run's (run_name, which
        # outlives the job id across SLURM requeues and resubmissions; else the job id).
        self.persist_job_id = f"{cfg.persist_name}/{scope}" if scope else cfg.persist_name
        self.events = _event_log(cfg, rank) if not scope else _ScopedEvents(_event_log(cfg, rank), scope)
        self.injector = Injector(rank, scope=scope)
        self.protection = Protection(rank=rank, interval=cfg.interval, on_unprotected=cfg.on_unprotected,
                                     emit=self.events.emit, warn_interval_s=cfg.warn_interval_s)
        self.reporter = Reporter(self._send_state, who=f"rank {rank}")
        self.paths = HolderPaths(cfg.holder_dir, cfg.job_id, cfg.node)
        self.client: Optional[HolderClient] = None
        # Two running jobs that derived the same id must not share a holder (shardsafe.jobid): JobConflict.
        claim(cfg.holder_dir, cfg.job_id, cfg.node)
        try:
            self.client = connect_or_start(self.paths, budget_gb=cfg.memory_budget_gb, start=cfg.start_holder,
                                           timeout_s=cfg.timeout_s, idle_exit_s=cfg.holder_idle_exit_s,
                                           run_dir=cfg.run_dir, scope=scope)
        except (HolderUnavailable, OSError) as e:
            self.protection.stand(Cause.NO_HOLDER, f"rank {rank}: no holder for job {cfg.job_id} on node {cfg.node} "
                                                   f"({e})")
            log.warning("[rank %d] no holder for job %s on node %s (%s): this rank is NOT protected", rank,
                        cfg.job_id, cfg.node, e)
        group = None
        self.coll = Collectives(None, world_size)
        self.exchange = None
        self.nodes: list[str] | None = None
        # Every rank's (node, dp, tp, pp): a restore at another data-parallel size places the old ranks' state by it.
        c = {"dp": rank, "tp": 0, "pp": 0, **(coords or {})}
        self.places: list[tuple[str, int, int, int]] = [(cfg.node, int(c["dp"]), int(c["tp"]), int(c["pp"]))]
        self._resized_from = -1   # after a restore at another size: its version, until a version at this size commits
        self._vote_hier = None
        self._held: Optional[tuple[Any, list[dict]]] = None   # (client, every rank's holdings) from the places gather
        if world_size > 1:
            import torch.distributed as dist
            advice = mesh_advice(world_size, os.environ)
            if advice and rank == 0:
                log.warning("[rank 0] %s", advice)
            # A dedicated gloo group for the slots placement moves point to point; every vote and gather runs on the
            # hierarchies below (node-local groups, then the node leaders). None of them is the training
            # communicator (NCCL on GPU), and they time out on their own.
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout_s))
            places, topo = self._places(group, c)
            self.nodes = [p.node for p in places]
            self.places = [(p.node, p.dp, p.tp, p.pp) for p in places]
            self._vote_hier = Hierarchy(self._store, f"{self._prefix}/vote", topo, rank, cfg.timeout_s)
            try:
                plan = plan_parity(places, group_size=cfg.parity_group_size, parity_shards=cfg.parity_shards)
            except TopologyError as e:
                raise ConfigError(f"shardsafe parity settings cannot be placed on this job: {e}") from None
            if plan is not None and cfg.parity_group_size > 1 and rank == 0:
                sizes = sorted({g.n for g in plan})
                if sizes != [cfg.parity_group_size]:
                    log.warning("[rank 0] parity_group_size=%d: the data-parallel ranks split into groups of %s "
                                "members (RS(k=n-%d, m=%d)), not %d; set parity_group_size to %d to say so, or change "
                                "the layout", cfg.parity_group_size, sizes, cfg.parity_shards, cfg.parity_shards,
                                cfg.parity_group_size, max(sizes))
            if plan is not None:
                try:
                    self.exchange = ParityExchange(plan, rank, timeout_s=cfg.timeout_s, transport=cfg.parity_transport,
                                                   store=self._store, prefix=f"{self._prefix}/parity")
                except ExchangeError as e:
                    raise ConfigError(f"shardsafe.{e}") from None   # "parity_transport 'device' needs ..."
                g = self.exchange.group
                if rank == 0:
                    log.info("[rank 0] parity on: %d group(s), RS(k=%d, m=%d) per group; group of rank 0: ranks %s on "
                             "nodes %s", len(plan), g.k, g.m, list(g.members), list(g.nodes))
        self.pipeline = SnapshotPipeline(
            self.client, rank=rank, world_size=world_size, node=cfg.node,
            agreement=GlooAgreement(self._vote_hier) if world_size > 1 else LocalAgreement(),
            parity=self.exchange, hasher=checksum.shared(cfg.hash_threads), interval=cfg.interval,
            hooks=PipelineHooks(on_event=self.events.emit, on_phase=self.injector.phase,
                                on_progress=self.injector.copy_progress, reconnect=self._reconnect,
                                flush=self._on_commit))
        self.pipeline.coords = {"dp": int(c["dp"]), "tp": int(c["tp"]), "pp": int(c["pp"])}
        if self.exchange is not None:
            self.exchange.on_phase = self.injector.phase
        self.persist = PersistentStore(cfg.persist_dir, self.persist_job_id) if cfg.persist_dir else None
        self.restored: RestoreResult | None = None
        self._closed = False
        self.left_behind = False   # abandon() left a snapshot thread to its timeout
        if world_size > 1:
            teardown.guard(self)

    def _places(self, group: Any, c: dict) -> tuple[list, Topology]:
        """Every rank's (node, dp, tp, pp) and which ranks share a node, with the restore's hierarchy built on it.
        The launcher's node blocks (torchrun's LOCAL_WORLD_SIZE x GROUP_WORLD_SIZE) build the hierarchy before any
        message, and the places travel over it; without them, one world all-gather over ``group`` says where every
        rank is. The nodes' names decide in the end (two agents on one host are one failure domain)."""
        import torch.distributed as dist
        from .parity.topology import RankPlace
        self._store = dist.distributed_c10d._get_default_store()
        # Each runtime's groups get their own keys in the job's store (every rank builds the same runtimes in order).
        self._prefix = f"shardsafe/{self.scope or 'engine0'}/{next_ordinal('runtime')}"
        rank, world = self.rank, self.world_size
        topo = Topology.from_launcher(os.environ, world, rank)
        if topo is None:
            places = gather_places(rank, world, self.cfg.node, c["dp"], c["tp"], c["pp"], group=group)
            topo = Topology.from_names([p.node for p in places])
        else:
            hier = Hierarchy(self._store, f"{self._prefix}/restore", topo, rank, self.cfg.timeout_s)
            # What this rank's holder holds travels with its place, for the restore (snapshot/inventory.py): a
            # restart's first collective is then the only one before the vote.
            listed = node_listing(self.client, rank=rank, world_size=world) if topo.members(rank)[0] == rank else None
            mine = {"rank": rank, "node": self.cfg.node, "dp": c["dp"], "tp": c["tp"], "pp": c["pp"],
                    "held": held_part(self.client, rank, listed and (listed[0], slot_ranks(inventory_of(listed[1]))))}
            got = collectives.gather_json(mine, hier)
            places = [RankPlace(**{k: v for k, v in p.items() if k != "held"}) for p in got]
            named = Topology.from_names([p.node for p in places])
            if named == topo:   # the node leaders that listed are the nodes' lowest ranks
                self._held = (self.client, [p["held"] for p in got])
                self.coll = Collectives(group, world, hier=hier)
                return places, topo
            hier.close()
            topo = named
        self.coll = Collectives(group, world, hier=Hierarchy(self._store, f"{self._prefix}/restore/named", topo, rank,
                                                             self.cfg.timeout_s))
        return places, topo

    def _on_commit(self, version: int) -> None:
        """Every committed version: the first one after a restore at another data-parallel size lets the old layout's
        copies go; every persist_every-th goes to disk."""
        if 0 <= self._resized_from < version:
            self._resized_from = -1
            drop_old_layout(self.pipeline.client, rank=self.rank, node=self.cfg.node,
                            nodes=self.nodes or [self.cfg.node], version=version)
        if self.cfg.persist_dir:
            self._flush_to_disk(version)

    def _flush_due(self, version: int) -> bool:
        return (version // self.cfg.interval) % self.cfg.persist_every == 0

    def _flush_to_disk(self, version: int) -> None:
        """Every persist_every-th snapshot: the holder writes it to disk in the background."""
        if not self._flush_due(version) or self.pipeline.client is None:
            return
        self._request_flush(version)

    def _request_flush(self, version: int) -> None:
        self.pipeline.client.flush(rank=self.rank, version=version, dir=self.cfg.persist_dir, job_id=self.persist_job_id,
                                   keep=self.cfg.persist_keep, mbps=self.cfg.persist_mbps)

    # After a failed start, ranks only try to connect for this long before starting a holder again: a start
    # that keeps failing must not cost every snapshot a process start on the snapshot worker.
    HOLDER_RESTART_BACKOFF_S = 30.0
    _holder_retry_at = 0.0

    def _reconnect(self) -> HolderClient:
        """A new connection to this node's holder once the old one broke (the pipeline calls it before the next
        snapshot). A killed holder leaves nobody to answer: the node's first rank (its lowest) then starts a
        new, empty one, detached, with this job's budget and idle exit, and records ``holder_restarted``; the
        node's other ranks connect to it once it serves (a snapshot they take before then is skipped)."""
        first = min((r for r, n in enumerate(self.nodes) if n == self.cfg.node), default=self.rank) \
            if self.nodes else self.rank
        start = self.cfg.start_holder and self.rank == first and time.monotonic() >= self._holder_retry_at
        # A launcher that started the holders says their budget; a config without one leaves it to them.
        budget = self.cfg.memory_budget_gb or float(env.get(env.HOLDER_BUDGET_GB) or 0)
        try:
            c = connect_or_start(self.paths, budget_gb=budget, start=start, timeout_s=self.cfg.timeout_s,
                                 idle_exit_s=self.cfg.holder_idle_exit_s, run_dir=self.cfg.run_dir, scope=self.scope)
        except (HolderUnavailable, OSError, subprocess.SubprocessError) as e:
            if start:
                self._holder_retry_at = time.monotonic() + self.HOLDER_RESTART_BACKOFF_S
            raise HolderUnavailable(f"{e}" if isinstance(e, HolderUnavailable) else
                                    f"starting a new holder failed ({type(e).__name__}: {e})") from None
        if c.started_holder:
            log.warning("[rank %d] the holder of node %s was gone: started a new one (pid %d); snapshots resume "
                        "(the versions the old one held are lost on this node)", self.rank, self.cfg.node, c.holder_pid)
            self.events.emit("holder_restarted", node=self.cfg.node, pid=c.holder_pid)
        self.client = c   # close() closes the live connection, not the broken one
        self.protection.clear(Cause.NO_HOLDER)
        return c

    # ---- the three calls adapters make ------------------------------------------------------------
    def try_restore(self, adapter: StateAdapter) -> RestoreResult:
        if not isinstance(adapter, StateAdapter):
            raise TypeError(f"shardsafe restores through a shardsafe.snapshot.state.StateAdapter; got "
                            f"{type(adapter).__name__}. Subclass StateAdapter (capture, apply; validate and the "
                            "rest have defaults).")
        # The slot this trainer mapped while it started (holder/early_open.py), for the first engine's restore.
        early = early_open.take() if not self.scope else None
        # What makes this run this run, before the restore changes any state: every snapshot carries it, and a
        # snapshot of another run is refused (shardsafe/fingerprint.py).
        fp = fingerprint.make(adapter.fingerprint())
        self.pipeline.fingerprint = fp
        if self.cfg.resume == "never":
            if early is not None:
                early.discard()
            self.events.emit("restore_start")
            dropped = self._drop_everything()
            self.events.emit("restore_end", tier="none", version=-1, seconds=0.0, bytes=0,
                             notes={"resume": "never", "dropped": dropped})
            self.restored = RestoreResult(message="resume is \"never\": started fresh" + (
                f" and dropped {dropped} older version(s) of this job" if dropped else ""),
                timeline=new_timeline(self.coll))
            self.pipeline.timeline = self.restored.timeline
            self.protection.started(-1)
            self._check_budget(adapter)
            return self.restored
        moved: list = []

        def emit(kind: str, **f: Any) -> None:
            if kind == "restore_end" and moved and moved[0].moves:
                f.update(migrated_slots=len(moved[0].moves), migrated_bytes=moved[0].nbytes)
            self.events.emit(kind, **f)

        def placement(settled: Optional[bool] = None) -> None:
            # Torch elastic may have put this rank on another node than its snapshot: move it first.
            if self.world_size > 1:
                moved.append(migrate(self.client, rank=self.rank, world_size=self.world_size, node=self.cfg.node,
                                     rank_nodes=self.nodes, group=self.coll.group, coll=self.coll.hier,
                                     settled=settled))

        emit("restore_start")
        t0 = time.perf_counter()   # what every rank holds, and the nodes' checks (snapshot/inventory.py)
        nodes = self.nodes or [self.cfg.node]
        listed, self._held = self._held, None
        if listed is not None and listed[0] is self.client:   # gathered with the places, nothing written since
            held = held_from_parts(listed[1], self.rank, nodes, parity=self.exchange is not None,
                                   settled=lambda node, ranks: settled_ranks(nodes, node, ranks))
        else:
            held = gather_held(self.client, self.rank, self.exchange, self.coll, node_checks(
                self.client, rank=self.rank, world_size=self.world_size, nodes=nodes,
                settled=lambda listing: settled(nodes, self.cfg.node, inventory_of(listing))))
        resize = None
        if not held.same_size:
            # Copies of another world size (the job re-formed at another data-parallel size): no migration (it
            # would move the old ranks' payloads by their old rank numbers); the restore re-partitions them.
            resize = Resize(places=self.places, recovery=MemberRecovery, migrate=lambda: placement(held.settled))
        elif not held.settled:
            placement(False)
            held = None   # slots moved: what every rank holds is gathered again
        self.restored = restore_from_holder(adapter, self.client, rank=self.rank, coll=self.coll,
                                            on_event=emit, exchange=self.exchange, nodes=self.nodes,
                                            persist=self.persist, on_phase=self.injector.phase,
                                            h2d=self.cfg.restore_h2d, early=early, fingerprint=fp,
                                            force=self.cfg.resume == "force", resize=resize, held=held, started=t0,
                                            # the budget check's gather rides in the vote on the verified copy: the
                                            # restored state's size is its manifest's
                                            vote_extra=lambda m: self._budget_row(int(m["payload_nbytes"]) if m else 0))
        if self.restored.reshard:
            self._resized_from = self.restored.version
        # Every snapshot of this attempt belongs to the new branch; the restored version counts as committed.
        self.pipeline.timeline = self.restored.timeline
        self.protection.started(self.restored.version)
        self._check_budget(adapter, self.restored.vote_rows)   # after the restore: the engine has all of its state
        if self.restored.version >= 0:
            self.pipeline.last_committed = self.restored.version
        if self.rank == 0:
            log.info("[rank 0] %s (%.3f s)", self.restored.message, self.restored.seconds)
        return self.restored

    @property
    def stall_total_s(self) -> float:
        """Seconds the training loop has spent blocked by snapshots so far (subtract the growth over an
        iteration from its `seconds`: docs/tor.md)."""
        return self.pipeline.stall_total_s

    def before_step(self, step: int) -> float:
        """Call before the optimizer step ``step`` mutates the state. Returns the stall in seconds."""
        self.injector.before_step(step)
        self.last_stall_s = self.pipeline.wait_copied()
        return self.last_stall_s

    def after_step(self, step: int, adapter: StateAdapter) -> None:
        if step % self.cfg.interval == 0:
            self.pipeline.submit(step, adapter.capture())
        self.protection.report(self.pipeline.take_causes(), self.pipeline.standing_everywhere)
        try:
            self.protection.observe(step, self.pipeline.last_committed)   # raises for on_unprotected: fail
        finally:
            self._report_state()

    REPORT_EVERY_S = 5.0   # how often a rank leaves its protection state with the holder while nothing changes
    _reported = (None, float("-inf"))

    def _report_state(self) -> None:
        """``shardsafe status`` shows every rank's protection state: left with the holder when it changes, else
        every REPORT_EVERY_S, by the runtime's Reporter thread (the training thread only posts it)."""
        now = time.monotonic()
        flag, last = self._reported
        if self.pipeline.client is None or (flag == self.protection.protected and now - last < self.REPORT_EVERY_S):
            return
        self._reported = (self.protection.protected, now)
        self.reporter.post(self.protection.state())

    def _send_state(self, state: dict) -> None:
        try:
            if self.pipeline.client is not None:
                self.pipeline.client.report(rank=self.rank, state=state)
        except (HolderFailure, OSError):
            pass   # the pipeline reconnects; the state is reported again then

    def banner(self) -> str:
        """What rank 0 says at initialize: protected or not, and why (never a claim that is not true)."""
        return self.protection.startup_check()

    def _check_budget(self, adapter: StateAdapter, rows: Optional[list[list[int]]] = None) -> None:
        """Every node's holder must keep two versions (and their parity) of every rank of the node, or the second
        version never commits and a crash much later restores the first. Collective: every rank reports its need,
        its holder's budget and what the holder's other engines hold; every rank reaches the same verdict.
        ``rows``: every rank's :meth:`_budget_row`, gathered already (in the restore's vote); None: gathered here."""
        if rows is None:
            _, nbytes = mf.layout(adapter.capture().tensors)
            rows = self.coll.gather_ints(self._budget_row(nbytes + adapter.pending_state_nbytes()))
        missing = [r for r, row in enumerate(rows) if not row[3]]
        if missing and self.client is not None:   # every rank knows, so rank 0 never claims protection
            self.protection.stand_until_commit(Cause.NO_HOLDER, f"rank(s) {missing[:8]}"
                                               + ("..." if len(missing) > 8 else "") + " have no holder")
        nodes = self.nodes or [self.cfg.node]
        problem = budget_problem([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], nodes)
        if problem is None:
            return
        if self.cfg.on_unprotected == "fail":
            raise ConfigError(f"shardsafe: {problem}; on_unprotected is \"fail\", so the run does not start "
                              "unprotected.")
        self.protection.stand(Cause.BUDGET, problem)

    def _budget_row(self, nbytes: int) -> list[int]:
        """This rank's line of the budget check for a state of ``nbytes``: what its holder must keep for it, the
        holder's budget, what the holder's other engines hold, and whether it has a holder."""
        need = 0
        if self.client is not None:
            from .holder.segments import round_size
            from .holder.slots import MAX_SLOTS
            data = nbytes if self.exchange is None else max(nbytes, self.exchange.padded_nbytes(nbytes))
            share = 0 if self.exchange is None else self.exchange.group.m * self.exchange.group.chunk_size(data)
            need = MAX_SLOTS * (round_size(data) + (round_size(share) if share else 0))
        budget, other = -1, 0
        if self.client is not None:
            try:
                st = self.client.status()
                budget = int(st.get("budget", -1))
                other = int(st.get("used", 0)) - int((st.get("used_by_scope") or {}).get(self.scope, st.get("used", 0)))
            except HolderFailure as e:
                log.warning("[rank %d] the holder's budget could not be read: %s", self.rank, e)
        return [need, budget, max(other, 0), int(self.client is not None)]

    def _drop_everything(self) -> int:
        """``resume: never``: every version this rank keeps, in its holder and on disk, goes."""
        n = 0
        if self.client is not None:
            try:
                for kind in ("data", "parity"):
                    for v in self.client.sealed_versions(self.rank, kind):
                        self.client.drop(rank=self.rank, version=v, kind=kind)
                        n += 1
            except HolderFailure as e:
                log.warning("[rank %d] resume \"never\": older versions not dropped from the holder: %s", self.rank, e)
        if self.persist is not None:
            n += self.persist.drop_rank(self.rank)
        return n

    def on_exit(self, step: int, adapter: StateAdapter) -> None:
        """The job is leaving after ``step`` (the framework's exit signal, exit interval or duration). Snapshot
        that step if the interval skipped it (else the work since the last snapshot is lost), wait for it to
        commit, and with a persistent tier have it flushed whatever persist_every says: the holders may go
        with the job. Every rank calls it for the same step (Megatron-LM decides to exit collectively)."""
        if step % self.cfg.interval != 0:
            self.pipeline.submit(step, adapter.capture())
        committed = self.pipeline.flush(self.cfg.timeout_s)
        if not (committed and self.cfg.persist_dir and self.pipeline.last_committed == step):
            return
        if self._flush_due(step) or self.pipeline.client is None:
            return   # already requested by the commit
        try:
            self._request_flush(step)
        except HolderFailure as e:
            log.warning("[rank %d] final snapshot %d not flushed to %s: %s", self.rank, step, self.cfg.persist_dir, e)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until the last submitted snapshot is sealed and voted on; True if it committed."""
        return self.pipeline.flush(timeout)

    def retire(self) -> None:
        """The engine is done for good (the program built its successor): wait for the snapshot in flight, keep
        the newest committed version of this rank in the holder (a restarted program that rebuilds this engine
        restores its end state from it), free the older ones, and close. Collective like every commit vote."""
        if self._closed:
            return
        self.pipeline.flush(self.cfg.timeout_s)
        keep, client = self.pipeline.last_committed, self.pipeline.client
        if keep >= 0 and client is not None:
            try:
                for kind in ("data", "parity"):
                    for v in client.sealed_versions(self.rank, kind):
                        if v != keep:
                            client.drop(rank=self.rank, version=v, kind=kind)
            except HolderFailure as e:   # the memory is the holder's to reclaim; the program goes on
                log.warning("[rank %d] retiring engine scope %r: older versions not freed: %s", self.rank,
                            self.scope, e)
        self.close()

    ABANDON_COPY_WAIT_S = 60.0   # an abandoned snapshot's copy into holder memory is local: it ends within this

    def abandon(self, grace_s: float) -> bool:
        """Stop at once for a restart in place (shardsafe.inplace): the snapshot in flight is neither sealed nor
        committed, the groups are dropped (their sockets close, so peers waiting on them fail now, not at their
        timeout) and the holder connection closes as if this process had died.

        The snapshot thread gets ``grace_s`` to stop. One still waiting for a peer of the abandoned attempt (a peer
        whose own wait holds its end of the group open) is left to end at its timeout: once its copy is over, its
        holder memory is fenced off (:meth:`HolderClient.fence`), so whatever it does later cannot reach the holder.
        False when that could not be done (the copy did not end, or the fence failed): the process must not go on."""
        if self._closed:
            return True
        self._closed = True
        teardown.forget(self)
        self.reporter.close(0)
        self.pipeline.abandon()
        # Off this thread: a gloo group's destructor can wait for a peer up to its timeout (hierarchy.let_go_of).
        for h in (self._vote_hier, self.coll.hier):
            if isinstance(h, Hierarchy):
                h.retire()
        self._vote_hier = None
        self.coll = Collectives(None, self.world_size)
        if self.exchange is not None:
            self.exchange.retire()
        self.exchange = None
        stopped = self.pipeline.join(grace_s)
        if self.client is not None and not self.pipeline.wait_abandoned_copy(self.ABANDON_COPY_WAIT_S):
            return False
        if not stopped and self.client is not None:
            try:
                n = self.client.fence()
            except OSError as e:
                log.error("[rank %d] %s", self.rank, e)
                return False
            log.warning("[rank %d] the abandoned attempt's snapshot thread still waits for a peer; it is left to end "
                        "at its timeout, its %.0f MB of holder memory fenced off", self.rank, n / 1e6)
            self.left_behind = True
        if self.client is not None:
            self.client.close()
        return True

    def close(self) -> None:
        """Finish the snapshot in flight, stop the worker, let the holder go. Idempotent; also run when the
        program tears torch.distributed down or exits without calling it (an unchanged program never does)."""
        if self._closed:
            return
        self._closed = True
        teardown.forget(self)
        self.pipeline.close()
        self.reporter.close()
        for h in (self._vote_hier, self.coll.hier):
            if isinstance(h, Hierarchy):
                h.close()
        if self.client is not None:
            self.client.close()


def engine_scope(ordinal: int) -> str:
    """The holder scope of a process's ``ordinal``-th protected engine (0-based): "" for the first, so a program
    with one engine keeps the layout it always had; ``engine1``, ``engine2``, ... for the next ones. Programs build
    their engines in the same order on every run, so the ordinal names the same engine after a restart."""
    if ordinal < 0:
        raise ConfigError(f"engine ordinal must be >= 0, got {ordinal}")
    return f"engine{ordinal}" if ordinal else ""
