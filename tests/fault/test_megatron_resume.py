"""Megatron on the real holder runtime: real processes, real SIGKILLs, bit-exact resume.

Every job runs under the local launcher (simulated nodes, one holder each, whole-group restarts). A
protected run loses one rank to a SIGKILL right before the optimizer step of a seeded iteration
(``kill-rank``, injected by the runtime's ``before_step``, i.e. through the optimizer-step wrapper),
or a whole node (its trainers and holder, ``kill-node``); the restarted ranks restore in place and
train on. Every loss any attempt computed, and every rank's final state (optimizer shards and
state, RNGs, model params), must be ``torch.equal`` to an uninterrupted run without shardsafe
(``shardsafe.runcheck.compare_runs``).

Own loop (examples/megatron_pretrain_gpt.py, megatron-core of this venv): TP2xDP2, TP1xPP2xDP2,
TP2xPP2, TP1xPP2(x2 virtual)xDP2, MoE PP2xDP2xEP2 on 2 nodes x 2 ranks, and node loss on TP2xDP2 (DP peers
on different nodes: parity); the two-call core API (restore/snapshot/close) on TP2xDP2.
Megatron-LM's ``pretrain`` (examples/megatron_lm_pretrain_gpt.py) needs ``megatron.training``
(megatron-core >= 0.17): the trainers get ``PYTHONPATH=.venv/mcore-0.17.1`` themselves. Bad
arguments fail on every rank before the first iteration, with a message naming the flag.

Fault points are drawn from SHARDSAFE_FAULT_SEED (printed; default fixed) so a failure reproduces.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import uuid

import pytest

from shardsafe.launch import PRELOAD_MEGATRON, LaunchConfig
from shardsafe.runcheck import compare_runs, losses_by_attempt, read_jsonl

from .._probes import installed_version
from .helpers import (PLAIN_MEGATRON, cached_reference, committed_everywhere, launch, reference_preload, restores,
                      trainer_logs)

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OWN_LOOP = os.path.join(ROOT, "examples", "megatron_pretrain_gpt.py")
MEGATRON_LM = os.path.join(ROOT, "examples", "megatron_lm_pretrain_gpt.py")
LM_ARGS = os.path.join(ROOT, "configs", "megatron", "megatron_lm_tiny_gpt.args")
# Megatron-LM's loop ships inside megatron-core >= 0.17; SHARDSAFE_TEST_MCORE_LM points the Megatron-LM
# tests at another side folder (e.g. .venv/mcore-0.19.2, `make test-mcore019`).
MCORE_017 = os.environ.get("SHARDSAFE_TEST_MCORE_LM") or os.path.join(ROOT, ".venv", "mcore-0.17.1")
SEED = int(os.environ.get("SHARDSAFE_FAULT_SEED", "20261129"))
STEPS = 7

LAYOUTS = {"tp2_dp2": ["--tp", "2"], "tp1_pp2_dp2": ["--pp", "2"], "tp2_pp2": ["--tp", "2", "--pp", "2", "--bf16"],
           # interleaved pipeline, two model chunks per rank
           "tp1_pp2_vpp2_dp2": ["--pp", "2", "--vpp", "2", "--num-layers", "4", "--bf16"],
           # MoE (4 experts, expert parallel 2): a dense and an expert DistributedOptimizer
           "moe_pp2_dp2_ep2": ["--pp", "2", "--num-experts", "4", "--ep", "2", "--bf16"]}


MCORE = installed_version("megatron-core", "megatron.core")
needs_mcore = pytest.mark.skipif(MCORE is None, reason="megatron-core is not installed in this venv "
                                                       "(pip install megatron-core==0.16.1, docs/megatron.md)")
needs_lm = pytest.mark.skipif(not os.path.isdir(os.path.join(MCORE_017, "megatron", "training")),
                              reason=f"Megatron-LM's loop needs megatron-core >= 0.17 in {MCORE_017} (pip install "
                                     "--no-deps --ignore-requires-python --target .venv/mcore-0.17.1 "
                                     "megatron-core==0.17.1 pyyaml==6.0.4; docs/megatron.md)")


def run_megatron(run_dir, script_args, *, script=OWN_LOOP, nodes=2, nproc=2, inject="", shardsafe=True,
                 max_restarts=2, env=None, cold=False):
    """One job under the local launcher; trainers write losses/final state into run_dir.

    Protected runs fork their trainers from a pre-warmed server shared by the package (helpers.launch:
    megatron.core is imported once, not per job, rank and attempt). Unprotected runs (the references) fork
    from a server that imported the frameworks only, or with ``cold`` start cold (and niced: the host is
    shared), so that bit-exact check also compares forked trainers with cold ones (helpers.reference_preload)."""
    run_dir = str(run_dir)
    cfg = LaunchConfig(nodes=nodes, nproc_per_node=nproc, job_id=f"mt{uuid.uuid4().hex[:8]}", run_dir=run_dir,
                       inject=inject, max_restarts=max_restarts, memory_budget_gb=0.5, start_holders=shardsafe,
                       attempt_timeout_s=240, env=dict(env or {}))
    preload = PRELOAD_MEGATRON if shardsafe else reference_preload(PLAIN_MEGATRON, cold)
    nice = ["nice", "-n", "5"] if shutil.which("nice") and not preload else []
    cmd = [*nice, sys.executable, script, *script_args, "--out", run_dir]
    if shardsafe:
        cmd += ["--shardsafe", "--shardsafe-timeout-s", "30"]
    return launch(cfg, cmd, preload=preload)


def lm_env() -> dict[str, str]:
    """megatron-core 0.17.1 (it ships megatron.training) ahead of the venv's own megatron-core."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (MCORE_017, os.environ.get("PYTHONPATH", "")) if p)}


