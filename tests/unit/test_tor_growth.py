"""How a control-plane cost grows with the rank count (shardsafe/tor/growth.py) and ``tor project --from-bench``:
the fits against laws chosen by hand, and the projection from a small bench JSON (bench/control_plane_bench.py's
format, its per-N series only)."""
from __future__ import annotations

import json
import math

import pytest

from shardsafe.tor import growth
from shardsafe.tor.classes import Costs
from shardsafe.tor.cli import main
from shardsafe.tor.errors import TorError

RANKS = [4, 16, 64]
# Each series follows one law exactly, so a fit must give back its coefficients: detection and re-rendezvous
# grow by a constant per doubling (log), trainer start and restore as sqrt(N), the tree's vote as N^0.5 and the
# ring's linearly.
BENCH = {
    "schema": "shardsafe.bench.control_plane/1", "ranks": RANKS, "machine": {"cpus": 2},
    "detect_s": [0.04 + 0.01 * math.log2(n) for n in RANKS],
    "rendezvous_s": [0.15 * math.log2(n) for n in RANKS],
    "startup_s": [0.1 * n ** 0.5 for n in RANKS],
    "restore_s": [0.015 * n ** 0.5 for n in RANKS],
    "vote_tree_s": [0.001 * n ** 0.5 for n in RANKS],
    "vote_ring_s": [0.001 * n for n in RANKS],
    "kill_to_next_iteration_s": [0.8, 1.6, 3.2], "skipped_snapshots": [0, 0, 0],
}


@pytest.fixture
def bench_file(tmp_path):
    p = tmp_path / "cp.json"
    # The bench prints its table, then the object as the last line: a saved stdout is read as it is.
    p.write_text("control plane on this host: ...\n  ranks nodes | vote tree\n" + json.dumps(BENCH) + "\n")
    return p


def test_a_power_law_and_a_log_law_are_given_back():
    p = growth.fit_power(RANKS, BENCH["startup_s"])
    assert (p.a, p.b) == pytest.approx((0.1, 0.5)) and p.rel_rmse < 1e-9
    assert p(16384) == pytest.approx(0.1 * 128)
    lg = growth.fit_log(RANKS, BENCH["detect_s"])
    assert (lg.a, lg.b) == pytest.approx((0.04, 0.01)) and lg(1024) == pytest.approx(0.14)
    # "best" takes the form with the smaller relative error, per series.
    assert growth.fit(RANKS, BENCH["startup_s"]).form == "power"
    assert growth.fit(RANKS, BENCH["detect_s"]).form == "log"
    assert growth.fit(RANKS, BENCH["vote_ring_s"]).b == pytest.approx(1.0)
    assert "N^0.500" in p.describe() and "log2(N)" in lg.describe()


def test_zero_values_take_the_log_form_and_bad_series_say_what_was_expected():
    assert growth.fit(RANKS, [0, 0, 0]).form == "log" and growth.fit(RANKS, [0, 0, 0])(16384) == 0.0
    with pytest.raises(TorError, match="at least two rank counts"):
        growth.fit([64], [1.0])
    with pytest.raises(TorError, match="two different rank counts"):
        growth.fit([64, 64], [1.0, 2.0])
    with pytest.raises(TorError, match="values >= 0"):
        growth.fit(RANKS, [1.0, -1.0, 2.0])
    with pytest.raises(TorError, match="every value > 0"):
        growth.fit_power(RANKS, [0.0, 1.0, 2.0])
    with pytest.raises(TorError, match="fit form"):
        growth.fit(RANKS, [1, 2, 3], form="cubic")


def test_load_bench_reads_the_last_json_line_and_says_what_it_missed(tmp_path, bench_file):
    assert growth.load_bench(bench_file)["ranks"] == RANKS
    assert growth.is_bench_file(bench_file) and not growth.is_bench_file(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"no": "ranks"}\n')
    with pytest.raises(TorError, match="no JSON object with 'ranks'"):
        growth.load_bench(bad)
    with pytest.raises(TorError, match="at least two rank counts"):
        growth.BenchGrowth({"ranks": [64], "detect_s": [1.0]})
    with pytest.raises(TorError, match="none of"):
        growth.BenchGrowth({"ranks": RANKS, "kill_to_next_iteration_s": [1, 2, 3]})


