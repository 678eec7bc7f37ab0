"""The DeepSpeed config as DeepSpeed itself takes it, for the automatic activation and the adapter.

``deepspeed.initialize`` accepts its config as ``config=`` (a dict or a JSON/HJSON path), ``config_params=``, or
``args.deepspeed_config``; :func:`config_source` finds it the same way, :func:`read_config` parses it as DeepSpeed
does, and :func:`wants_protection` is the activation's test for a ``"shardsafe"`` block. Standard library only:
the automatic activation imports it inside a wrapped ``deepspeed.initialize``, before deciding anything else.
"""
from __future__ import annotations

import os

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
    """The config as a mapping (a dict as is; a path parsed as JSON, else HJSON as DeepSpeed does), or None."""
    if isinstance(src, dict):
        return src
    if isinstance(src, (str, os.PathLike)):
        import json
        with open(src) as f:
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
