"""Restart in place (``--restart in-place``, shardsafe.inplace): a SIGKILLed rank starts again alone, the others go on
in their processes, and every rank ends bit-exact.

Two simulated nodes of two ranks under ``shardsafe launch``'s launcher (torchrun agents, holders, fork servers),
bench/control_plane_trainer.py on every rank: shardsafe's runtime, parity and restore over a synthetic optimizer
state (an fp32 master and two moments, and a step counter) whose every step is an in-place update. The oracle is
the state an uninterrupted run ends with, computed here from the same seed and updates: every rank's final state
must hash to it, byte for byte.
"""
import hashlib
import json
import os
import sys

import pytest

from shardsafe.launch import PRELOAD_DEEPSPEED
from shardsafe.launch.elastic import ElasticConfig, ElasticLauncher
from shardsafe.runcheck import compare_runs, read_jsonl

from .helpers import SCRIPT, restores

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(ROOT, "bench", "control_plane_trainer.py")
PRELOAD = ("torch", "torch.distributed", "shardsafe.runtime", "shardsafe.snapshot.pipeline")
STEPS, KILL_AT, MB, WORLD = 10, 5, 0.5, 4
pytestmark = pytest.mark.slow


def expected_digest(rank: int) -> str:
    """What rank ``rank`` ends with when nothing fails: the trainer's synthetic state after STEPS updates."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from control_plane_trainer import _synthetic_adapter
    finally:
        sys.path.pop(0)
    state = _synthetic_adapter(int(MB * 1e6), seed=rank)
    for step in range(1, STEPS + 1):
        state.optimizer_step(step)
    return hashlib.sha256(b"".join(state.tensors[k].numpy().tobytes() for k in sorted(state.tensors))).hexdigest()


def run(tmp_path, inject: str):
    cfg = ElasticConfig(nodes=2, nproc_per_node=2, run_dir=str(tmp_path), inject=inject, memory_budget_gb=0.25,
                        max_restarts=2, timeout_s=300, preload=PRELOAD, restart="in-place")
    res = ElasticLauncher(cfg).run([TRAINER, "--out", str(tmp_path), "--mb", str(MB), "--steps", str(STEPS),
                                    "--step-s", "0.2", "--votes", "tree", "--timeout-s", "30"])
    logd = tmp_path / "logs"
    logs = "".join((logd / f).read_text(errors="replace") for f in sorted(os.listdir(logd)) if f.startswith("agent_"))
    lines = {r: [json.loads(x) for x in (tmp_path / f"bench_rank{r}.jsonl").read_text().splitlines() if x.strip()]
             for r in range(WORLD)}
    return res, logs, lines, read_jsonl(str(tmp_path / "events.jsonl"))


def started(lines, attempt):
    """Per rank: the line each attempt's start wrote (pid, restored version)."""
    return {r: next(x for x in ls if x.get("attempt") == attempt and "restored_version" in x) for r, ls in lines.items()}


def check_bit_exact(lines):
    for r, ls in lines.items():
        end = [x for x in ls if "done" in x]
        assert len(end) == 1 and end[0]["done"] == STEPS, (r, ls)
        assert end[0]["state_sha256"] == expected_digest(r), f"rank {r} ended with another state"


def check_resumed(evs, version, world=WORLD):
    """Attempt 1 restored ``version`` from memory on every rank and went on with the step after it."""
    ends = [e for e in evs if e["kind"] == "restore_end" and e.get("attempt") == 1]
    assert sorted(e["rank"] for e in ends) == list(range(world)), ends
    assert {(e["tier"], e["version"]) for e in ends} == {("memory", version)}, ends
    ready = {e["rank"]: e["iteration"] for e in evs if e["kind"] == "train_ready" and e.get("attempt") == 1}
    assert ready == {r: version + 1 for r in range(world)}, ready
    first = {}
    for e in evs:
        if e["kind"] == "iteration" and e.get("attempt") == 1:
            first.setdefault(e["rank"], e["iteration"])
    assert first == {r: version + 1 for r in range(world)}, first


