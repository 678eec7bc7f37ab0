"""A Megatron job that lost a node continues at a smaller data-parallel size from memory, and grows back (issue 44).

Real megatron-core on forked gloo ranks (the tiny GPT of examples/megatron_pretrain_gpt.py with its CPU shims,
DistributedOptimizer over torch Adam, bf16 params with fp32 main params, cosine LR with warmup, gradient clipping,
dropout), protected by ``shardsafe.adapters.megatron.protect`` with real holders, one per simulated node, parity on
(parity_shards 1: per tensor-parallel rank one RS(2, 1) group over the 3 nodes). TP = 2 is the smallest layout where
a re-partition must keep the tensor-parallel slices apart: each slice (the ranks of one TP coordinate) is cut by
itself, and a lost node takes a source of every slice with it. The global batch is 12 samples: 2 micro-batches of
2 per rank at D = 3, 3 at D' = 2, and Megatron's num-microbatches calculator is initialised as Megatron-LM does.

1. TP2 x DP3 on nodes n0..n2 (node n_d holds data-parallel rank d's two TP ranks) trains V steps, snapshotting every
   step (version V committed everywhere). Before the last snapshot data-parallel rank 1 draws one random number, so
   the ranks' RNG streams differ and the RNG rule is tested. The same process then writes Megatron's own checkpoint
   of that step (dist_checkpointing, the fully reshardable DistributedOptimizer format, as
   tests/dist/test_megatron_reshard_oracle.py writes and loads it: the oracle).
2. Node n1 is lost: its holder is SIGKILLed (its shared memory goes with it).
3. TP2 x DP2 on the survivors (data-parallel rank r on the r-th of n2, n0). First a run that does not keep the global
   batch (2 micro-batches, 8 samples) is refused as another run's state, naming the batch; nothing is applied or
   deleted. Then the run that keeps it restores: each rank reads its own node's holder, the lost source of each slice
   is rebuilt from the survivors' parity, version V is re-partitioned to 2 data-parallel ranks and applied. In the
   same processes the oracle loads Megatron's checkpoint at D'. Compared right after: every captured tensor (fp32
   main-parameter shards, exp_avg, exp_avg_sq, the per-parameter step, RNGs) and every model parameter (torch.equal),
   the metadata (groups, scheduler, counters, iteration, layout, batch); then K steps each: every loss equal
   (float.hex), and the final states. Once a version at D' commits, the holders keep the new layout's ranks only.
4. Grow back: n1 returns with an empty holder, the job restarts at D = 3 and re-partitions the newest version taken
   at D' (V + K) from memory (no parity needed), equal again to Megatron's checkpoint of the D' job's step V + K
   loaded at D, and the losses continue equal.
"""
from __future__ import annotations

import json
import os
import time

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (see docs/megatron.md)")

import torch  # noqa: E402

from shardsafe.holder.client import HolderClient  # noqa: E402
from shardsafe.holder.paths import HolderPaths  # noqa: E402

from ._node_holders import NodeHolders  # noqa: E402
from .test_megatron_reshard_oracle import (MB, _capture, _diff, _loss, dist_ckpt, ex, load_tensors,  # noqa: E402
                                           run_ranks)

pytestmark = pytest.mark.slow

JOB = "mrsz"
TP, D, D2, G = 2, 3, 2, 2              # G micro-batches per rank at D: a global batch of MB x G x D = 12 samples
V, K = 2, 2
FULL = [f"n{i}" for i in range(D)]
SHRUNK = ["n2", "n0"]                  # n1 is lost; data-parallel rank r of D2 runs on the r-th of these


def _node(nodes: list[str], rank: int) -> str:
    return nodes[rank // TP]   # Megatron's rank order tp-dp (pp 1): data-parallel rank = world rank // TP


def _trainer(dp: int, microbatches: int, seed: int, *, first: bool) -> "ex.Trainer":
    """A bf16 TP2 trainer at ``dp`` data-parallel ranks with ``microbatches`` per rank; ``first``: this process's
    first one (parallel state and shims; later ones share them)."""
    import _megatron_cpu_shims
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)
    run = ex.TinyGPT(tp=TP, bf16=True, num_microbatches=microbatches, micro_batch_size=MB, seed=seed, timeout_s=60.0)
    if first:
        _megatron_cpu_shims.install()
        ex.initialize_parallel(run)
    else:
        destroy_num_microbatches_calculator()
        torch.manual_seed(seed)   # another init: nothing may come from it
    # as Megatron-LM's initialize does: the global batch is the run's, the micro-batches follow the size
    init_num_microbatches_calculator(torch.distributed.get_rank(), None, MB * microbatches * dp, MB, dp)
    return ex.Trainer(run)


