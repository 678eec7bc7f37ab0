"""The sbatch scripts on a real SLURM cluster: 4 slurmd "nodes" on this host (scripts/slurm/local_cluster.sh).

One job of 3 nodes (2 active + 1 spare) trains the tiny DeepSpeed GPT under torch elastic:
  attempt 0: rank 1 SIGKILLed at step 4 -> torch elastic restarts the group inside the allocation;
             the holders keep their memory (restore from memory, no holder restarted);
  attempt 1: node2 set DOWN with scontrol at step 8 -> the job keeps running (--no-kill), node2 leaves
             the allocation, the spare node3 joins torch elastic's next round, rank 1 is rebuilt there
             from parity;
  attempt 2: finishes; every rank leaves a completion marker; the TOR report is produced.
The final losses and rank states must equal an uninterrupted run's, bit for bit. The cluster is
torn down afterwards, also when the test fails, and nothing of it may keep running.

A second job loses every node's memory at once (beyond what parity covers) twice: it is requeued with
`scontrol requeue`, then, after the requeued allocation is lost as well, submitted again with `sbatch`.
Each new allocation has empty holders and a new job id, and resumes from the persistent tier, which is
keyed by the run name (SS_RUN_NAME) that a requeue and a resubmission keep.

A third job has no spare: it loses a node and continues on the two left at a smaller data-parallel size
(SS_SHRINK_AFTER_S), with a stand-in trainer that records where each rank ran.
"""
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from shardsafe.launch import PRELOAD_DEEPSPEED
from shardsafe.persist import PersistentStore
from shardsafe.runcheck import compare_runs, read_jsonl

from ..fault.helpers import run_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "scripts", "slurm", "local_cluster.sh")
SBATCH = os.path.join(ROOT, "scripts", "slurm", "pretrain_deepspeed.sbatch")
STEPS = 12
pytestmark = pytest.mark.slow


def _free_port_block(n: int) -> int:
    """A base port with base..base+n free on loopback (slurmctld + one slurmd per node)."""
    for base in range(17100 + (os.getpid() % 200) * 10, 30000, 10):
        try:
            socks = []
            for p in range(base, base + n + 1):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block for the local SLURM cluster")