def test_a_killed_rank_starts_again_alone_and_every_rank_ends_bit_exact(tmp_path):
    res, logs, lines, evs = run(tmp_path, f"kill-rank:3@{KILL_AT}")
    assert res.ok and res.attempts == 2, (res, logs[-4000:])
    assert [(f["cause"], f["rank"], f["rc"]) for f in res.failures] == [("rank_exit", 3, -9)], res.failures
    assert "restarting them in place as attempt 1" in logs, logs[-4000:]
    a0, a1 = started(lines, 0), started(lines, 1)
    # in place: the survivors are the same processes, only rank 3 is a new one
    assert [a0[r]["pid"] == a1[r]["pid"] for r in range(WORLD)] == [True, True, True, False], (a0, a1)
    assert {a1[r]["in_place"].get("let_go_s") is not None for r in (0, 1, 2)} == {True}
    # the newest version every rank sealed before the kill at the start of step 5: 4, or 3 if rank 3's copy of 4
    # was still running when it died; the same on every rank
    (version,) = {a1[r]["restored_version"] for r in range(WORLD)}
    assert version in (KILL_AT - 2, KILL_AT - 1), version
    check_resumed(evs, version)
    check_bit_exact(lines)
    kinds = [(e["kind"], e.get("attempt")) for e in evs if e["kind"] in ("attempt_start", "failure_detected")]
    assert kinds == [("attempt_start", 0), ("failure_detected", 0), ("attempt_start", 1)], kinds


def test_rank_0_killed_restarts_every_worker_and_ends_bit_exact(tmp_path):
    """Rank 0's process hosts the workers' store: no restart in place, the agents restart every worker (and say
    why), as without --restart in-place."""
    res, logs, lines, evs = run(tmp_path, f"kill-rank:0@{KILL_AT}")
    assert res.ok and res.attempts == 2, (res, logs[-4000:])
    assert "not restarting in place (rank 0 hosts the workers' store)" in logs, logs[-4000:]
    a0, a1 = started(lines, 0), started(lines, 1)
    assert not any(a0[r]["pid"] == a1[r]["pid"] for r in range(WORLD)), (a0, a1)
    (version,) = {a1[r]["restored_version"] for r in range(WORLD)}
    check_resumed(evs, version)
    check_bit_exact(lines)


DS_STEPS, DS_KILL_AT, DS_WORLD = 10, 6, 3
FUSED = ("--optimizer", "fused-adamw", "--no-scheduler", "--no-clip")
DS_CASES = [
    # DeepSpeed's default optimizer (FusedAdam from the config's "AdamW"): its CPU kernel keeps beta powers in a
    # C++ object that a survivor builds again with its engine; no scheduler, no clipping
    (2, "bf16", FUSED),
    # bf16 + ZeRO-1 + fp32 gradient accumulation: BF16_Optimizer over torch AdamW, with scheduler and clipping
    (1, "bf16", ("--grad-accum-dtype", "fp32")),
]


def run_deepspeed(tmp_path, stage, dtype, extra, kill):
    cfg = ElasticConfig(nodes=DS_WORLD, nproc_per_node=1, run_dir=str(tmp_path),
                        inject=f"kill-rank:{kill}@{DS_KILL_AT}", memory_budget_gb=0.5, max_restarts=2, timeout_s=240, preload=PRELOAD_DEEPSPEED,
                        restart="in-place")
    res = ElasticLauncher(cfg).run([SCRIPT, "--steps", str(DS_STEPS), "--zero-stage", str(stage), "--dtype", dtype,
                                    *extra, "--in-place"])
    logd = tmp_path / "logs"
    logs = "".join((logd / f).read_text(errors="replace") for f in sorted(os.listdir(logd)) if f.startswith("agent_"))
    return res, logs, read_jsonl(str(tmp_path / "events.jsonl"))


