"""The early open (shardsafe.holder.early_open): a restarted trainer maps and verifies its newest held snapshot
while it starts.

Real holder processes, real shared memory and fork. What must hold: the restore uses the early mapping only for
the version and shared memory it chose, and the early verification only for the same sealing of that slot with
the same manifest (else it verifies itself: corruption the early verification found, or any made after a
map-only early open, is caught); and no mapping outlives its use (unclaimed, discarded, or inherited by a
forked child).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from shardsafe.errors import ConfigError
from shardsafe.holder import early_open
from shardsafe.holder.client import HolderClient
from shardsafe.payload import manifest as mf
from shardsafe.snapshot.restore import Collectives, restore_from_holder

from .test_snapshot_restore import ToyAdapter, snap


@pytest.fixture
def held(holder_factory):
    """(client, env of a trainer of rank 0 on the holder's node)"""
    (h,) = holder_factory(1, job="ejob", budget_gb=0.2)
    env = {"SHARDSAFE_JOB_ID": "ejob", "RANK": "0", "SHARDSAFE_NODE": "n0", "SHARDSAFE_HOLDER_DIR": h.paths.root}
    c = HolderClient(h.paths, timeout_s=10).connect()
    yield c, env
    c.close()
    early_open.take()


def _mapped(mm) -> tuple[int, int]:
    arr = np.frombuffer(mm, dtype=np.uint8)
    return int(arr.ctypes.data), len(mm)


def _in_maps(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def _opened(c, env, version: int):
    """A snapshot of rank 0 at ``version``, opened early: (the early open, the address of its mapping)."""
    snap(c, ToyAdapter(1), version)
    e = early_open.start(env)
    assert e.wait(30) and e.version == version, e.why
    return e, _mapped(e._slot.mm)[0]


def test_the_restore_uses_the_early_opened_and_verified_slot_and_is_bit_exact(held, monkeypatch):
    c, env = held
    src = ToyAdapter(1)
    snap(c, ToyAdapter(5), 9)
    snap(c, src, 10)
    e = early_open.start(env)
    assert e is not None and early_open.start(env) is e   # once per process
    assert e.wait(30) and e.problems == [], (e.why, e.problems)
    assert early_open.take() is e and early_open.take() is None
    hashed = []   # the restore's own passes over the payload: none, the early open verified this sealing
    verify = mf.verify
    monkeypatch.setattr(mf, "verify", lambda *a, **k: hashed.append(1) or verify(*a, **k))
    dst = ToyAdapter(2)
    res = restore_from_holder(dst, c, rank=0, coll=Collectives(), early=e)
    assert (res.version, res.tier) == (10, "memory"), res.message
    assert res.notes["early_open"] == "used" and res.notes["early_open_version"] == 10, res.notes
    assert res.notes["early_verify"] == "used" and res.notes["early_verify_s"] > 0, res.notes
    assert hashed == []
    for k in src.t:
        assert torch.equal(src.t[k], dst.t[k]), k


def _flip(c, version: int) -> None:
    """Flip a byte of rank 0's ``version`` behind the holder's back, through the writer's own mapping."""
    man, mm = c.open(rank=0, version=version)
    mm.close()
    entry = next(x for x in man["entries"] if x["name"] == "master")
    for m in c._maps.values():   # the pipeline's cached writable mappings
        buf = memoryview(m)
        good = mf.verify(man, buf) == []
        buf.release()
        if good:
            m[entry["offset"] + 1234] ^= 0x10
            return
    pytest.fail(f"no writable mapping holds version {version}")


def test_corruption_found_by_the_early_verification_is_verified_again_and_an_older_version_restored(held):
    c, env = held
    old = ToyAdapter(1)
    snap(c, old, 1)
    snap(c, ToyAdapter(2), 2)
    _flip(c, 2)                   # while the trainer was down
    e = early_open.start(env)
    assert e.wait(30) and e.version == 2, e.why
    assert len(e.problems) == 1 and "master segment 0" in e.problems[0], e.problems
    dst = ToyAdapter(3)
    res = restore_from_holder(dst, c, rank=0, coll=Collectives(), early=early_open.take())
    assert res.version == 1, res.message
    assert res.notes["early_open"].startswith("missed: opened version 2, which was not restorable on every rank"), res.notes
    assert res.notes["early_verify"].startswith("missed: the early verification found 1 problem(s)"), res.notes
    assert all(torch.equal(old.t[k], dst.t[k]) for k in old.t)


def test_map_only_corruption_after_the_early_open_is_caught_and_an_older_version_restored(held):
    c, env = held
    old = ToyAdapter(1)
    snap(c, old, 1)
    snap(c, ToyAdapter(2), 2)
    e = early_open.start({**env, "SHARDSAFE_EARLY_OPEN": "map"})
    assert e.wait(30)
    assert e.version == 2 and e.problems is None, e.why
    _flip(c, 2)
    dst = ToyAdapter(3)
    res = restore_from_holder(dst, c, rank=0, coll=Collectives(), early=early_open.take())
    assert res.version == 1, res.message
    assert res.notes["early_open"].startswith("missed: opened version 2, which was not restorable on every rank"), res.notes
    assert res.notes["early_verify"] == "missed: not verified early (SHARDSAFE_EARLY_OPEN=map)", res.notes
    assert all(torch.equal(old.t[k], dst.t[k]) for k in old.t)


@pytest.mark.parametrize("change", ["sealing", "manifest"])
def test_the_early_verification_holds_only_for_the_same_sealing_and_manifest(held, change):
    c, env = held
    e, _ = _opened(c, env, 5)
    assert e.problems == []
    now = c.open_slot(rank=0, version=5, populate=False)
    now.mm.close()
    later = (now._replace(sealing=now.sealing + 1) if change == "sealing" else
             now._replace(manifest={**now.manifest, "entries": now.manifest["entries"][:-1]}))
    got = e.claim(0, 5, later)
    assert got is not None and not got.verified      # the mapping serves, the restore verifies it itself
    got.mm.close()
    assert ("sealed again" if change == "sealing" else "manifest changed") in e.verify_why, e.verify_why
    assert e.notes(5)["early_verify"].startswith("missed: "), e.notes(5)


def test_the_holder_counts_seals(held):
    c, _ = held
    snap(c, ToyAdapter(1), 1)
    snap(c, ToyAdapter(2), 2)
    a, b, a2 = (c.open_slot(rank=0, version=v, populate=False) for v in (1, 2, 1))
    for x in (a, b, a2):
        x.mm.close()
    assert 0 < a.sealing < b.sealing and a2.sealing == a.sealing


def test_the_mode_comes_from_the_environment(held, caplog):
    _, env = held
    assert [early_open.mode({early_open.ENV_EARLY_OPEN: v}) for v in ("", "1", "verify", "map", "MAP", "0", "off")] == \
        ["verify", "verify", "verify", "map", "map", "off", "off"]
    with pytest.raises(ConfigError, match="expected 1 .* map .* or 0"):
        early_open.mode({early_open.ENV_EARLY_OPEN: "mpa"})
    assert early_open.start({**env, early_open.ENV_EARLY_OPEN: "0"}) is None
    e = early_open.start({**env, early_open.ENV_EARLY_OPEN: "mpa"})   # said, and the strictest mode that helps
    assert e is not None and not e.verify and "SHARDSAFE_EARLY_OPEN='mpa'" in caplog.text
    e.wait(30)
    early_open.take().discard()


def test_another_slot_or_version_is_refused_and_the_mapping_closed(held):
    c, env = held
    e, addr = _opened(c, env, 4)
    held_slot = c.open_slot(rank=0, version=4, populate=False)
    held_slot.mm.close()
    assert _in_maps(addr)
    other = (held_slot.ident[0], held_slot.ident[1] + 1, held_slot.ident[2])
    assert e.claim(0, 4, held_slot._replace(ident=other)) is None   # the holder serves version 4 from other memory now
    assert not _in_maps(addr) and "other shared memory" in e.why
    assert e.claim(0, 4, held_slot) is None       # spent: claimed once


def test_a_version_the_restore_does_not_choose_is_closed_by_the_restore(held):
    c, env = held
    _, addr = _opened(c, env, 7)
    c.drop(rank=0, version=7)                    # gone from the holder before the restore asks
    res = restore_from_holder(ToyAdapter(2), c, rank=0, coll=Collectives(), early=early_open.take())
    assert res.version == -1
    assert not _in_maps(addr)                    # the restore closed the unclaimed mapping


def test_a_forked_child_closes_its_inherited_copy(held):
    c, env = held
    _, addr = _opened(c, env, 3)
    pid = os.fork()
    if pid == 0:   # a data-loader worker, say: it never restores
        code = 3 if _in_maps(addr) else (4 if early_open.take() is not None else 0)
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _in_maps(addr)                        # the parent keeps its own for the restore
    early_open.take().discard()
    assert not _in_maps(addr)


def test_only_a_trainer_of_a_shardsafe_job_with_a_holder_opens_early(held, tmp_path):
    _, env = held
    assert early_open.start({k: v for k, v in env.items() if k != "SHARDSAFE_JOB_ID"}) is None
    assert early_open.start({k: v for k, v in env.items() if k != "RANK"}) is None
    assert early_open.start({**env, "SHARDSAFE_EARLY_OPEN": "0"}) is None
    assert early_open.start({**env, "SHARDSAFE_HOLDER_DIR": str(tmp_path / "none")}) is None   # no holder there
    e = early_open.start({**env, "RANK": "5"})   # a rank the holder has nothing of
    assert e.wait(30)
    assert e.version == -1 and "no sealed version of rank 5" in e.why
    assert early_open.take() is e


def test_deepspeed_loading_in_a_trainer_starts_it(held, monkeypatch):
    """A trainer torchrun started itself (no fork server): the automatic activation opens early when DeepSpeed
    loads; the fork server's children start it before the script (tests/fault check that path end to end)."""
    import types

    from shardsafe.adapters import autoload
    c, env = held
    snap(c, ToyAdapter(1), 8)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(early_open.ENV_TRAINER, "")   # this process says it is the trainer: undone after the test
    autoload._patch_deepspeed(types.SimpleNamespace(initialize=lambda *a, **k: None))
    e = early_open.take()
    assert e is not None and e.wait(30) and e.version == 8, e and e.why
    e.discard()
