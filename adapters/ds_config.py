"""The DeepSpeed config as DeepSpeed itself takes it, for the automatic activation and the adapter.

``deepspeed.initialize`` accepts its config as ``config=`` (a dict or a JSON/HJSON path), ``config_params=``, or
``args.deepspeed_config``; :func:`config_source` finds it the same way, :func:`read_config` parses it as DeepSpeed
does, and :func:`wants_protection` is the activation's test for a ``"shardsafe"`` block. Standard library only:
the automatic activation imports it inside a wrapped ``deepspeed.initialize``, before deciding anything else.
"""
from __future__ import annotations

import logging
import os
import stat

log = logging.getLogger(__name__)


def config_source(args: tuple, kwargs: dict):
    """Where ``deepspeed.initialize(*args, **kwargs)`` takes its config from, as DeepSpeed reads it."""
    src = kwargs.get("config")
    if src is None:
        src = kwargs.get("config_params")
    if src is None:
        ns = kwargs.get("args", args[0] if args else None)
        if ns is not None:
            src = getattr(ns, "deepspeed_config", None) or getattr(ns, "deepscale_config", None)
    return src


def read_config(src):
    """The config as a mapping, read as DeepSpeed reads it: a dict as is; a path parsed as JSON, else HJSON; a string
    that is no path as base64 of the JSON (DeepSpeed's ``urlsafe_b64decode``). None for anything else, and for a path
    that is not a regular file (a pipe, ``<(...)`` process substitution, a device): it can be read only once, and
    DeepSpeed must get its content, so shardsafe leaves it alone and says so once."""
    if isinstance(src, dict):
        return src
    if isinstance(src, (str, os.PathLike)):
        import json
        path = os.fspath(src)
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = None
        if mode is None and isinstance(src, str):
            return _from_base64(src)
        if mode is not None and not stat.S_ISREG(mode):
            _say_once(path)
            return None
        with open(path) as f:
            text = f.read()
        try:
            return json.loads(text)
        except ValueError:
            try:
                import hjson   # DeepSpeed's own parser (comments allowed)
            except ImportError:
                raise
            return hjson.loads(text)
    try:   # a Mapping that is not a dict (DeepSpeed accepts any)
        from collections.abc import Mapping
        return src if isinstance(src, Mapping) else None
    except ImportError:
        return None


def _from_base64(text: str):
    import base64
    import binascii
    import json
    try:
        decoded = base64.urlsafe_b64decode(text).decode("utf-8")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None   # neither a path nor base64: DeepSpeed's own error names it
    try:
        return json.loads(decoded)
    except ValueError:
        try:
            import hjson
            return hjson.loads(decoded)
        except Exception:  # noqa: BLE001 - DeepSpeed reports an unreadable config itself
            return None


_SAID: set[str] = set()


def _say_once(path: str) -> None:
    if path not in _SAID:
        _SAID.add(path)
        log.warning("shardsafe: the DeepSpeed config %s is not a regular file (a pipe or a process substitution can be "
                    "read only once, and DeepSpeed must read it): shardsafe leaves it to DeepSpeed, so a \"shardsafe\" "
                    "block in it is NOT applied and this engine is NOT protected. Pass the config as a file or a "
                    "dict to protect it.", path)


def wants_protection(args: tuple, kwargs: dict) -> bool:
    """True when the config has a ``"shardsafe"`` block other than ``{"enabled": false}``. A block that is
    malformed is routed to shardsafe too, whose config check names what is wrong."""
    try:
        cfg = read_config(config_source(args, kwargs))
    except (OSError, ValueError):
        return False   # DeepSpeed reports an unreadable config itself
    if not cfg or "shardsafe" not in cfg:
        return False
    block = cfg["shardsafe"]
    return not (isinstance(block, dict) and block.get("enabled", True) is False)
