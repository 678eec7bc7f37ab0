"""The bytes of a restore at another data-parallel size (:mod:`.reshard_restore`), moved point to point over gloo.

Two moves, both planned by every rank alike from facts every rank has (the survey, the gathered manifests, the
resharder's reads), so no metadata travels with the bytes:

* **rebuild**: each target decodes the part of a lost source it reads (whole checksum segments), in parallel with
  the others, from the same byte ranges of the k fragments of every codeword its part is in, which the current
  ranks that read them (the servers of the surviving members' data and parity) hold. By default their linear
  combination is formed along those servers, each adding the products of all the fragments it reads to what the
  previous one sent, and the target receives the finished bytes once (partial-parallel repair); ``repair="gather"``
  sends it the k fragments to decode instead. Either way the code is tier 2's
  (:class:`shardsafe.parity.recovery.MemberRecovery`, handed in; it works byte by byte), and the target verifies its
  segments against the checksums that survived in its group's parity manifests. No decoded byte is sent again;
* **pieces**: for each (source, target) pair on different nodes, the pieces the target reads, each one message
  sent from where it lies in the source's mapped payload (or its rebuilt copy) by its server (or its rebuilder), and
  received into its place in one buffer per pair, back to back, each 64-byte aligned so that the target views it as
  its dtype in place. A target reads what its own node holds straight from its holder (or the persistent tier's
  file), and receives nothing for it. The messages are posted as soon as the plan is known (:class:`Move`) and
  travel while the servers verify their sources and the targets rebuild: the network's time hides behind the
  checksums' and the decode's, and no received byte is read before the votes on both passed.

The pieces and the gathered rebuild post every send before waiting on any receive, as the parity exchange and
placement do; the chains bound each server's memory to a window of slices (shardsafe.parity.repair). Every rank
posts the same messages whatever fails on it (a fragment it cannot read goes as zeros), so no rank waits for ever
on another: what failed comes back as a problem, and the restore's vote refuses the version on every rank.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import ConfigError, ShardsafeError
from ..payload import manifest as mf
from .reshard import Pieces
from .reshard_survey import Choice, Source

_TAG = 3 << 22          # tags of the pieces' messages (+ source rank) ...
_FRAG_TAG = 5 << 22     # ... and of the rebuild's fragments (+ group, codeword, fragment) or chains (+ chain)
REPAIRS = ("chain", "gather")
_ALIGN = 64


class Refused(ShardsafeError):
    """A candidate version cannot be restored; raised only where every rank reaches the same verdict (after a
    gather), so every rank goes on to the same next candidate."""


class Opened:
    """The holder mappings and files one attempt opened on this rank, closed at its end (after the apply)."""

    def __init__(self, client: Any, persist: Any):
        self.client, self.persist = client, persist
        self.data: dict[int, tuple[dict, Any]] = {}      # source rank -> (manifest, mapping)
        self.parity: dict[int, tuple[dict, Any]] = {}
        self._all: list[Any] = []

    def source(self, s: Source, version: int) -> tuple[dict, Any]:
        """(manifest, mapping) of ``s`` on this rank's node: its holder's slot, or the persistent tier's file.

        Raises:
            Refused: the slot was sealed again since the survey (its content is not what the survey saw).
        """
        if s.key not in self.data:
            if s.where == "disk":
                man, mm = self.persist.open(version, s.key)
            else:
                held = self.client.open_slot(rank=s.key, version=version, populate=False)
                man, mm = held.manifest, held.mm
                if held.sealing != s.sealing:
                    self._all.append(mm)
                    raise Refused(f"source rank {s.key}'s slot of version {version} on node {s.node} was sealed "
                                  "again since the survey")
            self._all.append(mm)
            self.data[s.key] = (man, mm)
        return self.data[s.key]

    def parity_of(self, key: int, version: int) -> tuple[dict, Any]:
        if key not in self.parity:
            man, mm = self.client.open(rank=key, version=version, kind="parity", populate=False)
            self._all.append(mm)
            self.parity[key] = (man, mm)
        return self.parity[key]

    def close(self) -> None:
        for mm in self._all:
            try:
                mm.close()
            except (BufferError, ValueError):
                pass   # a view still refers to it: the mapping goes with the last view
        self._all.clear()


def as_bytes(buf: Any) -> torch.Tensor:
    """A uint8 tensor over a mapping or array, read only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=torch.uint8)


# ---- rebuild ------------------------------------------------------------------------------------------------------