def lm_args(*extra: str) -> list[str]:
    return [f"@{LM_ARGS}", *extra]


def lm_reference(megatron_reference):
    """Megatron-LM's loop without shardsafe, started as a user's unchanged program (``--plain-entry``: the entry
    calls Megatron-LM's ``pretrain`` as pretrain_gpt.py does) and cold: what a plain start imports is checked on
    it, and the protected runs, forked, must compute what it computed."""
    return megatron_reference("megatron_lm_plain_entry", [*lm_args(), "--plain-entry"], script=MEGATRON_LM,
                              env=lm_env(), cold=True)


@pytest.fixture(scope="session")
def megatron_reference(tmp_path_factory):
    """Uninterrupted runs without shardsafe (plain Megatron), cached per (script, arguments); ``cold`` as in
    ``run_megatron`` (a cold reference also serves a test that asks for a forked one)."""
    cache: dict = {}

    def get(key: str, script_args: list[str], *, script=OWN_LOOP, env=None, cold=False):
        def run():
            d = tmp_path_factory.mktemp(f"mref-{key}" + ("-cold" if cold else ""))
            res = run_megatron(d, script_args, script=script, shardsafe=False, max_restarts=0, env=env, cold=cold)
            assert res.ok, f"reference run failed; see {d}:\n{trainer_logs(str(d))[-3000:]}"
            return d

        return cached_reference(cache, key, cold, run)

    return get


def events(run_dir) -> list[dict]:
    return read_jsonl(os.path.join(str(run_dir), "events.jsonl"))


def restore_tiers(run_dir) -> dict[int, set]:
    out: dict[int, set] = {}
    for e in events(run_dir):
        if e.get("kind") == "restore_end":
            out.setdefault(int(e.get("attempt") or 0), set()).add(e["tier"])
    return out


def assert_bit_identical(run_dir, ref_dir, steps=STEPS, world=4):
    cmp = compare_runs(str(run_dir), str(ref_dir), world, steps)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches, cmp.state_mismatches, cmp.replayed_losses_equal,
                               trainer_logs(str(run_dir))[-3000:])


