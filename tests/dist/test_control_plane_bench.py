"""bench/control_plane_bench.py: its simulated path at 1024 ranks (rounds within the bound, the store's load per
connection measured on real gloo groups) and, slow, one real 4-rank run of the harness under shardsafe launch."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "control_plane_bench.py")


def _run(args, timeout):
    out = subprocess.run([sys.executable, BENCH, *args, "--json"], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stdout


def test_simulated_1024_ranks_vote_within_the_bound_and_restart_connects_log_pairs_per_rank():
    d, text = _run(["--ranks", "", "--simulate", "1024"], timeout=120)
    assert d["ranks"] == [] and d["simulated_ranks"] == [1024]
    row = d["simulation"]["rows"][0]
    assert row["nodes"] == 128 and d["rounds_bound"] == [16]
    assert d["rounds_per_vote"][0] <= 16 and d["targets"]["rounds_within_bound"]["met"]
    # Messages: each rank up and down once, each leader once per recursive-doubling round: O(N), none O(N^2).
    assert d["messages_per_vote"][0] == 2 * (1024 - 128) + 128 * 7
    assert row["ring"]["rounds"] == 2 * 1023 and row["ring"]["messages"] == 2 * 1024 * 1023
    rs = row["restart"]
    assert rs["collectives"] == 2 and rs["rounds"] <= 2 * 16
    assert rs["max_pairs_per_rank"] <= 2 * (8 + 7)          # its node and log2(nodes) leaders, per hierarchy
    # The store's load, from counts on real gloo groups: one set per group member (3 operations for a member of a
    # group on the shared device, which also reads its own address), a get and a wait each way per connected pair;
    # a torch world group as a full mesh reads every member's address on every rank.
    store = d["simulation"]["store"]
    assert (store["per_mesh_member"], store["per_lazy_member"], store["per_pair"]) == (3.0, 1.0, 4.0)
    # 128 nodes of 8: the node groups connect every pair (28 each), the leaders' group (128 > 16) the pairs it uses
    c = rs["connections"]
    assert (c["mesh_members"], c["mesh_pairs"], c["lazy_members"]) == (2 * 1024, 2 * 128 * 28, 2 * 128)
    assert c["lazy_pairs"] == 2 * (row["vote"]["pairs"] - 128 * 7)
    assert rs["pairs"] == c["mesh_pairs"] + c["lazy_pairs"]
    assert rs["store_ops"] == 3 * c["mesh_members"] + c["lazy_members"] + 4 * rs["pairs"]
    assert row["ring"]["store_ops_full_mesh"] > 50 * rs["store_ops"]   # N^2 against N: 54x at 1024 ranks
    assert "rounds per vote" in text


@pytest.mark.slow
def test_a_4_rank_run_measures_both_votes_a_kill_and_the_restart():
    d, text = _run(["--ranks", "4", "--steps", "16", "--kill-at", "8", "--step-s", "0.2", "--warmup", "2", "--keep"],
                   timeout=240)
    assert d["ranks"] == [4] and d["launcher"] == "elastic"
    r = d["rows"][0]
    text += f"\n(the job's run directory, with its events, is kept for a failure: {r['run_dir']})"
    assert d["vote_tree_s"][0] > 0 and d["vote_ring_s"][0] > 0
    assert r["samples"]["tree"] >= 4 * 4 and r["samples"]["ring"] >= 4 * 4
    assert d["skipped_snapshots"] == [0] and r["restore_tier"] == ["memory"], (r["restore_by_rank"], text[-3000:])
    assert 0 < d["kill_to_next_iteration_s"][0] < 60
    kinds = [k for k, _, _ in r["start_collectives"]]
    # the places gather carrying what every rank holds, then the vote on the verified copy carrying the budget check
    assert kinds == ["gather_bytes", "gather_ints"], r["start_collectives"]
    assert r["start_collectives"][1][1] == 3 + 4, r["start_collectives"]
    assert set(r["start_phases"]) >= {"init_process_group (store connect)", "placement + restore"}
    assert "kill -> next" in text
    shutil.rmtree(r["run_dir"])