def decode_plan(choice: Choice, manifests: dict[int, dict], slices: dict) -> dict[int, dict[int, list[tuple]]]:
    """Who decodes what of each lost source: every target that reads from it decodes the bytes it reads, widened to
    whole checksum segments (so that it can verify them) and merged into ranges. {source: {target rank: [(start,
    end) payload offsets]}}; every rank computes the same plan from the manifests and the resharder's reads."""
    plan: dict[int, dict[int, list[tuple]]] = {}
    for sl in sorted(slices):
        p = slices[sl]
        for d, k in enumerate(p["keys"]):
            if choice.sources[k].where != "rebuilt":
                continue
            man = manifests[k]
            entries = {e["name"]: e for e in man["entries"]}
            for t, r in enumerate(p["targets"]):
                reads = p["reads"][t].get(d)
                if not reads:
                    continue
                segs = set()
                for name, _, _, a, n, _ in layout(man, reads)[0]:
                    segs.update((s0, s1) for s0, s1 in mf.chunk_ranges(entries[name], man["chunk_bytes"])
                                if n and s0 < a + n and a < s1)
                merged: list[list[int]] = []
                for s0, s1 in sorted(segs):
                    if merged and merged[-1][1] == s0:
                        merged[-1][1] = s1
                    else:
                        merged.append([s0, s1])
                plan.setdefault(k, {})[r] = [(a, b) for a, b in merged]   # also none: it reads the rebuilt copy
    return plan


