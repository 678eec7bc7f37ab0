"""Rebuilding a lost member of a parity group whose ranks no longer run (shardsafe/parity/recovery.py): the
exchange's code and chunk layout read back from a parity manifest, fragments from wherever they are read, decoded
on one rank, byte for byte the lost payload."""
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
    frags = rec.fragments()
    assert all(f.rank not in lost for f in frags) and {t for f in frags for t in f.takers} == set(lost)
    received = {(f.codeword, f.fragment): rec.fragment_of(f, parity[f.rank] if f.parity else payloads[f.rank]).clone()
                for f in frags}
    for r in lost:
        got = rec.decode(r, received)
        assert got.numel() == rec.k * cs and bytes(got[:sizes[r]].numpy()) == bytes(payloads[r]), r
    # only the codewords with a lost data chunk are read: k of them per lost member, k fragments each
    assert len({f.codeword for f in frags}) <= rec.k * len(lost) and len(frags) == rec.k * len({f.codeword
                                                                                             for f in frags})


def test_another_code_or_a_member_not_lost_is_refused():
    record, cs, code, _, _ = _encoded(4, 1, [100] * 4)
    with pytest.raises(ParityError, match="rebuild with the shardsafe version that took the snapshot"):
        MemberRecovery(group=record, chunk_size=cs, code={**code, "code": "another"}, lost=[1])
    rec = MemberRecovery(group=record, chunk_size=cs, code=code, lost=[1])
    with pytest.raises(ParityError, match="not among the lost members"):
        rec.decode(2, {})
