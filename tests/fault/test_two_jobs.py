"""Two concurrent jobs of one user on one node, started as users start them, never share a holder (issue 15).

Observed before: two plain ``torchrun`` jobs without ``--rdzv-id`` (torchrun then sets the run id to
``none``) both got the job id "local"; the second restored the first one's snapshot at its very first
start, and the first, resubmitted after a kill, restored the second one's final state and exited 0 with
the other job's model. Here, 2 ranks per job:

* plain torchrun twice, no ids (the job id is derived from the launch command; shardsafe.jobid), one job
  (``--standalone``: torchrun draws a new run id per launch) SIGKILLed at step 4 and resubmitted by the same
  torchrun command (torchrun's in-place restart can hang in
  gloo on this CPU machine): both finish bit-exact against their uninterrupted references, the resubmitted
  job restores its own version v and its first step is v + 1 on every rank, the other job starts fresh. The
  killed job is what a user of plain torchrun runs unchanged: examples/ds_plain_gpt.py, which imports nothing
  of shardsafe, protected by its DeepSpeed config's block alone (its trainers start the node's holder
  themselves); the other is the tiny DeepSpeed GPT (ZeRO-2, bf16) with the block passed as an argument;
* ``shardsafe launch`` twice (no --job-id, trainers forked: ``--preload deepspeed``), one with a rank kill, both
  the tiny DeepSpeed GPT: the same checks.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import pytest

from shardsafe.launch import PRELOAD_DEEPSPEED
from shardsafe.launch.elastic import ElasticConfig, ElasticLauncher
from shardsafe.holder.client import HolderClient, HolderUnavailable
from shardsafe.holder.paths import HolderPaths, private_dir
from shardsafe.launch.discovery import free_port
from shardsafe.runcheck import compare_runs, read_jsonl, resume_problems

from .helpers import PLAIN, PLAIN_STEPS, ROOT, SCRIPT, plain_config

STEPS, KILL_AT, WORLD = 8, 4, 2
SEEDS = {"a": 11, "b": 22}
pytestmark = pytest.mark.slow


def job_args(seed, out):
    return [SCRIPT, "--steps", str(STEPS), "--zero-stage", "2", "--dtype", "bf16", "--seed", str(seed),
            "--budget-gb", "0.5", "--running-tor-every", "0", "--out", str(out),
            # both ranks of a plain torchrun job share one node: no parity group is possible there
            "--shardsafe-json", json.dumps({"parity_group_size": 1})]


def restores(run_dir, since=0):
    """rank -> restored version, from the restore_end events after line ``since`` of events.jsonl."""
    evs = read_jsonl(os.path.join(str(run_dir), "events.jsonl"))[since:]
    return {e["rank"]: e["version"] for e in evs if e.get("kind") == "restore_end"}


def lines(path):
    return len(read_jsonl(path))


def job_dirs(holder_dir):
    """The job ids with a directory in shardsafe's private directory inside ``holder_dir``."""
    d = private_dir(holder_dir)
    return sorted(j for j in os.listdir(d) if os.path.isdir(os.path.join(d, j))) if os.path.isdir(d) else []


def stop_job_holders(holder_dir):
    """The holders plain-torchrun trainers start are detached (an idle exit ends them later): stop them now."""
    for job in job_dirs(holder_dir):
        for node in HolderPaths.list_nodes(holder_dir, job):
            try:
                c = HolderClient(HolderPaths(holder_dir, job, node), timeout_s=10).connect()
                c.shutdown()
                c.close()
            except (HolderUnavailable, OSError, RuntimeError):
                pass


@pytest.fixture
def holder_dir():
    # short: DIR/shardsafe-UID/cmd-<16 hex>/NODE.sock must fit AF_UNIX's 108 bytes (pytest's tmp_path is long)
    d = tempfile.mkdtemp(prefix="ss-")
    yield d
    stop_job_holders(d)
    shutil.rmtree(d, ignore_errors=True)


