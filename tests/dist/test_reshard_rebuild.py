"""The rebuild step of the restore at another data-parallel size (shardsafe/snapshot/reshard_move.py ``rebuild``) on
forked gloo ranks: each target decodes its part of a lost source, by chain (partial sums formed along the ranks that
read the survivors, shardsafe.parity.repair) or gathered (the k fragments sent to it), byte for byte the lost
payload, each checked against its checksums. Survivors' payloads and parity made as the exchange makes them
(tests/unit/test_recovery.py), held in memory here instead of the holders (the whole restore on real holders is
tests/dist/test_ds_reshard_restore.py). Small slices and windows, so that a range takes several chains and a rank
waits on its sends; servers that read several survivors of one codeword; a corrupt survivor and an unreadable one
are problems on every path, never a hang."""
import pytest

from shardsafe.parity import repair as repair_mod
from shardsafe.parity.recovery import MemberRecovery
from shardsafe.payload import manifest as mf
from shardsafe.snapshot.reshard_move import rebuild
from shardsafe.snapshot.reshard_survey import Choice, LostGroup, Source

from ..unit.test_recovery import _encoded
from ._fork_ranks import run_ranks

SEG = 4000   # checksum segment bytes: not a multiple of the chunk size, so ranges end inside chunks

# name -> (members n, parity m, lost members, current world, the current rank serving each surviving member)
LAYOUTS = {
    # n1 lost, the survivors' nodes each run one rank: a target serves one fragment of every codeword itself
    "spread": (4, 1, [1], 3, {0: 0, 2: 1, 3: 2}),
    # rank 0 reads members 0 and 2 (two fragments of every codeword): one hop for both
    "shared": (4, 1, [1], 2, {0: 0, 2: 0, 3: 1}),
    # rank 0 reads every survivor: it decodes its own part alone, and is rank 1's only hop
    "one_server": (4, 1, [1], 2, {0: 0, 2: 0, 3: 0}),
    # two lost members of an RS(3, 2) group, rank 1 reading two survivors
    "two_lost": (5, 2, [1, 3], 3, {0: 0, 2: 1, 4: 1}),
}


