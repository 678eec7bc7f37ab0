"""shardsafe.runcheck's proof of resume (a deterministic run that starts over also ends bit-exact): the
restarted attempt's first step must follow the version it restored, engine by engine for a program with several."""
import json

from shardsafe.runcheck import resume_problems


def _write(d, losses, restores):
    with open(d / "losses_rank0.jsonl", "w") as f:
        for attempt, step, engine in losses:
            f.write(json.dumps({"step": step, "loss": "0x1p+0", "attempt": attempt,
                                **({"engine": engine} if engine else {})}) + "\n")
    with open(d / "events.jsonl", "w") as f:
        for attempt, version, engine in restores:
            f.write(json.dumps({"kind": "restore_end", "rank": 0, "attempt": attempt, "version": version,
                                **({"engine": engine} if engine else {})}) + "\n")


def test_one_engine_must_continue_after_its_restore(tmp_path):
    _write(tmp_path, [(0, 1, ""), (0, 2, ""), (0, 3, ""), (1, 3, ""), (1, 4, "")], [(0, -1, ""), (1, 2, "")])
    assert resume_problems(str(tmp_path), 1) == []
    _write(tmp_path, [(0, 1, ""), (0, 2, ""), (1, 1, ""), (1, 2, "")], [(0, -1, ""), (1, 1, "")])
    assert resume_problems(str(tmp_path), 1) == ["rank 0: attempt 1 restored version 1 but its first step was 1"]


def test_a_fresh_start_after_an_attempt_that_died_before_committing_anything(tmp_path):
    """Attempt 0 died before its first step (nothing committed): attempt 1 starts fresh at step 1, which is no
    problem; one that started fresh but skipped steps, or started fresh after a commit, is."""
    _write(tmp_path, [(1, 1, ""), (1, 2, ""), (2, 2, "")], [(1, -1, ""), (2, 1, "")])
    assert resume_problems(str(tmp_path), 1) == []
    _write(tmp_path, [(0, 1, ""), (0, 2, ""), (1, 2, ""), (1, 3, "")], [(0, -1, ""), (1, -1, "")])
    assert resume_problems(str(tmp_path), 1) == ["rank 0: attempt 1 restored version -1 but its first step was 2"]
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write(json.dumps({"kind": "snapshot", "rank": 0, "attempt": 0, "version": 1, "committed": True}) + "\n")
    assert resume_problems(str(tmp_path), 1) == [
        "rank 0: attempt 1 started fresh although an earlier attempt committed snapshots",
        "rank 0: attempt 1 restored version -1 but its first step was 2"]


def test_each_engine_is_checked_against_its_own_restore(tmp_path):
    """Two engines numbered across the program (the second's step s is logged as 10 + s): attempt 1 restored
    the first engine's version 10 (nothing left to train) and the second's version 3."""
    first = [(0, s, "") for s in range(1, 11)] + [(0, 10 + s, "engine1") for s in range(1, 5)]
    restores = [(0, -1, ""), (0, -1, "engine1"), (1, 10, ""), (1, 3, "engine1")]
    _write(tmp_path, first + [(1, 10 + s, "engine1") for s in range(4, 11)], restores)
    assert resume_problems(str(tmp_path), 1, offsets={"engine1": 10}) == []
    # without the offset the second engine's first step reads as 14: flagged, not silently accepted
    assert resume_problems(str(tmp_path), 1) == [
        "rank 0: attempt 1 engine 'engine1' restored version 3 but its first step was 14"]
    # the second engine started over in attempt 1 although it restored 3
    _write(tmp_path, first + [(1, 10 + s, "engine1") for s in range(1, 11)], restores)
    assert resume_problems(str(tmp_path), 1, offsets={"engine1": 10}) == [
        "rank 0: attempt 1 engine 'engine1' restored version 3 but its first step was 1"]
    # an engine whose restore event is missing in the attempt
    _write(tmp_path, first + [(1, 10 + s, "engine1") for s in range(4, 11)], restores[:3])
    assert resume_problems(str(tmp_path), 1, offsets={"engine1": 10}) == [
        "rank 0: attempt 1 engine 'engine1' logged steps but no restore_end event"]
