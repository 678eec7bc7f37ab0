"""The shrink demo's oracle stretches (shardsafe/demo_shrink.py ``_kept_segments``) from a run's restore events."""
import json

from shardsafe.demo_shrink import _kept_segments


def _run(tmp_path, restores):
    with open(tmp_path / "events.jsonl", "w") as f:
        for attempt, rank, version in restores:
            f.write(json.dumps({"kind": "restore_end", "attempt": attempt, "rank": rank, "version": version}) + "\n")
    return str(tmp_path)


def test_each_stretch_starts_at_the_version_its_first_attempt_restored(tmp_path):
    run = _run(tmp_path, [(0, 0, -1), (1, 0, 4), (1, 1, 3), (2, 0, 7)])
    segs = _kept_segments(run, [4, 3, 4], 10)
    assert [(s["dp"], s["attempts"], s["first"], s["last"]) for s in segs] == \
        [(4, [0], 0, 3), (3, [1], 3, 7), (4, [2], 7, 10)]


def test_an_attempt_killed_inside_its_restore_does_not_end_the_previous_stretch_at_zero(tmp_path):
    """Attempt 1, the first at the smaller size, was killed while it wrote the re-partitioned state (no restore_end
    from any rank); attempt 2 restored version 3 again: the stretch at 3 starts there."""
    run = _run(tmp_path, [(0, 0, -1), (2, 0, 3), (2, 1, 3), (3, 0, 3), (4, 0, 7)])
    segs = _kept_segments(run, [4, 3, 3, 3, 4], 10)
    assert [(s["dp"], s["attempts"], s["first"], s["last"]) for s in segs] == \
        [(4, [0], 0, 3), (3, [1, 2, 3], 3, 7), (4, [4], 7, 10)]