def _layout(name, seed=0):
    """The old group's payloads (uneven) and parity, the lost members' manifests (two entries, SEG-byte segments),
    the Choice and the plan: each current rank decodes every len(world)-th pair of segments of each lost member,
    the last rank also the first segment again (ranges of two targets overlap)."""
    n, m, lost, world, serves = LAYOUTS[name]
    sizes = [30_000 + 1_111 * i for i in range(n)]
    record, cs, code, payloads, parity = _encoded(n, m, sizes, seed=seed)
    manifests, plan = {}, {}
    for k in lost:
        cut = sizes[k] // 3 // mf.ALIGN * mf.ALIGN
        entries = [{"name": "a", "dtype": "uint8", "shape": [cut], "offset": 0, "nbytes": cut},
                   {"name": "b", "dtype": "uint8", "shape": [sizes[k] - cut], "offset": cut,
                    "nbytes": sizes[k] - cut}]
        segs = []
        for e in entries:
            rs = list(mf.chunk_ranges(e, SEG))
            e["xxh3"] = [mf.hash_bytes(memoryview(payloads[k])[a:b]) for a, b in rs]
            segs += rs
        manifests[k] = {"format": mf.FORMAT, "chunk_bytes": SEG, "payload_nbytes": sizes[k], "entries": entries}
        plan[k] = {}
        for r in range(world):
            mine = [s for i, s in enumerate(segs) if (i // 2) % world == r] + ([segs[0]] if r == world - 1 else [])
            merged = []
            for a, b in sorted(mine):
                if merged and merged[-1][1] == a:
                    merged[-1][1] = b
                else:
                    merged.append([a, b])
            plan[k][r] = [tuple(x) for x in merged]
    sources = {i: Source(key=i, dp=i, tp=0, pp=0, where="rebuilt" if i in lost else "holder",
                         node=None if i in lost else f"n{i}", server=serves.get(i)) for i in range(n)}
    group = LostGroup(group=record, chunk_size=cs, code=code, lost=list(lost), parity_server=dict(serves),
                      manifests_from=0)
    return Choice(version=1, world=n, timeline=0, sources=sources, groups=[group]), manifests, plan, payloads, parity


class _Held:
    """What Opened gives the rebuild: each survivor's payload and parity shares, from memory. ``unreadable``: this
    rank's parity shares cannot be read (a holder that went away after the verify)."""

    def __init__(self, payloads, parity, unreadable=False):
        self.payloads, self.parity, self.unreadable = payloads, parity, unreadable

    def source(self, s, version):
        return {}, self.payloads[s.key]

    def parity_of(self, key, version):
        if self.unreadable:
            raise OSError("the holder of this node does not answer")
        return {}, self.parity[key]


def _rebuild(rank, world, name, repair, fault):
    choice, manifests, plan, payloads, parity = _layout(name)
    if fault == "corrupt":   # a flipped byte in survivor 2's first data chunk: the bytes decoded from it are wrong
        payloads[2][5] ^= 0x40
    held = _Held(payloads, parity, unreadable=fault == "unreadable" and rank == 0)
    rebuilt, problems, got, decoded = rebuild(choice, manifests, plan, MemberRecovery, held, rank=rank, group=None,
                                              repair=repair)
    equal = {str(k): all(bytes(rebuilt[k][a:b].numpy()) == bytes(payloads[k][a:b]) for a, b in plan[k][rank])
             for k in rebuilt}
    return {"problems": problems, "got": got, "decoded": decoded, "equal": equal, "rebuilt": sorted(rebuilt)}


def _expected(name, repair):
    """Per current rank: bytes received and decoded, from the plan and the layout alone. Gathered, a target
    receives every fragment it does not read itself. By chain (one per slice of every range, in the plan's order),
    a target receives each byte it decodes once (unless it reads all k itself), and every server but the first
    each byte it passes on, the servers in rank order turned by one place per chain."""
    choice, _, plan, _, _ = _layout(name)
    g = choice.groups[0]
    rec = MemberRecovery(group=g.group, chunk_size=g.chunk_size, code=g.code, lost=g.lost)
    cs, world = g.chunk_size, LAYOUTS[name][3]
    got, decoded, chain = [0] * world, [0] * world, 0
    for k in sorted(g.lost):
        for r, ranges in sorted(plan[k].items()):
            for a, b in ranges:
                for j in range(a // cs, (b - 1) // cs + 1):
                    lo, hi = max(a, j * cs), min(b, (j + 1) * cs)
                    decoded[r] += hi - lo
                    servers = [g.parity_server[f.rank] for f in rec.chunks_of(k)[j][2]]
                    hops = sorted(set(servers) - {r})
                    if repair == "gather":
                        got[r] += (hi - lo) * sum(s != r for s in servers)
                        continue
                    for x in range(lo, hi, repair_mod.SLICE):
                        n = min(hi, x + repair_mod.SLICE) - x
                        if hops:
                            turn = chain % len(hops)
                            for s in (hops[turn:] + hops[:turn])[1:] + [r]:
                                got[s] += n
                        chain += 1
    return got, decoded


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("repair,slice_bytes,window", [("chain", 1000, 2), ("chain", 3333, 1), ("chain", None, None),
                                                       ("gather", None, None)])
def test_each_target_decodes_its_part_byte_for_byte(monkeypatch, name, repair, slice_bytes, window):
    """1000-byte slices: a chunk's range takes up to 14 chains, the last one short; a window of 1: a server waits on
    each send and posts each receive one slice ahead. Every target's ranges come back equal to the lost payload and
    pass their checksums; the counters are the model's (by chain each byte decoded is received once, however many
    fragments a server reads)."""
    if slice_bytes:
        monkeypatch.setattr(repair_mod, "SLICE", slice_bytes)   # the forked ranks inherit it
    if window:
        monkeypatch.setattr(repair_mod, "WINDOW", window)
    world, lost = LAYOUTS[name][3], LAYOUTS[name][2]
    out = run_ranks(world, _rebuild, name, repair, None, timeout_s=60, pg_timeout_s=20)
    assert all(o["problems"] == [] for o in out), out
    assert all(o["rebuilt"] == lost and all(o["equal"].values()) for o in out), out
    got, decoded = _expected(name, repair)
    assert [o["decoded"] for o in out] == decoded and [o["got"] for o in out] == got, (out, got, decoded)
    if repair == "chain" and name in ("shared", "one_server"):   # the target of two-fragment servers: once per byte
        assert out[1]["got"] == out[1]["decoded"]


@pytest.mark.parametrize("repair", ["chain", "gather"])
@pytest.mark.parametrize("fault", ["corrupt", "unreadable"])
def test_a_bad_survivor_is_a_problem_and_no_rank_hangs(monkeypatch, repair, fault):
    """A flipped byte in a survivor's data: the target whose range it reaches says its rebuilt part fails its
    checksums (a survivor is corrupt), the others decode theirs. A server whose parity shares cannot be read sends
    zeros in their place and says so; the targets it serves fail their checksums. Every rank returns."""
    monkeypatch.setattr(repair_mod, "SLICE", 1000)
    monkeypatch.setattr(repair_mod, "WINDOW", 2)
    out = run_ranks(3, _rebuild, "spread", repair, fault, timeout_s=60, pg_timeout_s=20)
    said = [p for o in out for p in o["problems"]]
    assert any("source rank 1 rebuilt from parity fails its checksums" in p and "a survivor's data or parity share "
               "is corrupt" in p for p in said), out
    if fault == "corrupt":   # the ranks whose part holds the byte say so, and only they; the others decoded theirs
        assert all(bool(o["problems"]) == (not all(o["equal"].values())) for o in out), out
        assert not all(o["problems"] for o in out), out
    else:
        assert any(p.startswith("source rank 1 could not be decoded from parity: OSError: the holder of this node")
                   for p in out[0]["problems"]), out


def test_an_unknown_repair_is_refused_where_it_is_set():
    from shardsafe.snapshot.reshard_restore import Resize
    with pytest.raises(ValueError, match=r"one of \('chain', 'gather'\); got 'scatter'"):
        Resize(places=[], repair="scatter")
    with pytest.raises(ValueError, match="got 'scatter'"):
        rebuild(*_layout("spread")[:3], MemberRecovery, None, rank=0, group=None, repair="scatter")
