"""The restore at another data-parallel size on one rank, from the persistent tier (shardsafe/snapshot/
reshard_restore.py): no holder and no process group, the orchestration alone. The multi-rank restore from the
holders, with a parity rebuild and against DeepSpeed's own resume, is tests/dist/test_ds_reshard_restore.py."""
import pytest
import torch

from shardsafe.adapters.deepspeed.reshard import ZERO3, DeepSpeedResharder
from shardsafe.payload import manifest as mf
from shardsafe.persist import PersistentStore
from shardsafe.snapshot.reshard import reshard
from shardsafe.snapshot.reshard_restore import Resize
from shardsafe.snapshot.restore import Collectives, RestoreError, restore_from_holder
from shardsafe.snapshot.state import RankState, StateAdapter

from .test_reshard import _snapshots, _truth

GROUPS = [[("a", 50), ("b", 7)], [("c", 13)]]


class _Target(StateAdapter):
    """A rank of the job at the new size: takes the re-partitioned state (the DeepSpeed adapter checks it against
    its engine; here nothing is live)."""

    def __init__(self):
        self.got = None

    def capture(self):
        return RankState({}, {})

    def apply(self, tensors, meta, peers=None):
        raise AssertionError("a re-partitioned state goes through apply_resharded")

    def resharder(self):
        return DeepSpeedResharder()

    def resharded_problems(self, tensors, meta):
        return []

    def apply_resharded(self, tensors, meta):
        self.got = ({n: t.clone() for n, t in tensors.items()}, meta)


def _flush(store, snaps, version, ranks=None):
    """Each rank's snapshot as a holder flushes it: payload and manifest (checksums, world size, coordinates)."""
    for r in (range(len(snaps)) if ranks is None else ranks):
        entries, n = mf.layout(snaps[r].tensors)
        buf = bytearray(n)
        for e, t in zip(entries, snaps[r].tensors.values()):
            buf[e["offset"]: e["offset"] + e["nbytes"]] = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            e["xxh3"] = [mf.hash_bytes(memoryview(buf)[a:b]) for a, b in mf.chunk_ranges(e)]
        man = mf.build(version=version, rank=r, world_size=len(snaps), node=f"n{r}", entries=entries,
                       payload_nbytes=n, meta=mf.to_jsonable(snaps[r].meta),
                       extra={"timeline": 3, "coords": {"dp": r, "tp": 0, "pp": 0}})
        store.write(version=version, rank=r, payload=memoryview(buf), manifest=man)


def test_memory_cannot_serve_and_the_persistent_tier_holds_the_old_layout(tmp_path):
    snaps = _snapshots(ZERO3, GROUPS, 2, _truth(GROUPS), sub_group_size=9, gas=2)
    store = PersistentStore(str(tmp_path), "job")
    _flush(store, snaps, 5)
    events, target = [], _Target()
    res = restore_from_holder(target, None, rank=0, coll=Collectives(), persist=store,
                              on_event=lambda kind, **f: events.append((kind, f)),
                              resize=Resize(places=[("n0", 0, 0, 0)]))
    assert (res.version, res.tier, res.reshard["from_dp"], res.reshard["to_dp"]) == (5, "persistent", 2, 1)
    assert "re-partitioned from 2 to 1 data-parallel ranks" in res.message
    want = reshard(snaps, 1, DeepSpeedResharder()).ranks[0]
    tensors, meta = target.got
    assert sorted(tensors) == sorted(want.tensors) and all(torch.equal(tensors[n], want.tensors[n]) for n in tensors)
    assert meta["resharded"]["from_dp_world_size"] == 2 and meta["dp_world_size"] == 1
    end = events[-1]
    assert end[0] == "restore_end" and end[1]["tier"] == "persistent" and (end[1]["from_dp"], end[1]["to_dp"]) == (2, 1)
    assert end[1]["reshard"]["local_bytes"] > 0 and end[1]["reshard"]["remote_bytes"] == 0


def test_nothing_complete_at_another_size_is_a_clear_error_and_nothing_is_applied(tmp_path):
    snaps = _snapshots(ZERO3, GROUPS, 2, _truth(GROUPS), sub_group_size=9, gas=2)
    store = PersistentStore(str(tmp_path), "job")
    _flush(store, snaps, 5, ranks=[0])
    target = _Target()
    with pytest.raises(RestoreError, match=r"another data-parallel size.*has 1 of its 2 ranks' files.*Nothing was "
                                           r"loaded and nothing was deleted"):
        restore_from_holder(target, None, rank=0, coll=Collectives(), persist=store,
                            resize=Resize(places=[("n0", 0, 0, 0)]))
    assert target.got is None


def test_an_adapter_that_cannot_re_partition_is_refused_before_anything_is_read(tmp_path):
    class Plain(_Target):
        def resharder(self):
            return None
    with pytest.raises(RestoreError, match="Plain cannot re-partition its state"):
        restore_from_holder(Plain(), None, rank=0, coll=Collectives(), resize=Resize(places=[("n0", 0, 0, 0)]))


class _Live(_Target):
    """A target whose live state is flat tensors of the new size (capture hands them out, as an engine's adapter
    does), filled with garbage; its check refuses when ``refuse`` is set."""

    def __init__(self, shapes, refuse=False):
        super().__init__()
        self.live = {n: torch.full(t.shape, float("nan"), dtype=t.dtype) for n, t in shapes.items()
                     if n.startswith("opt/") and t.dim() == 1}
        self.refuse = refuse

    def capture(self):
        return RankState(dict(self.live), {})

    def resharded_problems(self, tensors, meta):
        return ["refused by the test"] if self.refuse else []

    def apply_resharded(self, tensors, meta):
        for n, t in self.live.items():
            t.copy_(tensors[n])
        super().apply_resharded(tensors, meta)


def test_the_flat_tensors_are_written_into_the_live_ones_after_the_check_and_never_on_a_refusal(tmp_path):
    snaps = _snapshots(ZERO3, GROUPS, 2, _truth(GROUPS), sub_group_size=9, gas=2)
    store = PersistentStore(str(tmp_path), "job")
    _flush(store, snaps, 5)
    want = reshard(snaps, 1, DeepSpeedResharder()).ranks[0]
    refused = _Live(want.tensors, refuse=True)
    with pytest.raises(RestoreError, match="refused by the test"):
        restore_from_holder(refused, None, rank=0, coll=Collectives(), persist=store,
                            resize=Resize(places=[("n0", 0, 0, 0)]))
    assert refused.got is None and refused.live and all(torch.isnan(t).all() for t in refused.live.values())
    target = _Live(want.tensors)
    ptrs = {n: t.data_ptr() for n, t in target.live.items()}
    res = restore_from_holder(target, None, rank=0, coll=Collectives(), persist=store,
                              resize=Resize(places=[("n0", 0, 0, 0)]))
    assert res.phases["assemble"] > 0 and "move" in res.phases
    tensors, _ = target.got
    assert all(torch.equal(tensors[n], want.tensors[n]) for n in want.tensors)
    assert all(torch.equal(t, want.tensors[n]) and t.data_ptr() == ptrs[n] for n, t in target.live.items())
