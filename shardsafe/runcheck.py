"""Compare a protected (failed and restored) run against an uninterrupted reference, bit for bit.

Trainers write ``losses_rank{R}.jsonl`` (one line per optimizer step, float.hex losses; a restarted
attempt re-writes the steps it replays) and ``final_rank{R}.{bin,json}``. The *effective* loss of
a step is the one of the last attempt that ran it: that is what the finished job computed.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .payload.manifest import load_tensors


def read_jsonl(path: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line torn by SIGKILL
    except FileNotFoundError:
        pass
    return out


def effective_losses(run_dir: str, rank: int) -> dict[int, str]:
    out: dict[int, str] = {}
    for rec in read_jsonl(os.path.join(run_dir, f"losses_rank{rank}.jsonl")):
        out[int(rec["step"])] = rec["loss"]
    return out


def losses_by_attempt(run_dir: str, rank: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for rec in read_jsonl(os.path.join(run_dir, f"losses_rank{rank}.jsonl")):
        out.setdefault(int(rec.get("attempt", 0)), []).append(int(rec["step"]))
    return out


def resume_problems(run_dir: str, world: int, *, events_file: str = "events.jsonl",
                    offsets: dict[str, int] | None = None) -> list[str]:
    """Why the run's restarted attempts did *not* provably continue from what they restored (empty = they did).

    A deterministic run that silently starts over also ends bit-identical, so bit-exactness alone proves
    nothing about the restore. For every attempt after the first, on every rank: its first logged step is the
    restored version + 1, i.e. no step at or before the restored version ran twice. A fresh start (version -1)
    after an attempt that died before anything was committed must begin at the run's first step; once an
    earlier attempt had committed a snapshot, a fresh start is itself a problem.

    A program with several protected engines (shardsafe.runtime.engine_scope) tags its loss records with the
    engine's scope (``"engine"``, "" for the first) and numbers them across engines: ``offsets[scope]`` is the step
    number of the scope's step 0; each engine's records in an attempt are checked against that engine's restore."""
    offsets = offsets or {}
    restored: dict[tuple[int, int, str], int] = {}
    committed: dict[int, list[int]] = {}    # rank -> attempts in which it committed a snapshot
    for e in read_jsonl(os.path.join(run_dir, events_file)):
        if e.get("rank") is None:
            continue
        if e.get("kind") == "restore_end":
            restored[(int(e.get("attempt") or 0), int(e["rank"]), str(e.get("engine") or ""))] = \
                int(e.get("version", -1))
        elif e.get("kind") == "snapshot" and e.get("committed"):
            committed.setdefault(int(e["rank"]), []).append(int(e.get("attempt") or 0))
    problems = []
    for r in range(world):
        steps: dict[tuple[int, str], list[int]] = {}
        for rec in read_jsonl(os.path.join(run_dir, f"losses_rank{r}.jsonl")):
            steps.setdefault((int(rec.get("attempt", 0)), str(rec.get("engine") or "")), []).append(int(rec["step"]))
        for a, eng in sorted(steps):
            if a == 0:
                continue
            which = f" engine {eng!r}" if eng else ""
            v = restored.get((a, r, eng))
            if v is None:
                problems.append(f"rank {r}: attempt {a}{which} logged steps but no restore_end event")
                continue
            if v < 0 and any(b < a for b in committed.get(r, [])):
                problems.append(f"rank {r}: attempt {a}{which} started fresh although an earlier attempt committed "
                                "snapshots")
            first = min(steps[(a, eng)]) - offsets.get(eng, 0)
            # a fresh start (an earlier attempt died before anything was committed) begins where the run began
            start = min(min(s) for (_, e2), s in steps.items() if e2 == eng) - offsets.get(eng, 0)
            if first != (v + 1 if v >= 0 else start):
                problems.append(f"rank {r}: attempt {a}{which} restored version {v} but its first step was {first}")
    return problems


def flatten_state(prefix: str, obj: Any) -> dict[str, torch.Tensor]:
    """A framework's own ``state_dict()`` (nested dicts, lists, tensors and plain values) as named tensors, so the
    final-state comparison covers what the framework reports and not only what an adapter captures: tensors as
    they are, numbers as 0-d float64/int64/bool tensors (bit-exact), objects (a loss scaler) by their attributes,
    anything else as the bytes of its JSON (or ``repr``) text."""
    out: dict[str, torch.Tensor] = {}

    def walk(name: str, v: Any) -> None:
        if torch.is_tensor(v):
            out[name] = v.detach().cpu().clone()
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{name}/{k}", x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{name}/{i}", x)
        elif isinstance(v, bool):
            out[name] = torch.tensor(v)
        elif isinstance(v, int):
            out[name] = torch.tensor(v, dtype=torch.int64)
        elif isinstance(v, float):
            out[name] = torch.tensor(v, dtype=torch.float64)
        elif hasattr(v, "__dict__") and not callable(v):   # e.g. fp16's loss scaler object: its attributes
            walk(f"{name}/{type(v).__name__}", {k: x for k, x in vars(v).items() if not k.startswith("__")})
        else:
            try:
                text = json.dumps(v)
            except (TypeError, ValueError):
                text = type(v).__name__ if "object at 0x" in repr(v) else repr(v)
            out[name] = torch.tensor(list(text.encode()), dtype=torch.uint8)

    walk(prefix, obj)
    return out


@dataclass
class Comparison:
    bit_identical: bool
    steps: int
    loss_mismatches: list[str] = field(default_factory=list)
    state_mismatches: list[str] = field(default_factory=list)
    replayed_losses_equal: bool = True
    resume_problems: list[str] = field(default_factory=list)   # resume_problems(): empty = every restart resumed


def compare_runs(run_dir: str, ref_dir: str, world_size: int, steps: int,
                 offsets: dict[str, int] | None = None) -> Comparison:
    """Every later loss and the final rank state must be torch.equal / identical to the reference. ``offsets``:
    the engines' step offsets of a program with several (:func:`resume_problems`)."""
    loss_bad, state_bad, replay_ok = [], [], True
    for r in range(world_size):
        got, want = effective_losses(run_dir, r), effective_losses(ref_dir, r)
        if sorted(want) != list(range(1, steps + 1)):
            loss_bad.append(f"rank {r}: reference has {len(want)} of {steps} steps")
        for s in range(1, steps + 1):
            if got.get(s) != want.get(s):
                loss_bad.append(f"rank {r} step {s}: {got.get(s)} != {want.get(s)}")
        # Steps computed by an attempt that later failed must also equal the reference: a restore
        # that replays them must reproduce them exactly.
        for rec in read_jsonl(os.path.join(run_dir, f"losses_rank{r}.jsonl")):
            if want.get(int(rec["step"])) != rec["loss"]:
                replay_ok = False
        try:
            a = load_tensors(os.path.join(run_dir, f"final_rank{r}"))
            b = load_tensors(os.path.join(ref_dir, f"final_rank{r}"))
        except FileNotFoundError as e:
            state_bad.append(f"rank {r}: {e}")
            continue
        if a.keys() != b.keys():
            state_bad.append(f"rank {r}: tensor names differ: {sorted(a.keys() ^ b.keys())[:5]}")
        for k in a.keys() & b.keys():
            if not torch.equal(a[k], b[k]):
                state_bad.append(f"rank {r}: {k}")
    return Comparison(not loss_bad and not state_bad and replay_ok, steps, loss_bad[:20], state_bad[:20], replay_ok,
                      resume_problems(run_dir, world_size, offsets=offsets)[:20])