def rebuild(choice: Choice, manifests: dict[int, dict], plan: dict[int, dict[int, list[tuple]]],
            recovery: Callable[..., Any], opened: Opened, *, rank: int, group: Any,
            repair: str = "chain") -> tuple[dict[int, torch.Tensor], list[str], int, int]:
    """Decode the lost sources of ``choice`` as ``plan`` (:func:`decode_plan`) splits them: each target decodes the
    ranges it reads (the code works byte by byte) and verifies the segments it decoded against the checksums that
    survived in the group's parity manifests. ``repair``: "chain" forms each range's linear combination along the
    ranks that read its k fragments, each adding all those it reads, the target last (partial-parallel repair,
    ``recovery.chain_decode``: the target receives each byte it decodes once); "gather" sends the k fragments to
    the target, which decodes them (``recovery.decode_range``). Every rank calls it. Returns (this rank's decoded
    sources, as whole-payload buffers of which only its ranges are written; its problems; bytes of fragments or
    partial sums it received; bytes it decoded)."""
    if repair not in REPAIRS:
        raise ConfigError(f"repair must be one of {REPAIRS}; got {repair!r}")
    rebuilt: dict[int, torch.Tensor] = {}
    problems: list[str] = []
    got = decoded = 0
    for gi, g in enumerate(choice.groups):
        rec = recovery(group=g.group, chunk_size=g.chunk_size, code=g.code, lost=g.lost)
        cs = g.chunk_size

        def server(f: Any, g: Any = g) -> int:   # the current rank that reads f on its member's node
            return g.parity_server[f.rank] if f.parity else choice.sources[f.rank].server

        def read(f: Any, lo: int, hi: int, rec: Any = rec) -> torch.Tensor:
            where = (opened.parity_of(f.rank, choice.version) if f.parity
                     else opened.source(choice.sources[f.rank], choice.version))[1]
            return rec.fragment_range(f, where, lo, hi)

        def out(k: int, j: int, lo: int, hi: int, cs: int = cs) -> torch.Tensor:
            return rebuilt[k][j * cs + lo: j * cs + hi]

        # What each target decodes, in the order every rank lists it: (source, target, chunk, lo, hi) within the chunk
        wanted = []
        for k in sorted(g.lost):
            chunks = rec.chunks_of(k)
            for r, ranges in sorted(plan.get(k, {}).items()):
                if r == rank:
                    rebuilt[k] = torch.empty(rec.k * cs, dtype=torch.uint8)
                for a, b in ranges:
                    for j in range(a // cs, (b - 1) // cs + 1):
                        lo, hi = max(a, j * cs) - j * cs, min(b, (j + 1) * cs) - j * cs
                        if j not in chunks:   # past the data every codeword covers: the padding's zeros
                            if r == rank:
                                rebuilt[k][j * cs + lo: j * cs + hi].zero_()
                            continue
                        wanted.append((k, r, j, lo, hi))
        if repair == "chain":
            errors, n_got, n_decoded = rec.chain_decode(_Peers(group), rank, wanted, server=server, read=read,
                                                        out=out, tag=_FRAG_TAG)
        else:
            errors, n_got, n_decoded = _gather(rec, gi, wanted, rank, group, server, read, out)
        got += n_got
        decoded += n_decoded
        problems += [f"source rank {k} could not be decoded from parity: {type(e).__name__}: {e}"
                     for k, e in sorted(errors.items())]
        for k in sorted(set(g.lost) & set(rebuilt)):
            if k in errors:
                continue
            bad = mf.verify(manifests[k], memoryview(rebuilt[k].numpy()), within=plan[k][rank])
            if bad:
                problems.append(f"source rank {k} rebuilt from parity fails its checksums ({'; '.join(bad[:2])}): "
                                "a survivor's data or parity share is corrupt")
    return rebuilt, problems, got, decoded


class _Peers:
    """isend/irecv by global rank over the restore's group (None: the world), as the parity code takes them."""

    def __init__(self, group: Any):
        self.group = group

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> Any:
        import torch.distributed as dist
        return dist.isend(t, dst, group=self.group, tag=tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> Any:
        import torch.distributed as dist
        return dist.irecv(t, src, group=self.group, tag=tag)


def _gather(rec: Any, gi: int, wanted: list[tuple], rank: int, group: Any, server: Callable, read: Callable,
            out: Callable) -> tuple[dict[int, Exception], int, int]:
    """The k fragments of each range sent to its target, which decodes them: (the first failure by source, bytes of
    fragments received, bytes decoded). A fragment its server cannot read goes as zeros (every rank posts the same
    messages whatever fails: no peer waits for ever), and the target's checksums fail."""
    import torch.distributed as dist
    errors: dict[int, Exception] = {}
    reqs, todo, got, decoded = [], [], 0, 0
    for k, r, j, lo, hi in wanted:
        cw, _, sources = rec.chunks_of(k)[j]
        frags: dict[int, torch.Tensor] = {}
        for f in sources:
            sender = server(f)
            tag = _FRAG_TAG + (gi * 256 + cw) * 256 + f.fragment
            if sender == rank:
                try:
                    piece = read(f, lo, hi)
                except Exception as e:   # noqa: BLE001 -- said as a decode that failed; the zeros still go
                    errors.setdefault(k, e)
                    piece = torch.zeros(hi - lo, dtype=torch.uint8)
                if r == rank:
                    frags[f.fragment] = piece
                else:
                    reqs.append(dist.isend(piece, r, group=group, tag=tag))
            elif r == rank:
                frags[f.fragment] = torch.empty(hi - lo, dtype=torch.uint8)
                reqs.append(dist.irecv(frags[f.fragment], sender, group=group, tag=tag))
                got += hi - lo
        if r == rank:
            todo.append((k, j, lo, hi, frags))
    for q in reqs:
        q.wait()
    for k, j, lo, hi, frags in todo:
        try:
            rec.decode_range(k, j, frags, out(k, j, lo, hi))
            decoded += hi - lo
        except (ShardsafeError, ValueError, KeyError) as e:
            errors.setdefault(k, e)
    return errors, got, decoded


# ---- the pieces ---------------------------------------------------------------------------------------------------

def layout(manifest: dict, reads: Sequence[tuple[str, int, int]]) -> tuple[list[tuple], int]:
    """Where each read lies in the source's payload and in the message: [(name, first element, elements, payload
    offset, bytes, message offset)], and the message's size. Server and target compute it alike."""
    entries = {e["name"]: e for e in manifest["entries"]}
    out, at = [], 0
    for name, start, count in reads:
        e = entries[name]
        es = mf.dtype_from_name(e["dtype"]).itemsize
        a, n = (e["offset"], e["nbytes"]) if count < 0 else (e["offset"] + start * es, count * es)
        out.append((name, start, count, a, n, at))
        at += -(-n // _ALIGN) * _ALIGN
    return out, at


@dataclass
class Light:
    """A source as the resharder sees it on one target: its manifest and metadata, and its tensors (views of the
    whole payload when this node holds it, else the pieces received, as :class:`~.reshard.Pieces`)."""
    manifest: dict
    meta: dict
    tensors: dict


class Move:
    """The pieces' messages of one attempt, posted at construction (every rank constructs it alike, once the plan is
    known) and finished by :meth:`finish` after the verify and the rebuild, which run while the bytes travel: a
    server sends from its mapping, a target receives into buffers of its own, and nothing is read from them before
    both votes passed. :meth:`wait` must run before the attempt's mappings close, whatever happened (gloo reads and
    writes these buffers until then)."""

    def __init__(self, choice: Choice, manifests: dict[int, dict], slices: dict, senders: dict[int, int],
                 opened: Opened, *, rank: int, nodes: Sequence[str], group: Any):
        import torch.distributed as dist
        self.choice, self.manifests, self.slices, self.senders = choice, manifests, slices, senders
        self.opened, self.rank, self.nodes = opened, rank, nodes
        self.traffic: dict[str, Any] = {"local_bytes": 0, "remote_bytes": 0, "sent_bytes": 0, "by_source": {}}
        self._recvs: list[Any] = []   # waited for before the resharder reads them
        self._sends: list[Any] = []   # waited for at the end: the receivers take them as they post their receives
        self._inbox: dict[int, tuple[torch.Tensor, list[tuple]]] = {}
        for sl in sorted(slices):
            p = slices[sl]
            for d, k in enumerate(p["keys"]):
                for t, r in enumerate(p["targets"]):
                    reads = p["reads"][t].get(d)
                    if not reads or self._here(k, r) or rank not in (r, senders[k]):
                        continue
                    lay, size = layout(manifests[k], reads)
                    nbytes = sum(x[4] for x in lay)
                    if senders[k] == rank:   # each piece sent from where it lies: no staging copy
                        src = as_bytes(opened.source(choice.sources[k], choice.version)[1])
                        self._sends += [dist.isend(src[a: a + n], r, group=group, tag=_TAG + k)
                                        for _, _, _, a, n, _ in lay if n]
                        self.traffic["sent_bytes"] += nbytes
                    else:   # into its place in one buffer; one tag per pair: gloo matches them in order
                        msg = torch.empty(size, dtype=torch.uint8)
                        self._recvs += [dist.irecv(msg[at: at + n], senders[k], group=group, tag=_TAG + k)
                                        for _, _, _, _, n, at in lay if n]
                        self._inbox[k] = (msg, lay)
                        near = nodes[senders[k]] == nodes[rank]
                        self.traffic["local_bytes" if near else "remote_bytes"] += nbytes
                        self.traffic["by_source"][str(k)] = {"bytes": nbytes, "from_rank": senders[k],
                                                             "same_node": near}

    def _here(self, k: int, target: int) -> bool:
        """Whether the target reads source k where it runs (or decoded it): nothing travels for it."""
        s = self.choice.sources[k]
        return (target == self.senders[k] or s.where in ("disk", "rebuilt")
                or (s.where == "holder" and self.nodes[target] == s.node))

    def wait(self) -> None:
        """Wait for every message posted; the first failure is raised once all have ended."""
        reqs, first = self._recvs + self._sends, None
        self._recvs, self._sends = [], []
        for q in reqs:
            try:
                q.wait()
            except Exception as e:   # noqa: BLE001 -- every buffer must be released by gloo before one is raised
                first = first or e
        if first is not None:
            raise first

    def finish(self, rebuilt: dict[int, torch.Tensor], my_slice: tuple[int, int]) -> tuple[list[Light], dict]:
        """Once what it receives arrived: this rank's view of its slice's sources (received pieces, what its own
        node holds, the parts it decoded), and its traffic: ``local_bytes`` read from its own node, ``remote_bytes``
        received from others, ``sent_bytes``, by source. Its sends may still travel (:meth:`wait` ends them)."""
        recvs, self._recvs = self._recvs, []
        for i, q in enumerate(recvs):
            try:
                q.wait()
            except Exception:
                self._recvs = recvs[i + 1:]   # still to be waited for before the buffers go
                raise
        p = self.slices[my_slice]
        me = p["targets"].index(self.rank)
        light = []
        for d, k in enumerate(p["keys"]):
            man = self.manifests[k]
            if k in self._inbox:
                tensors = _unpack(man, *self._inbox[k])
            elif d in p["reads"][me]:
                lay = layout(man, p["reads"][me][d])[0]
                if k in rebuilt:   # only the pieces it decoded and verified: the rest of that buffer was never written
                    tensors = _unpack(man, rebuilt[k], [(*x[:5], x[3]) for x in lay])
                else:
                    tensors = mf.views(man, self.opened.source(self.choice.sources[k], self.choice.version)[1])
                n = sum(x[4] for x in lay)
                self.traffic["local_bytes"] += n
                self.traffic["by_source"][str(k)] = {"bytes": n, "from_rank": self.rank, "same_node": True}
            else:
                tensors = {e["name"]: Pieces(e["name"], e["shape"], mf.dtype_from_name(e["dtype"]))
                           for e in man["entries"]}
            light.append(Light(man, p["metas"][d], tensors))
        return light, self.traffic


def _unpack(manifest: dict, msg: torch.Tensor, lay: list[tuple]) -> dict[str, Any]:
    """A source's tensors from one received message (or a rebuilt payload, ``lay`` at its own offsets): whole tensors
    as themselves, pieces in :class:`Pieces`, the others as empty :class:`Pieces` (their shape and dtype)."""
    entries = {e["name"]: e for e in manifest["entries"]}
    out: dict[str, Any] = {n: Pieces(n, e["shape"], mf.dtype_from_name(e["dtype"])) for n, e in entries.items()}
    for name, start, count, _, n, at in lay:
        e = entries[name]
        view = msg[at: at + n].view(mf.dtype_from_name(e["dtype"]))
        if count < 0:
            out[name] = view.view(e["shape"])
        else:
            out[name].add(start, view)
    return out
