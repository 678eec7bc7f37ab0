"""py-cpuinfo's answer remembered for a host's boot (shardsafe.adapters.deepspeed.prewarm).

The memo logic runs against a stand-in for the ``cpuinfo`` module whose ``get_cpu_info`` counts its calls (the real
one costs 1.1 s a call here); one test runs the real py-cpuinfo in fresh interpreters, and one checks that the
DeepSpeed adapter installs the memo before DeepSpeed builds anything.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from shardsafe.adapters.deepspeed import prewarm as ds_prewarm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ANSWER = {"arch": "X86_64", "flags": ["avx2", "avx512f", "sse2"], "brand_raw": "Test CPU", "vendor_id_raw": "Tst"}


def _cpuinfo(answer=ANSWER):
    calls = []

    def get_cpu_info():
        calls.append(1)
        return json.loads(json.dumps(answer))

    return types.SimpleNamespace(get_cpu_info=get_cpu_info, CPUINFO_VERSION=(9, 0, 0)), calls


@pytest.fixture
def memo(monkeypatch, tmp_path):
    """A fresh memo over a stand-in cpuinfo module; the cache file in a private directory of tmp_path."""
    def make(answer=ANSWER):
        mod, calls = _cpuinfo(answer)
        m = ds_prewarm._Memo()
        monkeypatch.setattr(ds_prewarm, "_MEMO", m)
        monkeypatch.setitem(sys.modules, "cpuinfo", mod)
        m.install(mod, str(tmp_path / "holders" / "cpuinfo-boot.json"))
        return mod, calls, tmp_path / "holders" / "cpuinfo-boot.json"
    return make


def test_asked_once_written_private_and_read_by_the_next_process(memo):
    mod, calls, path = memo()
    a = mod.get_cpu_info()
    a["flags"].append("mutated-by-the-caller")
    assert mod.get_cpu_info() == ANSWER and len(calls) == 1
    assert path.exists() and path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert json.loads(path.read_text()) == {"cpuinfo": "9.0.0", "info": ANSWER}
    # the next process of this boot: its own memo, the file already there
    mod2, calls2, _ = memo()
    assert mod2.get_cpu_info() == ANSWER and calls2 == []
    assert ds_prewarm._MEMO.source.startswith("answer of this boot read from")


@pytest.mark.parametrize("bad", ["garbage", "other-version", "no-flags", "group-writable", "symlink", "flags-not-str"])
def test_a_file_that_is_not_this_boots_private_answer_is_ignored_and_py_cpuinfo_asked(memo, bad, tmp_path):
    mod, calls, path = memo()
    path.parent.mkdir(mode=0o700)
    good = {"cpuinfo": "9.0.0", "info": {**ANSWER, "flags": ["forged"]}}
    doc = {"garbage": "{not json", "other-version": json.dumps({**good, "cpuinfo": "8.0.0"}),
           "no-flags": json.dumps({"cpuinfo": "9.0.0", "info": {"arch": "X86_64", "flags": []}}),
           "flags-not-str": json.dumps({"cpuinfo": "9.0.0", "info": {"arch": "X86_64", "flags": [1, 2]}}),
           "group-writable": json.dumps(good), "symlink": json.dumps(good)}[bad]
    target = tmp_path / "elsewhere.json" if bad == "symlink" else path
    target.write_text(doc)
    os.chmod(target, 0o620 if bad == "group-writable" else 0o600)
    if bad == "symlink":
        path.symlink_to(target)
    assert mod.get_cpu_info() == ANSWER and len(calls) == 1   # py-cpuinfo asked, the file's flags not used
    assert json.loads(path.read_text())["info"] == ANSWER     # and this boot's answer written in its place
    assert not path.is_symlink()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the cache file to another user")
def test_another_users_file_is_ignored(memo):
    mod, calls, path = memo()
    path.parent.mkdir(mode=0o700)
    path.write_text(json.dumps({"cpuinfo": "9.0.0", "info": {**ANSWER, "flags": ["forged"]}}))
    os.chmod(path, 0o600)
    os.chown(path, 12345, 12345)
    assert mod.get_cpu_info() == ANSWER and len(calls) == 1


def test_without_py_cpuinfo_there_is_nothing_to_remember(monkeypatch):
    monkeypatch.setitem(sys.modules, "cpuinfo", None)   # import cpuinfo raises ImportError
    monkeypatch.setattr(ds_prewarm, "_MEMO", ds_prewarm._Memo())
    ds_prewarm.memo_cpu_info("/nonexistent")
    assert ds_prewarm._MEMO.original is None


def test_no_flags_is_not_remembered_and_asked_again(memo):
    mod, calls, path = memo(answer={})
    assert mod.get_cpu_info() == {} and mod.get_cpu_info() == {} and len(calls) == 2
    assert not path.exists()


def test_a_directory_others_can_enter_gets_no_file(memo):
    mod, calls, path = memo()
    path.parent.mkdir(mode=0o755)
    os.chmod(path.parent, 0o755)
    assert mod.get_cpu_info() == ANSWER and not path.exists()
    assert mod.get_cpu_info() == ANSWER and len(calls) == 1    # still remembered in memory


_PROBE = """
import json, sys
from shardsafe.adapters.deepspeed import prewarm as ds_prewarm
said = ds_prewarm.remember_cpu_info(sys.argv[1])
import cpuinfo
info = cpuinfo.get_cpu_info()
print(json.dumps({"said": said, "flags": info["flags"], "arch": info["arch"]}))
"""


def test_real_py_cpuinfo_asked_by_the_first_process_and_read_by_the_second(tmp_path):
    """Two fresh interpreters of this boot: the first asks py-cpuinfo (its subprocess), the second reads the
    answer; both get what a plain ``cpuinfo.get_cpu_info()`` returns."""
    run = lambda code, *a: json.loads(subprocess.run(   # noqa: E731
        [sys.executable, "-c", code, *a], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout)
    if ds_prewarm.cache_path(str(tmp_path)) is None:
        pytest.skip(f"no {ds_prewarm.BOOT_ID} on this host: the answer is remembered in memory only")
    first, second = run(_PROBE, str(tmp_path)), run(_PROBE, str(tmp_path))
    plain = run("import json, cpuinfo; i = cpuinfo.get_cpu_info(); print(json.dumps({'flags': i['flags'], "
                "'arch': i['arch']}))")
    assert first["said"].startswith("py-cpuinfo asked once"), first["said"]
    assert second["said"].startswith("py-cpuinfo answer of this boot read from"), second["said"]
    assert first["flags"] == second["flags"] == plain["flags"] and first["arch"] == second["arch"] == plain["arch"]


def test_the_deepspeed_adapter_installs_the_memo_before_deepspeed_builds_the_engine(monkeypatch, tmp_path):
    """Protection on: ``cpuinfo.get_cpu_info`` is the memo by the time DeepSpeed's initialize runs (its op builders
    ask there). Protection off: the program's process is left as it is."""
    from shardsafe.adapters import deepspeed as ss_ds

    class Stop(Exception):
        pass

    def doc_seen_by_deepspeed(enabled: bool) -> str | None:
        mod, _ = _cpuinfo()
        monkeypatch.setattr(ds_prewarm, "_MEMO", ds_prewarm._Memo())
        monkeypatch.setitem(sys.modules, "cpuinfo", mod)
        seen = {}

        def ds_initialize(*a, **k):   # DeepSpeed's initialize: stopped where its op builders would ask
            seen["doc"] = mod.get_cpu_info.__doc__
            raise Stop

        conf = {"train_batch_size": 1, "shardsafe": {"enabled": enabled, "holder_dir": str(tmp_path / "h"),
                                                     "job_id": "memo"}}   # a pytest-xdist worker has no script argv
        with pytest.raises(Stop):
            ss_ds.protect(ds_initialize, (), {"config": conf})
        return seen["doc"]

    assert "remembered by shardsafe" in doc_seen_by_deepspeed(True)
    assert doc_seen_by_deepspeed(False) is None