def assert_resumed_after(run_dir, attempt: int, version: int, world=4):
    """The restarted attempt continued right after the restored version (it did not start over: a run
    started from scratch would also match the reference, so this is what shows the restore took effect)."""
    for r in range(world):
        steps = losses_by_attempt(str(run_dir), r).get(attempt, [])
        assert steps and min(steps) == version + 1, f"rank {r}: attempt {attempt} ran steps {steps}, restored {version}"


def seeded_fault(layout: str, first: int, last: int) -> tuple[int, int]:
    rng = random.Random(f"{SEED}:{layout}")
    rank, at = rng.randrange(4), rng.randint(first, last)
    print(f"SHARDSAFE_FAULT_SEED={SEED}: {layout}: kill-rank:{rank}@{at}")
    return rank, at


# ---- own loop (megatron-core API + shardsafe.adapters.megatron.protect) -----------------------------

@needs_mcore
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kill_rank_resumes_bit_exact(tmp_path, megatron_reference, layout):
    args = [*LAYOUTS[layout], "--steps", str(STEPS)]
    ref = megatron_reference(layout, args, cold=layout == "tp2_dp2")   # cold: helpers.reference_preload
    rank, at = seeded_fault(layout, 3, STEPS - 2)
    res = run_megatron(tmp_path, args, inject=f"kill-rank:{rank}@{at}")
    assert res.ok and res.attempts == 2, (res, trainer_logs(str(tmp_path))[-3000:])
    assert res.failures[0]["rank"] == rank and res.failures[0]["rc"] == -9, res.failures
    got = restores(tmp_path)
    # The newest version every rank had sealed when rank `rank` died right before step `at`.
    assert got[0] == -1 and got[1] in (at - 2, at - 1), got
    assert restore_tiers(tmp_path)[1] == {"memory"}
    assert_resumed_after(tmp_path, 1, got[1])
    assert any(e.get("kind") == "snapshot" and e.get("committed") for e in events(tmp_path))
    # DP peers on one node (TP1 PP2 DP2: DP groups {0,1}, {2,3}): their shards come from the holder;
    # across nodes (TP2 DP2: {0,2}, {1,3}) Megatron's all-gather; DP1: nothing to gather.
    want = {"tp2_dp2": "all-gather", "tp1_pp2_dp2": "from the node's holder", "tp2_pp2": "local",
            "tp1_pp2_vpp2_dp2": "from the node's holder", "moe_pp2_dp2_ep2": "from the node's holder"}[layout]
    assert {e["notes"]["model_params"] for e in events(tmp_path)
            if e.get("kind") == "restore_end" and e.get("version", -1) >= 0} == {want}
    assert_bit_identical(tmp_path, ref)


@needs_mcore
def test_node_loss_rebuilt_from_parity(tmp_path, megatron_reference):
    """TP2xDP2 on 2 nodes x 2 ranks: the DP peers of each TP rank sit on different nodes, so each parity
    group (RS(1,1)) survives the loss of node1 (both its trainers and its holder, shared memory gone)."""
    args = [*LAYOUTS["tp2_dp2"], "--steps", str(STEPS)]
    ref = megatron_reference("tp2_dp2", args)
    res = run_megatron(tmp_path, args + ["--shardsafe-parity-shards", "1"], inject="kill-node:node1@4")
    assert res.ok and res.attempts == 2 and res.failures[0]["cause"] == "node_loss", res
    ev = events(tmp_path)
    # The launcher kills the node once it sees iteration 4 finish; another step may complete meanwhile, and a commit
    # vote may still be out.
    done = max(e["iteration"] for e in ev if e.get("kind") == "iteration" and not e.get("attempt"))
    version, committed = restores(tmp_path)[1], committed_everywhere(tmp_path, 4)
    assert 1 <= committed <= version <= min(committed + 1, done), (version, committed, done)
    assert restore_tiers(tmp_path)[1] == {"parity"}
    assert_resumed_after(tmp_path, 1, version)
    rebuilt = {e["rank"]: e.get("rebuilt_bytes", 0) for e in ev if e.get("kind") == "restore_end" and e.get("attempt") == 1}
    assert rebuilt[2] > 0 and rebuilt[3] > 0 and rebuilt[0] == rebuilt[1] == 0, rebuilt
    assert all(e.get("parity_s", 0) > 0 for e in ev if e.get("kind") == "snapshot" and e.get("committed"))
    assert_bit_identical(tmp_path, ref)


