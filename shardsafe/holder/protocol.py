"""Holder wire protocol: length-prefixed JSON messages over a Unix stream socket, fds via SCM_RIGHTS.

Frame: an 8-byte header (body length, number of fds; little-endian uint32 each) sent with
``sendmsg`` carrying the file descriptors as ancillary data, then the JSON body. JSON only:
nothing a peer sends is ever unpickled or executed.

A peer that does not speak this protocol (bad header, body over the limit, invalid or too deeply
nested JSON, a body that is not an object) gets :class:`BadFrame`; every fd that came with such a
frame is closed before it is raised, so nothing a peer sends can leak into the receiver.
"""
from __future__ import annotations

import array
import json
import math
import os
import re
import socket
import struct
import time
from typing import Any

from ..errors import ShardsafeError

# How long a holder may take, after a shutdown request, to write the flushes still queued (it bounds
# that itself with the same number). The newest committed version is usually among them: killing the
# holder earlier loses exactly the version a user would export or restart from.
FLUSH_DRAIN_S = 120.0

# Holders started automatically (by the first rank of a node, or by a launcher) exit after this long with
# no client connected and no flush pending: nobody stops a detached holder whose job is gone, and it
# would keep its memory forever. 0 = never (a holder started by hand, which its operator stops).
DEFAULT_IDLE_EXIT_S = 600.0

_HDR = struct.Struct("<II")
MAX_BODY = 64 << 20   # manifests of huge models stay far below this
MAX_FDS = 16


class HolderFailure(RuntimeError, ShardsafeError):
    """Base of what the holder tier fails at: a refused request (:class:`HolderError`), no holder answering
    (``HolderUnavailable``), a broken connection (:class:`ProtocolError`). Snapshot and restore paths catch this
    one class: whichever it was, the holder cannot serve now."""


class ProtocolError(HolderFailure):
    """The peer closed the connection or sent something that is not a shardsafe frame."""


class BadFrame(ProtocolError):
    """The peer sent a frame that is not a shardsafe message (the connection cannot be trusted after it)."""


class HolderError(HolderFailure):
    """The holder refused a request; ``code`` says why (``budget``, ``state``, ``not_found``, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def send_msg(sock: socket.socket, obj: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_BODY:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_BODY}-byte limit")
    hdr = _HDR.pack(len(body), len(fds))
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sent = sock.sendmsg([hdr], anc)
    if sent != len(hdr):  # 8 bytes always go in one piece on a blocking Unix socket; be strict anyway
        sock.sendall(hdr[sent:])
    sock.sendall(body)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """``n`` bytes; with a ``deadline`` (time.monotonic()) the whole read must finish by then, however
    slowly the peer trickles bytes in (a per-recv timeout would let one byte a second hold it forever)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"frame incomplete: {len(buf)} of {n} bytes arrived in time")
            sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ProtocolError(f"connection closed by peer ({len(buf)} of {n} bytes of a frame arrived)")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket, *, frame_timeout_s: float | None = None) -> tuple[dict[str, Any], list[int]]:
    """One message and the fds that came with it (the caller owns and closes them).

    Waiting for a frame to *start* uses the socket's own timeout (idle clients between requests are
    normal); once its first byte is in, ``frame_timeout_s`` bounds the rest of it: a peer that sends part
    of a frame and goes silent raises ``socket.timeout`` instead of holding the reader forever. The
    socket's timeout is restored afterwards.

    Raises:
        ProtocolError: the peer closed the connection.
        BadFrame: the frame is not a shardsafe message (its fds are closed).
        socket.timeout: the rest of a started frame did not come within ``frame_timeout_s``.
    """
    fds: list[int] = []
    data, anc, flags, _addr = sock.recvmsg(_HDR.size, socket.CMSG_SPACE(MAX_FDS * 4))
    for level, typ, payload in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
            fds.extend(a)
    if not data:
        close_fds(fds)
        raise ProtocolError("connection closed by peer")
    saved = sock.gettimeout()
    deadline = None if frame_timeout_s is None else time.monotonic() + frame_timeout_s
    try:
        if flags & socket.MSG_CTRUNC:   # the kernel closed the fds beyond MAX_FDS; the frame is unusable
            raise BadFrame(f"more than {MAX_FDS} file descriptors sent with one frame")
        if len(data) < _HDR.size:
            data += _recv_exact(sock, _HDR.size - len(data), deadline)
        n, nfds = _HDR.unpack(data)
        if n > MAX_BODY or nfds != len(fds):
            raise BadFrame(f"bad frame header: body of {n} bytes (at most {MAX_BODY}), {nfds} fds announced, "
                           f"{len(fds)} received")
        body = _recv_exact(sock, n, deadline)
        try:
            obj = json.loads(body)
        # json.loads recurses once per nesting level: a 100 000-deep '[[[...' raises RecursionError (at the
        # interpreter's limit, long before the C stack is at risk). UnicodeDecodeError is a ValueError.
        except (ValueError, RecursionError) as e:
            raise BadFrame(f"body is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
        if not isinstance(obj, dict):
            raise BadFrame(f"expected a JSON object, got {type(obj).__name__}")
    except BaseException:
        close_fds(fds)
        raise
    finally:
        if frame_timeout_s is not None:
            try:
                sock.settimeout(saved)
            except OSError:
                pass
    return obj, fds


def close_fds(fds: list[int] | tuple[int, ...]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# ---- request fields (checked where a request is served) ----------------------------------------

def gib_up(nbytes: int) -> float:
    """``nbytes`` in GiB rounded *up* to the 3 decimals a message prints: a budget set to the printed
    number must hold what the message says (rounding to nearest could name a budget 1 MB short)."""
    return math.ceil(nbytes / (1 << 30) * 1000) / 1000


def req_int(req: dict, key: str, *, minimum: int | None = None) -> int:
    """``req[key]`` as an int, or a ``bad_request`` naming the field, what is expected and what came."""
    if key not in req:
        raise HolderError("bad_request", f"{req.get('op')!r} needs an integer {key!r}; the request has none")
    v = req[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise HolderError("bad_request", f"{req.get('op')!r}: {key!r} must be an integer, got "
                                         f"{type(v).__name__} {str(v)[:60]!r}")
    if minimum is not None and v < minimum:
        raise HolderError("bad_request", f"{req.get('op')!r}: {key!r} must be >= {minimum}, got {v}")
    return v


SCOPE_RE = re.compile(r"[A-Za-z0-9._-]{0,64}")


def req_scope(req: dict) -> str:
    """The request's ``scope``: the namespace of one engine's snapshots inside the job's holder ("" is the
    first engine of every trainer process; shardsafe.runtime names the others)."""
    v = req.get("scope", "")
    if not isinstance(v, str) or not SCOPE_RE.fullmatch(v):
        raise HolderError("bad_request", f"{req.get('op')!r}: 'scope' must be up to 64 characters of [A-Za-z0-9._-], "
                                         f"got {str(v)[:80]!r}")
    return v


def req_ranks(req: dict) -> list[int]:
    """The ``ranks`` list of a request (or its single ``rank``), each a non-negative int."""
    if "ranks" not in req:
        return [req_int(req, "rank", minimum=0)]
    v = req["ranks"]
    if not isinstance(v, list) or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in v):
        raise HolderError("bad_request", f"{req.get('op')!r}: 'ranks' must be a list of non-negative integers, got "
                                         f"{str(v)[:60]!r}")
    return v
