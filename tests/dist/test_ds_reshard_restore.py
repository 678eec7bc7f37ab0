"""A DeepSpeed job that lost a node continues at a smaller data-parallel size from memory, and grows back (issue 44).

Real DeepSpeed engines on forked gloo ranks, real holders, one per simulated node, parity on (parity_shards 1: one
RS(3, 1) group over the 4 nodes). The tiny GPT of examples/ds_pretrain_gpt.py (odd sizes: no partition boundary
falls on a parameter's), bf16, DeepSpeed's FusedAdam from the config, two parameter groups, WarmupLR, gradient
clipping; gradient accumulation 3 at D = 4 (a global batch of 12 micro-batches). ZeRO-1, ZeRO-2 and ZeRO-3 run side by
side in the same processes, one protected engine each (each keeps its own snapshots: engine scopes), so that each
phase pays DeepSpeed's first-engine start-up once.

1. At D = 4 on nodes n0..n3 the job trains V steps, snapshotting every step (version V committed everywhere), and
   DeepSpeed's own ``save_checkpoint`` of the same step is the oracle's input.
2. Node n1 is lost: its holder is SIGKILLed (its shared memory goes with it).
3. The job continues at D' = 3 on the survivors (rank r on the r-th of n2, n3, n0: every target reads sources held
   on other nodes), started as the launcher starts it: the program's unchanged config (gradient_accumulation_steps
   3) with SHARDSAFE_FULL_WORLD_SIZE=4, which the activation turns into 4. The restore reads each node's holder only,
   rebuilds source rank 1 from the survivors' parity, re-partitions version V to 3 ranks and applies it. In the same
   processes the oracle is DeepSpeed's universal checkpoint of step V (``ds_to_universal``) loaded at D' with
   ``load_universal`` (completed by hand where DeepSpeed's resume falls short, as tests/dist/test_ds_reshard_oracle.py
   does and says). Compared: every optimizer tensor and module buffer, tensor for tensor (torch.equal), the
   metadata and DeepSpeed's layout fields; then both continue K steps with the same accumulation and RNG seeding:
   every loss equal (float.hex). Once a version at D' commits, the holders keep the new layout only.
4. Grow back: node n1 returns with an empty holder, the job restarts at D = 4 and re-partitions the newest version
   taken at D' = 3 from memory (no parity needed): equal to the pure re-partition of the D' ranks' end states and to
   DeepSpeed's universal-checkpoint resume, and the losses continue equal.

A refusal: a fourth engine (ZeRO-2) restarted at D' = 3 without keeping the global batch (no
SHARDSAFE_FULL_WORLD_SIZE) is refused as another run's state, naming the global batch; nothing is applied or deleted.
"""
import json
import os

import pytest

from shardsafe.holder.client import HolderClient
from shardsafe.holder.paths import HolderPaths

from ._node_holders import NodeHolders
from ._fork_ranks import load_tensors, run_ranks, save_tensors
from ._universal import ds_to_universal
from .test_ds_reshard_oracle import MB, MODEL, SEED, _buffers_from_checkpoint, _diff, _save_capture, _train, \
    _zero3_group_hyperparameters

pytestmark = pytest.mark.slow

JOB = "rsz"
V, K = 2, 2
D, G, D2 = 4, 3, 3                    # G x D = 12 micro-batches per step; at D2 the accumulation is 4
FULL = [f"n{i}" for i in range(D)]
SHRUNK = ["n2", "n3", "n0"]           # n1 is lost; rank r of D2 runs on the r-th of these
STAGES = (1, 2, 3)                    # engines 0..2 of every process; engine 3 (ZeRO-2) is the refused one


def _config(stage, gas, *, root=None, node=None, universal=False):
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},   # DeepSpeed's FusedAdam
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                        "warmup_num_steps": 10}},
           "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
           "steps_per_print": 10 ** 9}
    if root is not None:
        cfg["shardsafe"] = {"job_id": JOB, "holder_dir": root, "node": node, "start_holder": False, "timeout_s": 30,
                            "interval": 1, "parity_shards": 1}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _engine(cfg, rank, protected, full_world=None):
    import random

    import deepspeed
    import deepspeed.ops
    import numpy as np
    import torch
    from ds_pretrain_gpt import TinyGPT
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(SEED)
    model = TinyGPT(MODEL["vocab"], MODEL["d"], MODEL["layers"], MODEL["heads"], MODEL["seq"])
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    torch.manual_seed(SEED + 1 + rank)
    random.seed(SEED + rank)
    np.random.seed(SEED + rank)
    if not protected:   # the oracle: DeepSpeed's own, never the activation's wrapper
        initialize = getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize)
        return initialize(model=model, model_parameters=groups, config=cfg)[0]
    from shardsafe.adapters.deepspeed import initialize
    if full_world is not None:   # what the launcher exports to a job it re-formed at another size
        os.environ["SHARDSAFE_FULL_WORLD_SIZE"] = str(full_world)
    try:
        return initialize(model=model, model_parameters=groups, config=cfg)[0]
    finally:
        os.environ.pop("SHARDSAFE_FULL_WORLD_SIZE", None)