# fp16 with Megatron's dynamic loss scaler, tuned so the scale moves within a few steps: up every 2 clean steps,
# halved (and the step skipped: no grad norm) at the first overflow.
FP16 = ["--tp", "2", "--fp16", "--initial-loss-scale", "131072", "--loss-scale-window", "2", "--hysteresis", "1"]


def loss_scales(run_dir, rank=0) -> dict[int, float]:
    """step -> loss scale after that step, from the attempt that last ran it."""
    out: dict[int, float] = {}
    for e in read_jsonl(os.path.join(str(run_dir), f"losses_rank{rank}.jsonl")):
        out[int(e["step"])] = e["loss_scale"]
    return out


@needs_mcore
def test_fp16_loss_scaler_resumes_bit_exact(tmp_path, megatron_reference):
    """TP2xDP2 fp16 DistributedOptimizer: the scaler's scale, growth and hysteresis trackers come back with the
    snapshot, so after a SIGKILL the scale, the skipped (overflowed) steps, every loss and the final state
    match an uninterrupted run. The reference must move the scale both ways (else the check has no teeth)."""
    steps = 9
    args = [*FP16, "--steps", str(steps)]
    ref = megatron_reference("tp2_dp2_fp16", args)
    want = loss_scales(ref)
    moves = [b / a for a, b in zip([131072.0] + [want[s] for s in range(1, steps)], [want[s] for s in range(1, steps + 1)])]
    assert 2.0 in moves and 0.5 in moves, want
    rank, at = seeded_fault("fp16", 4, steps - 2)
    res = run_megatron(tmp_path, args, inject=f"kill-rank:{rank}@{at}")
    assert res.ok and res.attempts == 2 and res.failures[0]["rank"] == rank, (res, trainer_logs(str(tmp_path))[-3000:])
    got = restores(tmp_path)
    assert got[0] == -1 and got[1] in (at - 2, at - 1), got
    assert_resumed_after(tmp_path, 1, got[1])
    for r in range(4):
        assert loss_scales(tmp_path, r) == want, (r, loss_scales(tmp_path, r), want)
    assert_bit_identical(tmp_path, ref, steps=steps)


@needs_mcore
def test_core_functions_restore_snapshot_close(tmp_path, megatron_reference):
    """The two-call core API (``restore`` once, ``snapshot(..., iteration)`` after every step, ``close``;
    examples/megatron_pretrain_gpt.py --core-api functions) on TP2xDP2 with --shardsafe-interval 2: a rank
    killed before a seeded step comes back from an even iteration with its counters, the last iteration
    (7, skipped by the interval) is sealed by ``final=True`` on every rank, and the run is bit-exact."""
    args = [*LAYOUTS["tp2_dp2"], "--steps", str(STEPS)]
    ref = megatron_reference("tp2_dp2", args)
    rank, at = seeded_fault("core-functions", 4, STEPS - 1)
    res = run_megatron(tmp_path, args + ["--core-api", "functions", "--shardsafe-interval", "2"],
                       inject=f"kill-rank:{rank}@{at}")
    assert res.ok and res.attempts == 2 and res.failures[0]["rank"] == rank, (res, trainer_logs(str(tmp_path))[-3000:])
    got = restores(tmp_path)
    assert got[0] == -1 and got[1] % 2 == 0 and at - 3 <= got[1] <= at - 1, (got, at)
    assert_resumed_after(tmp_path, 1, got[1])
    sealed = {(e["rank"], e["version"]) for e in events(tmp_path) if e.get("kind") == "snapshot" and e.get("committed")}
    assert {v for _, v in sealed} <= {2, 4, 6, STEPS}, sealed
    assert {r for r, v in sealed if v == STEPS} == {0, 1, 2, 3}, sealed
    assert_bit_identical(tmp_path, ref)