def check_deepspeed_bit_exact(tmp_path, ref):
    cmp = compare_runs(str(tmp_path), str(ref), DS_WORLD, DS_STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)


@pytest.mark.parametrize("stage, dtype, extra", DS_CASES, ids=["z2-fusedadam", "z1-bf16optimizer"])
def test_deepspeed_engines_restart_in_place_bit_exact(tmp_path, reference, stage, dtype, extra):
    """examples/ds_pretrain_gpt.py --in-place on three simulated nodes: rank 1 SIGKILLed at the start of optimizer
    step 6 starts again alone. Ranks 0 and 2, whose collectives of that step fail as it dies, wait for the agent's
    notice and build their engines again in their processes (DeepSpeed's cached groups forgotten,
    adapters/deepspeed/inplace.py); every rank restores the same version from memory, and the run ends with the
    losses and final state (module, optimizer and scheduler state_dicts, counters) of an uninterrupted one."""
    cold = "fused-adamw" in extra   # as in test_deepspeed_optimizers: the JIT-loaded kernel's builder
    ref = reference(stage, dtype, DS_STEPS, extra=extra, world=DS_WORLD, cold=cold)
    res, logs, evs = run_deepspeed(tmp_path, stage, dtype, extra, kill=1)
    assert res.ok and res.attempts == 2, (res, logs[-4000:])
    assert [(f["cause"], f["rank"], f["rc"]) for f in res.failures] == [("rank_exit", 1, -9)], res.failures
    assert "restarting them in place as attempt 1" in logs, logs[-4000:]
    # only rank 1 is a new process: the survivors' processes started once, in attempt 0
    starts = sorted((e.get("attempt"), e["rank"]) for e in evs if e["kind"] == "trainer_start")
    assert starts == [(0, 0), (0, 1), (0, 2), (1, 1)], starts
    for r in (0, 2):
        assert f"[rank {r}] the job restarts in place at attempt 1" in logs, logs[-4000:]
    got = restores(tmp_path)
    assert got[0] == -1 and got[1] in (DS_KILL_AT - 2, DS_KILL_AT - 1), got
    check_resumed(evs, got[1], DS_WORLD)
    check_deepspeed_bit_exact(tmp_path, ref)


def test_a_survivor_stuck_in_a_collective_makes_the_job_restart_in_full_bit_exact(tmp_path, reference):
    """Rank 2 SIGKILLed instead: rank 0's all-reduce of that step waits for a part that never comes (gloo ends it
    only at the group's timeout, 30 minutes for DeepSpeed's groups) and its main thread runs no signal handler.
    Its watchdog (shardsafe.inplace._Watchdog) makes it exit with 75 within a second or two, and the job restarts
    in full from memory, bit-exact, instead of waiting."""
    ref = reference(2, "bf16", DS_STEPS, extra=FUSED, world=DS_WORLD, cold=True)
    res, logs, evs = run_deepspeed(tmp_path, 2, "bf16", FUSED, kill=2)
    assert res.ok, (res, logs[-4000:])
    got = restores(tmp_path)
    if res.attempts == 2:   # every survivor's collective failed by itself: in place after all
        assert "[rank 0] the job restarts in place at attempt 1" in logs, logs[-4000:]
    else:
        assert res.attempts == 3, (res, logs[-4000:])
        assert "which no signal ends. Exiting with 75 so the job restarts in full" in logs, logs[-4000:]
        assert "not restarting in place" in logs, logs[-4000:]
        assert [(f["cause"], f["rank"]) for f in res.failures][0] == ("rank_exit", 2), res.failures
        # attempt 1 (in place) never got to train; attempt 2 (everyone started again) restored what was sealed
        assert got[0] == -1 and got[2] in (DS_KILL_AT - 2, DS_KILL_AT - 1), got
        starts = sorted((e.get("attempt"), e["rank"]) for e in evs if e["kind"] == "trainer_start")
        assert [a for a, _ in starts].count(2) == DS_WORLD, starts
    check_deepspeed_bit_exact(tmp_path, ref)


