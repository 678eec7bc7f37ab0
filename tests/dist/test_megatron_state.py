"""Megatron adapter: capture -> CPU copies -> apply is bit-identical, in process and in fresh processes.

Per layout (TP2xDP2, TP1xPP2xDP2, TP2xPP2) and dtype (fp32, bf16), on 4 forked gloo ranks:
  run A: train N steps, capture into CPU copies (JSON meta, raw tensors), train M more steps
         (the reference), then roll back in process and replay M steps;
  run B: fresh processes build the model/optimizer from scratch with a *different* init seed,
         apply the saved state, train M steps.
Every loss, grad norm and lr of both replays, and the final optimizer shards and model params,
must be ``torch.equal``/``==`` to the reference. The ablation test proves the check has teeth.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (see docs/megatron.md)")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (HERE, os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

# Import the heavy modules once in the parent: forked ranks inherit them (no CPU shims here: those
# are installed inside each forked rank only, never in the pytest process).
import megatron.core.distributed  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401

import megatron_pretrain_gpt as ex  # noqa: E402
from _fork_ranks import load_tensors, run_ranks, save_tensors  # noqa: E402
from shardsafe.runtime import BaseRuntime  # noqa: E402

N_BEFORE, M_AFTER = 3, 3

LAYOUTS = {"tp2_dp2": dict(tp=2, pp=1), "tp1_pp2_dp2": dict(tp=1, pp=2), "tp2_pp2": dict(tp=2, pp=2),
           # interleaved pipeline: two model chunks per pipeline rank (layers 1+3 / 2+4 of 4)
           "tp1_pp2_vpp2_dp2": dict(tp=1, pp=2, vpp=2, num_layers=4),
           # MoE: 4 experts over 2 expert-parallel ranks; a dense and an expert DistributedOptimizer (ChainedOptimizer)
           "moe_dp4_ep2": dict(tp=1, pp=1, num_experts=4, ep=2)}


def _start(run_kw: dict) -> "ex.Trainer":
    import _megatron_cpu_shims
    _megatron_cpu_shims.install()
    run = ex.TinyGPT(**run_kw)
    ex.initialize_parallel(run)
    return ex.Trainer(run)


def _final_state(tr: "ex.Trainer") -> dict[str, torch.Tensor]:
    t, _ = ex.cpu_copy(tr.adapter().capture())
    t = {k: v for k, v in t.items() if not k.startswith("rng/")}
    t.update({f"model/{k}": v.cpu().clone() for k, v in tr.model_params().items()})
    return t


def _run_a(rank: int, world: int, run_kw: dict, out: str) -> dict:
    tr = _start(run_kw)
    ad = tr.adapter()
    for _ in range(N_BEFORE):
        tr.train_step()
    tensors, meta = ex.cpu_copy(ad.capture())
    save_tensors(f"{out}/snap{rank}", tensors, meta)
    ref = [tr.train_step() for _ in range(M_AFTER)]
    save_tensors(f"{out}/ref{rank}", _final_state(tr))
    sched_before = tr.scheduler.num_steps
    ad.apply(tensors, meta)  # in-process roll-back: the live counters are ahead of the snapshot
    rolled = {"iteration": tr.iteration, "num_steps": tr.scheduler.num_steps, "sched_before": sched_before,
              "consumed": tr.counters["consumed_train_samples"]}
    replay = [tr.train_step() for _ in range(M_AFTER)]
    save_tensors(f"{out}/rollback{rank}", _final_state(tr))
    from shardsafe.adapters.megatron import rank_coordinates
    from shardsafe.adapters.megatron.state_checks import leaf_optimizers
    return {"ref": ref, "replay": replay, "rolled": rolled, "gbs": tr.gbs, "opt": type(tr.optimizer).__name__,
            "coords": rank_coordinates(), "chunks": len(tr.model_chunks), "schedule": tr.fb.__name__,
            "leaves": [type(leaf).__name__ for leaf in leaf_optimizers(tr.optimizer)]}


def _run_b(rank: int, world: int, run_kw: dict, out: str) -> dict:
    tr = _start(dict(run_kw, seed=run_kw.get("seed", 1234) + 17))  # nothing may come from the init
    tensors, meta = load_tensors(f"{out}/snap{rank}")
    tr.adapter().apply(tensors, meta)
    restored = {"iteration": tr.iteration, "num_steps": tr.scheduler.num_steps,
                "consumed": tr.counters["consumed_train_samples"]}
    replay = [tr.train_step() for _ in range(M_AFTER)]
    save_tensors(f"{out}/fresh{rank}", _final_state(tr))
    return {"replay": replay, "restored": restored}


def _assert_equal_states(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: tensor names differ"
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:5]}"


def _check(run_kw: dict, tmp_path) -> None:
    out = str(tmp_path)
    a = run_ranks(4, _run_a, run_kw, out)
    b = run_ranks(4, _run_b, run_kw, out)
    for rank in range(4):
        ra, rb = a[rank], b[rank]
        gbs = ra["gbs"]
        assert ra["ref"][0]["loss"] is not None or ra["ref"][0]["grad_norm"] is not None
        assert ra["replay"] == ra["ref"], f"rank {rank}: in-process roll-back diverged"
        assert rb["replay"] == ra["ref"], f"rank {rank}: fresh-process restore diverged"
        # no double counting: the scheduler was ahead by M steps before the roll-back
        assert ra["rolled"] == {"iteration": N_BEFORE, "num_steps": N_BEFORE * gbs,
                                "sched_before": (N_BEFORE + M_AFTER) * gbs, "consumed": N_BEFORE * gbs}
        assert rb["restored"] == {"iteration": N_BEFORE, "num_steps": N_BEFORE * gbs, "consumed": N_BEFORE * gbs}
        ref, _ = load_tensors(f"{out}/ref{rank}")
        _assert_equal_states(ref, load_tensors(f"{out}/rollback{rank}")[0], f"rank {rank} roll-back")
        _assert_equal_states(ref, load_tensors(f"{out}/fresh{rank}")[0], f"rank {rank} fresh restore")
    # rank_coordinates: Megatron's default order tp-cp-ep-dp-pp, so TP peers are adjacent world ranks
    tp, pp = run_kw["tp"], run_kw["pp"]
    dp = 4 // (tp * pp)
    vpp = run_kw.get("vpp", 1)
    for rank, r in enumerate(a):
        c = r["coords"]
        assert (c["rank"], c["world_size"], c["tp_size"], c["pp_size"], c["dp_size"]) == (rank, 4, tp, pp, dp)
        assert (r["chunks"], c["vpp_size"]) == (vpp, vpp)
        plain = "Float16OptimizerWithFloat16Params" if run_kw.get("bf16") else "FP32Optimizer"
        want = ["DistributedOptimizer"] * (2 if run_kw.get("num_experts") else 1) \
            if run_kw.get("distributed_optimizer", True) else [plain]
        assert r["leaves"] == want and c["ep_size"] == run_kw.get("ep", 1), (r["leaves"], c)
        assert r["schedule"].endswith("_with_interleaving") == (vpp > 1), r["schedule"]
        assert (c["tp"], c["dp"], c["pp"]) == (rank % tp, (rank // tp) % dp, rank // (tp * dp))
        assert rank in c["dp_ranks"] and len(c["dp_ranks"]) == dp and len(c["tp_ranks"]) == tp
        assert all(a[o]["coords"]["tp"] == c["tp"] and a[o]["coords"]["pp"] == c["pp"] for o in c["dp_ranks"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_distopt_restore_is_bit_identical(layout, dtype, tmp_path):
    _check(dict(LAYOUTS[layout], bf16=dtype == "bf16"), tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # FP32Optimizer / Float16OptimizerWithFloat16Params
def test_plain_optimizer_restore_is_bit_identical(dtype, tmp_path):
    _check(dict(tp=2, pp=1, bf16=dtype == "bf16", distributed_optimizer=False), tmp_path)


# ---- ablation: the comparison above must fail when a piece of state is not restored -----------------

def _ablate(adapter, meta: dict, what: str) -> dict:
    meta = copy.deepcopy(meta)
    if what == "lr":  # neither the scheduler nor the param_groups' lr
        adapter._apply_scheduler = lambda sd: None
        for om in meta["optimizers"]:
            for g in om["groups"]:
                g["hparams"].pop("lr", None)
    elif what == "rng_tracker":  # the dropout RNG of Megatron's tracker
        meta["rng"]["tracker"] = []
    return meta  # "adam_step" is ablated in the tensors: every per-param step counter set to 1


def _run_ablations(rank: int, world: int, run_kw: dict, out: str) -> dict:
    tr = _start(dict(run_kw, seed=99))
    tensors, meta = load_tensors(f"{out}/snap{rank}")
    res = {}
    for what in ("full", "lr", "rng_tracker", "adam_step", "full_again"):
        ad = tr.adapter()
        t = dict(tensors)
        if what == "adam_step":
            t = {k: (v.clone().fill_(1.0) if k.endswith("/step") else v) for k, v in t.items()}
        ad.apply(t, _ablate(ad, meta, what))
        res[what] = [tr.train_step() for _ in range(M_AFTER)]
    # A snapshot from another layout is refused before anything is touched.
    ex.destroy_parallel()
    tr2 = _start(dict(run_kw, tp=1, pp=2))
    res["other_layout_problems"] = tr2.adapter().validate(tensors, meta)
    # A changed LR schedule is found before anything is mutated (Megatron-LM's default scheduler policy).
    tr2.scheduler.use_checkpoint_opt_param_scheduler = False
    tr2.scheduler.lr_decay_steps += 8
    res["schedule_problems"] = tr2.adapter().validate(tensors, meta)
    # Unsupported setups are refused when the adapter is built, naming the setting.
    from shardsafe.config import ConfigError
    tr2.optimizer.chained_optimizers[0].config.use_precision_aware_optimizer = True
    try:
        tr2.adapter()
        res["rejected"] = None
    except ConfigError as e:
        res["rejected"] = str(e)
    return res


@pytest.mark.timeout(120)
def test_ablation_each_piece_of_state_matters(tmp_path):
    run_kw = dict(tp=2, pp=1, bf16=False)
    out = str(tmp_path)
    a = run_ranks(4, _run_a, run_kw, out)
    b = run_ranks(4, _run_ablations, run_kw, out)
    for rank in range(4):
        ref, r = a[rank]["ref"], b[rank]
        assert r["full"] == ref and r["full_again"] == ref, f"rank {rank}: full restore must be exact"
        for what in ("lr", "rng_tracker", "adam_step"):
            assert r[what] != ref, f"rank {rank}: skipping the {what} restore went unnoticed"
        assert any("parallel layout differs" in p for p in r["other_layout_problems"]), r["other_layout_problems"]
        assert "--use-precision-aware-optimizer" in (r["rejected"] or "")
        assert any("lr_decay_steps" in p and "LR/WD schedule differs" in p for p in r["schedule_problems"])


# ---- TE FP8 scaling state: code path with a stand-in module (TE cannot be installed without CUDA) ----

class _FakeTEModule(torch.nn.Module):
    """Carries ``fp8_meta`` like transformer_engine.pytorch modules; allocates it lazily like TE."""

    def __init__(self, allocated: bool):
        super().__init__()
        self.fp8_meta = {}
        if allocated:
            self.init_fp8_metadata(num_gemms=1)

    def init_fp8_metadata(self, num_gemms: int = 1):
        from types import SimpleNamespace
        if "scaling_fwd" not in self.fp8_meta:
            self.fp8_meta["scaling_fwd"] = SimpleNamespace(scale=torch.ones(3 * num_gemms),
                                                           amax_history=torch.zeros(4, 3 * num_gemms))
            self.fp8_meta["scaling_bwd"] = SimpleNamespace(scale=torch.ones(2 * num_gemms),
                                                           amax_history=torch.zeros(4, 2 * num_gemms))

    def forward(self, x):
        self.fp8_meta["scaling_fwd"].amax_history[0].fill_(-1.0)  # TE updates amax during forward
        return x


def _run_fp8(rank: int, world: int) -> dict:
    tr = _start(dict(tp=1, pp=1))
    inner = tr.model_chunks[0].module
    inner.add_module("fake_te", _FakeTEModule(allocated=True))
    ad = tr.adapter()
    fwd = inner.fake_te.fp8_meta["scaling_fwd"]
    fwd.scale.copy_(torch.tensor([2.0, 3.0, 4.0]))
    fwd.amax_history.normal_()
    st = ad.capture()
    name = "fp8/c0.module.fake_te/scaling_fwd/amax_history"
    cloned = st.tensors[name].data_ptr() != fwd.amax_history.data_ptr()
    tensors, meta = ex.cpu_copy(st)
    saved_amax = tensors[name].clone()
    fwd.scale.fill_(0.0)
    fwd.amax_history.fill_(7.0)
    ad.apply(tensors, meta)
    in_place = torch.equal(fwd.amax_history, saved_amax) and fwd.scale.tolist() == [2.0, 3.0, 4.0]
    # a fresh TE module has no fp8_meta tensors before its first FP8 forward: restored right there
    inner.fake_te = _FakeTEModule(allocated=False)
    ad2 = tr.adapter()
    ad2.apply(tensors, meta)
    before = dict(inner.fake_te.fp8_meta)
    inner.fake_te(torch.zeros(1))
    fresh = inner.fake_te.fp8_meta["scaling_fwd"]
    deferred = (not before and fresh.scale.tolist() == [2.0, 3.0, 4.0]
                and torch.equal(fresh.amax_history[1:], saved_amax[1:]) and fresh.amax_history[0].eq(-1).all().item()
                and not inner.fake_te._forward_pre_hooks)
    return {"cloned": cloned, "in_place": in_place, "deferred": bool(deferred)}


@pytest.mark.timeout(60)
def test_fp8_scaling_state_code_path():
    r = run_ranks(1, _run_fp8)[0]
    assert r == {"cloned": True, "in_place": True, "deferred": True}


# ---- persistent module buffers (e.g. the MoE router's expert_bias): copied at capture, restored in place ----

def _run_buffers(rank: int, world: int) -> dict:
    tr = _start(dict(tp=1, pp=1))
    inner = tr.model_chunks[0].module
    inner.register_buffer("expert_bias", torch.arange(4, dtype=torch.float32))            # persistent
    inner.register_buffer("scratch", torch.zeros(3), persistent=False)                    # not state
    ad = tr.adapter()
    st = ad.capture()
    name = next(k for k in st.tensors if k.startswith("buf/"))
    names = sorted(k for k in st.tensors if k.startswith("buf/"))
    cloned = st.tensors[name].data_ptr() != inner.expert_bias.data_ptr()
    tensors, meta = ex.cpu_copy(st)
    inner.expert_bias.add_(10.0)   # training updates it (finalize_model_grads), possibly during the async copy
    ad.apply(tensors, meta)
    restored = inner.expert_bias.tolist() == [0.0, 1.0, 2.0, 3.0]
    inner.register_buffer("other_bias", torch.zeros(2))                                   # another model
    problems = tr.adapter().validate(tensors, meta)
    return {"names": names, "cloned": cloned, "restored": restored, "problems": problems}


@pytest.mark.timeout(60)
def test_persistent_buffers_are_copied_and_restored():
    r = run_ranks(1, _run_buffers)[0]
    assert r["names"] == ["buf/c0.module.expert_bias"], r["names"]   # the non-persistent one is not state
    assert r["cloned"] and r["restored"]
    assert any("persistent module buffers differ" in p for p in r["problems"]), r["problems"]


# ---- the two-call core API: restore() once, snapshot() after every step, close() ----------------------

class _RecordingRuntime(BaseRuntime):
    """Stands in for the holder runtime (tests/fault/test_megatron_resume.py runs the real one through the
    same calls): keeps CPU copies of what the interval captures, and applies the newest one on restore."""

    def __init__(self, cfg, saved: dict) -> None:
        self.cfg, self.saved, self.calls, self.restored = cfg, saved, [], None

    def try_restore(self, adapter):
        from shardsafe.snapshot.restore import RestoreResult
        if self.saved:
            version = max(self.saved)
            adapter.apply(*self.saved[version])
            self.restored = RestoreResult(version=version, tier="memory")
        else:
            self.restored = RestoreResult()
        return self.restored

    def after_step(self, iteration, adapter):
        self.calls.append(("after_step", iteration))
        if iteration % self.cfg.interval == 0:
            self.saved[iteration] = ex.cpu_copy(adapter.capture())

    def on_exit(self, iteration, adapter):
        self.calls.append(("on_exit", iteration))
        if iteration % self.cfg.interval != 0:
            self.saved[iteration] = ex.cpu_copy(adapter.capture())

    def close(self):
        self.calls.append(("close",))


def _run_core_functions(rank: int, world: int) -> dict:
    from shardsafe.adapters import megatron as sm
    tr = _start(dict(tp=1, pp=1))
    saved, runtimes, out = {}, [], {}

    def factory(cfg):
        runtimes.append(_RecordingRuntime(cfg, saved))
        return runtimes[-1]

    def error(fn, *a, **k) -> str:
        try:
            fn(*a, **k)
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            return f"{type(e).__name__}: {e}"
        return "no error"

    chunks, opt, sched = tr.model_chunks, tr.optimizer, tr.scheduler
    out["before_restore"] = error(sm.snapshot, chunks, opt, sched, 1)
    got = sm.restore(chunks, opt, sched, {"interval": 2}, runtime_factory=factory)
    out["fresh"] = (got.iteration, got.counters, got.tier)
    out["twice"] = error(sm.restore, chunks, opt, sched, {"interval": 2}, runtime_factory=factory)
    out["other_scheduler"] = error(sm.snapshot, chunks, opt, object(), 1)
    taken = []
    for _ in range(3):
        tr.train_step()
        taken.append(sm.snapshot(chunks, opt, sched, tr.iteration, counters=dict(tr.counters),
                                 final=tr.iteration == 3))
    out["taken"] = taken
    out["calls"] = list(runtimes[0].calls)
    expect = ex.cpu_copy(tr.adapter().capture())[0]
    sm.close(opt)
    sm.close(opt)   # idempotent
    out["closed"] = runtimes[0].calls[-1] == ("close",) and len(runtimes[0].calls) == len(out["calls"]) + 1
    out["step_unwrapped"] = "step" not in vars(opt)
    tr.train_step()  # moves every piece of state on; restore must bring iteration 3 back
    got = sm.restore(chunks, opt, sched, {"interval": 2}, runtime_factory=factory)
    out["restored"] = (got.iteration, got.counters, got.tier)
    now = ex.cpu_copy(tr.adapter().capture())[0]
    out["state_equal"] = sorted(k for k in expect if not torch.equal(expect[k], now[k]))
    out["gbs"] = tr.gbs
    sm.close(opt)
    return out


@pytest.mark.timeout(60)
def test_core_functions_restore_snapshot_close_contract():
    r = run_ranks(1, _run_core_functions)[0]
    assert r["before_restore"].startswith("UsageError") and "Call restore(model_chunks" in r["before_restore"]
    assert r["fresh"] == [None, {}, "none"]   # results come back through JSON: tuples are lists
    assert r["twice"].startswith("UsageError") and "already protected" in r["twice"]
    assert r["other_scheduler"].startswith("ConfigError") and "not the objects restore() was given" in r["other_scheduler"]
    # interval 2: iteration 2 is captured; 3 is the last one (final=True), sealed by on_exit
    assert r["taken"] == [False, True, True]
    assert r["calls"] == [["after_step", 1], ["after_step", 2], ["after_step", 3], ["on_exit", 3]]
    assert r["closed"] and r["step_unwrapped"]
    assert r["restored"] == [3, {"consumed_train_samples": 3 * r["gbs"]}, "memory"]
    assert r["state_equal"] == [], r["state_equal"]