# ---- Megatron-LM's pretrain (megatron-core 0.17.1 from the side folder) -----------------------------

@needs_lm
def test_megatron_lm_unmodified_entry_protected_by_its_flags_alone(tmp_path, megatron_reference):
    """The entry script calls Megatron-LM's own ``pretrain`` as pretrain_gpt.py does and imports nothing of
    shardsafe (``--plain-entry``); ``--shardsafe`` on the command line is what protects it (adapters/autoload.py
    wraps pretrain when megatron.training loads). Without the flag, the same script runs plain Megatron-LM and
    imports nothing of shardsafe beyond the hook; with it, Megatron-LM's own loop (TP2xDP2 bf16 DistOpt) loses
    rank 2 to a SIGKILL right before the optimizer step of iteration 4 (inside Megatron-LM's train_step, through
    shardsafe's optimizer-step wrapper); the restart restores inside setup_model_and_optimizer, and iterations 4-6
    and the final state match the plain run exactly. (The explicit entry, shardsafe.adapters.megatron.pretrain, is
    killed and restored by the node-loss, final-snapshot and `shardsafe launch` tests below.)"""
    steps = 6
    ref = lm_reference(megatron_reference)   # cold: a fork server's child would have the server's modules
    hook_only = ["shardsafe", "shardsafe.adapters", "shardsafe.adapters.autoload", "shardsafe.env", "shardsafe.errors"]
    for r in range(4):
        with open(os.path.join(str(ref), f"modules_rank{r}.json")) as f:
            assert json.load(f) == hook_only
    assert "Megatron-LM's pretrain is protected" not in trainer_logs(str(ref))
    res = run_megatron(tmp_path, [*lm_args(), "--plain-entry"], script=MEGATRON_LM, env=lm_env(),
                       inject="kill-rank:2@4")
    assert res.ok and res.attempts == 2, (res, trainer_logs(str(tmp_path))[-3000:])
    logs = trainer_logs(str(tmp_path))
    assert "Megatron-LM's pretrain is protected (automatic activation; SHARDSAFE_AUTO=0" in logs, logs[-3000:]
    with open(os.path.join(str(tmp_path), "modules_rank0.json")) as f:
        assert "shardsafe.adapters.megatron" in json.load(f)
    assert res.failures[0]["rank"] == 2 and res.failures[0]["rc"] == -9
    got = restores(tmp_path)
    assert got[0] == -1 and got[1] in (2, 3), got
    ev = events(tmp_path)
    assert any(e.get("kind") == "train_ready" and e.get("attempt") == 1 and e["iteration"] == got[1] + 1 for e in ev)
    assert_resumed_after(tmp_path, 1, got[1])
    assert_bit_identical(tmp_path, ref, steps=steps)


@needs_lm
def test_megatron_lm_node_loss_rebuilt_from_parity(tmp_path, megatron_reference):
    """Megatron-LM's loop, TP2xDP2 on 2 nodes x 2 ranks (each DP pair spans both nodes: parity RS(1,1)): node1
    (ranks 2 and 3 and its holder, shared memory gone) is lost after iteration 3; the restarted ranks 2 and 3
    are rebuilt from node0's data and parity inside setup_model_and_optimizer and the run ends bit-exact."""
    ref = lm_reference(megatron_reference)
    res = run_megatron(tmp_path, lm_args(), script=MEGATRON_LM, env=lm_env(), inject="kill-node:node1@3")
    assert res.ok and res.attempts == 2 and res.failures[0]["cause"] == "node_loss", (res, trainer_logs(str(tmp_path))[-3000:])
    ev = events(tmp_path)
    # The launcher kills the node once it sees iteration 3 finish; another step may complete meanwhile, and on a
    # loaded machine a commit vote may still be out (then the restore takes the version before it).
    done = max(e["iteration"] for e in ev if e.get("kind") == "iteration" and not e.get("attempt"))
    version, committed = restores(tmp_path)[1], committed_everywhere(tmp_path, 4)
    assert 1 <= committed <= version <= min(committed + 1, done) and done < 6, (version, committed, done)
    assert restore_tiers(tmp_path)[1] == {"parity"}
    rebuilt = {e["rank"]: e.get("rebuilt_bytes", 0) for e in ev if e.get("kind") == "restore_end" and e.get("attempt") == 1}
    assert rebuilt[2] > 0 and rebuilt[3] > 0 and rebuilt[0] == rebuilt[1] == 0, rebuilt
    assert_resumed_after(tmp_path, 1, version)
    assert_bit_identical(tmp_path, ref, steps=6)


