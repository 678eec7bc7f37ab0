"""The control plane as ranks are added: commit votes (hierarchy vs the old gloo ring), restarts, store load.

    .venv/bin/python bench/control_plane_bench.py [--ranks 4,16,64] [--simulate 1024,16384] [--json]
                                                  [--launcher elastic|local] [--steps 40] [--kill-at 16]

Per rank count N, one job under ``shardsafe launch``'s launcher (ElasticLauncher: a torchrun agent, a holder
and a fork server per simulated node of --per-node ranks; ``--launcher local``: the local launcher, one fork
server for all) runs bench/control_plane_trainer.py: shardsafe's real runtime, holders, parity (RS over the
nodes) and restore on a synthetic state of --mb MB per rank, a snapshot every step (``interval: 1``), --step-s
of sleep per step standing in for the accelerator. Snapshot versions alternate their commit vote between the
hierarchy (shardsafe.hierarchy, even versions) and the agreement it replaced (gloo's ring all-reduce over a
world group, odd versions): both designs in the same processes, under the same load, interleaved. Rank N-1 is
SIGKILLed at step --kill-at (``--inject kill-rank:N-1@K``); the job restarts (every trainer; with ``--restart
in-place`` rank N-1 alone starts again and the others go on in their processes, shardsafe.inplace), restores from
the holders and runs to --steps. Per N, from the event log and the trainers'
lines:

* commit vote: the median ``vote_s`` of the snapshot events per design (every rank and version, the first
  --warmup versions of each attempt left out: they connect gloo pairs), and per version the vote of the rank
  that arrived last (the collective's own latency, without waiting for slower ranks) and the spread of the
  ranks' arrivals (max - min vote_s: a vote ends everywhere at about the same moment);
* snapshots at interval 1: committed per second, versions that did not commit (``skipped``), and submits that
  found the previous snapshot still in flight (the training loop waits for it: the pipeline never skips for it);
* restart: kill -> the end of the next iteration and its phases (bench/restart_bench.py's kill_phases:
  detection, re-rendezvous, trainer start, restore, first iteration), the restore's vote (``agree``) and
  placement + restore (``try_restore``), and the hierarchy collectives each restarted rank ran;
* holder RSS (the peak over the job's holders, sampled every 0.25 s) and its shared-memory part;
* the growth of each over N: power law and log fits (shardsafe.tor.growth), the better one shown.

This host has few cores for N processes: above that, every hop of a collective waits for a process to be
scheduled, so the figures are process switches, not a network's latency. Compare the designs by their ratio in
the same run, and read the growth with that in mind. ``--simulate SIZES`` adds the message pattern of the
same algorithms at those sizes (bench/control_plane_sim.py): rounds and messages per vote, per restart the
collectives, pairs of ranks that connect (gloo connections) and the store operations those need (measured per
member and per pair on real gloo groups), against gloo's ring. ``--json`` prints one object as the last line
(``shardsafe tor project --from-bench FILE`` reads it).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [p for p in (ROOT, HERE) if p not in sys.path]

import control_plane_sim as sim  # noqa: E402
from control_plane_trainer import DESIGNS, design_of  # noqa: E402

SCHEMA = "shardsafe.bench.control_plane/1"
TRAINER = os.path.join(HERE, "control_plane_trainer.py")
# What the fork servers import before the first attempt: the trainer needs torch and shardsafe's runtime only.
PRELOAD = ("torch", "torch.distributed", "shardsafe.runtime", "shardsafe.snapshot.pipeline")
# The per-N series of the JSON (top-level lists, one value per --ranks entry) and the fits made of them.
SERIES = ("vote_tree_s", "vote_ring_s", "vote_tree_last_s", "vote_ring_last_s", "vote_tree_arrival_spread_s",
          "kill_to_next_iteration_s",
          "detect_s", "rendezvous_s", "startup_s", "restore_s", "restore_vote_s", "placement_restore_s",
          "first_rendezvous_s", "holder_rss_mb", "snapshots_per_s", "skipped_snapshots")


def layout(ranks: int, per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node): --per-node per node, at least two nodes (parity needs two failure domains)."""
    nodes = max(2, ranks // per_node) if ranks > 1 else 1
    if ranks % nodes:
        raise SystemExit(f"--ranks {ranks} does not split into {nodes} nodes of {per_node}; pick multiples of "
                         f"--per-node ({per_node})")
    return nodes, ranks // nodes


class HolderRss(threading.Thread):
    """Samples every holder's VmRSS and RssShmem (kB) while the job runs; keeps each holder's peak."""

    def __init__(self, launcher):
        super().__init__(daemon=True)
        self.launcher, self.peak, self.done = launcher, {}, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.25):
            for node, proc in list(getattr(self.launcher, "holders", {}).items()):
                got = {}
                try:
                    with open(f"/proc/{proc.pid}/status") as f:
                        for line in f:
                            k, _, v = line.partition(":")
                            if k in ("VmRSS", "RssShmem"):
                                got[k] = int(v.split()[0])
                except (OSError, ValueError):
                    continue
                if got.get("VmRSS", 0) > self.peak.get(node, {}).get("VmRSS", -1):
                    self.peak[node] = got


