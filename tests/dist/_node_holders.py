"""Real holder processes, one per simulated node, that outlive the phases of a module (the restore at another
data-parallel size reads what an earlier phase's ranks left in them)."""
import subprocess

from shardsafe.holder.client import holder_command
from shardsafe.holder.paths import HolderPaths


class NodeHolders:
    """One holder per node of job ``job`` under ``root``, started on demand, stopped by :meth:`stop`."""

    def __init__(self, root: str, job: str, budget_gb: float = 0.1):
        self.root, self.job, self.budget_gb, self.procs = root, job, budget_gb, {}

    def start(self, *nodes: str) -> None:
        """Started together (each takes a second or so to import), then each waited for."""
        for node in nodes:
            self.procs[node] = subprocess.Popen(holder_command(HolderPaths(self.root, self.job, node),
                                                               budget_gb=self.budget_gb), stdout=subprocess.PIPE)
        for node in nodes:
            line = self.procs[node].stdout.readline()
            assert line.startswith(b"holder ready"), (node, line)

    def kill(self, node: str) -> None:
        """Node loss: the holder SIGKILLed, its shared memory gone with it."""
        self.procs[node].kill()
        self.procs[node].wait()

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
