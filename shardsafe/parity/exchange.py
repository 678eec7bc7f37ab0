"""Parity exchange and rebuild inside parity groups, over dedicated gloo process groups.

After a rank has sealed its data payload for a version, the members of its parity group
(topology.ParityGroup) move stripes point-to-point: member i sends chunk c of its padded payload
to the parity holders of codeword i+1+c; each member receives the k data chunks of the m codewords
it holds parity for, encodes one parity fragment per codeword (ISA-L on CPU) straight into a
"parity" slot of its own holder, checksums it and seals it with a manifest that also carries every
member's data manifest (so a lost member's checksums survive it). A version is committed only when
this succeeded on every rank.

Rebuild (restore after node loss): survivors read their data and parity slots and form every lost
fragment (data chunks and the parity shares the lost member held) as partial products reduced along
the survivors (shardsafe.parity.repair), so a lost member receives each fragment once, finished, into
a fresh data or parity slot of its (new, empty) holder; it verifies the data against the replicated
checksums and seals both, and the normal restore path then loads them. Its parity shares back, the
restored version is protected again at once (a second node loss before the next snapshot is
covered); those slots are committed only when the restore of the version verified on every rank
(``finish_rebuild``), else dropped. ``repair="gather"`` sends the k source fragments to the lost
member instead, which decodes them (the baseline the rebuild bench measures against).

All collectives here run on the parity group's own gloo group, from the snapshot worker thread
(encode) or the main thread before training (rebuild); every member of a group takes the same
branches, decided by small votes, so point-to-point traffic never waits for a peer that skipped.
"""
from __future__ import annotations

import json
import logging
import time
import warnings
from datetime import timedelta
from typing import Any, Callable, Iterable

import numpy as np
import torch

from ..config import PARITY_TRANSPORTS
from ..faults import PHASE_PARITY_AFTER, PHASE_PARITY_BEFORE, PHASE_PARITY_BLOCK, PHASE_RESTORE_REBUILD
from ..holder.client import HolderClient
from ..holder.protocol import HolderFailure
from ..payload import manifest as mf
from ..hierarchy import MemberGroup
from ..ordinals import next_ordinal
from .codec import get_codec
from .device import DevicePath
from .host import HostTransport
from .repair import chain_rebuild
from .transport import ExchangeError, ParityTransport
from .topology import ParityGroup, ParityGroups, RankPlace, build_parity_groups

log = logging.getLogger(__name__)
_MANIFEST_TAG = 1 << 20
REPAIRS = ("chain", "gather")