def test_the_costs_at_scale_are_the_fits_and_the_vote_is_added_to_the_stall():
    g = growth.BenchGrowth(BENCH)
    c = g.costs(16384, base_stall_s=0.5)
    assert c["detect_s"] == pytest.approx(0.04 + 0.01 * 14)
    assert c["restart_s"] == pytest.approx(0.15 * 14)
    assert c["startup_s"] == pytest.approx(0.1 * 128)
    assert c["restore_memory_s"] == pytest.approx(0.015 * 128)
    assert c["snapshot_stall_s"] == pytest.approx(0.5 + 0.001 * 128)
    d = g.as_dict(16384, 0.5)
    assert d["extrapolated"] and d["factor_beyond_measured"] == 256 and d["fits"]["vote_ring_s"]["gives"] == ""
    assert d["vote_series"] == "vote_tree_s"


def test_the_last_rank_ins_vote_is_preferred_to_the_median_that_waits_for_the_slowest():
    # The median over ranks holds every rank's wait for the slowest to arrive; the last rank in waits for none.
    g = growth.BenchGrowth({**BENCH, "vote_tree_last_s": [0.0005 * math.log2(n) for n in RANKS]})
    assert g.vote_key == "vote_tree_last_s" and g.gives("vote_tree_s") == ""
    assert g.costs(1024, base_stall_s=0.5)["snapshot_stall_s"] == pytest.approx(0.5 + 0.005)


def test_poor_fits_and_superlinear_growth_far_beyond_the_data_are_flagged():
    g = growth.BenchGrowth({**BENCH, "startup_s": [0.1, 0.2, 12.0], "restore_s": [0.01 * n ** 1.5 for n in RANKS]})
    warn = g.warnings(16384)
    assert any(w.startswith("startup_s: neither form fits well") for w in warn)
    assert any(w.startswith("restore_s grows as N^1.50") and "256x beyond" in w for w in warn)
    assert not [w for w in g.warnings(64) if "beyond" in w]          # within the data: no extrapolation to flag
    assert not growth.BenchGrowth(BENCH).warnings(16384)             # exact laws, none faster than linear


def test_project_from_bench_uses_the_fitted_costs_and_says_what_is_measured(bench_file, capsys):
    assert main(["project", "--from-bench", str(bench_file), "--gpus", "16384", "--no-simulate", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    co, g = d["costs"], d["growth"]
    assert co["detect_s"] == pytest.approx(0.18) and co["startup_s"] == pytest.approx(12.8)
    assert co["snapshot_stall_s"] == pytest.approx(Costs().snapshot_stall_s + 0.128)
    assert co["restore_parity_s"] == Costs().restore_parity_s          # not measured: the default
    assert set(co["measured"]) == {"detect_s", "restart_s", "startup_s", "restore_memory_s", "snapshot_stall_s"}
    assert g["at_ranks"] == 16384 and g["fits"]["startup_s"]["b"] == pytest.approx(0.5)
    assert "restore_parity_s" in g["assumed_fields"] and "detect_s" in g["measured_fields"]
    # --from takes the same file; a flag overrides the bench, and the output says so.
    assert main(["project", "--from", str(bench_file), "--gpus", "16384", "--no-simulate", "--detect-s", "5",
                 "--json"]) == 0
    d2 = json.loads(capsys.readouterr().out)
    assert d2["costs"]["detect_s"] == 5.0 and d2["growth"]["overridden_by_flags"] == ["detect_s"]
    assert d2["costs"]["startup_s"] == pytest.approx(12.8)
    assert main(["project", "--from-bench", str(bench_file), "--gpus", "16384", "--no-simulate"]) == 0
    text = capsys.readouterr().out
    assert "0.1 * N^0.500" in text and "assumed" in text and "256x beyond" in text


def test_a_sweep_from_bench_takes_each_scales_own_costs(bench_file, capsys):
    def tor(*extra):
        assert main(["project", "--from-bench", str(bench_file), "--no-simulate", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)
    swept = {row["gpus"]: row["shardsafe"] for row in tor("--gpus", "16384", "--sweep", "1024,16384")["sweep"]}
    assert swept[16384] == pytest.approx(tor("--gpus", "16384")["strategies"]["shardsafe"]["tor"])
    assert swept[1024] == pytest.approx(tor("--gpus", "1024")["strategies"]["shardsafe"]["tor"])


def test_from_bench_errors_are_one_line_and_exit_2(tmp_path, bench_file, capsys):
    assert main(["project", "--from-bench", str(tmp_path / "none.json")]) == 2
    assert "cannot read it" in capsys.readouterr().err
    assert main(["project", "--from", str(bench_file), "--from-bench", str(bench_file)]) == 2
    assert "pass one of them" in capsys.readouterr().err