def test_two_plain_torchrun_jobs_without_ids_one_killed_and_resubmitted(tmp_path, reference, plain_reference,
                                                                        holder_dir):
    refs = {"a": plain_reference, "b": reference(2, "bf16", STEPS, extra=("--seed", str(SEEDS["b"])), world=WORLD)}
    steps = {"a": PLAIN_STEPS, "b": STEPS}
    run = {j: tmp_path / j for j in SEEDS}
    for d in run.values():
        d.mkdir()
    # one node: no parity group possible
    args = {"a": [PLAIN, "--config", plain_config(run["a"] / "ds.json", parity_group_size=1), "--steps",
                  str(PLAIN_STEPS), "--out", str(run["a"])],
            "b": job_args(SEEDS["b"], run["b"])}

    def torchrun(j, inject=""):
        # What a user types, the same both times for job a; only the fault injection differs (it is not a
        # setting of the job, and a resubmitted job has no fault to inject).
        # job a as `torchrun --standalone` (a fresh run id per launch), job b with a fixed --master-port
        rdzv = ["--standalone"] if j == "a" else ["--master-port", str(free_port())]
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", str(WORLD), *rdzv,
               *args[j]]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "SHARDSAFE_HOLDER_DIR": holder_dir,
               "SHARDSAFE_RUN_DIR": str(run[j])}
        for v in ("SHARDSAFE_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "SHARDSAFE_NODE", "SHARDSAFE_INJECT",
                  "SHARDSAFE_ATTEMPT", "SHARDSAFE_INSTANCE", "SHARDSAFE_HOLDER_BUDGET_GB"):
            env.pop(v, None)
        if inject:
            env["SHARDSAFE_INJECT"] = inject
        with open(run[j] / "torchrun.log", "ab") as log:
            return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    procs = {"a": torchrun("a", inject=f"kill-rank:1@{KILL_AT}"), "b": torchrun("b")}
    try:
        rc = {j: p.wait(timeout=400) for j, p in procs.items()}
        assert rc["a"] != 0 and rc["b"] == 0, (rc, tail(run["a"]), tail(run["b"]))
        jobs = job_dirs(holder_dir)
        assert len(jobs) == 2 and all(j.startswith("cmd-") for j in jobs), jobs   # two ids, none shared
        # resubmit job a by the same command
        since = lines(run["a"] / "events.jsonl")
        since_loss = {r: lines(run["a"] / f"losses_rank{r}.jsonl") for r in range(WORLD)}
        again = torchrun("a")
        assert again.wait(timeout=400) == 0, tail(run["a"])
    finally:
        for p in list(procs.values()) + [locals().get("again")]:
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert job_dirs(holder_dir) == jobs, "the resubmission derived another job id"

    # job b never saw job a's snapshots: it started fresh on every rank
    assert restores(run["b"]) == {r: -1 for r in range(WORLD)}, restores(run["b"])
    # job a's resubmission restored its own newest version v (sealed before the kill at step KILL_AT)...
    got = restores(run["a"], since)
    v = got.get(0)
    assert set(got) == set(range(WORLD)) and set(got.values()) == {v} and 1 <= v <= KILL_AT, got
    # ...and continued from it: its first step is v + 1 on every rank (no fresh start)
    for r in range(WORLD):
        done = [e["step"] for e in read_jsonl(str(run["a"] / f"losses_rank{r}.jsonl"))[since_loss[r]:]]
        assert done == list(range(v + 1, PLAIN_STEPS + 1)), (r, v, done)
    # a's holder survived the kill and served the resubmission: one holder start in a's run dir
    assert len([e for e in read_jsonl(str(run["a"] / "events.jsonl")) if e.get("kind") == "holder_start"]) == 1
    for j in SEEDS:
        cmp = compare_runs(str(run[j]), str(refs[j]), WORLD, steps[j])
        assert cmp.bit_identical and not cmp.resume_problems, (j, cmp.resume_problems, cmp.loss_mismatches,
                                                               cmp.state_mismatches)
    print(f"plain torchrun: job ids {jobs}; job a restored version {v} after the kill at step {KILL_AT}")


def test_two_shardsafe_launch_jobs_without_ids_one_with_a_rank_kill(tmp_path, reference, holder_dir):
    refs = {j: reference(2, "bf16", STEPS, extra=("--seed", str(s)), world=WORLD) for j, s in SEEDS.items()}
    run = {j: tmp_path / j for j in SEEDS}
    results, launchers = {}, {}
    for j in SEEDS:
        cfg = ElasticConfig(nodes=WORLD, nproc_per_node=1, run_dir=str(run[j]), holder_dir=holder_dir,
                            inject=f"kill-rank:1@{KILL_AT}" if j == "a" else "", memory_budget_gb=0.5,
                            max_restarts=2, timeout_s=400, preload=PRELOAD_DEEPSPEED)
        launchers[j] = ElasticLauncher(cfg)
    threads = [threading.Thread(target=lambda j=j: results.__setitem__(
        j, launchers[j].run(job_args(SEEDS[j], run[j])))) for j in SEEDS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=450)
    ids = {j: launchers[j].cfg.job_id for j in SEEDS}
    assert ids["a"] != ids["b"], ids
    assert results["a"].ok and results["a"].attempts == 2 and results["b"].ok and results["b"].attempts == 1, results
    assert restores(run["b"]) == {r: -1 for r in range(WORLD)}, restores(run["b"])
    evs = read_jsonl(str(run["a"] / "events.jsonl"))
    v = {e["rank"]: e["version"] for e in evs if e.get("kind") == "restore_end" and e.get("attempt") == 1}
    assert set(v) == set(range(WORLD)) and len(set(v.values())) == 1 and 1 <= v[0] <= KILL_AT, v
    assert resume_problems(str(run["a"]), WORLD) == []
    for j in SEEDS:
        cmp = compare_runs(str(run[j]), str(refs[j]), WORLD, STEPS)
        assert cmp.bit_identical, (j, cmp.loss_mismatches, cmp.state_mismatches)
        assert HolderPaths.list_nodes(holder_dir, ids[j]) == [], "the launcher left a holder running"
    print(f"shardsafe launch: job ids {ids}; job a restored version {v[0]}")


def tail(run_dir, n=3000):
    out = ""
    for name in sorted(os.listdir(run_dir)):
        if name.endswith(".log"):
            with open(os.path.join(run_dir, name), errors="replace") as f:
                out += f"--- {name}\n" + f.read()[-n:]
    return out
