"""Tier 1: one rank's state as a snapshot in its node holder's memory, and back.

Modules, from the bottom up (the payload format they write and read is :mod:`shardsafe.payload`'s):

* :mod:`~shardsafe.snapshot.state`: the contract between a framework adapter and this package (the
  ``StateAdapter`` protocol and its defaults, ``RankState``, RNG capture, casts).
* :mod:`~shardsafe.snapshot.pipeline`: the asynchronous copy into a holder slot (double buffer, checksums
  beside the copy, the commit vote).
* :mod:`~shardsafe.snapshot.restore`: the vote on the newest recoverable version, verification, rebuild
  through :mod:`shardsafe.parity`, and the write-back into the live tensors.
* :mod:`~shardsafe.snapshot.reshard`: one version re-partitioned from D to D' data-parallel ranks (transfer plan,
  byte copies; the framework's partitioning rules are handed in by its adapter).

Importing this package imports nothing; its modules are imported by name.
"""