def _read_lines(path: str) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass   # a line torn by the kill
    return out


def one_job(a: argparse.Namespace, ranks: int) -> dict:
    from restart_bench import kill_phases
    from shardsafe.runcheck import read_jsonl
    nodes, per = layout(ranks, a.per_node)
    d = tempfile.mkdtemp(prefix=f"control-plane-{ranks}-")
    job = f"cp{os.getpid()}n{ranks}"
    inject = f"kill-rank:{ranks - 1}@{a.kill_at}"
    args = [TRAINER, "--out", d, "--mb", str(a.mb), "--steps", str(a.steps), "--step-s", str(a.step_s),
            "--votes", a.votes]
    t0 = time.time()
    if a.launcher == "elastic":
        from shardsafe.launch.elastic import ElasticConfig, ElasticLauncher
        launcher = ElasticLauncher(ElasticConfig(nodes=nodes, nproc_per_node=per, run_dir=d, job_id=job, max_restarts=1,
                                                 inject=inject, memory_budget_gb=a.budget_gb, preload=PRELOAD,
                                                 timeout_s=a.job_timeout_s, restart=a.restart))
    else:
        from shardsafe.launch import LaunchConfig, LocalLauncher
        launcher = LocalLauncher(LaunchConfig(nodes=nodes, nproc_per_node=per, job_id=job, run_dir=d, max_restarts=1,
                                              inject=inject, memory_budget_gb=a.budget_gb, preload=PRELOAD,
                                              attempt_timeout_s=a.job_timeout_s, restart=a.restart))
        args = [sys.executable] + args
    rss = HolderRss(launcher)
    rss.start()
    try:
        res = launcher.run(args)
    finally:
        rss.done.set()
        rss.join()
    wall = time.time() - t0
    if not res.ok or res.attempts != 2:
        raise SystemExit(f"{ranks} ranks: the job did not finish in 2 attempts ({res}); logs kept in {d}")
    ev = read_jsonl(os.path.join(d, "events.jsonl"))
    lines = [x for r in range(ranks) for x in _read_lines(os.path.join(d, f"bench_rank{r}.jsonl"))]
    row = measure(a, ranks, ev, lines)
    row.update(nodes=nodes, per_node=per, wall_s=wall, **kill_phase_fields(kill_phases(ev)))
    row["first_rendezvous_s"] = (min(e["t"] for e in ev if e["kind"] == "attempt_start" and not e.get("attempt"))
                                 - min(e["t"] for e in ev if e["kind"] == "job_start"))
    peak = max(rss.peak.values(), key=lambda x: x.get("VmRSS", 0), default={})
    row["holder_rss_mb"] = peak.get("VmRSS", 0) / 1024
    row["holder_shmem_mb"] = peak.get("RssShmem", 0) / 1024
    row["trainer_rss_mb"] = max((x.get("rss_mb", 0.0) for x in lines), default=0.0)
    if a.keep:
        row["run_dir"] = d
    else:
        shutil.rmtree(d, ignore_errors=True)
    return row


