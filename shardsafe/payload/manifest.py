"""Snapshot manifest: the JSON description of a payload (no pickle anywhere).

A payload is the rank state's tensors laid out back to back (64-byte aligned). Each tensor is
checksummed with xxh3-64 in fixed ``chunk_bytes`` segments, so verification, scrubbing and parity
repair can name the exact bad segment.
"""
from __future__ import annotations

import json
import time
import warnings
from typing import Any, Iterable, Mapping, Sequence

import torch
import xxhash

from . import checksum
from ..errors import ShardsafeError

FORMAT = "shardsafe/1"
ALIGN = 64
CHUNK_BYTES = 4 << 20


class ManifestError(ValueError, ShardsafeError):
    """A manifest is malformed or does not match the live state it should restore."""


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ManifestError(f"unknown dtype {name!r} in manifest")
    return dt


def layout(tensors: Mapping[str, torch.Tensor]) -> tuple[list[dict[str, Any]], int]:
    """Entries (name, dtype, shape, offset, nbytes) for the tensors in order, and the payload size."""
    entries, off = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        entries.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": off, "nbytes": nbytes})
        off += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return entries, off


def chunk_ranges(entry: Mapping[str, Any], chunk_bytes: int = CHUNK_BYTES) -> Iterable[tuple[int, int]]:
    """(start, end) payload offsets of the checksum segments of one entry."""
    start, end = entry["offset"], entry["offset"] + entry["nbytes"]
    for a in range(start, end, chunk_bytes):
        yield a, min(a + chunk_bytes, end)


def hash_bytes(buf) -> str:
    return format(xxhash.xxh3_64_intdigest(buf), "016x")


def build(*, version: int, rank: int, world_size: int, node: str, entries: list[dict], payload_nbytes: int,
          meta: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"format": FORMAT, "version": version, "rank": rank, "world_size": world_size, "node": node,
            "chunk_bytes": CHUNK_BYTES, "payload_nbytes": payload_nbytes, "created": time.time(),
            "meta": dict(meta), "entries": entries, **(extra or {})}


def verify(manifest: Mapping[str, Any], buf: memoryview, *, populate: bool = False,
           within: Sequence[tuple[int, int]] | None = None) -> list[str]:
    """Return a description of every segment whose bytes do not match its checksum (empty = good). Every
    segment is hashed (on the process's checksum threads, shardsafe/payload/checksum.py), also after a bad one.
    ``populate``: ``buf`` is a fresh mapping; the hash threads fill its page tables, each for its segments.
    ``within``: only the segments inside these payload byte ranges (a part of the payload rebuilt alone)."""
    if manifest.get("format") != FORMAT:
        return [f"unknown manifest format {manifest.get('format')!r} (expected {FORMAT!r})"]
    bad, cb = [], manifest["chunk_bytes"]
    if manifest["payload_nbytes"] > len(buf):
        return [f"payload of {manifest['payload_nbytes']} bytes does not fit the {len(buf)}-byte segment"]
    todo: list[tuple[str, int, int, int, str]] = []   # (entry, segment, start, end, expected digest)
    for e in manifest["entries"]:
        sums = e.get("xxh3", [])
        ranges = list(chunk_ranges(e, cb))
        if len(sums) != len(ranges):
            bad.append(f"{e['name']}: {len(sums)} checksums for {len(ranges)} segments")
            continue
        todo.extend((e["name"], i, a, b, want) for i, ((a, b), want) in enumerate(zip(ranges, sums))
                    if within is None or any(lo <= a and b <= hi for lo, hi in within))
    got = checksum.shared().hash_ranges(buf, [(a, b) for _, _, a, b, _ in todo], populate=populate)
    for (name, i, a, b, want), have in zip(todo, got):
        if have != want:
            bad.append(f"{name} segment {i} (bytes {a}-{b}) fails its xxh3 checksum")
    return bad


def verify_any(manifest: Mapping[str, Any], buf: memoryview) -> list[str]:
    """Verify a data manifest (per-entry segments) or a parity manifest (one xxh3 per parity slot)."""
    if manifest.get("kind") == "parity":
        cs, bad = manifest["chunk_size"], []
        fits = [j for j in range(len(manifest["xxh3"])) if (j + 1) * cs <= len(buf)]
        got = dict(zip(fits, checksum.shared().hash_ranges(buf, [(j * cs, (j + 1) * cs) for j in fits])))
        for j, want in enumerate(manifest["xxh3"]):
            if got.get(j) != want:
                bad.append(f"parity slot {j} (bytes {j * cs}-{(j + 1) * cs})")
        return bad
    return verify(manifest, buf)


