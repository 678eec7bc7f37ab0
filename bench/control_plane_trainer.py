"""The training loop bench/control_plane_bench.py runs on every rank: shardsafe's real runtime, no framework.

    python bench/control_plane_trainer.py --out DIR [--mb 2] [--steps 40] [--step-s 1.0] [--votes alternate]

Started by ``shardsafe launch`` (or the local launcher) through the fork server. Each rank holds a synthetic
state (a StateAdapter over an fp32 master and two moments of ``--mb`` MB in all, and a step counter), builds
:class:`shardsafe.runtime.Runtime` (holder, hierarchy, parity groups), restores with ``try_restore`` and then
runs ``--steps`` iterations: ``--step-s`` of sleep standing in for the accelerator's forward and backward (the
host CPU is free meanwhile, as it is while a GPU computes), ``before_step`` (the fault injector's kill point), an
in-place update of the state (the optimizer step), ``after_step`` (a snapshot every step: ``interval: 1``).

``--votes`` picks the commit vote's design, per snapshot version, inside one job:

* ``tree``: the runtime's own agreement (shardsafe.hierarchy: node-local, then the node leaders);
* ``ring``: the agreement shardsafe had before the hierarchy, ``GlooAgreement`` over a world-wide gloo group (its
  all-reduce is gloo's ring; :class:`_WorldGroup`, the same all-reduce as the ``dist.new_group`` the runtime built
  then);
* ``alternate`` (the default): even versions vote on the tree, odd ones on the ring. Both designs then run in the
  same processes, under the same load, interleaved: what the harness compares.

Under ``--restart in-place`` (``SHARDSAFE_RESTART=in-place``) the training runs inside
:func:`shardsafe.inplace.run`: a survivor of the kill leaves its loop, abandons its runtime and trains again from
the restored version in the same process; its start line then also carries ``in_place`` (when it learnt of the
restart, how long abandoning took, the new default group). Every rank's last line has the SHA-256 of its final
state (tests/fault/test_inplace.py compares it with an uninterrupted run's).

The swap is this script's alone (``pipeline.agreement`` is replaced after the runtime is built); shardsafe keeps
no switch for it. Every rank appends JSON lines to ``OUT/bench_rank<R>.jsonl`` as it goes: after its restore,
the hierarchy's collectives of the start (set-up and restore, in order), the seconds ``try_restore`` took
(placement + restore) and wall-clock marks of the start; one per submit that found the previous snapshot still
in flight (its version, the design it voted on, the seconds the submit waited); at the end, its last step and
RSS.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

DESIGNS = ("tree", "ring")


def design_of(version: int, votes: str) -> str:
    """Which design the commit vote of ``version`` ran on under ``--votes votes``."""
    if votes == "alternate":
        return DESIGNS[version % 2]
    return votes


def _synthetic_adapter(nbytes: int, seed: int):
    import torch
    from shardsafe.snapshot.state import RankState, StateAdapter

    class Synthetic(StateAdapter):
        """A rank's optimizer shard without a framework: fp32 master and two moments, and a step counter."""

        def __init__(self) -> None:
            # Filled, not drawn from a random generator: every survivor of a restart in place builds its state again
            # while the restart is on the clock, and 63 draws of 2 MB of normals cost 0.16 core-seconds there, a cost
            # of this stand-in and not of shardsafe. The restore overwrites it in any case.
            n = max(1, nbytes // 3 // 4)
            self.tensors = {k: torch.arange(n, dtype=torch.float32).mul_(1e-6).add_(seed + i)
                            for i, k in enumerate(("fp32_master", "exp_avg", "exp_avg_sq"))}
            self.tensors["step"] = torch.zeros(1, dtype=torch.int64)

        def capture(self) -> RankState:
            return RankState(tensors=dict(self.tensors), meta={"step": int(self.tensors["step"].item())})

        def apply(self, tensors, meta, peers=None) -> None:
            for k, t in tensors.items():
                self.tensors[k].copy_(t)

        def optimizer_step(self, step: int) -> None:
            for k in ("fp32_master", "exp_avg", "exp_avg_sq"):
                self.tensors[k].mul_(0.999).add_(1e-3)
            self.tensors["step"].fill_(step)

    return Synthetic()


class _WorldGroup:
    """Every rank in one gloo group, for GlooAgreement: its min_reduce is gloo's all-reduce over the world (the ring
    the hierarchy replaced), the same call a ``dist.new_group`` makes. Built over the job's store like shardsafe's
    own groups (shardsafe.hierarchy.MemberGroup), not registered with torch.distributed: a restart in place that
    leaves a vote stuck in it does not wait for it when it destroys torch's groups."""

    def __init__(self, store: Any, prefix: str, world: int, rank: int, timeout_s: float):
        from shardsafe.hierarchy import MemberGroup
        self.world = world
        self._group = MemberGroup(store, prefix, list(range(world)), rank, timeout_s)

    def min_reduce(self, values: list[int]) -> list[int]:
        return self._group.min_reduce(values)

    def gather_bytes(self, blob: bytes) -> list[bytes]:
        from shardsafe.errors import InternalError
        raise InternalError("the bench's world group only votes")

    def retire(self) -> None:
        """Off this thread, as shardsafe's own groups on a restart in place (shardsafe.hierarchy.let_go_of)."""
        self._group.retire()


class _Agreements:
    """The pipeline's agreement, dispatching each version's vote to the design :func:`design_of` names."""

    def __init__(self, by_design: dict[str, Any], votes: str):
        self.by_design, self.votes = by_design, votes

    def rebuild(self, generation: int) -> None:
        for a in self.by_design.values():
            a.rebuild(generation)

    def vote(self, version: int, ok: bool, causes: int = 0, standing: int = 0):
        return self.by_design[design_of(version, self.votes)].vote(version, ok, causes, standing)


def _count_collectives(log: list) -> None:
    """Record every call of the hierarchy's collectives in this process (kind, length in ints or bytes,
    hierarchy prefix), so the harness knows what a start costs without reading shardsafe's code."""
    from shardsafe import hierarchy
    H = hierarchy.Hierarchy
    if getattr(H, "_bench_counted", False):
        return
    min_reduce, gather_bytes, gather_ints = H.min_reduce, H.gather_bytes, H.gather_ints

    def counted_min(self, values):
        log.append(["min_reduce", len(values), self.prefix.rsplit("/", 1)[-1]])
        return min_reduce(self, values)

    def counted_gather(self, blob):
        log.append(["gather_bytes", len(blob), self.prefix.rsplit("/", 1)[-1]])
        return gather_bytes(self, blob)

    def counted_ints(self, values):
        log.append(["gather_ints", len(values), self.prefix.rsplit("/", 1)[-1]])
        return gather_ints(self, values)

    H.min_reduce, H.gather_bytes, H.gather_ints, H._bench_counted = counted_min, counted_gather, counted_ints, True


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="where each rank appends its bench_rank<R>.jsonl line")
    p.add_argument("--mb", type=float, default=2.0, help="MB of state per rank")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-s", type=float, default=1.0, help="seconds of sleep per step (the accelerator's share)")
    p.add_argument("--votes", choices=("alternate", *DESIGNS), default="alternate")
    p.add_argument("--timeout-s", type=float, default=60.0, help="shardsafe timeout_s (holder requests, votes)")
    a = p.parse_args(argv)
    marks = {"start": time.time()}   # wall-clock marks of the start, to line up with the event log
    from shardsafe.launch.discovery import discover
    discover()
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from shardsafe import env, inplace

    torch.set_num_threads(1)
    calls: list = []
    _count_collectives(calls)
    marks["imported"] = time.time()
    if env.restart_mode() == "in-place":
        # Survivors of a kill stay in this process and enter _train again (shardsafe.inplace), on a new default
        # group made by inplace.run: a re-entry's marks start when it enters.
        first = [True]

        def entry() -> int:
            now = time.time()
            m = marks if first[0] else {"start": now, "imported": now}
            first[0], m["process_group"] = False, now
            calls.clear()
            return _train(a, m, calls, now - m["imported"])
        return inplace.run(entry, timeout_s=a.timeout_s)
    t0 = time.perf_counter()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout_s))
    marks["process_group"] = time.time()
    rc = _train(a, marks, calls, time.perf_counter() - t0)
    dist.destroy_process_group()
    return rc


