"""Tier 2: Reed-Solomon parity across data-parallel ranks on different nodes.

Modules, from the bottom up:

* :mod:`~shardsafe.parity.codec`: the erasure codec contract (RS(k, m) over GF(2^8)) over the backends in
  ``shardsafe.kernels`` (reference spec, ISA-L, CUDA). Bytes in, bytes out; no torch.
* :mod:`~shardsafe.parity.topology`: parity groups from the node placement of the ranks (who protects whom,
  which stripe goes where); pure logic.
* :mod:`~shardsafe.parity.exchange`: the stripe exchange after a snapshot is sealed (encode into the
  holder's parity slots) and the rebuild of lost members at restore, over dedicated process groups.
* :mod:`~shardsafe.parity.placement`: a rank that restarted on another node finds its snapshot (moved from
  its old node's holder, or rebuilt from parity).

The codec's public names are re-exported here (``from shardsafe.parity import get_codec``); importing this
package imports numpy only, never torch.distributed (exchange and placement are imported by name).
"""
from .codec import (BACKENDS, CODE_ID, MAX_FRAGMENTS, BackendUnavailable, Codec, CudaCodec,  # noqa: F401
                    InsufficientFragments, InvalidFragment, InvalidParameter, IsalCodec, KernelError, ParityError,
                    ReferenceCodec, available_backends, get_codec, select_sources)

__all__ = ["BACKENDS", "CODE_ID", "MAX_FRAGMENTS", "BackendUnavailable", "Codec", "CudaCodec", "InsufficientFragments",
           "InvalidFragment", "InvalidParameter", "IsalCodec", "KernelError", "ParityError", "ReferenceCodec",
           "available_backends", "get_codec", "select_sources"]
