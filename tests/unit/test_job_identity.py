"""What identifies a job across launches: the default job id of a torchrun worker (shardsafe.jobid) and the run
name that keys the persistent tier (shardsafe.run_name, SHARDSAFE_RUN_NAME, the sbatch scripts' SS_RUN_NAME).

The real torchrun resubmissions are in tests/fault/test_resubmission.py, the real SLURM requeue and resubmission
in tests/slurm/test_slurm.py; these pin the rules themselves.
"""
import logging
import os
import subprocess
import sys
import uuid

import pytest

from shardsafe import jobid
from shardsafe.config import ConfigError, ShardsafeConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGV, CWD = ["examples/ds_pretrain_gpt.py", "--seed", "1"], "/work/exp"


def worker_env(run_id, port, world="2"):
    """What torchrun hands a worker: torchrun's run id, the master address and port of this launch's rendezvous."""
    return {"TORCHELASTIC_RUN_ID": run_id, "MASTER_ADDR": "localhost", "MASTER_PORT": str(port), "WORLD_SIZE": world,
            "RANK": "0"}


def torchrun(*args):
    """An agent's command line as agent_command() returns it: the module, then torchrun's arguments."""
    return ["torch.distributed.run", *args, *ARGV]


@pytest.fixture(autouse=True)
def no_pet_env(monkeypatch):
    """torchrun's parser takes defaults from PET_* variables; the rules must not depend on the test's shell."""
    for k in list(os.environ):
        if k.startswith("PET_"):
            monkeypatch.delenv(k)


@pytest.mark.parametrize("args", [("--nproc-per-node", "2", "--standalone"),
                                  ("--nproc-per-node", "2"),   # one node, no endpoint, no port: torchrun's own draw
                                  ("--nproc_per_node=2", "--standalone", "--rdzv-id", "ignored-by-standalone")])
def test_a_resubmitted_one_node_torchrun_job_gets_the_same_id(args):
    """torchrun draws a UUID run id and a free master port for each such launch; the id comes from the command."""
    first = jobid.derive_job_id(worker_env(str(uuid.uuid4()), 41057), ARGV, CWD, agent=torchrun(*args))
    again = jobid.derive_job_id(worker_env(str(uuid.uuid4()), 37563), ARGV, CWD, agent=torchrun(*args))
    assert first == again and first[1] == "command" and first[0].startswith("cmd-"), (first, again)
    assert first[0] == jobid.command_digest(ARGV, CWD, worker_env("", 0), rendezvous="local")
    # what still tells two jobs apart: the arguments, the directory, the world size
    assert jobid.derive_job_id(worker_env(str(uuid.uuid4()), 1), ARGV + ["x"], CWD, agent=torchrun(*args)) != first
    assert jobid.derive_job_id(worker_env(str(uuid.uuid4()), 1), ARGV, "/elsewhere", agent=torchrun(*args)) != first
    assert jobid.derive_job_id(worker_env(str(uuid.uuid4()), 1, "4"), ARGV, CWD, agent=torchrun(*args)) != first