@needs_lm
def test_megatron_lm_exit_seals_a_final_snapshot(tmp_path, megatron_reference):
    """--shardsafe-interval 3 with Megatron-LM's --exit-interval 4: the job leaves after iteration 4, which
    the interval skipped. Its final snapshot is committed and flushed to the persistent tier (persist_every
    10 would flush neither 3 nor 4), so the next job of the same id, whose holders start empty, restores
    iteration 4 from disk and finishes bit-exact."""
    ref = lm_reference(megatron_reference)
    disk, job = tmp_path / "persist", f"mx{uuid.uuid4().hex[:8]}"
    flags = ["--shardsafe", "--shardsafe-timeout-s", "30", "--shardsafe-interval", "3",
             "--shardsafe-persist-dir", str(disk), "--out", str(tmp_path)]
    for extra in (["--exit-interval", "4"], []):
        cfg = LaunchConfig(nodes=2, nproc_per_node=2, job_id=job, run_dir=str(tmp_path), max_restarts=0,
                           memory_budget_gb=0.5, attempt_timeout_s=240, env=lm_env())
        res = launch(cfg, [sys.executable, MEGATRON_LM, *lm_args(*extra), *flags], preload=PRELOAD_MEGATRON)
        assert res.ok and res.attempts == 1, (res, trainer_logs(str(tmp_path))[-3000:])
    assert sorted(os.listdir(disk / job)) == [f"v{4:012d}"]   # the final snapshot, and only it
    ends = [e for e in events(tmp_path) if e.get("kind") == "restore_end"]
    assert [e["version"] for e in ends] == [-1] * 4 + [4] * 4 and {e["tier"] for e in ends[4:]} == {"persistent"}, ends
    for r in range(4):   # the second job went on from iteration 5: nothing was computed twice
        assert losses_by_attempt(str(tmp_path), r) == {0: [1, 2, 3, 4, 5, 6]}
    assert_bit_identical(tmp_path, ref, steps=6)


# Megatron-LM with interleaved pipeline parallelism: TP1 x PP2 (2 virtual stages: two model chunks per rank,
# one data loader per chunk) x DP2, gradient reduce-scatter and param all-gather overlapped with compute (the
# flags production DistributedOptimizer runs use).
LM_VPP = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
          "--num-layers-per-virtual-pipeline-stage", "1", "--overlap-grad-reduce", "--overlap-param-gather"]