def _reseed(rank):
    """The same RNG streams for the two engines that continue side by side (a re-partition restores no RNG: the
    program's seeding stands, as after DeepSpeed's universal resume)."""
    import random

    import numpy as np
    import torch
    torch.manual_seed(SEED + 7 + rank)
    random.seed(SEED + 7 + rank)
    np.random.seed(SEED + 7 + rank)


def _run_full(rank, world, root, out):
    """The job at D = 4: train, snapshot every step, DeepSpeed's checkpoint of the last step for the oracle."""
    got = []
    for stage in (*STAGES, 2):
        engine = _engine(_config(stage, G, root=root, node=FULL[rank]), rank, True)
        _train(engine, V, rank, world, G)
        assert engine.shardsafe.flush()
        if len(got) < len(STAGES):
            engine.save_checkpoint(os.path.join(out, f"z{stage}"), tag=f"global_step{V}")
        got.append({"committed": engine.shardsafe.runtime.pipeline.last_committed,
                    "restored": engine.shardsafe.restored.version})
    return got


def _run_resized(rank, world, root, out, phase, nodes, tag, refuse):
    """The job at another size: per stage ours restores from the holders and the oracle loads DeepSpeed's universal
    checkpoint of the same step, both continue K steps; ours leaves its end state and DeepSpeed checkpoint for the
    next size. ``refuse``: then a fourth engine starts without keeping the global batch."""
    from shardsafe.adapters.deepspeed import DeepSpeedStateAdapter
    from shardsafe.payload import manifest as mf
    _universal(rank, out, tag)
    gas = G * D // world
    got = {}
    for stage in STAGES:
        ours = _engine(_config(stage, G, root=root, node=nodes[rank]), rank, True, full_world=D)
        res = ours.shardsafe.restored
        g = got[stage] = {"version": res.version, "tier": res.tier, "reshard": res.reshard, "lost": res.lost_ranks,
                          "rebuilt_bytes": res.rebuilt_bytes, "gas": int(ours.gradient_accumulation_steps()),
                          "micro_steps": int(ours.micro_steps)}
        _save_capture(os.path.join(out, f"{phase}_z{stage}_ours_loaded{rank}"), ours.shardsafe.adapter)
        oracle = _engine(_config(stage, gas, universal=True), rank, False)
        path, _ = oracle.load_checkpoint(os.path.join(out, f"z{stage}"))   # its latest_universal
        assert path is not None, "load_universal found no checkpoint"
        ad = DeepSpeedStateAdapter(oracle)
        powers = ours.shardsafe.adapter.adam_powers   # FusedAdam's CPU beta powers: in no DeepSpeed checkpoint
        if ad.adam_powers is not None and powers is not None:
            ad.adam_powers.restore(powers.state())
        universal = os.path.join(out, f"z{stage}", f"global_step{res.version}_universal")
        _buffers_from_checkpoint(oracle, universal)
        if stage == 3:
            _zero3_group_hyperparameters(oracle, universal)
        _save_capture(os.path.join(out, f"{phase}_z{stage}_oracle_loaded{rank}"), ad)
        # The CPU FusedAdam kernel's beta powers live in one static C++ object per process, shared by both engines:
        # each continues from the chain as restored, as it would in a process of its own.
        chain = powers.state() if powers is not None else None
        _reseed(rank)
        g["losses"] = _train(ours, K, rank, world, gas)
        _reseed(rank)
        if chain is not None:
            powers.restore(chain)
        g["oracle_losses"] = _train(oracle, K, rank, world, gas)
        assert ours.shardsafe.flush()
        g["committed"] = ours.shardsafe.runtime.pipeline.last_committed
        st = ours.shardsafe.adapter.capture()
        save_tensors(os.path.join(out, f"{phase}_z{stage}_end{rank}"),
                     {n: t.detach().cpu().clone() for n, t in st.tensors.items()}, mf.to_jsonable(st.meta))
        ours.save_checkpoint(os.path.join(out, f"z{stage}"), tag=f"global_step{ours.global_steps}")
    if refuse:
        from shardsafe.snapshot.restore import RestoreError
        try:
            _engine(_config(2, G, root=root, node=nodes[rank]), rank, True)
            got["refused"] = None
        except RestoreError as e:
            got["refused"] = str(e)
    return got