def test_a_c10d_job_is_identified_by_its_rendezvous_endpoint_not_the_drawn_master_port():
    agent = torchrun("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                     "10.0.0.1:29400")
    first = jobid.derive_job_id(worker_env("none", 38859), ARGV, CWD, agent=agent)
    assert first == jobid.derive_job_id(worker_env("none", 43489), ARGV, CWD, agent=agent)
    assert first[0] == jobid.command_digest(ARGV, CWD, worker_env("", 0), rendezvous="c10d:10.0.0.1:29400")
    other = torchrun("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                     "10.0.0.1:29401")
    assert jobid.derive_job_id(worker_env("none", 38859), ARGV, CWD, agent=other) != first


def test_a_chosen_run_id_and_a_static_rendezvous_keep_their_rules():
    chosen = torchrun("--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "exp7")
    assert jobid.derive_job_id(worker_env("exp7", 1), ARGV, CWD, agent=chosen) == ("exp7", "TORCHELASTIC_RUN_ID")
    static = torchrun("--nproc-per-node", "2", "--master-port", "29612")
    env = {**worker_env("none", 29612), "MASTER_ADDR": "127.0.0.1"}
    # the digest of a fixed --master-port job is what it was: snapshots of such jobs keep their directory
    assert jobid.derive_job_id(env, ARGV, CWD, agent=static) == (jobid.command_digest(ARGV, CWD, env), "command")


def test_without_torchrun_command_line_a_per_launch_id_is_said_once(caplog):
    """torch's launch API called from a program (no torchrun command line to read): a UUID run id is used as it is,
    and rank 0 says once that a resubmission would not find the snapshots; other ranks say nothing."""
    rid = str(uuid.uuid4())
    with caplog.at_level(logging.WARNING, logger="shardsafe.jobid"):
        for rank in ("0", "0", "1"):
            env = {**worker_env(rid, 1), "RANK": rank}
            assert jobid.derive_job_id(env, ARGV, CWD, agent=[]) == \
                (rid, "TORCHELASTIC_RUN_ID")
    said = [r.getMessage() for r in caplog.records if r.name == "shardsafe.jobid"]
    assert len(said) == 1 and "a resubmitted job would get another id" in said[0], said
    assert "SHARDSAFE_JOB_ID" in said[0], said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardsafe.jobid"):
        job, source = jobid.derive_job_id(worker_env("none", 45555), ARGV, CWD, agent=[])
    assert source == "command" and job == jobid.command_digest(ARGV, CWD, worker_env("none", 45555))
    said = [r.getMessage() for r in caplog.records if r.name == "shardsafe.jobid"]
    assert len(said) == 1 and "MASTER_ADDR:MASTER_PORT=localhost:45555" in said[0] and "is unknown" in said[0], said


def test_agent_command_reads_torchrun_from_the_parent_command_line():
    """A worker's parent is torchrun's agent: its arguments follow the `torchrun` script (`python .../torchrun ARGS`)
    or `-m torch.distributed.run` in its /proc cmdline."""
    sleep = "import time; time.sleep(60)"
    torchrun_script = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cases = {(sys.executable, "-c", sleep, torchrun_script, "--standalone", "x.py", "--lr", "1"):
             ["torch.distributed.run", "--standalone", "x.py", "--lr", "1"],
             (sys.executable, "-c", sleep, "-m", "torch.distributed.launch", "--use-env", "x.py"):
             ["torch.distributed.launch", "--use-env", "x.py"],
             (sys.executable, "-c", sleep, "train.py", "--rdzv-id", "x"): None}
    procs = [(subprocess.Popen(list(cmd)), want) for cmd, want in cases.items()]
    try:
        for p, want in procs:
            assert jobid.agent_command(p.pid) == want
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()
    assert jobid.agent_command(2 ** 22 + 1) is None   # no such process
    # the parsed forms, including the deprecated launcher's own flag
    launch = ["torch.distributed.launch", "--use-env", "--standalone", "x.py"]
    assert jobid.torchrun_rendezvous(launch) == ("local", None)
    assert jobid.torchrun_rendezvous(["torch.distributed.run", "--no-such-flag", "x.py"]) is None
    assert jobid.torchrun_rendezvous(["torch.distributed.run"]) is None   # no script: not what started a worker


# ---- run names -------------------------------------------------------------------------------------------------

@pytest.fixture
def run_env(monkeypatch):
    for v in ("SHARDSAFE_RUN_NAME", "SHARDSAFE_HOLDER_BUDGET_GB"):
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_run_name_keys_the_persistent_tier_and_defaults_to_the_job_id(run_env):
    assert ShardsafeConfig(job_id="4711.0").resolved().persist_name == "4711.0"
    run_env.setenv("SHARDSAFE_RUN_NAME", "gpt-1b")
    assert ShardsafeConfig(job_id="4711.1").resolved().persist_name == "gpt-1b"      # the sbatch scripts' SS_RUN_NAME
    assert ShardsafeConfig(job_id="4712.0", run_name="mine").resolved().persist_name == "mine"   # the config wins
    run_env.setenv("SHARDSAFE_RUN_NAME", "")
    assert ShardsafeConfig(job_id="4711.0").resolved().persist_name == "4711.0"


@pytest.mark.parametrize("bad", ["a/b", "..", ".", "x" * 65, "a b", "../up"])
def test_a_run_name_that_is_no_single_directory_name_is_refused(run_env, bad):
    with pytest.raises(ConfigError, match="shardsafe.run_name must be 1-64 of the characters"):
        ShardsafeConfig(job_id="j", run_name=bad)
    run_env.setenv("SHARDSAFE_RUN_NAME", bad)
    with pytest.raises(ConfigError, match="SHARDSAFE_RUN_NAME .*must be 1-64"):
        ShardsafeConfig(job_id="j").resolved()


def sbatch_run_name(**env):
    """SS_RUN_NAME as scripts/slurm/common.sh derives it, under the given environment."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SS_", "SLURM_"))}
    p = subprocess.run(["bash", "-c", f"source {ROOT}/scripts/slurm/common.sh; ss_run_name; echo \"$SS_RUN_NAME\""],
                       env={**keep, **env}, capture_output=True, text=True, timeout=30)
    return p.stdout.strip() if p.returncode == 0 else f"rc={p.returncode}: {p.stderr.strip()}"


def test_sbatch_run_name_is_the_same_for_a_requeue_and_a_resubmission():
    # requeue (same job id, another restart count) and resubmission (another job id): the job name stays
    for jid, restart in (("17", ""), ("17", "1"), ("18", "")):
        assert sbatch_run_name(SLURM_JOB_ID=jid, SLURM_RESTART_COUNT=restart, SLURM_JOB_NAME="shardsafe-ds") == \
            "shardsafe-ds"
    assert sbatch_run_name(SLURM_JOB_ID="19", SLURM_JOB_NAME="sweep", SLURM_ARRAY_TASK_ID="3") == "sweep_3"
    assert sbatch_run_name(SLURM_JOB_ID="19", SLURM_JOB_NAME="my job", SS_RUN_DIR="/scratch/runs/exp 1/") == "exp_1"
    assert sbatch_run_name(SLURM_JOB_NAME="x", SS_RUN_NAME="chosen") == "chosen"
    assert sbatch_run_name(SLURM_JOB_NAME="x", SS_RUN_NAME="a/b").startswith("rc=2: ") and \
        "SS_RUN_NAME=a/b: expected 1-64 of the characters" in sbatch_run_name(SLURM_JOB_NAME="x", SS_RUN_NAME="a/b")


def test_the_runtime_flushes_and_restores_under_the_run_name(run_env, tmp_path):
    """The persistent tier's directory is the run name's, for every engine of the program; memory stays the job's."""
    from shardsafe.runtime import Runtime
    cfg = ShardsafeConfig(job_id="4711.1", run_name="gpt-1b", persist_dir=str(tmp_path / "persist"),
                          holder_dir=str(tmp_path / "h"), start_holder=False, timeout_s=2)
    for scope, want in (("", "gpt-1b"), ("engine1", "gpt-1b/engine1")):
        rt = Runtime(cfg, rank=0, world_size=1, scope=scope)
        try:
            assert rt.persist_job_id == want and rt.persist.dir == str(tmp_path / "persist" / want)
            assert rt.paths.job_id == "4711.1"
        finally:
            rt.close()


def test_megatron_flag_names_the_run(run_env):
    import argparse
    from shardsafe.adapters.megatron.args import add_arguments, config_from_args
    args = add_arguments(argparse.ArgumentParser()).parse_args(["--shardsafe", "--shardsafe-job-id", "4711.0",
                                                                "--shardsafe-run-name", "gpt-1b"])
    assert config_from_args(args).persist_name == "gpt-1b"
    bad = add_arguments(argparse.ArgumentParser()).parse_args(["--shardsafe", "--shardsafe-run-name", "a/b"])
    with pytest.raises(ConfigError, match="--shardsafe-run-name must be 1-64"):
        config_from_args(bad)


def test_the_per_process_local_rank_argument_is_no_part_of_the_digest():
    """The deepspeed launcher (and torch.distributed.launch) append --local_rank=N to each process's arguments: all
    ranks of the job must still derive one id."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2"}
    ids = {jobid.derive_job_id(env, [*ARGV, f"--local_rank={r}"], CWD) for r in range(2)}
    ids |= {jobid.derive_job_id(env, [*ARGV, f"--local-rank={r}"], CWD) for r in range(2)}
    assert ids == {(jobid.command_digest(ARGV, CWD, env), "command")}, ids