def test_megatron_core_restarts_in_place_bit_exact(tmp_path):
    """examples/megatron_pretrain_gpt.py --in-place (megatron-core, DistributedOptimizer over three data-parallel
    ranks on three simulated nodes): rank 1 SIGKILLed before its optimizer step 4 starts again alone; ranks 0 and
    2 clear parallel_state (adapters/megatron/inplace.py) and build it, the model and the optimizer again in their
    processes; every rank restores from memory and ends bit-exact with an uninterrupted run."""
    from .test_megatron_resume import MCORE, OWN_LOOP, STEPS as MSTEPS, run_megatron
    if MCORE is None:
        pytest.skip("megatron-core is not installed in this venv (pip install megatron-core==0.16.1, docs/megatron.md)")
    from shardsafe.launch import PRELOAD_MEGATRON
    ref = tmp_path / "reference"
    ref.mkdir()
    args = ["--steps", str(MSTEPS), "--timeout-s", "30"]
    assert run_megatron(ref, args, nodes=3, nproc=1, shardsafe=False, max_restarts=0).ok
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = ElasticConfig(nodes=3, nproc_per_node=1, run_dir=str(run_dir), inject="kill-rank:1@4", memory_budget_gb=0.5,
                        max_restarts=2, timeout_s=240, preload=PRELOAD_MEGATRON, restart="in-place")
    res = ElasticLauncher(cfg).run([OWN_LOOP, *args, "--shardsafe", "--in-place", "--out", str(run_dir)])
    logd = run_dir / "logs"
    logs = "".join((logd / f).read_text(errors="replace") for f in sorted(os.listdir(logd)) if f.startswith("agent_"))
    assert res.ok and res.attempts == 2, (res, logs[-4000:])
    assert [(f["cause"], f["rank"], f["rc"]) for f in res.failures] == [("rank_exit", 1, -9)], res.failures
    evs = read_jsonl(str(run_dir / "events.jsonl"))
    starts = sorted((e.get("attempt"), e["rank"]) for e in evs if e["kind"] == "trainer_start")
    assert starts == [(0, 0), (0, 1), (0, 2), (1, 1)], starts
    for r in (0, 2):
        assert f"[rank {r}] the job restarts in place at attempt 1" in logs, logs[-4000:]
    got = restores(run_dir)
    assert got[0] == -1 and got[1] in (2, 3), got
    check_resumed(evs, got[1], 3)
    cmp = compare_runs(str(run_dir), str(ref), 3, MSTEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)