def _protect(tr: "ex.Trainer", root: str, node: str):
    from shardsafe.adapters.megatron import protect

    def set_iteration(i: int) -> None:
        tr.iteration = i

    cfg = {"enabled": True, "job_id": JOB, "holder_dir": root, "node": node, "start_holder": False,
           "timeout_s": 30, "interval": 1, "parity_shards": 1}
    return protect(tr.model_chunks, tr.optimizer, tr.scheduler, cfg, get_iteration=lambda: tr.iteration,
                   set_iteration=set_iteration, get_counters=lambda: dict(tr.counters),
                   set_counters=lambda c: tr.counters.update(c))


def _save_megatron(tr: "ex.Trainer", folder: str) -> None:
    """Megatron's dist_checkpointing save of this step (the oracle's input; examples/megatron_dist_ckpt.py). Its
    writer has child processes, which the harness's daemonic ranks may not have: the flag is lifted."""
    import multiprocessing as mp
    mp.current_process()._config["daemon"] = False
    dist_ckpt.save(tr, folder)


def _run_full(rank: int, world: int, root: str, out: str) -> dict:
    """The job at D: train V steps, snapshot every step, Megatron's checkpoint of step V for the oracle."""
    from megatron.core import parallel_state as ps
    t = [time.monotonic()]
    tr = _trainer(D, G, seed=1234, first=True)
    prot = _protect(tr, root, _node(FULL, rank))
    losses = []
    for _ in range(V):
        losses.append(_loss(tr.train_step()))
        if tr.iteration == V and ps.get_data_parallel_rank() == 1:
            torch.rand(1)   # the data-parallel ranks' RNG streams now differ (Megatron-LM loads rank 0's)
        prot.after_step(tr.iteration)
    assert prot.flush()
    committed = prot.runtime.pipeline.last_committed
    prot.close()
    t.append(time.monotonic())
    _save_megatron(tr, os.path.join(out, f"ckpt{V}"))
    t.append(time.monotonic())
    return {"losses": losses, "committed": committed, "restored": prot.restored.version,
            "seconds": {"train": t[1] - t[0], "megatron_save": t[2] - t[1]}}


