"""The holder's connections: one thread per client, the hello with the job id first, every frame answered (an
error with a code for anything that is not a shardsafe request), slow or surplus clients turned away, and the stop
that wakes the accept loop. A mixin of :class:`shardsafe.holder.server.Holder`, whose state (``lock``,
``refused``, ``_clients``, ``read_timeout_s``, ``max_clients``, ``paths``, the stop event and wake pipe) and
``handle`` it uses; ``Holder.serve`` runs the accept loop.
"""
from __future__ import annotations

import logging
import os
import socket
import time

from .paths import peer_credentials
from .protocol import BadFrame, HolderError, ProtocolError, close_fds, recv_msg, send_msg

log = logging.getLogger(__name__)


class Serving:
    def _reply(self, conn: socket.socket, resp: dict, fds: list[int] | tuple[int, ...] = ()) -> bool:
        """Send ``resp``; a client that does not take it within the read timeout is dropped. False if gone."""
        conn.settimeout(self.read_timeout_s)
        try:
            send_msg(conn, resp, fds)
            return True
        except (OSError, ProtocolError):
            return False

    def _refuse(self, conn: socket.socket, reason: str, code: str, msg: str) -> None:
        """Answer a request that ends the connection (the caller closes it) and count why."""
        with self.lock:
            self.refused[reason] += 1
        self._reply(conn, {"ok": False, "code": code, "error": msg})

    def _serve_conn(self, conn: socket.socket) -> None:
        """One client. The first request must be ``hello`` with this holder's job id; anything a client
        sends that is not a shardsafe request is answered with an error (or the connection closed), never
        an exception out of this thread."""
        said_hello = False
        try:
            pid, uid, _ = peer_credentials(conn)
            if uid != os.getuid():  # the 0600 socket in a 0700 directory already stops this; belt and braces
                with self.lock:
                    self.refused["uid"] += 1
                log.error("refused a connection from pid %d of uid %d: this holder serves uid %d only (nothing read "
                          "from it, nothing sent)", pid, uid, os.getuid())
                return
            while not self._stop.is_set():
                # Before its hello a client gets the read timeout to send one; after it, idle between requests
                # is normal (a trainer stays connected for the whole run) and only a started frame is timed.
                conn.settimeout(None if said_hello else self.read_timeout_s)
                try:
                    req, fds = recv_msg(conn, frame_timeout_s=self.read_timeout_s)
                except BadFrame as e:
                    log.warning("closed a connection that sent a malformed frame: %s", e)
                    self._refuse(conn, "protocol", "protocol", f"malformed frame: {e}; the holder speaks "
                                 "length-prefixed JSON objects (shardsafe.holder.protocol): use HolderClient")
                    return
                except socket.timeout:
                    with self.lock:
                        self.refused["timeout"] += 1
                    log.warning("closed a connection that sent %s within %.1f s", "a partial frame and nothing more"
                                if said_hello else "no hello", self.read_timeout_s)
                    return
                except (ProtocolError, OSError):
                    return    # closed by the client (a trainer that exits or is killed): nothing to say
                close_fds(fds)   # clients never send fds: never keep one
                self._last_activity = time.monotonic()
                op = req.get("op")
                if not said_hello and op != "hello":
                    self._refuse(conn, "hello", "hello_required",
                                 f"the first request on a connection must be {{'op': 'hello', 'job_id': JOB_ID}} "
                                 f"naming this holder's job; got {str(op)[:60]!r} first. Connect with "
                                 "shardsafe.holder.client.HolderClient(paths).connect(), which says hello")
                    return
                resp, out_fds = self._answer(req)
                sent = self._reply(conn, resp, out_fds)
                if op == "open":
                    close_fds(out_fds)   # a new read-only fd per open; acquire hands out the holder's own
                if op == "shutdown" and resp.get("ok"):
                    self.request_stop()
                if not sent:
                    return
                if op == "hello":
                    if not resp.get("ok"):   # another job's client: nothing more for it here
                        with self.lock:
                            self.refused["hello"] += 1
                        return
                    said_hello = True
        except Exception:   # a bug must cost this connection, never the holder
            log.exception("connection handler failed; connection closed")
        finally:
            with self.lock:
                self._clients -= 1
            self._last_activity = time.monotonic()   # the idle exit counts from the last client's departure
            conn.close()

    def _answer(self, req: dict) -> tuple[dict, list[int]]:
        """The reply to one well-formed frame: ``ok`` with the result, or an error with a ``code``."""
        try:
            resp, out_fds = self.handle(req)
            return {"ok": True, **resp}, out_fds
        except HolderError as e:
            return {"ok": False, "code": e.code, "error": str(e)}, []
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            return {"ok": False, "code": "bad_request", "error": f"malformed request {str(req.get('op'))[:60]!r}: {e!r}"}, []
        except OSError as e:  # fallocate ENOSPC/ENOMEM: the node is out of memory
            return {"ok": False, "code": "budget", "error": f"holder on node {self.paths.node} could not allocate: {e}"}, []
        except Exception as e:   # a bug costs this request, never the holder and the snapshots it keeps
            log.exception("request %r failed", str(req.get("op"))[:60])
            return {"ok": False, "code": "internal", "error": f"holder bug on {str(req.get('op'))[:60]!r}: "
                                                             f"{type(e).__name__}: {e} (see the holder log)"}, []

    def _idle_expired(self) -> bool:
        with self.lock:
            return (self.idle_exit_s > 0 and self._clients == 0 and self._flush_pending == 0
                    and time.monotonic() - self._last_activity > self.idle_exit_s)

    def _turn_away(self, conn: socket.socket) -> None:
        """Over the connection cap: say why without blocking the accept loop (a fresh socket's buffer takes
        the short reply at once) and close. The client reads it as the answer to its hello."""
        with self.lock:
            self.refused["busy"] += 1
        log.warning("connection refused: %d clients already connected (max_clients)", self.max_clients)
        try:
            conn.setblocking(False)
            send_msg(conn, {"ok": False, "code": "busy",
                            "error": f"holder on node {self.paths.node} (job {self.paths.job_id}) already serves "
                                     f"{self.max_clients} connections (its max_clients): close unused clients, or "
                                     "start the holder with a larger --max-clients"})
        except (OSError, ProtocolError):
            pass
        finally:
            conn.close()

    def request_stop(self) -> None:
        """Stop serving (thread- and signal-safe): the accept loop wakes at once, queued flushes drain."""
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass   # already woken