def kill_phase_fields(ph: dict) -> dict:
    return {"kill_to_next_iteration_s": ph["kill -> next iteration"], "detect_s": ph["detect"],
            "rendezvous_s": ph["rendezvous"], "startup_s": ph["worker start"] + ph["to the first step"],
            "restore_s": ph["restore"], "kill_phases": ph}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def measure(a: argparse.Namespace, ranks: int, ev: list[dict], lines: list[dict]) -> dict:
    """Votes, snapshots and the restart's own figures of one job (kill phases apart)."""
    starts = {(x["attempt"], x["rank"]): x for x in lines if "start_collectives" in x}
    restored = min(x["restored_version"] for (att, _), x in starts.items() if att == 1)
    # Versions each attempt owns: attempt 0 up to the last one the killed rank finished and reported (the kill
    # lands at step K, before which K-1 was submitted and may be cut short), attempt 1 from the restored one on.
    owned = {0: range(1, a.kill_at - 1), 1: range(restored + 1, a.steps + 1)}
    timed = {0: range(1 + a.warmup, a.kill_at - 1), 1: range(restored + 1 + a.warmup, a.steps + 1)}
    snaps: dict[tuple, dict] = {}
    for e in ev:
        if e["kind"] == "snapshot":
            snaps[(int(e.get("attempt") or 0), e["version"], e["rank"])] = e
    votes = {dsg: [] for dsg in DESIGNS}
    last = {dsg: [] for dsg in DESIGNS}
    spread = {dsg: [] for dsg in DESIGNS}
    for att, vs in timed.items():
        for v in vs:
            got = [snaps[(att, v, r)]["vote_s"] for r in range(ranks) if (att, v, r) in snaps]
            if got:
                votes[design_of(v, a.votes)].extend(got)
                last[design_of(v, a.votes)].append(min(got))
                # A vote ends on every rank at about the same moment: the spread of vote_s is how far apart the
                # ranks arrived (each after its own copy, checksums and parity exchange).
                spread[design_of(v, a.votes)].append(max(got) - min(got))
    skipped_ev = {(int(e.get("attempt") or 0), e["version"]) for e in ev if e["kind"] == "snapshot_skipped"}
    skipped = sorted({(att, v) for att, vs in owned.items() for v in vs
                      if (att, v) in skipped_ev or not all(snaps.get((att, v, r), {}).get("committed")
                                                           for r in range(ranks))})
    waits = [x["wait"] for x in lines if "wait" in x]
    # Throughput: committed versions per second over attempt 1's timed versions, on the last rank's clock.
    it = {}
    for e in ev:
        if e["kind"] == "iteration" and int(e.get("attempt") or 0) == 1:
            it[e["iteration"]] = max(it.get(e["iteration"], 0.0), e["t"])
    v0, v1 = timed[1].start - 1, a.steps
    span = it.get(v1, 0.0) - it.get(v0, 0.0) if v0 in it and v1 in it else 0.0
    done = sum(1 for v in range(v0 + 1, v1 + 1) if (1, v) not in set(skipped))
    rend = [e for e in ev if e["kind"] == "restore_end" and int(e.get("attempt") or 0) == 1]
    a1 = [x for (att, _), x in starts.items() if att == 1]
    # The restarted trainers' start, from the last rank's wall-clock marks (each step waits for every rank):
    # forked and imported, connected to the job's store (init_process_group), shardsafe's runtime built (holder,
    # places gather, parity groups), placement and restore done.
    t_att = min(e["t"] for e in ev if e["kind"] == "attempt_start" and int(e.get("attempt") or 0) == 1)
    prev, start_phases = t_att, {}
    for key, name in (("imported", "trainers forked"), ("process_group", "init_process_group (store connect)"),
                      ("runtime", "shardsafe runtime set-up"), ("restored", "placement + restore")):
        t = max(x["marks"][key] for x in a1)
        start_phases[name], prev = t - prev, t
    row = {"ranks": ranks,
           "samples": {dsg: len(v) for dsg, v in votes.items()},
           "skipped_snapshots": len(skipped), "skipped_versions": [list(x) for x in skipped],
           "waits": {dsg: sum(1 for w in waits if w[1] == dsg) for dsg in DESIGNS},
           "wait_s_median": {dsg: _median([w[2] for w in waits if w[1] == dsg]) for dsg in DESIGNS},
           "snapshots_per_s": done / span if span > 0 else None, "step_wall_s": span / (v1 - v0) if span > 0 else None,
           "restore_end_s": max((e["seconds"] for e in rend), default=None),
           "restore_vote_s": max(((e.get("phases") or {}).get("agree", 0.0) for e in rend), default=None),
           "restore_tier": sorted({e.get("tier") for e in rend}),
           # what each rank restored (a rank kill leaves every copy in the holders: memory, nothing rebuilt)
           "restore_by_rank": {e["rank"]: {k: e.get(k) for k in ("tier", "version", "lost_ranks", "repaired_ranks")}
                               for e in rend},
           "placement_restore_s": max(x["try_restore_s"] for x in a1),
           "runtime_init_s": max(x["runtime_s"] for x in a1), "start_phases": start_phases,
           # survivors of a restart in place (shardsafe.inplace.timings): letting go of the abandoned attempt, and
           # the new default group; the slowest rank's
           "let_go_s": max((x.get("in_place", {}).get("let_go_s", 0.0) for x in a1), default=None),
           "reinit_s": max((x.get("in_place", {}).get("init_s", 0.0) for x in a1), default=None),
           "let_go_parts_s": {k: max((x.get("in_place", {}).get(f"{k}_s", 0.0) for x in a1), default=None)
                              for k in ("abandon", "destroy", "forget", "collect")},
           "start_collectives": min(a1, key=lambda x: x["rank"])["start_collectives"]}
    for dsg in DESIGNS:
        row[f"vote_{dsg}_s"] = _median(votes[dsg])
        row[f"vote_{dsg}_last_s"] = _median(last[dsg])
        row[f"vote_{dsg}_arrival_spread_s"] = _median(spread[dsg])
    return row