def _run_resized(rank: int, world: int, root: str, out: str, phase: str, nodes: list[str], version: int,
                 refuse: bool) -> dict:
    """The job at another size: ours restores from the holders, the oracle loads Megatron's checkpoint of
    ``version``; both continue K steps. Ours leaves Megatron's checkpoint of its end step for the next size.
    ``refuse``: first a run that does not keep the global batch is refused."""
    from shardsafe.snapshot.restore import RestoreError
    node = _node(nodes, rank)
    got: dict = {}
    t = [time.monotonic()]
    first = True
    if refuse:
        wrong = _trainer(world // TP, G, seed=99, first=True)   # G micro-batches at D': a global batch of 8, not 12
        first = False
        try:
            _protect(wrong, root, node)
            got["refused"] = None
        except RestoreError as e:
            got["refused"] = str(e)
        got["refused_iteration"] = wrong.iteration   # nothing was applied
    dp = world // TP
    oracle = _trainer(dp, G * D // dp, seed=1234 + 17, first=first)   # the global batch kept: G x D / D'
    ours = _trainer(dp, G * D // dp, seed=1234 + 29, first=False)
    t0 = time.monotonic()
    prot = _protect(ours, root, node)   # the restore at another size happens here
    got["restore_s"] = time.monotonic() - t0
    res = prot.restored
    got.update(version=res.version, tier=res.tier, reshard=res.reshard, lost=res.lost_ranks,
               rebuilt_bytes=res.rebuilt_bytes, message=res.message,
               loaded={"iteration": ours.iteration, "consumed": ours.counters.get("consumed_train_samples"),
                       "num_steps": ours.scheduler.num_steps, "microbatches": ours.run.num_microbatches})
    _capture(os.path.join(out, f"{phase}_ours_loaded{rank}"), ours, prot.adapter)
    got["losses"] = []
    for _ in range(K):
        got["losses"].append(_loss(ours.train_step()))
        prot.after_step(ours.iteration)
    assert prot.flush()
    got["committed"] = prot.runtime.pipeline.last_committed
    prot.close()
    _capture(os.path.join(out, f"{phase}_ours_final{rank}"), ours, prot.adapter)
    t.append(time.monotonic())
    if phase == "shrunk":
        _save_megatron(ours, os.path.join(out, f"ckpt{version + K}"))
    t.append(time.monotonic())
    # The oracle last: its load sets every RNG to the checkpoint's, as ours' restore did before ours trained.
    dist_ckpt.load(oracle, os.path.join(out, f"ckpt{version}"))
    adapter = oracle.adapter()
    _capture(os.path.join(out, f"{phase}_oracle_loaded{rank}"), oracle, adapter)
    got["oracle_loaded"] = {"iteration": oracle.iteration, "consumed": oracle.counters["consumed_train_samples"],
                            "num_steps": oracle.scheduler.num_steps, "microbatches": oracle.run.num_microbatches}
    got["oracle_losses"] = [_loss(oracle.train_step()) for _ in range(K)]
    _capture(os.path.join(out, f"{phase}_oracle_final{rank}"), oracle, adapter)
    t.append(time.monotonic())
    got["seconds"] = {"ours": t[1] - t[0], "megatron_save": t[2] - t[1], "oracle": t[3] - t[2]}
    torch.distributed.barrier()
    return got


def _held(root: str, nodes: list[str]) -> dict[str, list[int]]:
    """node -> the rank numbers its holder keeps data slots of."""
    out = {}
    for n in nodes:
        c = HolderClient(HolderPaths(root, JOB, n), timeout_s=10).connect()
        try:
            out[n] = sorted(int(r) for r, kinds in c.list().items() if kinds.get("data"))
        finally:
            c.close()
    return out


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    """The three phases, once: at D, at D' after node n1 is lost, and at D again once it is back."""
    out = str(tmp_path_factory.mktemp("mreshard-restore"))
    holders = NodeHolders(str(tmp_path_factory.mktemp("holders")), JOB)
    seconds = {}
    try:
        holders.start(*FULL)
        t0 = time.monotonic()
        full = run_ranks(TP * D, _run_full, holders.root, out, timeout_s=240, pg_timeout_s=60)
        seconds["full"] = time.monotonic() - t0
        holders.kill("n1")   # node n1 is lost, and its holder's memory with it
        t0 = time.monotonic()
        shrunk = run_ranks(TP * D2, _run_resized, holders.root, out, "shrunk", SHRUNK, V, True,
                           timeout_s=240, pg_timeout_s=60)
        seconds["shrunk"] = time.monotonic() - t0
        held = _held(holders.root, SHRUNK)
        holders.start("n1")   # n1 is back, with an empty holder
        t0 = time.monotonic()
        grown = run_ranks(TP * D, _run_resized, holders.root, out, "grown", FULL, V + K, False,
                          timeout_s=240, pg_timeout_s=60)
        seconds["grown"] = time.monotonic() - t0
        for name, res in (("full", full), ("shrunk", shrunk), ("grown", grown)):
            seconds[name + "_rank0"] = {k: round(v, 1) for k, v in res[0]["seconds"].items()}
        print("MEGATRON_RESHARD_RESTORE_SECONDS", json.dumps({k: round(v, 1) if isinstance(v, float) else v
                                                             for k, v in seconds.items()}))
        yield {"out": out, "full": full, "shrunk": shrunk, "held": held, "grown": grown,
               "held_grown": _held(holders.root, FULL)}
    finally:
        holders.stop()


def _check_loaded(out: str, phase: str, world: int, step: int) -> None:
    """Ours right after the restore vs the oracle right after Megatron's load, and both after K steps: every
    captured tensor and model parameter bit for bit, and the metadata."""
    for r in range(world):
        o_t, o_m = load_tensors(os.path.join(out, f"{phase}_oracle_loaded{r}"))
        s_t, s_m = load_tensors(os.path.join(out, f"{phase}_ours_loaded{r}"))
        assert any(n.endswith("/exp_avg_sq") for n in s_t) and any(n.startswith("model/") for n in s_t), r
        assert any(n.startswith("rng/") for n in s_t), r
        assert _diff(s_t, o_t) == [], (phase, r)
        # Megatron's load_state_dict leaves the checkpoint's param_groups 'step' in the live groups, which torch
        # Adam never reads (its step is per parameter, compared above): the one difference, and it is the step
        for om in o_m["optimizers"]:
            for gm in om["groups"]:
                assert gm["hparams"].pop("step") == step, gm["hparams"]
        assert s_m == o_m, (phase, r, [k for k in set(s_m) | set(o_m) if s_m.get(k) != o_m.get(k)])
        assert s_m["coords"]["dp_size"] == world // TP and s_m["coords"]["tp_size"] == TP
        assert s_m["batch"] == {"global_batch_size": MB * G * D, "micro_batch_size": MB,
                                "num_microbatches": MB * G * D // (MB * world // TP)}, s_m["batch"]
        a = load_tensors(os.path.join(out, f"{phase}_ours_final{r}"))[0]
        b = load_tensors(os.path.join(out, f"{phase}_oracle_final{r}"))[0]
        assert _diff(a, b) == [], (phase, r)


def test_a_lost_node_continues_at_a_smaller_size_as_megatrons_resharded_resume(phases):
    full, got = phases["full"], phases["shrunk"]
    assert [r["committed"] for r in full] == [V] * (TP * D) and [r["restored"] for r in full] == [-1] * (TP * D)
    # the committed version, re-partitioned from 3 to 2 data-parallel ranks per TP slice after rebuilding the
    # lost node's sources (old ranks 2 and 3: data-parallel rank 1 of each TP slice) from parity
    assert [g["version"] for g in got] == [V] * (TP * D2) and [g["tier"] for g in got] == ["parity"] * (TP * D2), got
    assert all(sorted(g["lost"]) == [2, 3] and g["reshard"]["from_dp"] == D and g["reshard"]["to_dp"] == D2
               for g in got), [(g["lost"], g["reshard"]) for g in got]
    # each lost source is decoded by the targets of its slice that read from it, each its own part, read locally
    for g in got:
        by = g["reshard"]["by_source"]
        assert (g["rebuilt_bytes"] > 0) == any(k in by for k in ("2", "3")), (g["rebuilt_bytes"], sorted(by))
        assert all(by[k]["same_node"] for k in ("2", "3") if k in by), by
    assert sum(g["rebuilt_bytes"] > 0 for g in got) > TP, [g["rebuilt_bytes"] for g in got]   # several per slice
    gbs = MB * G * D
    want = {"iteration": V, "consumed": V * gbs, "num_steps": V * gbs, "microbatches": gbs // (MB * D2)}
    assert [g["loaded"] for g in got] == [g["oracle_loaded"] for g in got] == [want] * (TP * D2), got
    _check_loaded(phases["out"], "shrunk", TP * D2, V)
    assert [g["losses"] for g in got] == [g["oracle_losses"] for g in got], got
    assert all(None not in g["losses"] for g in got)
    assert sum(g["reshard"]["remote_bytes"] for g in got) > 0   # something crossed nodes
    print("MEGATRON_RESHARD_RESTORE shrunk", json.dumps(
        [{"restore_s": round(g["restore_s"], 2), **{k: g["reshard"][k] for k in ("local_bytes", "remote_bytes",
                                                                                 "fragment_bytes")}} for g in got]))
    # a version at D' committed everywhere: the holders keep the new layout's ranks only
    assert [g["committed"] for g in got] == [V + K] * (TP * D2)
    assert phases["held"] == {n: [TP * i + t for t in range(TP)] for i, n in enumerate(SHRUNK)}, phases["held"]


def test_the_job_grows_back_from_memory(phases):
    got = phases["grown"]
    assert [g["version"] for g in got] == [V + K] * (TP * D) and [g["tier"] for g in got] == ["memory"] * (TP * D), got
    assert all(g["lost"] == [] and g["reshard"]["from_dp"] == D2 and g["reshard"]["to_dp"] == D for g in got), got
    gbs = MB * G * D
    want = {"iteration": V + K, "consumed": (V + K) * gbs, "num_steps": (V + K) * gbs, "microbatches": G}
    assert [g["loaded"] for g in got] == [g["oracle_loaded"] for g in got] == [want] * (TP * D), got
    _check_loaded(phases["out"], "grown", TP * D, V + K)
    assert [g["losses"] for g in got] == [g["oracle_losses"] for g in got], got
    assert [g["committed"] for g in got] == [V + 2 * K] * (TP * D)
    assert phases["held_grown"] == {n: [TP * i + t for t in range(TP)] for i, n in enumerate(FULL)}


def test_a_global_batch_that_is_not_kept_is_refused_naming_it(phases):
    """Restarted at D' = 2 with the full-size job's micro-batches per rank (a global batch of 8, not 12): another
    run; nothing is applied and nothing deleted (the run that keeps the batch restores the same version after)."""
    for g in phases["shrunk"]:
        msg = g["refused"]
        assert msg and "global_batch_size was 12, now 8" in msg and "Nothing was loaded" in msg, msg
        assert g["refused_iteration"] == 0
