"""Rebuilding a lost member of a parity group whose ranks no longer run (shardsafe/parity/recovery.py): the
exchange's code and chunk layout read back from a parity manifest, fragments from wherever they are read, decoded
by byte range, byte for byte the lost payload."""
import pytest
import torch

from shardsafe.errors import ParityError
from shardsafe.parity.codec import get_codec
from shardsafe.parity.exchange import data_chunks
from shardsafe.parity.recovery import MemberRecovery
from shardsafe.parity.topology import ParityGroup


def _encoded(n, m, sizes, seed=0):
    """Payloads of ``sizes`` bytes (uneven: the smaller slots end before the group's padding) and every member's
    parity slots, made as the exchange makes them (ParityGroup's stripes, the codec)."""
    g = ParityGroup(index=0, members=tuple(range(n)), nodes=tuple(f"n{i}" for i in range(n)), k=n - m, m=m, key=(),
                    dp=tuple(range(n)))
    gen = torch.Generator().manual_seed(seed)
    payloads = [bytearray(torch.randint(0, 256, (s,), generator=gen, dtype=torch.uint8).numpy().tobytes())
                for s in sizes]
    cs = g.chunk_size(max(sizes))
    codec = get_codec(k=g.k, m=m, backend="reference")
    parity = []
    for r in range(n):
        buf = bytearray(m * cs)
        for j, stripe in enumerate(g.parity_stripes(r)):
            chunks = {p: data_chunks(payloads[f.rank], g.k, cs)[f.slot].numpy() for p, f in enumerate(stripe.data)}
            out = torch.frombuffer(buf, dtype=torch.uint8, count=cs, offset=j * cs).numpy()
            codec.reconstruct(chunks, [g.k + j], out=[out])
        parity.append(buf)
    record = {"index": 0, "members": list(g.members), "nodes": list(g.nodes), "k": g.k, "m": m}
    return record, cs, codec.spec(), payloads, parity


@pytest.mark.parametrize("n,m,lost", [(4, 1, [1]), (4, 1, [3]), (5, 2, [0, 3]), (3, 1, [0])])
def test_the_lost_members_payloads_come_back_byte_for_byte(n, m, lost):
    sizes = [1000 + 37 * i for i in range(n)]
    record, cs, code, payloads, parity = _encoded(n, m, sizes)
    rec = MemberRecovery(group=record, chunk_size=cs, code=code, lost=lost)
    for r in lost:
        chunks = rec.chunks_of(r)
        # every data chunk of the lost member comes from one codeword, read from k fragments of members not lost
        assert sorted(chunks) == list(range(rec.k))
        assert all(len(src) == rec.k and all(f.rank not in lost for f in src) for _, _, src in chunks.values())
        got = torch.empty(rec.k * cs, dtype=torch.uint8)
        for slot, (_, _, sources) in chunks.items():
            received = {f.fragment: rec.fragment_range(f, parity[f.rank] if f.parity else payloads[f.rank], 0, cs)
                        .clone() for f in sources}
            rec.decode_range(r, slot, received, got[slot * cs:(slot + 1) * cs])
        assert bytes(got[:sizes[r]].numpy()) == bytes(payloads[r]) and not got[sizes[r]:].any(), r


def test_another_code_or_a_member_not_lost_is_refused():
    record, cs, code, _, _ = _encoded(4, 1, [100] * 4)
    with pytest.raises(ParityError, match="rebuild with the shardsafe version that took the snapshot"):
        MemberRecovery(group=record, chunk_size=cs, code={**code, "code": "another"}, lost=[1])
    rec = MemberRecovery(group=record, chunk_size=cs, code=code, lost=[1])
    with pytest.raises(ParityError, match="not among the lost members"):
        rec.chunks_of(2)


@pytest.mark.parametrize("n,m,lost", [(4, 1, [1]), (5, 2, [0, 3])])
def test_any_byte_range_is_decoded_from_the_same_range_of_the_fragments(n, m, lost):
    """The split rebuild of a re-partition (each target decodes the part it reads): a range of a lost chunk comes back
    from that range of its codeword's k fragments alone, equal to the whole payload's bytes there, also across the
    end of a smaller member's slot (its padding's zeros)."""
    sizes = [1000 + 37 * i for i in range(n)]
    record, cs, code, payloads, parity = _encoded(n, m, sizes, seed=3)
    rec = MemberRecovery(group=record, chunk_size=cs, code=code, lost=lost)
    for r in lost:
        chunks = rec.chunks_of(r)
        assert sorted(chunks) == list(range(rec.k))
        for slot, (lo, hi) in [(0, (0, 1)), (0, (5, 77)), (rec.k - 1, (3, cs)), (1, (0, cs))]:
            _, _, sources = chunks[slot]
            got = {f.fragment: rec.fragment_range(f, parity[f.rank] if f.parity else payloads[f.rank], lo, hi).clone()
                   for f in sources}
            out = torch.full((hi - lo,), 7, dtype=torch.uint8)
            rec.decode_range(r, slot, got, out)
            want = (bytes(payloads[r]) + bytes(rec.k * cs - sizes[r]))[slot * cs + lo: slot * cs + hi]
            assert bytes(out.numpy()) == want, (r, slot, lo, hi)
