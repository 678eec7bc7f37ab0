"""Holder wire protocol: length-prefixed JSON messages over a Unix stream socket, fds via SCM_RIGHTS.

Frame: an 8-byte header (body length, number of fds; little-endian uint32 each) sent with
``sendmsg`` carrying the file descriptors as ancillary data, then the JSON body. JSON only:
nothing a peer sends is ever unpickled or executed.
"""
from __future__ import annotations

import array
import json
import socket
import struct
from typing import Any

# How long a holder may take, after a shutdown request, to write the flushes still queued (it bounds
# that itself with the same number). The newest committed version is usually among them: killing the
# holder earlier loses exactly the version a user would export or restart from.
FLUSH_DRAIN_S = 120.0

_HDR = struct.Struct("<II")
MAX_BODY = 64 << 20   # manifests of huge models stay far below this
MAX_FDS = 16


class ProtocolError(RuntimeError):
    """The peer closed the connection or sent something that is not a shardsafe frame."""


class HolderError(RuntimeError):
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


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ProtocolError("connection closed by peer")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    fds: list[int] = []
    data, anc, _flags, _addr = sock.recvmsg(_HDR.size, socket.CMSG_SPACE(MAX_FDS * 4))
    for level, typ, payload in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
            fds.extend(a)
    if not data:
        raise ProtocolError("connection closed by peer")
    if len(data) < _HDR.size:
        data += _recv_exact(sock, _HDR.size - len(data))
    n, nfds = _HDR.unpack(data)
    if n > MAX_BODY or nfds != len(fds):
        for fd in fds:
            _close(fd)
        raise ProtocolError(f"bad frame header: body {n} bytes, {nfds} fds announced, {len(fds)} received")
    try:
        obj = json.loads(_recv_exact(sock, n))
    except (ValueError, ProtocolError):
        for fd in fds:
            _close(fd)
        raise
    if not isinstance(obj, dict):
        raise ProtocolError(f"expected a JSON object, got {type(obj).__name__}")
    return obj, fds


def _close(fd: int) -> None:
    import os
    try:
        os.close(fd)
    except OSError:
        pass