def gather_places(rank: int, world_size: int, node: str, dp: int, tp: int = 0, pp: int = 0, group=None) -> list[RankPlace]:
    """Every rank's (node, dp, tp, pp), exchanged as fixed-size tensors (no pickle)."""
    import torch.distributed as dist
    name = node.encode()[:64].ljust(64, b"\0")
    mine = torch.tensor([rank, dp, tp, pp, *name], dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(out, mine, group=group)
    places = []
    for t in out:
        v = t.tolist()
        places.append(RankPlace(rank=v[0], dp=v[1], tp=v[2], pp=v[3], node=bytes(v[4:]).rstrip(b"\0").decode()))
    return places


def plan_parity(places: list[RankPlace], *, group_size: int, parity_shards: int) -> ParityGroups | None:
    """The job's parity plan, or None when parity is off (n == 1) or impossible with *default* sizing
    (e.g. every rank on one node). An explicit group_size that cannot be honoured raises TopologyError."""
    if group_size == 1:
        return None
    if group_size == 0:
        from .topology import TopologyError
        try:
            return build_parity_groups(places, group_size=None, parity_shards=parity_shards)
        except TopologyError as e:
            if parity_shards > 1:
                # asked for more than the default: that request cannot be honoured, and silence would leave the
                # user believing m node losses are covered
                raise TopologyError(f"parity_shards={parity_shards} cannot be placed: {e}") from None
            if places and places[0].rank == 0 or not places:
                log.warning("parity off: node losses are not covered by parity (only the persistent tier, if "
                            "configured, survives them): %s", e)
            return None
    return build_parity_groups(places, group_size=group_size, parity_shards=parity_shards)


class ParityExchange:
    """Args:
        plan: the job's parity groups (every rank builds the same plan).
        rank: this rank.
        timeout_s: timeout of the groups' collectives.
        backend: codec backend ("auto": ISA-L, else the numpy reference).
        repair: how a lost member is rebuilt: "chain" (partial products reduced along the survivors,
            shardsafe.parity.repair: the rebuilder receives one byte per byte it rebuilds) or "gather" (the k
            source fragments sent to the rebuilder, which decodes them: k bytes per byte; kept as the baseline
            bench/rebuild_bench.py measures against).
    """

    def __init__(self, plan: ParityGroups, rank: int, *, timeout_s: float = 60.0, backend: str = "auto",
                 transport: str = "host", device: "torch.device | None" = None, store: Any = None,
                 prefix: str = "shardsafe/parity", repair: str = "chain"):
        import torch.distributed as dist
        if repair not in REPAIRS:
            raise ExchangeError(f"repair must be one of {REPAIRS}; got {repair!r}")
        self.plan, self.rank, self.repair = plan, rank, repair
        self.group: ParityGroup = plan.group_of(rank)
        # Every exchange a process builds gets its own keys in the store (every rank builds the same ones, in order).
        self.timeout_s, self.prefix = timeout_s, f"{prefix}/{next_ordinal('parity_exchange')}"
        if transport not in PARITY_TRANSPORTS:
            raise ExchangeError(f"parity transport must be one of {PARITY_TRANSPORTS}; got {transport!r}")
        if transport == "device":
            # Checked before any group is created: a rank that cannot take part must not leave the others
            # waiting in new_group.
            device = device if device is not None else DevicePath.default_device()
            DevicePath.check(device, self.group.k, self.group.m)
        self._store = store if store is not None else dist.distributed_c10d._get_default_store()
        # The group's own gloo group, built by its members alone (a MemberGroup: no world-wide new_group, and
        # rebuilt under a new generation after a failed exchange, rebuild_groups).
        self.generation = 0
        self.pg = self._member_group()
        self.codec = get_codec(k=self.group.k, m=self.group.m, backend=backend)
        # How the stripes of encode move and become parity (a ParityTransport): from the holders' memory over the
        # gloo group above ("host"), or through GPU memory over a second group of the same members, NCCL on GPU
        # ("device"; torch's new_group, created by every rank). Votes, manifests and the rebuild after a node loss
        # stay on the gloo group above either way.
        self.transport: ParityTransport = HostTransport(lambda: self.pg, self.codec)
        if transport == "device":
            xpg = None
            for g in plan:
                pg = dist.new_group(ranks=list(g.members), backend="nccl" if device.type == "cuda" else "gloo",
                                    timeout=timedelta(seconds=timeout_s))
                if rank in g.members:
                    xpg = pg
            self.transport = DevicePath(device, xpg, k=self.group.k, m=self.group.m)
        self.last_error = ""
        # Largest payload seen in the group: members with smaller payloads (Megatron's DistOpt
        # shards differ by up to a bucket) size their data slot for the group's padded layout.
        self.pmax_hint = 0
        self.timings: dict[str, float] = {}
        self._rebuilt: list[tuple[int, str]] = []   # (version, kind) slots sealed by the last rebuild
        # fault injection / tracing hook: on_phase(name, version) at "parity-before", "parity-block",
        # "parity-after" and "restore-rebuild" (shardsafe.faults.Injector.phase)
        self.on_phase: Callable[[str, int], None] = lambda name, version: None
        self._version = -1   # the version being encoded (for on_phase inside the transfer)

    def _member_group(self) -> MemberGroup:
        return MemberGroup(self._store, f"{self.prefix}/g{self.generation}/{self.group.index}", self.group.members,
                           self.rank, self.timeout_s)

    def retire(self) -> None:
        """For a restart in place: the gloo group is dropped off this thread (shardsafe.hierarchy.let_go_of); the
        exchange is unusable after."""
        pg, self.pg = self.pg, None
        if pg is not None:
            pg.retire()

    def rebuild_groups(self, generation: int) -> None:
        """After a failed exchange (a member slower than the timeout, a network error) the gloo group is unusable:
        build it again under ``generation`` (the same number on every member: the version that failed). The device
        transport's group (NCCL) is kept."""
        self.pg.close()
        self.generation = generation
        self.pg = self._member_group()

    # ---- sizes ------------------------------------------------------------------------------------
    def padded_nbytes(self, payload_nbytes: int) -> int:
        return self.group.padded_nbytes(max(payload_nbytes, self.pmax_hint))

    def _vote(self, ok: bool, nbytes: int) -> tuple[bool, int]:
        """(every member ok, the largest payload)."""
        flag, neg = self.pg.min_reduce([1 if ok else 0, -nbytes])
        return flag == 1, -neg

    def _gather_sizes(self, ok: bool, nbytes: int, blob_len: int) -> tuple[bool, int, int]:
        """One all-gather of (ok, payload bytes, manifest length): (all ok, largest payload, longest manifest)."""
        outs = [torch.zeros(3, dtype=torch.int64) for _ in range(self.group.n)]
        self.pg.all_gather(outs, torch.tensor([1 if ok else 0, nbytes, blob_len], dtype=torch.int64))
        rows = torch.stack(outs)
        return bool(rows[:, 0].min() == 1), int(rows[:, 1].max()), int(rows[:, 2].max())

    def _gather_manifests(self, ready: bool, blob: bytes, width: int) -> tuple[bool, list[bytes]]:
        """One all-gather of every member's manifest, each behind a ready byte: (all ready, blobs)."""
        buf = torch.zeros(width + 1, dtype=torch.uint8)
        if ready:
            buf[0] = 1
            if blob:
                buf[1: len(blob) + 1] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        outs = [torch.empty(width + 1, dtype=torch.uint8) for _ in range(self.group.n)]
        self.pg.all_gather(outs, buf)
        # JSON never ends in NUL: the zero padding after a shorter manifest is cut off.
        return all(int(o[0]) == 1 for o in outs), [bytes(o[1:].numpy()).rstrip(b"\0") for o in outs]

    # ---- encode after a snapshot --------------------------------------------------------------------
    def encode(self, *, version: int, client: HolderClient | None, data_mm: Any, data_manifest: dict | None,
               ok: bool) -> bool:
        """Compute and store this member's parity shares for ``version``. Every member calls it,
        also when its own snapshot failed (``ok=False``): the group then skips together."""
        g, me = self.group, self.rank
        self.last_error = ""
        self.on_phase(PHASE_PARITY_BEFORE, version)
        self._version = version
        t0 = time.perf_counter()
        nbytes = data_manifest["payload_nbytes"] if ok and data_manifest else 0
        blob = json.dumps(data_manifest, separators=(",", ":")).encode() if ok and data_manifest else b""
        # Two small collectives decide everything before bytes move: sizes (and whether every member
        # has its snapshot), then the manifests (and whether every member got its parity slot).
        ok, pmax, width = self._gather_sizes(ok, nbytes, len(blob))
        t_voted = time.perf_counter()
        if not ok:
            self.last_error = "a member of the parity group has no snapshot for this version"
            return False
        self.pmax_hint = max(self.pmax_hint, pmax)
        cs = g.chunk_size(pmax)
        pmm = None
        try:
            # Deterministic padding: parity covers payload + zeros up to k * cs. Where the slot is shorter
            # than that (a smaller member's first snapshot), data_chunks supplies the zeros.
            end = min(g.k * cs, len(data_mm))
            if end > nbytes:
                torch.frombuffer(data_mm, dtype=torch.uint8, count=end - nbytes, offset=nbytes).zero_()
            _, pmm = client.acquire(rank=me, version=version, nbytes=g.m * cs, kind="parity")
            ready = True
        except Exception as e:   # budget, holder gone: vote no, the group skips together
            self.last_error = f"parity slot: {e}"
            ready = False
        t_slot = time.perf_counter()
        ready, blobs = self._gather_manifests(ready, blob, width)
        if not ready:
            self.last_error = self.last_error or "a member of the parity group could not store parity"
            return False
        data = data_chunks(data_mm, g.k, cs)
        pview = np.frombuffer(pmm, dtype=np.uint8, count=g.m * cs)
        t_sent = time.perf_counter()
        sums, t_wait = self.transport.move_and_encode(g, me, data, pview, cs,
                                                      lambda: self.on_phase(PHASE_PARITY_BLOCK, version))
        t_xfer = time.perf_counter()
        man = self._parity_manifest(version, cs, pmax, sums, {str(r): json.loads(b) for r, b in zip(g.members, blobs)})
        try:
            client.seal(rank=me, version=version, manifest=man, kind="parity")
        except HolderFailure as e:
            # The holder died after the transfer (a holder kill landing here): this version goes without its
            # parity on this member, which the pipeline's commit vote tells every rank. Raising instead would
            # leave this rank out of that vote and end its snapshots for the run.
            self.last_error = f"parity seal: {e}"
            return False
        self.on_phase(PHASE_PARITY_AFTER, version)
        t_end = time.perf_counter()
        # Where parity time goes: votes + manifests + slot (prepare), blocks moving while earlier ones are
        # encoded (transfer_s; of it, recv_wait_s waiting for blocks, the rest encode + hash), the seal.
        # (The device path's transfer_s also holds its host-device copies.)
        # wait_s (inside prepare_s): the first collective, i.e. waiting for the group's slowest member's copy.
        self.timings = {"prepare_s": t_sent - t0, "wait_s": t_voted - t0, "slot_s": t_slot - t_voted,
                        "manifests_s": t_sent - t_slot, "transfer_s": t_xfer - t_sent, "recv_wait_s": t_wait,
                        "encode_s": t_xfer - t_sent - t_wait, "seal_s": t_end - t_xfer}
        return True

    # ---- rebuild at restore -------------------------------------------------------------------------
    def can_rebuild(self, version: int, missing: Iterable[int], data: list[list[int]], parity: list[list[int]]) -> bool:
        """Whether ``version`` can be rebuilt onto the ``missing`` ranks: every group misses at most m members and
        all of its survivors hold the version's data and parity (``data[r]``, ``parity[r]``: rank r's versions)."""
        gone = set(missing)   # a set: every rank of every group is looked up in it
        for g in self.plan:
            lost = [r for r in g.members if r in gone]
            if lost and (len(lost) > g.m or any(version not in parity[r] or version not in data[r]
                                                 for r in g.members if r not in gone)):
                return False
        return True

    def beyond_parity(self, missing: Iterable[int]) -> list[tuple[int, int, list[int]]]:
        """(group index, m, lost members) of every group that lost more members than its parity covers."""
        gone = set(missing)
        out = [(g.index, g.m, [r for r in g.members if r in gone]) for g in self.plan]
        return [w for w in out if len(w[2]) > w[1]]

    def rebuild(self, *, version: int, client: HolderClient | None, lost: Iterable[int]) -> tuple[bool, int, str]:
        """Rebuild the data payloads of ``lost`` members of this rank's group (all members call it).

        Returns (ok, bytes rebuilt by this rank, reason). Never raises for a bad share: a survivor
        whose parity fails its checksum votes no before anything moves, and a rebuilt payload that
        does not verify against the replicated checksums is not sealed (ok=False on that rank)."""
        g = self.group
        lost = sorted(set(lost) & set(g.members))
        if not lost:
            return True, 0, ""
        handles: list[Any] = []
        try:
            return self._rebuild(version, client, lost, handles)
        finally:
            for mm in handles:
                try:
                    mm.close()
                except BufferError:
                    pass

    def _rebuild(self, version: int, client: HolderClient | None, lost: list[int], handles: list) -> tuple[bool, int, str]:
        """Collective over the group: the survivors check and send their shares, the lost members decode, verify
        and seal their payload of ``version``. Returns (ok, bytes rebuilt on this rank, why not)."""
        g, me = self.group, self.rank
        survivors = [r for r in g.members if r not in lost]
        info, reason = self._survivor_info(version, client, handles) if me in survivors else ({}, "")
        ok, _ = self._vote(not reason, 0)
        if not ok:
            return False, 0, reason or "a survivor of the parity group cannot serve its shares"
        info = self._share_info(info, survivors[0], lost)
        cs = info["chunk_size"]
        plan = g.recovery_plan(lost)
        if self.repair == "chain":
            return self._chain_rebuild(version, client, plan, handles if me in survivors else None, cs, info)
        recv_bufs = self._transfer_sources(plan, handles if me in survivors else None, cs)
        self.on_phase(PHASE_RESTORE_REBUILD, version)
        if me not in lost:
            return True, 0, ""
        return self._decode_mine(version, client, plan, recv_bufs, cs, info)

    def _chain_rebuild(self, version: int, client: HolderClient | None, plan, handles: list | None, cs: int,
                       info: dict) -> tuple[bool, int, str]:
        """The rebuild by partial-parallel repair (shardsafe.parity.repair): a lost member receives its data chunks
        and parity shares finished, straight into the slots it then verifies and seals."""
        g, me = self.group, self.rank
        data = parity = None
        why = ""
        if handles is None:   # a lost member: the slots the fragments land in (parity best effort, as re-encoding)
            try:
                _, data = client.acquire(rank=me, version=version, nbytes=g.k * cs)
            except Exception as e:   # budget, holder gone: this rank's rebuild fails and says why, the group goes on
                why = f"rank {me}: no slot to rebuild into: {e}"
            if data is not None:
                try:
                    _, parity = client.acquire(rank=me, version=version, nbytes=g.m * cs, kind="parity")
                except Exception as e:
                    log.warning("[rank %d] no slot for the parity shares of rebuilt version %d (%s): the group is "
                                "protected again from the next committed snapshot", me, version, e)
        else:
            dv = data_chunks(handles[1], g.k, cs)
            pv_t = _read_only(handles[0], g.m * cs)

        def source(f):
            return pv_t[f.slot * cs:(f.slot + 1) * cs] if f.is_parity else dv[f.slot]

        def dest(t):
            mm = parity if t.is_parity else data
            return None if mm is None else torch.frombuffer(mm, dtype=torch.uint8, count=cs, offset=t.slot * cs)

        chain_rebuild(self.pg, self.codec, plan, me, cs, source=source, dest=dest)
        self.on_phase(PHASE_RESTORE_REBUILD, version)
        if handles is not None:
            return True, 0, ""
        if data is None:
            return False, 0, why
        ok, nbytes, why = self._seal_rebuilt(version, client, data, info)
        if ok and parity is not None:
            self._seal_rebuilt_parity(version, client, parity, cs, info)
        return ok, nbytes, why

    def _survivor_info(self, version: int, client: HolderClient, handles: list) -> tuple[dict[str, Any], str]:
        """A survivor opens its data and parity of ``version`` (into ``handles``) and checks its parity shares.
        Returns (what the lost members need: chunk size, payload size, the group's manifests; why not)."""
        me = self.rank
        try:
            pman, pmm = client.open(rank=me, version=version, kind="parity")
            handles.append(pmm)
            _, dmm = client.open(rank=me, version=version)
            handles.append(dmm)
            cs = pman["chunk_size"]
            pv = memoryview(pmm)
            bad = [j for j, s in enumerate(pman["xxh3"]) if mf.hash_bytes(pv[j * cs:(j + 1) * cs]) != s]
            pv.release()
            info = {"chunk_size": cs, "payload_max": pman["payload_max"], "manifests": pman["group_manifests"]}
            return info, (f"rank {me}: parity share(s) {bad} of version {version} fail their checksum" if bad else "")
        except Exception as e:   # said in the vote: every survivor must reach it, whatever failed here
            return {}, f"rank {me}: cannot read data/parity of version {version}: {e}"

    def _share_info(self, info: dict[str, Any], sender: int, lost: list[int]) -> dict[str, Any]:
        """The rebuilders learn the chunk size and their manifests from one survivor (JSON, point to point)."""
        if self.rank == sender:
            blob = torch.frombuffer(bytearray(json.dumps(info).encode()), dtype=torch.uint8)
            for r in lost:
                self.pg.send(torch.tensor([blob.numel()], dtype=torch.int64), r, _MANIFEST_TAG)
                self.pg.send(blob, r, _MANIFEST_TAG + 1)
        elif self.rank in lost:
            n = torch.zeros(1, dtype=torch.int64)
            self.pg.recv(n, sender, _MANIFEST_TAG)
            blob = torch.empty(int(n), dtype=torch.uint8)
            self.pg.recv(blob, sender, _MANIFEST_TAG + 1)
            info = json.loads(bytes(blob.numpy()))
        return info

    def _transfer_sources(self, plan, handles: list | None, cs: int) -> dict[int, list]:
        """Every codeword's k source fragments go from the survivors to the lost members (``handles``: this
        survivor's parity and data mappings, None on a lost member). Returns codeword -> received buffers."""
        me = self.rank
        reqs, recv_bufs = [], {}
        if handles is not None:
            dv = data_chunks(handles[1], self.group.k, cs)
            pv_t = _read_only(handles[0], self.group.m * cs)
        for cw in plan:
            takers = sorted({t.rank for t in cw.targets})   # lost members: their data chunks and parity shares
            for f in cw.sources:
                if f.rank == me:
                    src = pv_t[f.slot * cs:(f.slot + 1) * cs] if f.is_parity else dv[f.slot]
                    for t in takers:
                        reqs.append(self.pg.isend(src, t, cw.codeword))
            if me in takers:
                bufs = [torch.empty(cs, dtype=torch.uint8) for _ in cw.sources]
                recv_bufs[cw.codeword] = bufs
                for f, b in zip(cw.sources, bufs):
                    reqs.append(self.pg.irecv(b, f.rank, cw.codeword))
        for r in reqs:
            r.wait()
        return recv_bufs

    def _decode_mine(self, version: int, client: HolderClient, plan, recv_bufs: dict, cs: int,
                     info: dict) -> tuple[bool, int, str]:
        """A lost member decodes its chunks into a new slot, verifies them against its replicated manifest,
        seals, and re-encodes its parity shares."""
        me = self.rank
        try:
            _, wmm = client.acquire(rank=me, version=version, nbytes=self.group.k * cs)
        except Exception as e:   # budget, holder gone: this rank's rebuild fails and says why, the restore goes on
            return False, 0, f"rank {me}: no slot to rebuild into: {e}"
        for cw in plan:
            mine = [t for t in cw.targets if t.rank == me and not t.is_parity]
            if not mine:
                continue
            outs = [np.frombuffer(wmm, dtype=np.uint8, count=cs, offset=t.slot * cs) for t in mine]
            self.codec.reconstruct({f.fragment: b.numpy() for f, b in zip(cw.sources, recv_bufs[cw.codeword])},
                                   [t.fragment for t in mine], out=outs)
        ok, nbytes, why = self._seal_rebuilt(version, client, wmm, info)
        if ok:
            self._reencode_parity(version, client, plan, recv_bufs, cs, info)
        return ok, nbytes, why

    def _seal_rebuilt(self, version: int, client: HolderClient, wmm: Any, info: dict) -> tuple[bool, int, str]:
        """Verify a rebuilt payload against this member's replicated manifest and seal it (never if it fails)."""
        me = self.rank
        my_man = info["manifests"][str(me)]
        bad = mf.verify_mapping(my_man, wmm)
        if bad:
            return False, 0, (f"rank {me}: payload of version {version} rebuilt from parity fails its checksums "
                              f"({'; '.join(bad[:3])}): a peer's data or parity share is corrupt; not loaded")
        client.seal(rank=me, version=version, manifest=my_man)
        self._rebuilt.append((version, "data"))
        return True, my_man["payload_nbytes"], ""

    def _seal_rebuilt_parity(self, version: int, client: HolderClient, pmm: Any, cs: int, info: dict) -> None:
        """Checksum and seal the parity shares a rebuilt member holds again (best effort, as re-encoding is)."""
        try:
            sums = [mf.hash_bytes(memoryview(pmm)[j * cs:(j + 1) * cs]) for j in range(self.group.m)]
            man = self._parity_manifest(version, cs, info["payload_max"], sums, info["manifests"])
            client.seal(rank=self.rank, version=version, manifest=dict(man, rebuilt=True), kind="parity")
            self._rebuilt.append((version, "parity"))
        except Exception as e:   # the payload is restored already: re-protecting it is best effort
            log.warning("[rank %d] rebuilt payload of version %d restored, but its parity shares could not be "
                        "sealed (%s): the group is protected again from the next committed snapshot", self.rank,
                        version, e)

    def _reencode_parity(self, version: int, client: HolderClient, plan, recv_bufs: dict, cs: int, info: dict) -> None:
        """Re-encode this (rebuilt) member's parity shares of ``version`` from the fragments it received.

        Without them the group would cover no further loss until the next snapshot commits: with
        m=1, a second node lost meanwhile would find codewords short of a fragment. A failure here
        (budget) costs only that protection, never the restore: one warning, the data stays."""
        g, me = self.group, self.rank
        try:
            _, pmm = client.acquire(rank=me, version=version, nbytes=g.m * cs, kind="parity")
            for cw in plan:
                mine = [t for t in cw.targets if t.rank == me and t.is_parity]
                if mine:
                    outs = [np.frombuffer(pmm, dtype=np.uint8, count=cs, offset=t.slot * cs) for t in mine]
                    self.codec.reconstruct({f.fragment: b.numpy() for f, b in zip(cw.sources, recv_bufs[cw.codeword])},
                                           [t.fragment for t in mine], out=outs)
        except Exception as e:   # the payload is restored already: re-protecting it is best effort
            log.warning("[rank %d] rebuilt payload of version %d restored, but its parity shares could not be "
                        "re-encoded (%s): the group is protected again from the next committed snapshot", me, version, e)
            return
        self._seal_rebuilt_parity(version, client, pmm, cs, info)

    def _parity_manifest(self, version: int, cs: int, pmax: int, sums: list[str], manifests: dict) -> dict:
        """The manifest sealed with this member's parity slot: its codewords, their checksums, and every
        group member's data manifest (so a lost member's checksums survive it)."""
        g = self.group
        return {"format": mf.FORMAT, "kind": "parity", "version": version, "rank": self.rank,
                "group": {"index": g.index, "members": list(g.members), "nodes": list(g.nodes), "k": g.k, "m": g.m},
                "code": self.codec.spec(), "chunk_size": cs, "payload_max": pmax,
                "codewords": [s.codeword for s in g.parity_stripes(self.rank)], "xxh3": sums,
                "group_manifests": manifests}

    def finish_rebuild(self, client: HolderClient | None, version: int, *, restored: bool) -> None:
        """After the restore vote on ``version``: commit the slots this rank rebuilt for it (the
        version verified on every rank), or drop them (it did not: they must never be served)."""
        todo = [kind for v, kind in self._rebuilt if v == version]
        self._rebuilt = [(v, k) for v, k in self._rebuilt if v != version]
        for kind in todo:
            try:
                if restored:
                    client.commit(ranks=[self.rank], version=version, kind=kind)
                else:
                    client.drop(rank=self.rank, version=version, kind=kind)
            except Exception as e:   # the holder's state stays "sealed": restorable, just not protected from reuse
                log.warning("[rank %d] %s of rebuilt version %d: %s", self.rank, "commit" if restored else "drop", version, e)


def data_chunks(mm: Any, k: int, cs: int) -> list[torch.Tensor]:
    """The k data chunks of a member's padded payload in its data slot ``mm``.

    Chunks inside the slot are views. The group pads every payload to ``k * cs`` of its *largest*
    member, which can exceed a smaller member's slot (slots are sized from the member's own payload
    until the group's size is known, in 2 MiB steps); bytes beyond the slot then count as zeros, in a
    copy. Encode and rebuild read the same sealed slot through this one rule, so they see the same bytes.
    """
    n = len(mm)
    out = []
    for c in range(k):
        a, b = c * cs, (c + 1) * cs
        if b <= n:
            out.append(_read_only(mm, cs, a))
            continue
        t = torch.zeros(cs, dtype=torch.uint8)
        if a < n:
            t[: n - a] = _read_only(mm, n - a, a)
        out.append(t)
    return out


def _read_only(mm: Any, count: int, offset: int = 0) -> torch.Tensor:
    """``count`` bytes of a (read-only) mapping as a uint8 tensor, which is only read and sent: torch's warning
    about a buffer that is not writable would reach the user's log once per process for nothing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mm, dtype=torch.uint8, count=count, offset=offset)
