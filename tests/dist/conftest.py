"""Fixtures of the multi-rank tests (the holder processes themselves come from tests/conftest.py's holder_factory)."""
import pytest

from ._shards import WORLD


@pytest.fixture
def holders(holder_factory):
    """The root of WORLD holders of job pjob, nodes n0.. (a test module may override it: test_placement)."""
    return holder_factory(WORLD, job="pjob", budget_gb=0.1).root
