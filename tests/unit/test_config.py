"""Malformed "shardsafe" blocks fail at initialize, before DeepSpeed builds anything."""
import pytest

from shardsafe.adapters.deepspeed import config_from_ds, initialize
from shardsafe.config import ConfigError, ShardsafeConfig


@pytest.mark.parametrize("block, words", [
    ({"intervl": 1}, ["unknown key", "intervl", "interval"]),
    ({"interval": "2"}, ["shardsafe.interval", "int", "'2'"]),
    ({"interval": -1}, ["shardsafe.interval", ">= 1", "-1"]),
    ({"interval": 0}, ["shardsafe.interval", ">= 1"]),
    ({"memory_budget_gb": -2}, ["memory_budget_gb", ">= 0"]),
    ({"enabled": "yes"}, ["shardsafe.enabled", "bool"]),
    ({"job_id": "a/b"}, ["job_id", "'/'"]),
    ({"parity_shards": 0}, ["parity_shards"]),
    ({"parity_transport": "nccl"}, ["shardsafe.parity_transport", "'host', 'device'", "'nccl'"]),
    ([1, 2], ["JSON object"]),
])
def test_bad_blocks(block, words):
    with pytest.raises(ConfigError) as e:
        config_from_ds({"shardsafe": block})
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_initialize_fails_before_deepspeed_runs():
    # No process group exists here: reaching deepspeed.initialize would fail differently.
    with pytest.raises(ConfigError, match="unknown key"):
        initialize(model=None, config={"train_batch_size": 1, "shardsafe": {"enable": True}})


def test_defaults_and_absent_block():
    assert config_from_ds({"train_batch_size": 4}).enabled is False
    cfg = config_from_ds({"shardsafe": {"interval": 5, "memory_budget_gb": 1.5}})
    assert cfg.enabled and cfg.interval == 5 and cfg.memory_budget_bytes == int(1.5 * 2**30)
    assert ShardsafeConfig().memory_budget_bytes > 0


def test_device_parity_transport_without_a_gpu_is_refused_before_any_group_exists():
    """No process group is initialized here: the check must come before ParityExchange creates groups, so
    no rank of a job is left waiting in new_group for one that cannot take part."""
    import torch

    from shardsafe.parity.exchange import ExchangeError, ParityExchange
    from shardsafe.parity.topology import RankPlace, build_parity_groups
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the device transport is usable here (tests/dist covers its CPU double)")
    plan = build_parity_groups([RankPlace(rank=r, dp=r, tp=0, pp=0, node=f"n{r}") for r in range(3)],
                               group_size=3, parity_shards=1)
    with pytest.raises(ExchangeError, match="needs a CUDA device.*use parity_transport 'host'"):
        ParityExchange(plan, 0, transport="device")


# ---- job ids (shardsafe.jobid; docs/operations.md "Job ids") -------------------------------------------------

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

from shardsafe import jobid  # noqa: E402

_ID_VARS = ("SHARDSAFE_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE",
            "SHARDSAFE_HOLDER_BUDGET_GB")


@pytest.fixture
def clean_env(monkeypatch):
    for v in _ID_VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_job_id_rules_in_order(clean_env):
    argv, cwd = ["train.py", "--seed", "1"], "/work/exp"
    env = {"SHARDSAFE_JOB_ID": "mine", "SLURM_JOB_ID": "4711", "TORCHELASTIC_RUN_ID": "rdzv9"}
    assert jobid.derive_job_id(env, argv, cwd) == ("mine", "SHARDSAFE_JOB_ID")
    env.pop("SHARDSAFE_JOB_ID")
    assert jobid.derive_job_id(env, argv, cwd) == ("4711", "SLURM_JOB_ID")
    env.pop("SLURM_JOB_ID")
    assert jobid.derive_job_id(env, argv, cwd) == ("rdzv9", "TORCHELASTIC_RUN_ID")
    env["TORCHELASTIC_RUN_ID"] = "none"          # plain torchrun without --rdzv-id
    job, source = jobid.derive_job_id(env, argv, cwd)
    assert source == "command" and job.startswith("cmd-") and job != "none"
    assert jobid.derive_job_id({"TORCHELASTIC_RUN_ID": "a/b"}, argv, cwd)[0] == "a_b"   # a path-safe directory name