@needs_lm
def test_megatron_lm_under_shardsafe_launch(tmp_path, megatron_reference, monkeypatch):
    """Megatron-LM with virtual pipeline stages and overlapped DP communication (LM_VPP) under `shardsafe launch` (torch elastic agents on 2
    simulated nodes, the launcher's holders): torchrun restarts the worker group after the SIGKILL, the
    ranks restore both model chunks from the holders (DP peers share a node: the model params come from
    the holder, no all-gather), and the run is bit-exact to plain Megatron-LM."""
    from shardsafe.launch.elastic import ElasticConfig, ElasticLauncher
    ref = megatron_reference("megatron_lm_vpp", lm_args(*LM_VPP), script=MEGATRON_LM, env=lm_env())
    monkeypatch.setenv("PYTHONPATH", lm_env()["PYTHONPATH"])
    cfg = ElasticConfig(nodes=2, nproc_per_node=2, run_dir=str(tmp_path), inject="kill-rank:2@4", memory_budget_gb=0.5,
                        max_restarts=2, keep_alive_s=2, keep_alive_misses=3, timeout_s=420, preload=PRELOAD_MEGATRON)
    res = ElasticLauncher(cfg).run([MEGATRON_LM, *lm_args(*LM_VPP), "--shardsafe", "--shardsafe-no-start-holder"])
    assert res.ok and res.attempts == 2, (res, trainer_logs(str(tmp_path))[-3000:])
    agents = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("agent_*.log"))
    assert "workers are forked from the fork server" in agents and "start cold" not in agents, agents[-3000:]
    assert res.failures[0]["rank"] == 2 and res.failures[0]["cause"] == "rank_exit"
    got = restores(tmp_path)
    assert got[0] == -1 and got[1] in (2, 3), got
    assert restore_tiers(tmp_path)[1] == {"memory"}
    assert {e["notes"]["model_params"] for e in events(tmp_path)
            if e.get("kind") == "restore_end" and e.get("version", -1) >= 0} == {"from the node's holder"}
    assert_resumed_after(tmp_path, 1, got[1])
    assert_bit_identical(tmp_path, ref, steps=6)


# ---- bad arguments: a clear error on every rank before the first iteration -------------------------

def assert_failed_before_training(run_dir, res, *needles):
    assert not res.ok and res.attempts == 1, res
    logs = trainer_logs(str(run_dir))
    for n in needles:
        assert n in logs, f"{n!r} not in the trainer logs:\n{logs[-3000:]}"
    ev = events(run_dir)
    assert not [e for e in ev if e.get("kind") in ("iteration", "snapshot")], "training or snapshots started"
    assert not any(os.path.getsize(os.path.join(str(run_dir), f)) for f in os.listdir(str(run_dir))
                   if f.startswith("losses_rank")), "a loss was logged"


@needs_mcore
def test_bad_interval_fails_before_training(tmp_path):
    res = run_megatron(tmp_path, [*LAYOUTS["tp2_dp2"], "--steps", "3", "--shardsafe-interval", "0"], max_restarts=0)
    assert_failed_before_training(tmp_path, res, "ConfigError: --shardsafe-interval must be an integer >= 1")


@needs_mcore
def test_infeasible_parity_fails_before_training(tmp_path):
    """TP1xPP2xDP2 on 2 nodes x 2 ranks puts both DP peers of a pipeline stage on one node: a parity
    group of 2 on distinct nodes cannot exist. Every rank stops with the reason and the flags to change."""
    res = run_megatron(tmp_path, [*LAYOUTS["tp1_pp2_dp2"], "--steps", "3", "--shardsafe-parity-group-size", "2"],
                       max_restarts=0)
    assert_failed_before_training(tmp_path, res, "ConfigError: shardsafe parity settings cannot be placed on this job",
                                  "group_size=2", "at most 1 distinct nodes", "--shardsafe-parity-group-size")
    assert trainer_logs(str(tmp_path)).count("ConfigError: shardsafe parity settings") == 4


@needs_lm
def test_megatron_lm_bad_flags_fail_before_training(tmp_path):
    """Megatron-LM path: --shardsafe-interval 0 is refused in setup_model_and_optimizer, before the model
    is built; a parity group larger than the DP size is refused once the layout is known."""
    res = run_megatron(tmp_path / "interval", lm_args("--shardsafe-interval", "0"), script=MEGATRON_LM,
                       env=lm_env(), max_restarts=0)
    assert_failed_before_training(tmp_path / "interval", res, "--shardsafe-interval must be an integer >= 1")
    res = run_megatron(tmp_path / "parity", lm_args("--shardsafe-parity-group-size", "3"), script=MEGATRON_LM,
                       env=lm_env(), max_restarts=0)
    assert_failed_before_training(tmp_path / "parity", res, "group_size=3", "only 2 ranks",
                                  "--shardsafe-parity-group-size")
