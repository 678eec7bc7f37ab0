"""SIGKILL in every phase of the background snapshot work and of the restore (issue 15 item 11).

Two jobs, each taking one fault per attempt (fault j applies to attempt j), 2 nodes x 1 rank, ZeRO-2 bf16,
parity RS(1,1) across the nodes:
- snapshot side: a rank killed as its parity exchange starts, after the first block of stripes arrived,
  after its parity is sealed (before the commit vote), and after the vote agreed but before its holder
  committed the version;
- restore side: a rank killed after its copy verified (before the vote), halfway through writing the
  snapshot into its live tensors, and, after a whole node was lost, in the middle of the parity rebuild.
Every attempt after the first must continue right after the version it restored, and the finished job is
bit-identical to an uninterrupted run; an interrupted restore is simply repeated from the holders.
"""
import json

import pytest

from shardsafe.runcheck import compare_runs, read_jsonl

from .helpers import committed_everywhere, live_holders, restores, run_job

STEPS = 16
pytestmark = pytest.mark.slow


def _check(tmp_path, ref, res, faults):
    assert res.ok and res.attempts == len(faults) + 1, (res, faults)
    injected = [e["fault"] for e in read_jsonl(f"{tmp_path}/events.jsonl") if e.get("kind") == "fault_injected"]
    assert sorted(set(injected)) == sorted(f for f in faults if not f.startswith("kill-node")), injected
    cmp = compare_runs(str(tmp_path), str(ref), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)


def test_kills_during_parity_exchange_and_commit(tmp_path, reference):
    ref = reference(2, "bf16", STEPS)
    faults = ["kill-parity-before:1@4", "kill-parity-block:0@7", "kill-parity-after:1@10", "kill-commit:0@13"]
    res = run_job(tmp_path, stage=2, dtype="bf16", steps=STEPS, inject=";".join(faults), max_restarts=5)
    _check(tmp_path, ref, res, faults)
    got = restores(tmp_path)
    # The killed version's data was sealed on both ranks (same timeline) or not: the restore takes it or the one
    # before; a version sealed but never committed is restorable from memory, never from parity.
    assert got[1] in (3, 4) and got[2] in (6, 7) and got[3] in (9, 10) and got[4] in (12, 13), got


def test_kills_during_restore_verify_apply_and_rebuild(tmp_path, reference):
    ref = reference(2, "bf16", STEPS)
    faults = ["kill-rank:1@5", "kill-restore-verify:0@0", "kill-restore-apply:1@0", "kill-node:node1@10",
              "kill-restore-rebuild:0@0"]
    res = run_job(tmp_path, stage=2, dtype="bf16", steps=STEPS, inject=";".join(faults), max_restarts=6)
    _check(tmp_path, ref, res, faults)
    got = restores(tmp_path)
    evs = read_jsonl(f"{tmp_path}/events.jsonl")
    # An attempt killed inside its restore ends no restore (its peer waits in the vote and is stopped with it):
    # the version each interrupted restore was working on is the one its fault names.
    at = {int(e.get("attempt") or 0): int(e["step"]) for e in evs if e.get("kind") == "fault_injected"}
    assert 1 not in got and 2 not in got and 4 not in got, got
    assert got[3] in (3, 4) and at[1] == at[2] == got[3], (got, at)   # the interrupted restores repeated
    # node1's snapshot was being rebuilt from parity in attempt 4 (the rebuild fault only fires there): the newest
    # version every rank committed in attempt 3 (the node dies once the launcher sees step 10, and the other rank
    # may commit a step or two more before it blocks), or the one after it, sealed everywhere while its vote was
    # still out. Attempt 5 restores that version again, rebuilding it, or from the copy the lost rank had rebuilt
    # and sealed before its peer died.
    committed = committed_everywhere(tmp_path, 2, attempt=3)
    assert 9 <= at[4] and committed <= at[4] <= committed + 1 and got[5] == at[4], (got, at, committed)
    tiers = {(int(e.get("attempt") or 0), e["tier"]) for e in evs if e.get("kind") == "restore_end"
             and e.get("version", -1) >= 0}
    assert (5, "parity") in tiers or (5, "memory") in tiers, tiers


def test_holders_killed_alone_and_mid_flush_then_both_nodes_lost(tmp_path, reference):
    """node1's holder dies halfway through flushing version 6 to the persistent tier (a torn flush), node0's
    holder is killed alone at step 8; the trainers run on and each node's rank starts a new holder. Then both
    nodes are lost (more than parity covers): the restore comes from the persistent tier, from a version every
    rank flushed completely (never the torn one), and the job ends bit-identical, resumed from it."""
    fused = ["--optimizer", "fused-adamw"]   # DeepSpeed's default optimizer (FusedAdam), as users get it
    ref = reference(2, "bf16", STEPS, extra=fused)
    disk = tmp_path / "persist"
    faults = "kill-flush:node1@6&kill-holder:node0@8&kill-node:node0+node1@12"
    res = run_job(tmp_path, stage=2, dtype="bf16", steps=STEPS, inject=faults, max_restarts=1,
                  # slower steps from 6 on: the flush of 6 (and its kill) happens before the node loss at 12
                  extra=[*fused, "--step-sleep", "0.25", "--step-sleep-after", "5",
                         "--shardsafe-json", json.dumps({"persist_dir": str(disk), "persist_every": 2})])
    assert res.ok and res.attempts == 2, res
    evs = read_jsonl(f"{tmp_path}/events.jsonl")
    killed = sorted((e["node"], e["fault"].split(":")[0]) for e in evs if e.get("kind") == "holder_killed")
    assert killed == [("node0", "kill-holder"), ("node1", "kill-flush")], killed
    restarted = sorted(e["node"] for e in evs if e.get("kind") == "holder_restarted")
    assert restarted == ["node0", "node1"], restarted
    # the node loss killed the holders the ranks had started too, and the job's end stopped the replacements
    assert live_holders(tmp_path, wait_s=30) == []
    # the flushes done before both nodes were lost (the torn one never completes)
    # (up to the restart's first restore: the lost holders wrote nothing after they died, the replacements
    # flush only what attempt 1 commits after its restore)
    t_lost = min(e["t"] for e in evs if e.get("kind") == "restore_start" and int(e.get("attempt") or 0) == 1)
    flushed = {(int(e["rank"]), int(e["version"])) for e in evs
               if e.get("kind") == "flush" and e.get("ok") and e["t"] < t_lost}
    # (node0's own flush of 6 may or may not have finished before its holder was killed at step 8)
    assert (1, 6) not in flushed, sorted(flushed)
    ends = [e for e in evs if e.get("kind") == "restore_end" and int(e.get("attempt") or 0) == 1]
    assert {e["tier"] for e in ends} == {"persistent"} and len({e["version"] for e in ends}) == 1, ends
    # the newest version both ranks had flushed completely, never the torn one (its peer's copy of 6 is there)
    both = {v for r, v in flushed if r == 0 and (1, v) in flushed}
    assert ends[0]["version"] == max(both), (ends[0]["version"], sorted(flushed))
    cmp = compare_runs(str(tmp_path), str(ref), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)
