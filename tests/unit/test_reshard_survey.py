"""Which version of which earlier layout a restore at another data-parallel size can use, and who serves what
(shardsafe/snapshot/reshard_survey.py): the choice is pure, computed alike on every rank from the survey."""
from shardsafe.snapshot.reshard_survey import Held, HeldParity, Survey, choose, disk_choice

NODES = ("n0", "n1", "n2", "n3")


def _survey(*, world=4, version=5, timeline=7, m=1, gone=(), parity=True, nodes=NODES):
    """What the holders of ``nodes`` hold of one version at ``world`` ranks (one rank per node), ``gone``: ranks whose
    node's holder died with it."""
    group = {"index": 0, "members": list(range(world)), "nodes": list(nodes), "k": world - m, "m": m}
    coords = {str(r): [r, 0, 0] for r in range(world)}
    keep = [k for k in range(world) if k not in gone]
    data = [Held(k, version, world, timeline, nodes[k], 10 + k, k, 0, 0) for k in keep]
    par = [HeldParity(k, version, world, timeline, nodes[k], group, 64, {"code": "rs", "k": world - m, "m": m}, coords)
           for k in keep] if parity else []
    return Survey(data, par)


def test_a_source_on_a_lost_node_is_rebuilt_and_each_held_one_served_by_a_rank_of_its_node():
    sv = _survey(gone=(1,))
    choice, why = choose(sv, (5, 4, 7), ["n2", "n3", "n0"])
    assert why == "" and choice.tier == "parity" and choice.lost == [1]
    assert {k: (s.where, s.node, s.server) for k, s in choice.sources.items()} == {
        0: ("holder", "n0", 2), 1: ("rebuilt", None, None), 2: ("holder", "n2", 0), 3: ("holder", "n3", 1)}
    (g,) = choice.groups
    assert g.lost == [1] and g.parity_server == {0: 2, 2: 0, 3: 1} and g.manifests_from == 2
    assert choice.sources[0].sealing == 10   # what the survey saw: a target reading it itself checks it again


def test_a_node_no_rank_runs_on_is_as_lost_as_a_dead_one():
    """D' = 2 on n0 and n2: n3 is idle and no rank may read its holder, so ranks 1 (dead node) and 3 are missing."""
    choice, why = choose(_survey(gone=(1,)), (5, 4, 7), ["n0", "n2"])
    assert choice is None and "lost 2 members [1, 3]" in why and "parity_shards=1" in why
    choice, _ = choose(_survey(gone=(1,), m=2), (5, 4, 7), ["n0", "n2"])   # two parity shares cover both
    assert choice.lost == [1, 3] and choice.groups[0].parity_server == {0: 0, 2: 1}


def test_without_parity_a_missing_source_refuses_the_version():
    choice, why = choose(_survey(gone=(1,), parity=False), (5, 4, 7), ["n0", "n2", "n3"])
    assert choice is None and "source rank 1" in why and "no parity share" in why


def test_a_corrupt_copy_is_rebuilt_like_a_lost_one():
    choice, _ = choose(_survey(), (5, 4, 7), ["n1", "n2", "n3"], exclude=frozenset({2}))
    assert choice is None   # with n0 idle, 0 and the corrupt 2 are two missing members of one group
    choice, _ = choose(_survey(), (5, 4, 7), list(NODES), exclude=frozenset({2}))
    assert choice.lost == [2] and choice.groups[0].parity_server == {0: 0, 1: 1, 3: 3}


def test_the_ranks_of_a_node_take_its_sources_in_turn():
    nodes = ("a", "a", "b", "b")
    sv = _survey(parity=False, nodes=nodes)
    choice, _ = choose(sv, (5, 4, 7), ["a", "a", "b"])
    assert [choice.sources[k].server for k in range(4)] == [0, 1, 2, 2]


def test_newest_first_and_at_one_version_this_size_first():
    sv = _survey()
    sv.data += [Held(k, 6, 3, 9, NODES[k], 1, k, 0, 0) for k in range(3)]
    sv.data += [Held(k, 5, 3, 8, NODES[k], 1, k, 0, 0) for k in range(3)]
    assert sv.candidates(3) == [(6, 3, 9), (5, 3, 8), (5, 4, 7)]
    assert sv.candidates(4) == [(6, 3, 9), (5, 4, 7), (5, 3, 8)]


def test_the_persistent_tier_serves_a_complete_older_layout_read_by_every_rank():
    recs = [{"key": k, "version": 5, "world": 4, "timeline": 7, "dp": k, "tp": 0, "pp": 0} for k in range(4)]
    choice, _ = disk_choice(recs, 3)
    assert choice.tier == "persistent" and [s.server for s in choice.sources.values()] == [0, 1, 2, 0]
    assert disk_choice(recs[:3], 3) == (None, "persistent version 5 has 3 of its 4 ranks' files")
    newer = recs + [{"key": k, "version": 6, "world": 3, "timeline": 9, "dp": k, "tp": 0, "pp": 0} for k in range(3)]
    assert disk_choice(newer, 3) == (None, "")   # the newest is at this size: the same-size restore reads it
