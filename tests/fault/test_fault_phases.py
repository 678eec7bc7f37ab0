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
import pytest

from shardsafe.runcheck import compare_runs, read_jsonl

from .helpers import restores, run_job

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
    assert got[1] in (3, 4) and got[2] == got[1] and got[3] == got[1], got   # the interrupted restores repeated
    tiers = {(int(e.get("attempt") or 0), e["tier"]) for e in read_jsonl(f"{tmp_path}/events.jsonl")
             if e.get("kind") == "restore_end" and e.get("version", -1) >= 0}
    # node1's snapshot rebuilt from parity in attempt 4 (killed mid-rebuild); attempt 5 rebuilds again, or finds
    # the copy the lost rank had already rebuilt and sealed before its peer died
    assert (4, "parity") in tiers and ((5, "parity") in tiers or (5, "memory") in tiers), tiers
