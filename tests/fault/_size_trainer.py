"""A stand-in trainer for the launcher's resize tests: no framework, no restore; it records what the launcher gave it
and drives the launcher the way a protected trainer does, through the event log.

Each rank of each attempt appends one line to RUN_DIR/placement.jsonl (attempt, RANK, WORLD_SIZE, LOCAL_RANK,
GROUP_RANK, GROUP_WORLD_SIZE, SHARDSAFE_NODE, SHARDSAFE_FULL_WORLD_SIZE, whether its node's holder socket exists, and
which holder sockets of the job exist), then runs --steps steps of --step-s seconds each: an ``iteration`` event per
step (kill-node / add-node fire at their step) and, every --interval steps, a ``snapshot`` event with
``committed`` true (a grow waits for one). Exits 0 after the last step.
"""
import argparse
import glob
import json
import os
import sys
import time

from shardsafe import env
from shardsafe.tor.events import EventLog


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--step-s", type=float, default=0.1)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--barrier", action="store_true",
                   help="a gloo barrier every step, so that a lost peer fails the others as in a real job (torchrun)")
    a = p.parse_args()
    run_dir, rank = env.get(env.RUN_DIR), int(os.environ["RANK"])
    node, job = env.get(env.NODE), env.get(env.JOB_ID)
    attempt = env.attempt()
    job_dir = os.path.join(env.holder_dir(), job)
    rec = {"attempt": attempt, "rank": rank, "world": int(os.environ["WORLD_SIZE"]),
           "local_rank": int(os.environ["LOCAL_RANK"]), "group_rank": int(os.environ["GROUP_RANK"]),
           "group_world": int(os.environ["GROUP_WORLD_SIZE"]), "node": node,
           "full_world": env.get(env.FULL_WORLD_SIZE),
           "own_holder": os.path.exists(env.holder_socket()),
           "holders": sorted(os.path.basename(s)[:-5] for s in glob.glob(os.path.join(job_dir, "*.sock")))}
    with open(os.path.join(run_dir, "placement.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    ev = EventLog(run_dir, source="trainer", rank=rank, node=node, attempt=attempt)
    ev.emit("trainer_start")
    ev.emit("train_ready", iteration=1)
    if a.barrier:
        import torch.distributed as dist
        from datetime import timedelta
        dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    for step in range(1, a.steps + 1):
        time.sleep(a.step_s)
        if a.barrier:
            dist.barrier()
        ev.emit("iteration", iteration=step, seconds=a.step_s)
        if step % a.interval == 0:
            ev.emit("snapshot", version=step, stall_s=0.0, copy_s=0.0, bytes=0, committed=True)
    if a.barrier:
        dist.barrier()
        dist.destroy_process_group()
    from shardsafe.launch.markers import mark_rank_done
    mark_rank_done(rank=rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