def fits_of(rows: list[dict]) -> dict:
    from shardsafe.tor.growth import fit
    out = {}
    for key in SERIES:
        pts = [(r["ranks"], r.get(key)) for r in rows if isinstance(r.get(key), (int, float))]
        if len({n for n, _ in pts}) >= 2:
            out[key] = fit([n for n, _ in pts], [y for _, y in pts]).as_dict()
    return out


def machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    import torch
    return {"cpus": os.cpu_count(), "cpu": model, "python": platform.python_version(), "torch": torch.__version__,
            "load_average_start": os.getloadavg()[0]}


def targets(out: dict) -> dict:
    """The issue's targets, each with what was measured (None where this run did not measure it)."""
    t: dict = {}
    rows = {r["ranks"]: r for r in out.get("rows", [])}
    big, small = (max(rows), min(rows)) if rows else (None, None)
    if big is not None:
        r = rows[big]
        ratio = (r["vote_ring_s"] / r["vote_tree_s"]) if r.get("vote_ring_s") and r.get("vote_tree_s") else None
        last = (r["vote_ring_last_s"] / r["vote_tree_last_s"]) if r.get("vote_ring_last_s") and \
            r.get("vote_tree_last_s") else None
        t["vote_3x_faster_than_ring"] = {"ranks": big, "ratio": ratio, "met": ratio is not None and ratio >= 3,
                                         "ratio_last_in": last, "met_last_in": last is not None and last >= 3}
        t["no_skipped_snapshots"] = {"ranks": big, "skipped": r["skipped_snapshots"], "waits_for_tree_vote":
                                     r["waits"]["tree"], "met": r["skipped_snapshots"] == 0}
        if small != big:
            k = r["kill_to_next_iteration_s"] / rows[small]["kill_to_next_iteration_s"]

            def parts(x: dict) -> dict:   # torch's parts of the restart apart from shardsafe's own
                sp = x["start_phases"]
                return {"re-rendezvous": x["rendezvous_s"], "store connect": sp["init_process_group (store connect)"],
                        "shardsafe set-up + placement + restore": sp["shardsafe runtime set-up"]
                        + sp["placement + restore"]}
            t["kill_to_next_within_2x"] = {"ranks": [small, big], "ratio": k, "met": k <= 2.0,
                                           "parts": [parts(rows[small]), parts(r)]}
    if out.get("simulated_ranks"):
        rr = out["simulation"]["rows"]
        t["rounds_within_bound"] = {"ranks": out["simulated_ranks"], "rounds": out["rounds_per_vote"],
                                    "bound": [x["rounds_bound"] for x in rr], "met": all(x["within_bound"] for x in rr)}
    return t


