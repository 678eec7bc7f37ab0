import pytest

from .helpers import close_fork_servers, run_job


@pytest.fixture(scope="package", autouse=True)
def _shared_fork_servers():
    """The fork servers the package's protected runs share (helpers.launch) end with the package."""
    yield
    close_fork_servers()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Uninterrupted, unprotected runs (plain deepspeed.initialize), one per configuration."""
    cache = {}

    def get(stage, dtype, steps, extra=(), world=2):
        key = (stage, dtype, steps, tuple(extra), world)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"ref-z{stage}-{dtype}-{steps}-w{world}")
            res = run_job(d, stage=stage, dtype=dtype, steps=steps, shardsafe=False, max_restarts=0, extra=extra,
                          nodes=world, nproc=1)
            assert res.ok, f"reference run failed; see {d}"
            cache[key] = d
        return cache[key]

    return get