def submit(env: dict, tmp_path, run_dir):
    """sbatch the script on 3 nodes; returns the job id and ``diag()``: the job's output and the end of every agent
    log, for an assertion's message."""
    out_file = tmp_path / "job.out"
    sub = subprocess.run(["sbatch", "--parsable", "-N3", f"--output={out_file}", SBATCH], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr

    def diag() -> str:
        logs = ""
        for f in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").exists() else []:
            logs += f"\n==== {f.name}\n" + f.read_text(errors="replace")[-1500:]
        return (out_file.read_text(errors="replace") if out_file.exists() else "(no job output)") + logs

    return sub.stdout.strip().split(";")[0], diag


def _ours(env_marker: str, conf: str) -> list[int]:
    """PIDs of processes of this cluster (daemons carry SLURM_CI_TAG, job processes its SLURM_CONF)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        if env_marker.encode() in env or (f"SLURM_CONF={conf}".encode() in env
                                          and any(e.startswith(b"SLURM_JOB_ID=") for e in env)):
            out.append(int(d))
    return out


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster runs its daemons as root (SlurmUser=root); run as root or in CI")
    tools = ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "munged")
    if not all(shutil.which(t) for t in tools) and shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and apt-get is not available to install it "
                    "(slurmctld slurmd slurm-client munge)")
    # munged wants every parent of its socket world-executable: not pytest's private tmp dirs
    base = tempfile.mkdtemp(prefix="shardsafe-slurm-", dir="/tmp")
    os.chmod(base, 0o755)
    d = os.path.join(base, "c")
    env = {**os.environ, "SLURM_CI_DIR": d, "SLURM_CI_NODES": "4", "SLURM_CI_PORT": str(_free_port_block(4))}
    up = subprocess.run(["bash", CLUSTER, "up"], env=env, capture_output=True, text=True, timeout=900)
    env["SLURM_CONF"] = f"{d}/etc/slurm.conf"
    try:
        assert up.returncode == 0, f"local cluster did not come up:\n{up.stderr[-3000:]}"
        yield env
    finally:
        down = subprocess.run(["bash", CLUSTER, "down"], env=env, capture_output=True, text=True, timeout=180)
        left = _ours(f"SLURM_CI_TAG={d}", env["SLURM_CONF"])
        shutil.rmtree(base, ignore_errors=True)
        assert down.returncode == 0 and not left and not os.path.exists(d), \
            f"teardown left processes {left} / dir {os.path.exists(d)}:\n{down.stderr[-2000:]}"


def scontrol_job(env, jid) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", jid], env=env, capture_output=True, text=True,
                         timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _ts(s: str) -> float:
    return time.mktime(time.strptime(s, "%Y-%m-%dT%H:%M:%S"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted, unprotected run both jobs are compared with (local launcher, no shardsafe)."""
    ref = tmp_path_factory.mktemp("reference")
    res = run_job(ref, stage=2, dtype="bf16", steps=STEPS, shardsafe=False, max_restarts=0, nodes=2, nproc=1)
    assert res.ok
    return ref


@pytest.fixture
def holder_dir():
    """Short: a holder's socket path (HOLDER_DIR/shardsafe-UID/JOB_ID/NODE.sock) must fit AF_UNIX's 108 bytes."""
    d = tempfile.mkdtemp(prefix="ss-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_sbatch_rank_kill_and_node_loss_continue_in_the_allocation(cluster, tmp_path, reference, holder_dir):
    run_dir, holders = tmp_path / "run", holder_dir
    env = {**cluster, "SS_PYTHON": sys.executable, "SS_RUN_DIR": str(run_dir), "SS_HOLDER_DIR": str(holders),
           "SS_MEMORY_BUDGET_GB": "0.5", "SS_KEEP_ALIVE_S": "2", "SS_HANG_TIMEOUT": "120", "SS_GRACE": "2",
           # --step-sleep keeps steps 8..12 running long enough for SLURM to act on the node downed after
           # step 8: without it a quiet machine finished the job before the node failure reached it.
           # The last version (and only it) is flushed to disk at 0.5 MB/s: about 11 s, longer than the
           # cluster's KillWait, so only a graceful holder stop gets it there.
           "SS_SCRIPT_ARGS": f"--steps {STEPS} --zero-stage 2 --dtype bf16 --running-tor-every 2 --step-sleep 1.5 --step-sleep-after 7 "
                             "--shardsafe-json " + json.dumps({"persist_dir": str(tmp_path / "persist"),
                                                               "persist_every": STEPS, "persist_mbps": 0.5},
                                                              separators=(",", ":")),
           "SS_INJECT": "kill-rank:1@4", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           # workers forked from a fork server per node (shardsafe.launch.prewarm); the reference below starts cold
           "SS_PRELOAD": ",".join(PRELOAD_DEEPSPEED)}
    jid, diag = submit(env, tmp_path, run_dir)

    events = run_dir / "events.jsonl"
    downed, deadline, info = False, time.time() + 600, {}
    while time.time() < deadline:
        info = scontrol_job(env, jid)
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        if not downed and any(e.get("kind") == "iteration" and e.get("attempt") == 1 and e.get("iteration", 0) >= 8
                              for e in read_jsonl(str(events))):
            r = subprocess.run(["scontrol", "update", "nodename=node2", "state=down", "reason=shardsafe-test"],
                               env=env, capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            downed = True
        time.sleep(0.3)
    else:
        subprocess.run(["scancel", jid], env=env, timeout=30)
        pytest.fail(f"job {jid} did not finish in 600 s:\n{diag()}")
    assert downed, f"attempt 1 never reached step 8:\n{diag()}"
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", f"{info}\n{diag()}"

    agents = "".join(f.read_text(errors="replace") for f in (run_dir / "logs").glob("agent_*.log"))
    assert "workers are forked from the fork server" in agents and "start cold" not in agents, diag()
    # every rank finished, and the job recorded its allocation (requeue-safe)
    assert sorted(os.listdir(run_dir / "markers")) == ["rank0.done", "rank1.done"]
    assert "restart_count=0" in (run_dir / "slurm_allocations.log").read_text()
    evs = read_jsonl(str(events))
    kinds = [e["kind"] for e in evs]
    assert kinds.count("job_start") == 1 and kinds.count("job_end") == 1
    assert next(e for e in evs if e["kind"] == "job_start")["slurm_restart_count"] == 0
    fails = [(e["cause"], e.get("rank"), e.get("node")) for e in evs if e["kind"] == "failure_detected"]
    assert fails == [("rank_exit", 1, "node2"), ("node_loss", None, "node2")], f"{fails}\n{diag()}"
    # the rank kill restarted inside the allocation with every holder intact: one holder per node for the
    # whole job, and attempt 1 restored from holder memory
    assert sorted(e["node"] for e in evs if e["kind"] == "holder_start") == ["node1", "node2", "node3"]
    # at the end the surviving holders stopped gracefully (their SIGTERM handler ran, so queued flushes
    # were written), not SIGKILLed through their srun
    assert sorted(e["node"] for e in evs if e["kind"] == "holder_stop") == ["node1", "node3"], diag()
    flushed = [(e["rank"], e["version"], e["ok"]) for e in evs if e["kind"] == "flush"]
    assert sorted(flushed) == [(0, STEPS, True), (1, STEPS, True)], f"{flushed}\n{diag()}"
    (job_dir,) = (tmp_path / "persist").iterdir()
    assert job_dir.name == "run"   # the run name: SS_RUN_DIR's last component
    assert sorted(os.listdir(job_dir / f"v{STEPS:012d}")) == [f"rank{r:06d}.{x}" for r in (0, 1) for x in ("bin", "json")]
    tiers = {}
    for e in evs:
        if e["kind"] == "restore_end":
            tiers.setdefault(e["attempt"], set()).add((e["tier"], e["version"]))
    assert tiers[1] in ({("memory", 3)}, {("memory", 2)}), tiers   # newest version sealed before step 4
    assert {t for t, _ in tiers[2]} == {"parity"}, tiers
    # after the node loss, rank 1 ran on the spare
    placed = {e["rank"]: e["node"] for e in evs if e["kind"] == "trainer_start" and e["attempt"] == 2}
    assert placed == {0: "node1", 1: "node3"}, placed

    # TOR: the report works on the run and accounts for the job's wall time
    rep = subprocess.run([sys.executable, "-m", "shardsafe.tor", "report", str(run_dir), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert rep.returncode == 0, rep.stderr
    r = json.loads(rep.stdout)
    assert math.isclose(sum(r["breakdown"].values()), r["t_obs"] - r["t_opt"], abs_tol=1e-5)
    assert len(r["failures"]) == 2 and r["tor"] > 0
    wall = _ts(info["EndTime"]) - _ts(info["StartTime"])   # SLURM's own record, 1 s resolution
    assert abs(r["t_obs"] - wall) <= 3.0 + 0.02 * wall, (r["t_obs"], wall)
    assert (run_dir / "tor_report.txt").read_text().startswith("TOR report:")

    # bit for bit the same as an uninterrupted run of the same job (local launcher, no shardsafe)
    cmp = compare_runs(str(run_dir), str(reference), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches, cmp.state_mismatches)


RUN = "gpt-tiny"   # the run's directory name, so the run name the sbatch scripts derive from it


def _job_processes(jid: str) -> list[tuple[int, str]]:
    """(pid, what) of SLURM job ``jid``'s agents, trainers and holders on every node (python processes only:
    not the batch script, the controller or srun)."""
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if f"SLURM_JOB_ID={jid}".encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if not os.path.basename(cmd[0]).startswith(b"python"):
            continue
        if b"shardsafe.launch" in cmd and b"agent" in cmd:
            out.append((int(d), "agent"))
        elif b"shardsafe.cli" in cmd and b"holder" in cmd:
            out.append((int(d), "holder"))
        elif any(a.endswith(b"ds_pretrain_gpt.py") for a in cmd):
            out.append((int(d), "trainer"))
    return out


def _lose_every_node(jid: str) -> list[str]:
    """SIGKILL every agent (first: torch elastic must not restart anything), trainer and holder of the job on all of
    its nodes: all memory and parity is gone, as when every node of the job fails at once."""
    procs = sorted(_job_processes(jid), key=lambda p: p[1] != "agent")
    for pid, _ in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return sorted({w for _, w in procs})


_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _wait(what: str, cond, diag, timeout: float = 300.0, ended=lambda: False) -> None:
    """Poll ``cond`` until it holds; fail after ``timeout`` or as soon as ``ended()`` says the job is over."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        if ended():
            pytest.fail(f"the job ended before {what}:\n{diag()}")
        time.sleep(0.3)
    pytest.fail(f"{what} did not happen within {timeout:.0f} s:\n{diag()}")


def test_sbatch_requeue_and_resubmission_resume_from_the_persistent_tier(cluster, tmp_path, reference, holder_dir):
    """Allocation 0 flushes every 2nd version to persist_dir and loses every node's memory at once; `scontrol
    requeue` starts allocation 1 (SLURM_RESTART_COUNT=1, job id JID.1, empty holders), which must restore the
    newest version complete on disk, continue, and flush newer ones; it is lost the same way and cancelled; a fresh
    `sbatch` of the same script (a new SLURM job id) must restore the newest version again and finish. Each
    restore is from the persistent tier, continues at its version + 1, and the run ends bit for bit as an
    uninterrupted one."""
    run_dir, persist = tmp_path / RUN, tmp_path / "persist"
    store = PersistentStore(str(persist), RUN)
    env = {**cluster, "SS_PYTHON": sys.executable, "SS_RUN_DIR": str(run_dir), "SS_HOLDER_DIR": holder_dir,
           "SS_SPARES": "0", "SS_MEMORY_BUDGET_GB": "0.5", "SS_KEEP_ALIVE_S": "2", "SS_HANG_TIMEOUT": "120",
           "SS_GRACE": "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           # a second per step from step 3 on: the losses below land mid-run, between flushes
           "SS_SCRIPT_ARGS": f"--steps {STEPS} --zero-stage 2 --dtype bf16 --running-tor-every 0 --step-sleep 1 "
                             "--step-sleep-after 2 --shardsafe-json " + json.dumps(
                                 {"persist_dir": str(persist), "persist_every": 2}, separators=(",", ":"))}
    outs = []

    def submit() -> str:
        outs.append(tmp_path / f"job{len(outs)}.out")
        sub = subprocess.run(["sbatch", "--parsable", "-N2", f"--output={outs[-1]}", SBATCH], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert sub.returncode == 0, sub.stderr
        return sub.stdout.strip().split(";")[0]

    def diag() -> str:
        txt = "".join(f"\n==== {o.name}\n" + o.read_text(errors="replace")[-2000:] for o in outs if o.exists())
        for f in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").exists() else []:
            txt += f"\n==== {f.name}\n" + f.read_text(errors="replace")[-1500:]
        return txt + f"\npersistent tier: {sorted(os.listdir(persist)) if persist.exists() else []}, " \
                     f"versions of {RUN}: {store.versions()}"

    def newest_on_disk() -> int:
        return max(store.complete_versions(2), default=-1)

    def gone(jid: str) -> bool:
        return not _job_processes(jid)

    def ended(jid: str):
        return lambda: scontrol_job(env, jid).get("JobState") in _ENDED

    jid = submit()
    try:
        _wait(f"a version >= 4 complete in {store.dir}", lambda: newest_on_disk() >= 4, diag, ended=ended(jid))
        assert _lose_every_node(jid) == ["agent", "holder", "trainer"], diag()
        r = subprocess.run(["scontrol", "requeue", jid], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        _wait("the requeued allocation", lambda: scontrol_job(env, jid).get("Restarts") == "1" and
              scontrol_job(env, jid).get("JobState") == "RUNNING", diag)
        v1 = newest_on_disk()   # allocation 0 is gone (its processes were SIGKILLed before the requeue)
        _wait("allocation 1 flushing a newer version", lambda: newest_on_disk() >= v1 + 2, diag, ended=ended(jid))
        assert _lose_every_node(jid) == ["agent", "holder", "trainer"], diag()
        subprocess.run(["scancel", jid], env=env, timeout=30)
        _wait(f"job {jid} to end", lambda: scontrol_job(env, jid).get("JobState") in ("CANCELLED", "FAILED")
              and gone(jid), diag, timeout=120)
        v2 = newest_on_disk()
        jid2 = submit()
        _wait(f"job {jid2} to end", ended(jid2), diag, timeout=400)
    finally:
        for j in [jid] + ([jid2] if "jid2" in locals() else []):
            if scontrol_job(env, j).get("JobState") in ("RUNNING", "PENDING", "REQUEUED", "CONFIGURING"):
                subprocess.run(["scancel", j], env=env, timeout=30)
    info = scontrol_job(env, jid2)
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", f"{info}\n{diag()}"
    assert 4 <= v1 < v2 < STEPS, (v1, v2)

    # three allocations of one run: one run name, three job ids (memory scoped per allocation)
    allocs = (run_dir / "slurm_allocations.log").read_text().splitlines()
    assert [re.search(r"job=(\S+) restart_count=(\d) run_name=(\S+)", a).groups() for a in allocs] == \
        [(jid, "0", RUN), (jid, "1", RUN), (jid2, "0", RUN)], allocs
    assert os.listdir(persist) == [RUN]
    evs = read_jsonl(str(run_dir / "events.jsonl"))
    tiers: dict[int, set] = {}
    for e in evs:
        if e["kind"] == "restore_end":
            tiers.setdefault(e["attempt"], set()).add((e["rank"], e["tier"], e["version"]))
    # allocation 0 started fresh; each later allocation restored the newest version on disk, from disk, on every rank
    assert [tiers[a] for a in sorted(tiers)] == [{(r, t, v) for r in (0, 1)} for t, v in (
        ("none", -1), ("persistent", v1), ("persistent", v2))], (tiers, v1, v2, diag())
    # and continued from it (first step = version + 1 on every rank), bit for bit as the uninterrupted run
    cmp = compare_runs(str(run_dir), str(reference), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches, cmp.state_mismatches)
    print(f"run {RUN}: job {jid} requeued and restored version {v1} from disk; job {jid2} restored {v2}")


def test_megatron_sbatch_dry_run_shows_the_steps(cluster, tmp_path):
    """pretrain_megatron.sbatch shares common.sh; SS_DRY_RUN=1 prints what it would start, per node."""
    out_file = tmp_path / "job.out"
    env = {**cluster, "SS_PYTHON": sys.executable, "SS_RUN_DIR": str(tmp_path / "run"), "SS_DRY_RUN": "1",
           "SS_SPARES": "1"}
    sub = subprocess.run(["sbatch", "--parsable", "-N3", f"--output={out_file}",
                          os.path.join(ROOT, "scripts", "slurm", "pretrain_megatron.sbatch")],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    jid, deadline = sub.stdout.strip().split(";")[0], time.time() + 120
    while time.time() < deadline and scontrol_job(env, jid).get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED"):
        time.sleep(0.3)
    out = out_file.read_text()
    assert scontrol_job(env, jid).get("JobState") == "COMPLETED", out
    holders = re.findall(r"DRY-RUN: srun --overlap --no-kill -N1 -n1 -w (node\d) .*shardsafe.cli holder", out)
    agents = re.findall(r"DRY-RUN: srun --overlap --no-kill -N1 -n1 -w (node\d) .*shardsafe.launch agent .*"
                        r"--nnodes 2:2 --nproc-per-node 2 .*megatron_lm_pretrain_gpt.py @\S+megatron_lm_tiny_gpt.args "
                        r"--shardsafe", out)
    assert sorted(holders) == ["node1", "node2", "node3"] and sorted(agents) == ["node1", "node2"], out
    ctl = (tmp_path / "run" / "logs" / "controller.log").read_text()
    assert "DRY-RUN:" in ctl and "shardsafe.launch control serve" in ctl and "--world-size 4" in ctl, ctl


def test_sbatch_continues_on_the_nodes_left_when_no_spare_is_left(cluster, tmp_path, holder_dir):
    """3 active nodes, no spare: the last is set DOWN during attempt 0; after SS_SHRINK_AFTER_S the script stops the
    agents and starts new ones on the first two in a rendezvous of 2 nodes at data-parallel size 2 (the global
    batch of 6 samples keeps with accumulation 3). The stand-in trainer (tests/fault/_size_trainer.py) records
    each rank's placement; the DeepSpeed restore at the new size is the trainer side's test."""
    run_dir = tmp_path / "run"
    trainer = os.path.join(ROOT, "tests", "fault", "_size_trainer.py")
    env = {**cluster, "SS_PYTHON": sys.executable, "SS_RUN_DIR": str(run_dir), "SS_HOLDER_DIR": str(holder_dir),
           "SS_MEMORY_BUDGET_GB": "0.05", "SS_KEEP_ALIVE_S": "2", "SS_GRACE": "1", "SS_SPARES": "0",
           "SS_SHRINK_AFTER_S": "2", "SS_GLOBAL_BATCH": "6", "SS_MICRO_BATCH": "1", "SS_SCRIPT": trainer,
           "SS_SCRIPT_ARGS": "--steps 12 --step-s 0.5 --interval 2 --barrier", "OMP_NUM_THREADS": "1"}
    jid, diag = submit(env, tmp_path, run_dir)

    downed, deadline, info, nodes = "", time.time() + 300, {}, []
    while time.time() < deadline:
        info = scontrol_job(env, jid)
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        if not downed and any(e.get("kind") == "iteration" and e.get("attempt") == 0 and e.get("iteration", 0) >= 3
                              for e in read_jsonl(str(run_dir / "events.jsonl"))):
            # the allocation's last node (the first is the batch host, which runs the controller)
            nodes = subprocess.run(["scontrol", "show", "hostnames", info["NodeList"]], env=env, capture_output=True,
                                   text=True, timeout=30).stdout.split()
            downed = nodes[-1]
            r = subprocess.run(["scontrol", "update", f"nodename={downed}", "state=down", "reason=shardsafe-test"],
                               env=env, capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
        time.sleep(0.3)
    else:
        subprocess.run(["scancel", jid], env=env, timeout=30)
        pytest.fail(f"job {jid} did not finish in 300 s:\n{diag()}")
    if downed:
        subprocess.run(["scontrol", "update", f"nodename={downed}", "state=resume"], env=env, capture_output=True,
                       timeout=30)
    assert downed and info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", f"{info}\n{diag()}"
    evs = read_jsonl(str(run_dir / "events.jsonl"))
    (shrink,) = [e for e in evs if e["kind"] in ("shrink", "grow")]
    assert (shrink["kind"], shrink["from_dp"], shrink["to_dp"], shrink["nodes"]) == ("shrink", 3, 2, nodes[:2])
    assert [e["cause"] for e in evs if e["kind"] == "failure_detected"] == ["node_loss"], diag()
    placed = {}
    for line in open(run_dir / "placement.jsonl"):
        r = json.loads(line)
        placed.setdefault(r["attempt"], []).append((r["rank"], r["node"], r["world"], r["full_world"]))
    last = placed[max(placed)]
    assert sorted(n for _, n, _, _ in last) == nodes[:2], placed
    assert all((w, f) == (2, "3") for _, _, w, f in last), placed
    assert sorted(os.listdir(run_dir / "markers")) == ["rank0.done", "rank1.done"]


def test_sbatch_restarts_a_killed_rank_in_place_bit_exact(cluster, tmp_path, holder_dir):
    """SS_RESTART=in-place, 3 active nodes: rank 1 of examples/ds_pretrain_gpt.py --in-place SIGKILLs itself at step
    4; its node's agent starts it again alone inside the allocation, ranks 0 and 2 rebuild their engines in their
    processes, every rank restores from holder memory, and the run ends bit-exact with an uninterrupted one."""
    run_dir = tmp_path / "run"
    ref = tmp_path / "reference"
    ref.mkdir()
    assert run_job(ref, stage=2, dtype="bf16", steps=STEPS, shardsafe=False, max_restarts=0, nodes=3, nproc=1).ok
    env = {**cluster, "SS_PYTHON": sys.executable, "SS_RUN_DIR": str(run_dir), "SS_HOLDER_DIR": str(holder_dir),
           "SS_MEMORY_BUDGET_GB": "0.5", "SS_KEEP_ALIVE_S": "2", "SS_GRACE": "1", "SS_SPARES": "0",
           "SS_RESTART": "in-place", "SS_SCRIPT_ARGS": f"--steps {STEPS} --zero-stage 2 --dtype bf16 --in-place",
           "SS_INJECT": "kill-rank:1@4", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "SS_PRELOAD": ",".join(PRELOAD_DEEPSPEED)}
    jid, diag = submit(env, tmp_path, run_dir)
    _wait("the job to end", lambda: scontrol_job(env, jid).get("JobState") in
          ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"), diag, timeout=300)
    info = scontrol_job(env, jid)
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", f"{info}\n{diag()}"
    agents = "".join(f.read_text(errors="replace") for f in (run_dir / "logs").glob("agent_*.log"))
    assert "restarting them in place as attempt 1" in agents, diag()
    evs = read_jsonl(str(run_dir / "events.jsonl"))
    assert [(e["cause"], e.get("rank")) for e in evs if e["kind"] == "failure_detected"] == [("rank_exit", 1)], diag()
    # rank 1 alone is a new process; the survivors started once
    starts = sorted((e["attempt"], e["rank"]) for e in evs if e["kind"] == "trainer_start")
    assert starts == [(0, 0), (0, 1), (0, 2), (1, 1)], f"{starts}\n{diag()}"
    tiers = {(e["tier"], e["version"]) for e in evs if e["kind"] == "restore_end" and e["attempt"] == 1}
    assert tiers in ({("memory", 3)}, {("memory", 2)}), tiers   # the newest version sealed before step 4
    assert sorted(os.listdir(run_dir / "markers")) == ["rank0.done", "rank1.done", "rank2.done"]
    cmp = compare_runs(str(run_dir), str(ref), 3, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches, cmp.state_mismatches)
