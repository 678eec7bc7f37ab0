import os

import pytest

from .helpers import (PLAIN_DEEPSPEED, cached_reference, close_fork_servers, plain_config, plain_job, reference_preload,
                      run_job, trainer_logs)


@pytest.fixture(scope="session", autouse=True)
def _shared_fork_servers():
    """The fork servers the package's runs share (helpers.launch) end with the session. Not with the package:
    under pytest-xdist a worker leaves the package whenever its next file is elsewhere and comes back later,
    and each return paid every server's imports again (18 DeepSpeed servers for 3 workers and 2 preloads)."""
    yield
    close_fork_servers()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Uninterrupted, unprotected runs (plain deepspeed.initialize), one per configuration; ``cold``: its
    trainers start cold, else they fork from a server that imported the frameworks only (helpers.py says
    which references are cold and why). A cold reference also serves a test that asks for a forked one."""
    cache = {}
    # Under pytest-xdist the workers share one base folder: a reference one worker ran serves the others.
    shared = tmp_path_factory.getbasetemp().parent / "references" if os.environ.get("PYTEST_XDIST_WORKER") else None

    def get(stage, dtype, steps, extra=(), world=2, cold=False):
        def run(d=None):
            d = d or tmp_path_factory.mktemp(f"ref-z{stage}-{dtype}-{steps}-w{world}" + ("-cold" if cold else ""))
            res = run_job(d, stage=stage, dtype=dtype, steps=steps, shardsafe=False, max_restarts=0, extra=extra,
                          nodes=world, nproc=1, preload=reference_preload(PLAIN_DEEPSPEED, cold))
            assert res.ok, f"reference run failed; see {d}"
            return d

        return cached_reference(cache, (stage, dtype, steps, tuple(extra), world), cold, run, shared)

    return get


@pytest.fixture(scope="session")
def plain_reference(tmp_path_factory):
    """examples/ds_plain_gpt.py with its config without the block: plain DeepSpeed, nothing of shardsafe beyond the
    hook, started cold (test_unchanged_programs.py checks what it imported). One run for the session's workers."""
    shared = tmp_path_factory.getbasetemp().parent / "references" if os.environ.get("PYTEST_XDIST_WORKER") else None

    def run(d=None):
        d = d or tmp_path_factory.mktemp("plain-ref")
        res = plain_job(d, plain_config(d / "ds.json", block=False), max_restarts=0, protected=False)
        assert res.ok, trainer_logs(str(d))[-3000:]
        return d

    return cached_reference({}, ("ds_plain_gpt",), True, run, shared)
