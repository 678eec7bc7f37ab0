"""A plain torchrun job that dies whole and is submitted again by the same command resumes (shardsafe.jobid).

torchrun hands its workers nothing a resubmission reproduces: with ``--standalone`` the run id is a fresh UUID
per launch, with ``--rdzv-backend c10d --rdzv-endpoint HOST:PORT`` (no ``--rdzv-id``) the workers' MASTER_PORT a
fresh free port. The job id comes from the command instead (torchrun's own arguments, read from the agent's
command line), so the second launch finds the first one's holder. Here the tiny DeepSpeed GPT (ZeRO-2, bf16,
2 ranks on one node) runs under plain torchrun with the c10d form (test_two_jobs.py resubmits a ``--standalone``
job); once it has logged step KILL_AT the whole job is SIGKILLed --
the agent and each worker (torch elastic starts every worker in its own session), while the holder the
trainers started keeps running (detached) -- and the same command is launched again. It must restore the
newest version, continue at that version + 1 on every rank, and end bit-identical to an uninterrupted run.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from shardsafe.launch.discovery import free_port
from shardsafe.runcheck import compare_runs, read_jsonl

from .helpers import ROOT, SCRIPT
from .test_two_jobs import stop_job_holders, tail

STEPS, KILL_AT, SEED, WORLD = 8, 4, 11, 2   # the reference of test_two_jobs.py's job a: one run per session
pytestmark = pytest.mark.slow


def children(pid):
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
        except (OSError, ValueError, IndexError):
            pass
    return out


def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def kill_job(agent):
    """SIGKILL torchrun's agent and its workers (each worker leads its own process group), as a node's job dies."""
    workers = children(agent.pid)
    os.killpg(agent.pid, signal.SIGKILL)
    for w in workers:
        try:
            os.killpg(w, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait(timeout=30)
    deadline = time.time() + 30
    while not all(gone(w) for w in workers) and time.time() < deadline:
        time.sleep(0.05)
    assert all(gone(w) for w in workers), workers
    return workers


def test_plain_torchrun_job_killed_whole_and_resubmitted_by_the_same_command_resumes(tmp_path, reference):
    ref = reference(2, "bf16", STEPS, extra=("--seed", str(SEED)), world=WORLD)
    holders = tempfile.mkdtemp(prefix="ss-")   # short: the holder's socket path must fit AF_UNIX's 108 bytes
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    # What the user types, the same both times; --step-sleep only slows steps 3.. so that the kill lands mid-run.
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", str(WORLD), *rdzv,
           SCRIPT, "--steps", str(STEPS), "--zero-stage", "2", "--dtype", "bf16", "--seed", str(SEED),
           "--budget-gb", "0.5", "--running-tor-every", "0", "--step-sleep", "0.5", "--step-sleep-after", "2",
           "--out", str(tmp_path), "--shardsafe-json", '{"parity_group_size": 1}']   # one node: no parity group

    def launch(attempt):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SHARDSAFE_", "PET_")) and k not in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")}
        # SHARDSAFE_ATTEMPT only numbers the records of each launch for the checks below (no part of the job id)
        env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", SHARDSAFE_HOLDER_DIR=holders,
                   SHARDSAFE_RUN_DIR=str(tmp_path), SHARDSAFE_ATTEMPT=str(attempt))
        with open(tmp_path / f"torchrun{attempt}.log", "ab") as log:
            return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    first = again = None
    try:
        first = launch(0)
        deadline = time.time() + 240
        while time.time() < deadline and first.poll() is None and not any(
                r["step"] >= KILL_AT for r in read_jsonl(str(tmp_path / "losses_rank0.jsonl"))):
            time.sleep(0.05)
        assert first.poll() is None, f"the first launch ended before step {KILL_AT}:\n{tail(tmp_path)}"
        kill_job(first)
        evs = read_jsonl(str(tmp_path / "events.jsonl"))
        committed = max((e["version"] for e in evs if e.get("kind") == "snapshot" and e.get("committed")), default=-1)
        assert committed >= 1, f"nothing committed before the kill:\n{tail(tmp_path)}"
        logged = max(r["step"] for r in read_jsonl(str(tmp_path / "losses_rank0.jsonl")))
        again = launch(1)
        assert again.wait(timeout=300) == 0, tail(tmp_path)
    finally:
        for p in (first, again):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        stop_job_holders(holders)
        shutil.rmtree(holders, ignore_errors=True)
    # one job id, derived from the command by both launches (their run ids / master ports differed)
    jobs = [set(re.findall(r"cmd-[0-9a-f]{16}", (tmp_path / f"torchrun{a}.log").read_text())) for a in (0, 1)]
    assert len(jobs[0]) == 1 and jobs[0] == jobs[1], jobs
    evs = read_jsonl(str(tmp_path / "events.jsonl"))
    got = {(e["attempt"], e["rank"]): (e["tier"], e["version"]) for e in evs if e.get("kind") == "restore_end"}
    v = got.get((1, 0), ("", -1))[1]
    # the newest version: at least the newest committed before the kill (a version sealed on every rank may be newer)
    assert {got.get((1, r)) for r in range(WORLD)} == {("memory", v)} and committed <= v <= logged, \
        (got, committed, logged, tail(tmp_path))
    # the holder the first launch's trainers started survived the kill and served the second launch
    assert [e["kind"] for e in evs].count("holder_start") == 1
    # continued from v (its first step is v + 1 on every rank: compare_runs' resume_problems), bit for bit
    cmp = compare_runs(str(tmp_path), str(ref), WORLD, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)
    print(f"torchrun c10d: job id {jobs[0].pop()}; killed after step {logged} (committed {committed}), restored {v}")