def _train(a: argparse.Namespace, marks: dict, calls: list, t_pg: float) -> int:
    """One attempt on this rank, torch.distributed initialised: the runtime, its restore, the steps."""
    import torch.distributed as dist
    from shardsafe import inplace
    from shardsafe.config import ShardsafeConfig
    from shardsafe.faults import current_attempt
    from shardsafe.runtime import Runtime
    from shardsafe.snapshot.pipeline import GlooAgreement
    from shardsafe.tor import EventLog

    attempt = current_attempt()
    EventLog(os.environ["SHARDSAFE_RUN_DIR"], source="trainer", rank=int(os.environ.get("RANK", 0)),
             node=os.environ.get("SHARDSAFE_NODE"), attempt=attempt).emit("trainer_start")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ShardsafeConfig(interval=1, timeout_s=a.timeout_s, job_id=os.environ["SHARDSAFE_JOB_ID"])
    t0 = time.perf_counter()
    rt = Runtime(cfg, rank=rank, world_size=world)
    t_runtime = time.perf_counter() - t0
    marks["runtime"] = time.time()
    state = _synthetic_adapter(int(a.mb * 1e6), seed=rank)
    t0 = time.perf_counter()
    restored = rt.try_restore(state)
    t_restore = time.perf_counter() - t0
    marks["restored"] = time.time()
    out = open(os.path.join(a.out, f"bench_rank{rank}.jsonl"), "a", buffering=1)   # a line per write
    out.write(json.dumps({"rank": rank, "attempt": attempt, "world": world, "init_process_group_s": t_pg,
                          "runtime_s": t_runtime, "try_restore_s": t_restore, "restored_version": restored.version,
                          "start_collectives": list(calls), "votes": a.votes, "marks": marks,
                          "pid": os.getpid(), "in_place": dict(inplace.timings)}) + "\n")
    agreements, ring = {"tree": rt.pipeline.agreement}, None
    if a.votes != "tree":
        # The agreement before the hierarchy: the min-vote as gloo's all-reduce over a world-wide group.
        ring = _WorldGroup(dist.distributed_c10d._get_default_store(), "bench/ring", world, rank, a.timeout_s)
        agreements["ring"] = GlooAgreement(ring)
    rt.pipeline.agreement = _Agreements(agreements, a.votes)
    step = restored.version + 1 if restored.version >= 0 else 1
    rt.events.emit("train_ready", iteration=step)
    pipe, submitted = rt.pipeline, 0
    try:   # a restart in place (shardsafe.inplace) leaves this loop with RestartInPlace
        while step <= a.steps:
            t_it = time.perf_counter()
            stall0 = rt.stall_total_s
            time.sleep(a.step_s)
            rt.before_step(step)
            state.optimizer_step(step)
            # The previous snapshot (its parity, vote and commit) still running: this submit waits for it.
            in_flight = len(pipe.history) < submitted
            t_sub = time.perf_counter()
            rt.after_step(step, state)
            if in_flight:   # written at once: a killed attempt keeps what it saw
                out.write(json.dumps({"rank": rank, "attempt": attempt, "wait": [
                    step - 1, design_of(step - 1, a.votes), time.perf_counter() - t_sub]}) + "\n")
            submitted += 1
            rt.events.emit("iteration", iteration=step, seconds=max(0.0, time.perf_counter() - t_it -
                                                                     (rt.stall_total_s - stall0)))
            step += 1
        rt.flush(a.timeout_s)
    except BaseException:
        out.close()
        if ring is not None:
            ring.retire()
        raise
    digest = hashlib.sha256(b"".join(state.tensors[k].numpy().tobytes() for k in sorted(state.tensors))).hexdigest()
    out.write(json.dumps({"rank": rank, "attempt": attempt, "done": step - 1, "rss_mb": _rss_mb(), "pid": os.getpid(),
                          "state_sha256": digest}) + "\n")
    out.close()
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
