"""The automatic activation's contract (adapters/autoload.py): installed by the package, lazy, off by env.

The end-to-end checks (a plain DeepSpeed script and Megatron-LM's loop protected by their configuration alone)
are in tests/fault/test_unchanged_programs.py and tests/fault/test_megatron_resume.py.
"""
import argparse
import json
import os
import subprocess
import sys
import sysconfig

import pytest

from shardsafe.adapters import autoload, ds_config


def _py(code, **env):
    e = {k: v for k, v in os.environ.items() if k != "SHARDSAFE_AUTO"}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60)


def test_the_install_puts_the_pth_into_site_packages():
    pth = os.path.join(sysconfig.get_paths()["purelib"], "shardsafe-autoload.pth")
    assert os.path.isfile(pth), f"{pth} missing: setup.py's build_py/editable_wheel should write it"
    with open(pth) as f:
        line = f.read()
    assert line.startswith("import ") and "shardsafe.adapters.autoload" in line and line.count("\n") == 1


def test_a_new_interpreter_imports_only_the_hook_and_none_with_the_switch_off():
    probe = ("import sys, json; print(json.dumps([sorted(m for m in sys.modules if m.startswith('shardsafe')), "
             "[type(f).__name__ for f in sys.meta_path]]))")
    mods, finders = json.loads(_py(probe).stdout)
    assert mods == ["shardsafe", "shardsafe.adapters", "shardsafe.adapters.autoload", "shardsafe.env",
                    "shardsafe.errors"] and "Finder" in finders
    for off in ("0", "false", "off", "no", " OFF "):
        mods, finders = json.loads(_py(probe, SHARDSAFE_AUTO=off).stdout)
        assert mods == [] and "Finder" not in finders, off


def test_importing_an_unrelated_module_is_untouched_and_json_still_loads():
    out = _py("import json, email.message, shardsafe.adapters.autoload as a; print(a.PATCHES.keys() >= {'deepspeed'})")
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


@pytest.mark.parametrize("block, want", [({"enabled": True}, True), ({}, True), ({"enabled": False}, False),
                                         ({"enabled": "yes"}, True), ("bad", True), (None, False)])
def test_which_configs_ask_for_protection(tmp_path, block, want):
    """A block other than {"enabled": false} goes to shardsafe (whose check names a malformed one); no block,
    no protection. The config is found wherever DeepSpeed looks for it."""
    cfg = {"train_micro_batch_size_per_gpu": 1}
    if block is not None:
        cfg["shardsafe"] = block
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    ns = argparse.Namespace(deepspeed_config=str(path))
    for args, kwargs in (((), {"config": cfg}), ((), {"config": str(path)}), ((), {"config_params": cfg}),
                         ((ns,), {}), ((), {"args": ns})):
        assert ds_config.wants_protection(args, kwargs) is want, (args, kwargs)


def test_hjson_config_and_unreadable_config(tmp_path):
    p = tmp_path / "ds.hjson"
    p.write_text('{\n  // a comment, as DeepSpeed allows\n  "shardsafe": {"enabled": true}\n}\n')
    pytest.importorskip("hjson", reason="hjson comes with deepspeed")
    assert ds_config.wants_protection((), {"config": str(p)}) is True
    assert ds_config.wants_protection((), {"config": str(tmp_path / "missing.json")}) is False   # DeepSpeed says so
    assert ds_config.wants_protection((), {}) is False


def test_the_deepspeed_wrapper_goes_straight_to_the_original_without_a_block():
    calls = []

    class FakeDS:   # stands in for the deepspeed module object only: the wrapping, not DeepSpeed, is tested
        __name__ = "deepspeed"

        @staticmethod
        def initialize(*args, **kwargs):
            calls.append((args, kwargs))
            return "engine"

    original = FakeDS.initialize
    autoload._patch_deepspeed(FakeDS)
    assert FakeDS.initialize is not original and FakeDS.initialize.__wrapped__ is original
    autoload._patch_deepspeed(FakeDS)           # idempotent
    assert FakeDS.initialize.__wrapped__ is original
    assert FakeDS.initialize(model=1, config={"x": 1}) == "engine" and calls == [((), {"model": 1, "config": {"x": 1}})]


def test_megatron_wanted_reads_the_command_line():
    assert autoload.megatron_wanted(["pretrain_gpt.py", "--num-layers", "2", "--shardsafe"])
    assert autoload.megatron_wanted(["pretrain_gpt.py", "--shardsafe-interval", "2"])   # flags parse, protection off
    assert not autoload.megatron_wanted(["pretrain_gpt.py", "--shardsafer"])
    assert not autoload.megatron_wanted(["pretrain_gpt.py"])


def test_a_trainer_whose_resume_hooks_failed_is_refused_not_restored_behind_its_back(monkeypatch):
    """HF's Trainer resumes only through the hooks on its class; when they could not be installed (another
    transformers), a protected engine would restore a snapshot the Trainer's loop then ignores: refused, with
    what to do."""
    import types

    from shardsafe.config import ConfigError

    class FakeDS:   # stands in for the deepspeed module object: the refusal happens before DeepSpeed is called
        __name__ = "deepspeed"

        @staticmethod
        def initialize(*args, **kwargs):
            return "engine"

    autoload._patch_deepspeed(FakeDS)
    monkeypatch.setitem(autoload.FAILED, "transformers.trainer", "AttributeError: no _run_epoch")
    fake_accelerate = types.ModuleType("accelerate.fake")
    exec("def prepare(init, cfg):\n    return init(model=None, config_params=cfg)\n", fake_accelerate.__dict__)
    with pytest.raises(ConfigError, match="cannot resume this Hugging Face Trainer.*enabled.*false"):
        fake_accelerate.prepare(FakeDS.initialize, {"shardsafe": {"enabled": True}})
    assert fake_accelerate.prepare(FakeDS.initialize, {"no": "block"}) == "engine"
    assert autoload._called_from(("accelerate.",)) is False


def test_the_hooks_socket_path_follows_the_holder_paths_rules(tmp_path):
    """The activation asks only whether the job's socket exists, with ``os`` alone (a program without a holder on
    its node imports nothing more of shardsafe): its path must be the one shardsafe.holder.paths derives, for the
    default directory, a user-named one (shardsafe's private subdirectory in it), a user-named shardsafe-<uid>, and
    an XDG_RUNTIME_DIR that does not exist on this node (SLURM passing the submitting host's environment)."""
    from shardsafe.holder.paths import HolderPaths, default_holder_dir, default_node_name
    mine = f"shardsafe-{os.getuid()}"
    cases = [{}, {"SHARDSAFE_HOLDER_DIR": str(tmp_path / "named")}, {"SHARDSAFE_HOLDER_DIR": str(tmp_path / mine)},
             {"XDG_RUNTIME_DIR": str(tmp_path)}, {"XDG_RUNTIME_DIR": str(tmp_path / "absent")},
             {"SHARDSAFE_NODE": "nodeA", "SLURMD_NODENAME": "ignored"}, {"SLURMD_NODENAME": "slurm7"}]
    for extra in cases:
        env = {"SHARDSAFE_JOB_ID": "job1", **extra}
        want = HolderPaths(default_holder_dir(env), "job1", default_node_name(env)).socket
        assert autoload.holder_socket(env) == want, (extra, autoload.holder_socket(env), want)
    assert autoload.holder_socket({}) == ""