def simulation(a: argparse.Namespace, rows: list[dict]) -> dict:
    recorded = [tuple(x) for x in rows[-1]["start_collectives"]] if rows else list(sim.DEFAULT_RESTART)
    store = sim.store_costs()
    s = sim.simulate_sizes(a.simulate, a.sim_per_node, recorded, store)
    s["restart_sequence_from"] = f"rank 0's restart at {rows[-1]['ranks']} ranks" if rows else "DEFAULT_RESTART"
    if rows and [k for k, _, _ in recorded] != [k for k, _, _ in sim.DEFAULT_RESTART]:
        s["note"] = "the restart ran another sequence of collectives than DEFAULT_RESTART: update it"
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="4,16,64", help="rank counts of the real runs ('' for none)")
    p.add_argument("--per-node", type=int, default=4, help="ranks per simulated node (at least two nodes)")
    p.add_argument("--mb", type=float, default=2.0, help="MB of synthetic state per rank")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=16, help="rank N-1 is SIGKILLed at the start of this step")
    p.add_argument("--step-s", type=float, default=1.0,
                   help="seconds per step standing in for the accelerator (long enough that 64 ranks' snapshot work "
                        "leaves this host's 2 cores some room)")
    p.add_argument("--warmup", type=int, default=4, help="versions per attempt left out of the vote medians")
    p.add_argument("--votes", choices=("alternate", *DESIGNS), default="alternate")
    p.add_argument("--launcher", choices=("elastic", "local"), default="elastic",
                   help="elastic: shardsafe launch's launcher (torchrun agents); local: the local launcher")
    p.add_argument("--restart", choices=("full", "in-place"), default="full",
                   help="full (default): the kill restarts every trainer; in-place: only the killed rank starts "
                        "again, the others continue in their processes (shardsafe.inplace; the elastic launcher "
                        "only)")
    p.add_argument("--budget-gb", type=float, default=0.5, help="each holder's memory budget")
    p.add_argument("--job-timeout-s", type=float, default=900.0)
    p.add_argument("--simulate", default="", help="simulated rank counts, e.g. 1024,16384")
    p.add_argument("--sim-per-node", type=int, default=8, help="ranks per node in the simulation (GPUs per node)")
    p.add_argument("--keep", action="store_true", help="keep each job's run directory")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    a = p.parse_args(argv)
    ranks = [int(x) for x in a.ranks.split(",") if x.strip()]
    a.simulate = [int(x) for x in a.simulate.split(",") if x.strip()]
    if ranks and not 2 + a.warmup < a.kill_at < a.steps - a.warmup - 1:
        raise SystemExit(f"--kill-at {a.kill_at}: expected between {3 + a.warmup} and {a.steps - a.warmup - 2} "
                         "so that both attempts have versions past --warmup")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out: dict = {"schema": SCHEMA, "machine": machine(), "launcher": a.launcher, "restart": a.restart, "ranks": ranks,
                 "settings": {k: getattr(a, k) for k in ("per_node", "mb", "steps", "kill_at", "step_s", "warmup",
                                                        "votes", "budget_gb")}}
    rows = []
    for n in ranks:
        rows.append(one_job(a, n))
        r = rows[-1]
        print(f"{n} ranks: vote tree {_ms(r['vote_tree_s'])} ring {_ms(r['vote_ring_s'])}, kill -> next "
              f"iteration {r['kill_to_next_iteration_s']:.2f} s, skipped {r['skipped_snapshots']}, job "
              f"{r['wall_s']:.0f} s", file=sys.stderr, flush=True)
    out["machine"]["load_average_end"] = os.getloadavg()[0]
    out["rows"] = rows
    for key in SERIES:
        out[key] = [r.get(key) for r in rows]
    out["fits"] = fits_of(rows)
    if a.simulate:
        s = simulation(a, rows)
        out["simulation"] = s
        out["simulated_ranks"] = [x["ranks"] for x in s["rows"]]
        out["rounds_per_vote"] = [x["vote"]["rounds"] for x in s["rows"]]
        out["messages_per_vote"] = [x["vote"]["messages"] for x in s["rows"]]
        out["rounds_bound"] = [x["rounds_bound"] for x in s["rows"]]
    out["targets"] = targets(out)
    from control_plane_report import report_text
    print(report_text(out), end="")
    if a.json:
        print(json.dumps(out))
    return 0


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


if __name__ == "__main__":
    sys.exit(main())