def test_plain_torchrun_jobs_get_ids_unique_per_job_and_stable_across_resubmission(clean_env):
    """Issue 15: two plain torchrun jobs (no --rdzv-id: TORCHELASTIC_RUN_ID=none) shared the constant id
    "local". Same command again (a resubmission, or torch elastic's restart) -> the same id; another port,
    other arguments or another directory -> another id."""
    base = {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2"}
    a = ["examples/ds_pretrain_gpt.py", "--seed", "1"]
    for k, v in base.items():
        clean_env.setenv(k, v)
    clean_env.setattr(sys, "argv", a)
    first = ShardsafeConfig().resolved().job_id
    assert first == ShardsafeConfig().resolved().job_id == jobid.command_digest(a, os.getcwd(), base)
    clean_env.setenv("MASTER_PORT", "29501")
    assert ShardsafeConfig().resolved().job_id != first
    clean_env.setenv("MASTER_PORT", "29500")
    clean_env.setattr(sys, "argv", a[:-1] + ["2"])
    assert ShardsafeConfig().resolved().job_id != first
    clean_env.setattr(sys, "argv", a)
    assert jobid.derive_job_id(None, a, "/elsewhere")[0] != first
    assert ShardsafeConfig().resolved().job_id == first


def test_no_launcher_id_and_no_command_line_is_refused(clean_env):
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")
    clean_env.setattr(sys, "argv", ["-c"])
    with pytest.raises(ConfigError) as e:
        ShardsafeConfig().resolved()
    for w in ("SHARDSAFE_JOB_ID", "--rdzv-id", "shardsafe.job_id", "Refusing"):
        assert w in str(e.value), str(e.value)
    assert ShardsafeConfig(job_id="explicit").resolved().job_id == "explicit"
    assert ShardsafeConfig(enabled=False).resolved().job_id == ""   # protection off: nothing to identify, nothing raised


_CLAIMER = textwrap.dedent("""
    import sys, time
    from shardsafe import jobid
    try:
        jobid.claim(sys.argv[1], "job1", "node0", token=sys.argv[2], wait_s=1.0)   # waits 1 s for the owner to exit
    except jobid.JobConflict as e:
        print("CONFLICT", e, flush=True)
        sys.exit(3)
    print("CLAIMED", flush=True)
    time.sleep(float(sys.argv[3]))
""")


def _claimer(root, token, hold_s):
    p = subprocess.Popen([sys.executable, "-c", _CLAIMER, str(root), token, str(hold_s)], stdout=subprocess.PIPE,
                         text=True)
    return p, p.stdout.readline().strip()


def test_a_second_running_job_with_the_same_id_is_refused_and_a_resubmission_takes_over(tmp_path):
    """Real processes hold the claim: another instance is refused while one of the owner's processes lives
    (the message says what to set); once they are all gone (SIGKILL: the kernel drops the lock) the id is
    taken over, as a resubmitted job must; the owner's own restarts (same instance) always get it."""
    owner, said = _claimer(tmp_path, "agentA", 60)
    assert said == "CLAIMED"
    peer, said = _claimer(tmp_path, "agentA", 0)          # a restarted rank of the same job instance
    assert said == "CLAIMED" and peer.wait(30) == 0
    other, said = _claimer(tmp_path, "agentB", 0)
    assert other.wait(30) == 3 and said.startswith("CONFLICT"), said
    for w in ("'job1'", "node0", "another running job", "SHARDSAFE_JOB_ID", "--rdzv-id"):
        assert w in said, said
    owner.send_signal(signal.SIGKILL)
    owner.wait(30)
    again, said = _claimer(tmp_path, "agentB", 0)
    assert said == "CLAIMED" and again.wait(30) == 0
    job_dir = tmp_path / f"shardsafe-{os.getuid()}" / "job1"   # shardsafe's private directory in the one given
    assert json.loads((job_dir / "node0.owner").read_text())["token"] == "agentB"
    assert oct(job_dir.stat().st_mode & 0o777) == "0o700"


def test_instance_token_is_the_launcher_process_under_a_launcher(clean_env):
    assert jobid.instance_token({"SHARDSAFE_INSTANCE": "launch-1"}) == "launch-1"
    assert jobid.instance_token({"LOCAL_RANK": "0"}).startswith(f"{os.getppid()}.")
    assert jobid.instance_token({}).startswith(f"{os.getpid()}.")


# ---- a budget in the config vs the holders the launcher started -------------------------------------------

def test_config_budget_that_differs_from_the_launchers_holders_is_an_error_naming_both(clean_env):
    """Issue 15: under `shardsafe launch` the holders run with the launcher's budget and a memory_budget_gb
    in the DeepSpeed config was silently ignored."""
    clean_env.setenv("SHARDSAFE_HOLDER_BUDGET_GB", "0.5")
    with pytest.raises(ConfigError) as e:
        config_from_ds({"shardsafe": {"memory_budget_gb": 2, "job_id": "j"}}).resolved()
    for w in ("memory_budget_gb is 2 GiB", "--memory-budget-gb 0.5", "pass --memory-budget-gb 2"):
        assert w in str(e.value), str(e.value)
    assert config_from_ds({"shardsafe": {"memory_budget_gb": 0.5, "job_id": "j"}}).resolved().memory_budget_gb == 0.5
    assert config_from_ds({"shardsafe": {"job_id": "j"}}).resolved().memory_budget_gb == 0       # the launcher's holders decide
    clean_env.setenv("SHARDSAFE_HOLDER_BUDGET_GB", "0.0")
    with pytest.raises(ConfigError, match="half of the node's RAM"):
        config_from_ds({"shardsafe": {"memory_budget_gb": 1, "job_id": "j"}}).resolved()


# ---- fatal errors recorded for the launcher (shardsafe.fatal) -----------------------------------------------

_DIES = textwrap.dedent("""
    import sys
    from shardsafe.fatal import install_excepthook
    install_excepthook()   # what every protected trainer's entry point does first (the adapters' protect, the runtime)
    from shardsafe.config import ShardsafeConfig
    if sys.argv[1] == "config":
        ShardsafeConfig(interval=0, job_id="j")
    raise ValueError("an ordinary crash: a restart may help")
""")


@pytest.mark.parametrize("how, fatal", [("config", True), ("crash", False)])
def test_a_trainer_dying_of_a_config_error_leaves_a_marker_an_ordinary_crash_does_not(tmp_path, how, fatal):
    from shardsafe.fatal import describe, read_fatal
    env = {**os.environ, "SHARDSAFE_RUN_DIR": str(tmp_path), "RANK": "3", "SHARDSAFE_ATTEMPT": "2"}
    r = subprocess.run([sys.executable, "-c", _DIES, how], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and ("ConfigError" if fatal else "ValueError") in r.stderr, r.stderr  # traceback kept
    recs = read_fatal(str(tmp_path), 2)
    if not fatal:
        assert recs == [] and read_fatal(str(tmp_path)) == []
        return
    assert [(x["type"], x["rank"], x["attempt"]) for x in recs] == [("ConfigError", 3, 2)]
    assert "shardsafe.interval" in recs[0]["message"] and read_fatal(str(tmp_path), 1) == []
    assert "not restarting" in describe(recs) and "rank(s) [3]" in describe(recs)
