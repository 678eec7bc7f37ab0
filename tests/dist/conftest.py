"""Fixtures of the multi-rank tests (the holder processes themselves come from tests/conftest.py's holder_factory)."""
import pytest

from ._shards import WORLD


@pytest.fixture
def holders(holder_factory):
    """The root of WORLD holders of job pjob, nodes n0.. (a test module may override it: test_placement)."""
    return holder_factory(WORLD, job="pjob", budget_gb=0.1).root


@pytest.fixture(autouse=True, scope="module")
def _cpu_info_asked_once(request, tmp_path_factory):
    """DeepSpeed's op builders ask py-cpuinfo (a Python subprocess each time) twice per CPU op a process loads, and
    every forked rank of a test_ds_* module loads FusedAdam's: the answer is asked once here, before the ranks are
    forked, as the fork servers do (shardsafe.adapters.deepspeed.prewarm), and this worker's function is put back
    after the module."""
    if not request.module.__name__.rsplit(".", 1)[-1].startswith("test_ds_"):
        yield
        return
    import cpuinfo
    from shardsafe.adapters.deepspeed.prewarm import remember_cpu_info
    original = cpuinfo.get_cpu_info
    remember_cpu_info(str(tmp_path_factory.mktemp("cpuinfo")))
    try:
        yield
    finally:
        cpuinfo.get_cpu_info = original