def _universal(rank, out, tag):
    """DeepSpeed's documented conversion (``ds_to_universal --inject_missing_state``, one worker) of the checkpoint
    ``tag`` of the stage this rank converts (rank i: the i-th stage), then a barrier: the oracles load them."""
    import torch.distributed as dist
    if rank < len(STAGES):
        folder = os.path.join(out, f"z{STAGES[rank]}")
        ds_to_universal(os.path.join(folder, tag), os.path.join(folder, f"{tag}_universal"))
    dist.barrier()


def _held(root, nodes):
    """node -> {engine scope: the rank numbers its holder keeps data slots of}."""
    out = {}
    for n in nodes:
        out[n] = {}
        for scope in ("", "engine1", "engine2"):
            c = HolderClient(HolderPaths(root, JOB, n), timeout_s=10, scope=scope).connect()
            try:
                out[n][scope] = sorted(int(r) for r, kinds in c.list().items() if kinds.get("data"))
            finally:
                c.close()
    return out


def _prewarm():
    """What a fork server preloads for DeepSpeed trainers (``shardsafe launch --preload deepspeed``), and FusedAdam's
    CPU op, once in this process before the ranks are forked: DeepSpeed's first engine in a process otherwise
    imports torch._dynamo and inductor (through torch.optim and DeepSpeed's Muon module) and loads the op, several
    seconds per rank, every phase."""
    import importlib

    from shardsafe.launch.presets import PRELOAD_DEEPSPEED
    for item in PRELOAD_DEEPSPEED:
        mod, _, fn = item.partition(":")
        m = importlib.import_module(mod)
        if fn:
            getattr(m, fn)()
    from deepspeed.ops.op_builder import FusedAdamBuilder
    FusedAdamBuilder().load()


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    """The three phases, once: at D, at D' after node n1 is lost, and at D again once it is back."""
    out = str(tmp_path_factory.mktemp("reshard-restore"))
    holders = NodeHolders(str(tmp_path_factory.mktemp("holders")), JOB)
    _prewarm()
    try:
        holders.start(*FULL)
        full = run_ranks(D, _run_full, holders.root, out, timeout_s=300, pg_timeout_s=30)
        holders.kill("n1")   # node n1 is lost, and its holder's memory with it
        shrunk = run_ranks(D2, _run_resized, holders.root, out, "shrunk", SHRUNK, f"global_step{V}", True,
                           timeout_s=300, pg_timeout_s=60)
        held = _held(holders.root, SHRUNK)
        holders.start("n1")   # n1 is back, with an empty holder
        grown = run_ranks(D, _run_resized, holders.root, out, "grown", FULL, f"global_step{V + K}", False,
                          timeout_s=300, pg_timeout_s=60)
        yield {"out": out, "full": full, "shrunk": shrunk, "held": held, "grown": grown,
               "held_grown": _held(holders.root, FULL)}
    finally:
        holders.stop()


def _check_loaded(out, phase, stage, world):
    """Ours right after the restore vs the oracle right after its load: optimizer tensors and module buffers bit for
    bit, the metadata that says the same step (counters but micro_steps, schedules, param groups), and DeepSpeed's
    own layout fields."""
    from shardsafe.adapters.deepspeed.reshard import SIZED_FIELDS
    from shardsafe.payload import manifest as mf
    for r in range(world):
        o_t, o_m = load_tensors(os.path.join(out, f"{phase}_z{stage}_oracle_loaded{r}"))
        s_t, s_m = load_tensors(os.path.join(out, f"{phase}_z{stage}_ours_loaded{r}"))
        o_m, s_m = mf.from_jsonable(o_m), mf.from_jsonable(s_m)
        assert _diff(s_t, o_t, skip=("rng/",)) == [], (stage, r)
        assert any(n.startswith("opt/state/") for n in s_t), (stage, r)   # the moments came back, not fresh ones
        for key in ("param_groups", "lr_scheduler", "loss_scaler", "opt_scalars", "zero_stage", "optimizer",
                    "dp_world_size", "parallel", "base_optimizer", "adam_powers", "extra"):
            assert s_m.get(key) == o_m.get(key), (stage, r, key, s_m.get(key), o_m.get(key))
        assert {k: v for k, v in s_m["counters"].items() if k != "micro_steps"} == \
            {k: v for k, v in o_m["counters"].items() if k != "micro_steps"}, (stage, r)
        assert {k: s_m["ds_checkpoint"].get(k) for k in SIZED_FIELDS} == \
            {k: o_m["ds_checkpoint"].get(k) for k in SIZED_FIELDS}, (stage, r)