def test_megatron_lm_pretrain_restarts_in_place_bit_exact(tmp_path, monkeypatch):
    """Megatron-LM's own loop (examples/megatron_lm_pretrain_gpt.py: TP2 x DP2, bf16, DistributedOptimizer) on 2
    nodes x 2 ranks: rank 2 is SIGKILLed before its optimizer step 4 and starts again alone; ranks 0, 1 and 3 run
    Megatron-LM's pretrain again in their processes (its arguments, timers, microbatch calculator, rerun state
    machine and groups cleared: adapters/megatron/inplace.py), every rank restores from memory and ends bit-exact
    with plain Megatron-LM."""
    from shardsafe.launch import PRELOAD_MEGATRON

    from .test_megatron_resume import LM_ARGS, MCORE_017, MEGATRON_LM, lm_args, lm_env, run_megatron
    if not os.path.isdir(os.path.join(MCORE_017, "megatron", "training")):
        pytest.skip(f"Megatron-LM's loop needs megatron-core >= 0.17 in {MCORE_017} (docs/megatron.md)")
    assert os.path.exists(LM_ARGS)
    ref = tmp_path / "reference"
    ref.mkdir()
    assert run_megatron(ref, lm_args(), script=MEGATRON_LM, env=lm_env(), shardsafe=False, max_restarts=0).ok
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("PYTHONPATH", lm_env()["PYTHONPATH"])
    cfg = ElasticConfig(nodes=2, nproc_per_node=2, run_dir=str(run_dir), inject="kill-rank:2@4", memory_budget_gb=0.5,
                        max_restarts=2, timeout_s=300, preload=PRELOAD_MEGATRON, restart="in-place")
    res = ElasticLauncher(cfg).run([MEGATRON_LM, *lm_args(), "--shardsafe", "--shardsafe-no-start-holder",
                                    "--shardsafe-timeout-s", "30", "--out", str(run_dir)])
    logd = run_dir / "logs"
    logs = "".join((logd / f).read_text(errors="replace") for f in sorted(os.listdir(logd)))
    assert res.ok and res.attempts == 2, (res, logs[-4000:])
    assert [(f["cause"], f["rank"], f["rc"]) for f in res.failures] == [("rank_exit", 2, -9)], res.failures
    evs = read_jsonl(str(run_dir / "events.jsonl"))
    starts = sorted((e.get("attempt"), e["rank"]) for e in evs if e["kind"] == "trainer_start")
    assert starts == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 2)], starts
    for r in (0, 1, 3):
        assert f"[rank {r}] the job restarts in place at attempt 1" in logs, logs[-4000:]
    got = restores(run_dir)
    assert got[0] == -1 and got[1] in (2, 3), got
    check_resumed(evs, got[1], 4)
    cmp = compare_runs(str(run_dir), str(ref), 4, 6)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)


@pytest.mark.parametrize("kill", [1, 0])
def test_the_local_launcher_restarts_in_place_bit_exact(tmp_path, reference, kill):
    """The local launcher (`shardsafe demo`, the tests) with ``restart="in-place"``: the killed rank starts again
    alone, rank 0 included (the store is the launcher's, not rank 0's), and the run ends bit-exact."""
    import uuid

    from shardsafe.launch import LaunchConfig, LocalLauncher
    ref = reference(2, "bf16", DS_STEPS, extra=FUSED, world=DS_WORLD, cold=True)
    cfg = LaunchConfig(nodes=DS_WORLD, nproc_per_node=1, job_id=f"ip{uuid.uuid4().hex[:8]}", run_dir=str(tmp_path),
                       inject=f"kill-rank:{kill}@{DS_KILL_AT}", max_restarts=2, memory_budget_gb=0.5,
                       attempt_timeout_s=240, preload=PRELOAD_DEEPSPEED, restart="in-place")
    res = LocalLauncher(cfg).run([sys.executable, SCRIPT, "--steps", str(DS_STEPS), "--zero-stage", "2", "--dtype",
                                  "bf16", *FUSED, "--in-place", "--out", str(tmp_path)])
    logs = "".join((tmp_path / f).read_text(errors="replace") for f in sorted(os.listdir(tmp_path))
                   if f.startswith("trainer_rank"))
    assert res.ok and res.attempts == 2, (res, logs[-4000:])
    assert [(f["cause"], f["rank"], f["rc"]) for f in res.failures] == [("rank_exit", kill, -9)], res.failures
    evs = read_jsonl(str(tmp_path / "events.jsonl"))
    starts = sorted((e.get("attempt"), e["rank"]) for e in evs if e["kind"] == "trainer_start")
    assert starts == sorted([(0, 0), (0, 1), (0, 2), (1, kill)]), starts
    got = restores(tmp_path)
    assert got[0] == -1 and got[1] in (DS_KILL_AT - 2, DS_KILL_AT - 1), got
    check_resumed(evs, got[1], DS_WORLD)
    check_deepspeed_bit_exact(tmp_path, ref)