def verify_mapping(manifest: Mapping[str, Any], mapping: Any, *, populate: bool = False) -> list[str]:
    """:func:`verify_any` over a mapping (or any buffer), its view released also when the check raises: a mapping
    that still exports a view cannot be closed. ``populate``: as :func:`verify` (a data payload's fresh mapping)."""
    buf = memoryview(mapping)
    try:
        return verify_any(manifest, buf) if manifest.get("kind") == "parity" else verify(manifest, buf,
                                                                                          populate=populate)
    finally:
        buf.release()


def check_matches(manifest: Mapping[str, Any], live: Mapping[str, torch.Tensor],
                  optional_prefixes: tuple[str, ...] = ()) -> None:
    """The snapshot must describe the live tensors (names, dtypes, shapes). Names under
    ``optional_prefixes`` may exist only in the snapshot: state a fresh engine creates lazily
    (e.g. Adam moments before the first step) is created by the adapter on restore."""
    got = {e["name"]: (e["dtype"], tuple(e["shape"])) for e in manifest["entries"]}
    want = {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in live.items()}
    extra = {n: v for n, v in got.items() if n not in want and n.startswith(optional_prefixes)}
    got = {n: v for n, v in got.items() if n not in extra}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))[:6]
        raise ManifestError(f"snapshot version {manifest.get('version')} does not match this job's state "
                            f"(different model, optimizer, ZeRO stage or world size?); first differences: {diff}. "
                            "Start with a fresh job id, or drop the old snapshots with the holder's drop request.")


def views(manifest: Mapping[str, Any], buf) -> dict[str, torch.Tensor]:
    """CPU tensors viewing the payload (no copy). Keep ``buf`` alive while they are used."""
    out = {}
    with warnings.catch_warnings():
        # Read-only mappings are fine: restore only reads these views and copies out of them.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for e in manifest["entries"]:
            dt = dtype_from_name(e["dtype"])
            n = e["nbytes"] // torch.empty((), dtype=dt).element_size()
            t = torch.frombuffer(buf, dtype=dt, count=n, offset=e["offset"]) if n else torch.empty(0, dtype=dt)
            out[e["name"]] = t.view(e["shape"])
    return out


# ---- JSON helpers for meta (tuples survive the round trip; no pickle) -------------------------------

def to_jsonable(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return {"__tuple__": [to_jsonable(x) for x in obj]}
    if isinstance(obj, list):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            return {"__intkeys__": [[to_jsonable(k), to_jsonable(v)] for k, v in obj.items()]}
        return {k: to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor) and obj.numel() == 1 and obj.dim() == 0:
        return {"__scalar_tensor__": obj.item(), "dtype": dtype_name(obj.dtype)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise ManifestError(f"cannot snapshot a {type(obj).__name__} in metadata ({obj!r}): only JSON types, tuples and "
                        "scalar tensors are supported")


def from_jsonable(obj: Any) -> Any:
    if isinstance(obj, list):
        return [from_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        if "__tuple__" in obj:
            return tuple(from_jsonable(x) for x in obj["__tuple__"])
        if "__intkeys__" in obj:
            return {from_jsonable(k): from_jsonable(v) for k, v in obj["__intkeys__"]}
        if "__scalar_tensor__" in obj:
            return torch.tensor(obj["__scalar_tensor__"], dtype=dtype_from_name(obj["dtype"]))
        return {k: from_jsonable(v) for k, v in obj.items()}
    return obj


# ---- plain files (final-state dumps for comparisons; raw bytes + JSON, no pickle) -------------------

def save_tensors(path: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``path.bin`` (payload) and ``path.json`` (layout)."""
    entries, n = layout(tensors)
    buf = bytearray(n)
    for e, t in zip(entries, tensors.values()):
        b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        buf[e["offset"]: e["offset"] + len(b)] = b
    with open(path + ".bin", "wb") as f:
        f.write(buf)
    with open(path + ".json", "w") as f:
        json.dump({"entries": entries, "payload_nbytes": n}, f)


def load_tensors(path: str) -> dict[str, torch.Tensor]:
    with open(path + ".json") as f:
        man = json.load(f)
    with open(path + ".bin", "rb") as f:
        buf = bytearray(f.read())
    return {k: v.clone() for k, v in views(man, buf).items()}