@pytest.mark.parametrize("stage", STAGES)
def test_a_lost_node_continues_at_a_smaller_size_as_deepspeeds_universal_resume(phases, stage):
    assert [r[STAGES.index(stage)]["committed"] for r in phases["full"]] == [V] * D   # committed at D = 4
    got = [r[str(stage)] for r in phases["shrunk"]]
    # the committed version, re-partitioned from 4 to 3 ranks after rebuilding source rank 1 from parity
    assert [g["version"] for g in got] == [V] * D2 and [g["tier"] for g in got] == ["parity"] * D2, got
    assert all(g["lost"] == [1] and g["reshard"]["from_dp"] == D and g["reshard"]["to_dp"] == D2 for g in got), got
    # Source rank 1 is decoded where it is read: every target that reads from it decodes its own part (from the
    # fragments it received) and reads that part locally; no decoded byte is sent on.
    decoders = [r for r, g in enumerate(got) if g["rebuilt_bytes"] > 0]
    readers = [r for r, g in enumerate(got) if "1" in g["reshard"]["by_source"]]
    assert len(decoders) > 1 and decoders == readers, (decoders, readers)
    assert all(got[r]["reshard"]["by_source"]["1"]["from_rank"] == r and got[r]["reshard"]["fragment_bytes"] > 0
               for r in decoders), got
    assert all(g["reshard"]["rebuilt_by"] == {"1": decoders} for g in got), got
    assert [g["gas"] for g in got] == [G * D // D2] * D2 and [g["micro_steps"] for g in got] == [V * G * D // D2] * D2
    _check_loaded(phases["out"], "shrunk", stage, D2)
    assert [g["losses"] for g in got] == [g["oracle_losses"] for g in got], got
    # What moved: a target never receives from another rank what its own node holds, and something crossed nodes.
    for r, g in enumerate(got):
        tr = g["reshard"]
        assert all(v["same_node"] == (SHRUNK[v["from_rank"]] == SHRUNK[r]) for v in tr["by_source"].values()), tr
    assert sum(g["reshard"]["remote_bytes"] for g in got) > 0
    print("RESHARD_RESTORE", stage, json.dumps([{k: g["reshard"][k] for k in ("local_bytes", "remote_bytes",
                                                                              "sent_bytes", "fragment_bytes")}
                                                for g in got]))
    # a version at D' committed everywhere: the holders keep the new layout's ranks only
    assert [g["committed"] for g in got] == [V + K] * D2
    scope = ("", "engine1", "engine2")[STAGES.index(stage)]
    assert {n: h[scope] for n, h in phases["held"].items()} == {n: [r] for r, n in enumerate(SHRUNK)}


@pytest.mark.parametrize("stage", STAGES)
def test_the_job_grows_back_from_memory(phases, stage):
    import torch

    from shardsafe.adapters.deepspeed import DeepSpeedStateAdapter
    from shardsafe.payload import manifest as mf
    from shardsafe.snapshot.reshard import reshard
    got = [r[str(stage)] for r in phases["grown"]]
    assert [g["version"] for g in got] == [V + K] * D and [g["tier"] for g in got] == ["memory"] * D, got
    assert all(g["lost"] == [] and g["reshard"]["from_dp"] == D2 and g["gas"] == G for g in got), got
    _check_loaded(phases["out"], "grown", stage, D)
    # the distributed restore gives what the pure re-partition of the D' ranks' end states gives
    snaps = []
    for r in range(D2):
        t, m = load_tensors(os.path.join(phases["out"], f"shrunk_z{stage}_end{r}"))
        snaps.append(type("Snap", (), {"tensors": t, "meta": mf.from_jsonable(m)})())
    want = reshard(snaps, D, DeepSpeedStateAdapter.resharder())
    for r in range(D):
        mine = load_tensors(os.path.join(phases["out"], f"grown_z{stage}_ours_loaded{r}"))[0]
        assert all(torch.equal(mine[n], t) for n, t in want.ranks[r].tensors.items()), (stage, r)
    assert [g["losses"] for g in got] == [g["oracle_losses"] for g in got], got
    scope = ("", "engine1", "engine2")[STAGES.index(stage)]
    assert {n: h[scope] for n, h in phases["held_grown"].items()} == {f"n{r}": [r] for r in range(D)}


def test_a_global_batch_that_is_not_kept_is_refused_naming_it(phases):
    """Restarted at D' = 3 with the full-size job's accumulation (no SHARDSAFE_FULL_WORLD_SIZE): another global batch
    is another run; nothing is applied, nothing deleted (it grows back from memory later: the next test's engine 3
    is not built, but its versions are still held)."""
    for r in phases["shrunk"]:
        msg = r["refused"]
        assert msg and "batch: global_batch_size was 24, now 18" in msg and "Nothing was loaded" in msg, msg
    assert [r[3]["committed"] for r in phases["full"]] == [V] * D
