"""The format of a snapshot payload, shared by every layer that writes, keeps, moves or reads one.

* :mod:`~shardsafe.payload.checksum`: xxh3 per segment, on threads that release the GIL.
* :mod:`~shardsafe.payload.manifest`: the JSON manifest beside the flat payload bytes (entries: name, dtype,
  shape, offset; per-segment checksums; version, timeline, topology) and its verification. No pickle.

Below the holder (its scrub and flush verify payloads), the snapshot pipeline and the restore, the parity
exchange, the persistent tier and the export. Importing this package imports nothing; its modules are imported
by name.
"""
