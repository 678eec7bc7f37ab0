import pytest

from .helpers import run_job


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Uninterrupted, unprotected runs (plain deepspeed.initialize), one per configuration."""
    cache = {}

    def get(stage, dtype, steps, extra=()):
        key = (stage, dtype, steps, tuple(extra))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"ref-z{stage}-{dtype}-{steps}")
            res = run_job(d, stage=stage, dtype=dtype, steps=steps, shardsafe=False, max_restarts=0, extra=extra)
            assert res.ok, f"reference run failed; see {d}"
            cache[key] = d
        return cache[key]

    return get
