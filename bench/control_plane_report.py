"""The text bench/control_plane_bench.py prints, rendered from its JSON object (so both show the same numbers)."""
from __future__ import annotations


LAUNCHERS = {"elastic": "shardsafe launch (ElasticLauncher: torchrun agent + holder + fork server per node)",
             "local": "local launcher (one fork server)"}


def _ms(x) -> str:
    return f"{'-':>8}" if x is None else f"{x * 1e3:>6.1f}ms"


def _s(x) -> str:
    return f"{'-':>7}" if x is None else f"{x:>6.2f}s"


def _ratio(a, b) -> str:
    return f"{'-':>6}" if not a or not b else f"{a / b:>5.1f}x"


def _big(x: float) -> str:
    for unit, k in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= k:
            return f"{x / k:.1f}{unit}"
    return f"{x:.0f}"


def report_text(out: dict) -> str:
    m, st = out["machine"], out["settings"]
    lines = []
    rows = out.get("rows") or []
    if rows:
        lines += [
            f"control plane on this host: {m['cpus']} CPUs ({m['cpu']}), torch {m['torch']}, load average "
            f"{m['load_average_start']:.1f} -> {m.get('load_average_end', 0):.1f}",
            f"  N ranks share {m['cpus']} cores: every hop of a collective is a process switch, not a network's "
            "latency; compare the designs by their ratio in the same run",
            f"  launcher: {LAUNCHERS.get(out['launcher'], out['launcher'])}; "
            f"{st['mb']:g} MB of state per rank, {st['step_s']:g} s per step, a snapshot every step, parity on; "
            f"rank N-1 SIGKILLed at step {st['kill_at']} of {st['steps']}; restart "
            f"{'in place (rank N-1 alone starts again)' if out.get('restart') == 'in-place' else 'of every trainer'}",
            f"  votes ({st['votes']}): even versions on the hierarchy (tree), odd on gloo's ring all-reduce over a "
            f"world group (ring); medians over ranks and versions, {st['warmup']} versions per attempt left out",
            "",
            f"  {'ranks':>5} {'nodes':>5} | {'vote tree':>9} {'ring':>8} {'ring/tree':>9} | {'last in: tree':>13} "
            f"{'ring':>8} {'ratio':>6} | {'arrivals spread':>15} | {'snap/s':>6} {'skipped':>7} {'waits t/r':>9} | "
            f"{'holder RSS':>10} {'(shm)':>7}"]
        for r in rows:
            waits = f"{r['waits']['tree']}/{r['waits']['ring']}"
            sps = "-" if r["snapshots_per_s"] is None else f"{r['snapshots_per_s']:.2f}"
            lines.append(
                f"  {r['ranks']:>5} {r['nodes']:>5} | {_ms(r['vote_tree_s']):>9} {_ms(r['vote_ring_s'])} "
                f"{_ratio(r['vote_ring_s'], r['vote_tree_s']):>9} | {_ms(r['vote_tree_last_s']):>13} "
                f"{_ms(r['vote_ring_last_s'])} {_ratio(r['vote_ring_last_s'], r['vote_tree_last_s'])} | "
                f"{_ms(r.get('vote_tree_arrival_spread_s')):>15} | {sps:>6} "
                f"{r['skipped_snapshots']:>7} {waits:>9} | {r['holder_rss_mb']:>8.0f}MB {r['holder_shmem_mb']:>5.0f}MB")
        lines += ["", f"  {'ranks':>5} | {'kill -> next it.':>16} {'detect':>7} {'rendezv.':>8} {'start':>7} "
                      f"{'restore':>7} {'1st it.':>7} | {'placement+restore':>17} {'restore vote':>12} | "
                      f"{'first rendezvous':>16} | restart collectives"]
        for r in rows:
            ph = r["kill_phases"]
            kinds = [k for k, _, _ in r["start_collectives"]]
            lines.append(
                f"  {r['ranks']:>5} | {_s(r['kill_to_next_iteration_s']):>16} {_s(r['detect_s'])} "
                f"{_s(r['rendezvous_s']):>8} {_s(r['startup_s'])} {_s(r['restore_s'])} "
                f"{_s(ph['first iteration'])} | {_s(r['placement_restore_s']):>17} {_ms(r['restore_vote_s']):>12} | "
                f"{_s(r['first_rendezvous_s']):>16} | {sum(k.startswith('gather') for k in kinds)} gathers + "
                f"{kinds.count('min_reduce')} votes")
    if rows:
        lines += ["", "  the restarted trainers' start, from the last rank's marks (s after the new attempt_start):"]
        names = list(rows[0]["start_phases"])
        lines.append(f"  {'ranks':>5} | " + " | ".join(f"{n:>{max(8, len(n))}}" for n in names))
        for r in rows:
            lines.append(f"  {r['ranks']:>5} | " + " | ".join(f"{r['start_phases'][n]:>{max(8, len(n)) - 1}.2f}s"
                                                              for n in names))
    fits = out.get("fits") or {}
    if fits:
        lines += ["", "  growth over N (power: a * N^b, log: a + b * log2(N); the better fit; rel. RMS error):"]
        for key, f in fits.items():
            lines.append(f"    {key:<26} {f['law']:<28} ({f['form']}, {100 * f['rel_rmse']:.0f}%)")
    s = out.get("simulation")
    if s:
        store = s["store"]
        lines += ["", f"  simulated ({s['per_node']} ranks per node; shardsafe.hierarchy.simulate over the same "
                      f"algorithms; ring = gloo's ring all-reduce, 2(N-1) steps):",
                  f"  {'ranks':>6} {'nodes':>5} | {'vote rounds':>11} {'bound':>5} {'messages':>8} {'max/rank':>8} "
                  f"{'pairs':>6} | {'ring rounds':>11} {'messages':>8} | {'restart: coll.':>14} {'rounds':>6} "
                  f"{'pairs':>6} {'store ops':>9} {'/rank':>5} | {'ring group store ops lazy':>25} {'full mesh':>9}"]
        for r in s["rows"]:
            v, rg, rs = r["vote"], r["ring"], r["restart"]
            lines.append(
                f"  {r['ranks']:>6} {r['nodes']:>5} | {v['rounds']:>11} {r['rounds_bound']:>5} "
                f"{_big(v['messages']):>8} {v['max_messages_per_rank']:>8} {_big(v['pairs']):>6} | "
                f"{rg['rounds']:>11} {_big(rg['messages']):>8} | "
                f"{rs['collectives']:>14} {rs['rounds']:>6} {_big(rs['pairs']):>6} {_big(rs.get('store_ops', 0)):>9} "
                f"{rs.get('store_ops_per_rank', 0):>5.1f} | {_big(rg.get('store_ops_lazy', 0)):>25} "
                f"{_big(rg.get('store_ops_full_mesh', 0)):>9}")
        lines.append(f"    store operations measured on gloo groups here: {store['per_mesh_member']:g} per member of a "
                     f"group that connects all its pairs when made (up to {s['shared_device_max']} members), "
                     f"{store['per_lazy_member']:g} per member of a larger one, {store['per_pair']:g} per connected "
                     "pair (hierarchy); a torch world group: "
                     f"{store['world_lazy_per_rank']:g} per rank lazily, {store['world_full_mesh_n2']:g} N^2 as a full "
                     "mesh")
        lines.append(f"    restart sequence: {s['restart_sequence_from']}: "
                     + ", ".join(f"{k}[{n}]" for k, n, _ in s["restart_sequence"])
                     + f"; each rank receives {_big(s['rows'][-1]['restart']['bytes_per_rank_received'])}B of "
                       f"gathered blobs at {s['rows'][-1]['ranks']} ranks")
        if s.get("note"):
            lines.append(f"    NOTE: {s['note']}")
    t = out.get("targets") or {}
    if t:
        lines += ["", "  targets:"]
        word = {True: "met", False: "NOT met"}
        if "vote_3x_faster_than_ring" in t:
            x = t["vote_3x_faster_than_ring"]
            lines.append(f"    commit vote at {x['ranks']} ranks >= 3x faster than the ring: median over ranks "
                         f"{'-' if x['ratio'] is None else format(x['ratio'], '.1f') + 'x'} ({word[x['met']]}); the "
                         f"last rank in (the collective alone) "
                         f"{'-' if x['ratio_last_in'] is None else format(x['ratio_last_in'], '.1f') + 'x'} "
                         f"({word[x['met_last_in']]})")
        if "rounds_within_bound" in t:
            x = t["rounds_within_bound"]
            lines.append(f"    rounds per vote <= 2 ceil(log2 nodes) + 2: {x['rounds']} vs {x['bound']} "
                         f"({word[x['met']]})")
        if "no_skipped_snapshots" in t:
            x = t["no_skipped_snapshots"]
            lines.append(f"    no snapshot skipped at {x['ranks']} ranks: {x['skipped']} skipped, "
                         f"{x['waits_for_tree_vote']} submits waited for a tree-voted snapshot still in flight "
                         f"({word[x['met']]})")
        if "kill_to_next_within_2x" in t:
            x = t["kill_to_next_within_2x"]
            lines.append(f"    kill -> next iteration at {x['ranks'][1]} within 2x of {x['ranks'][0]} ranks: "
                         f"{x['ratio']:.2f}x ({word[x['met']]}); " + "; ".join(
                             f"{k} {a:.2f} -> {b:.2f} s" for (k, a), b in zip(x["parts"][0].items(),
                                                                              x["parts"][1].values())))
    return "\n".join(lines) + "\n"
