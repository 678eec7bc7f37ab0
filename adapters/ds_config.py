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


# ---- the global batch of a job re-formed at another size ----------------------------------------------------------

_SAID_BATCH: set[tuple[int, int, int]] = set()


class _Rescaled(dict):
    """A config whose gradient accumulation :func:`keep_global_batch` already scaled (never twice)."""


def reformed(environ=None) -> bool:
    """Whether the launcher runs this job at another world size than its full one (``SHARDSAFE_FULL_WORLD_SIZE``
    set and not ``WORLD_SIZE``): the launchers export the full size to every job, re-formed or not."""
    from shardsafe import env
    full, world = env.get(env.FULL_WORLD_SIZE, environ), _world_size(environ)
    return bool(full) and bool(world) and int(full) != world


def keep_global_batch(args: tuple, kwargs: dict, environ=None) -> tuple[tuple, dict]:
    """``deepspeed.initialize``'s arguments, with the config's ``gradient_accumulation_steps`` scaled so that a job
    the launcher re-formed at another world size (``WORLD_SIZE`` ranks of ``SHARDSAFE_FULL_WORLD_SIZE``; the
    model-parallel size unchanged) trains with the global batch of the full-size job: G becomes
    G x full / world, in a copy of the config handed to DeepSpeed in place of the program's. Unchanged when the
    variable is unset or equal to the world size, when the config is unreadable here (DeepSpeed reports it), or
    when DeepSpeed derives G from ``train_batch_size`` and ``train_micro_batch_size_per_gpu`` itself (then the
    batch stays by DeepSpeed's own rule). Rank 0 says it once.

    Raises:
        ConfigError: G x full / world is no integer: the message names the world sizes that keep the batch.
    """
    from shardsafe import env
    full = env.get(env.FULL_WORLD_SIZE, environ)
    world = _world_size(environ)
    if not full or not world or int(full) == world:
        return args, kwargs
    full = int(full)
    try:
        cfg = read_config(config_source(args, kwargs))
    except (OSError, ValueError):
        return args, kwargs
    if not isinstance(cfg, dict) or isinstance(cfg, _Rescaled):
        return args, kwargs
    g = cfg.get("gradient_accumulation_steps")
    if g is None and cfg.get("train_batch_size") is not None and cfg.get("train_micro_batch_size_per_gpu") is not None:
        return args, kwargs   # DeepSpeed computes G = global batch / (micro-batch x data-parallel size) itself
    g = 1 if g is None else g   # DeepSpeed's default
    if isinstance(g, bool) or not isinstance(g, int):
        return args, kwargs   # "auto" and the like: whoever fills it in (HF) answers for the batch
    if (g * full) % world:
        from shardsafe.errors import ConfigError
        fits = [w for w in range(1, full + 1) if (g * full) % w == 0]
        raise ConfigError(f"this job runs {world} of its {full} ranks (SHARDSAFE_FULL_WORLD_SIZE): keeping its global "
                          f"batch needs gradient_accumulation_steps = {g} x {full} / {world}, which is no integer. "
                          f"World sizes that keep it: {fits}. Continue at one of those (the launcher's shrink rule "
                          "picks one when the global batch allows), or wait for a node to come back")
    new = _Rescaled(cfg)
    new["gradient_accumulation_steps"] = g * full // world
    if _rank(environ) == 0 and (world, full, g) not in _SAID_BATCH:
        _SAID_BATCH.add((world, full, g))
        log.warning("shardsafe: this job runs %d of its %d ranks (SHARDSAFE_FULL_WORLD_SIZE): gradient_accumulation_"
                    "steps %d -> %d keeps the global batch", world, full, g, new["gradient_accumulation_steps"])
    return _with_config(args, kwargs, new)


def _world_size(environ) -> int:
    import sys
    dist = sys.modules.get("torch.distributed")   # the program imported torch before calling DeepSpeed
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return int((os.environ if environ is None else environ).get("WORLD_SIZE") or 0)


def _rank(environ) -> int:
    import sys
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int((os.environ if environ is None else environ).get("RANK") or 0)


def _with_config(args: tuple, kwargs: dict, cfg: dict) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with ``cfg`` where DeepSpeed takes the config from (the program's namespace is copied,
    never changed)."""
    import copy
    for key in ("config", "config_params"):
        if kwargs.get(key) is not None:
            return args, {**kwargs, key: cfg}
    in_kwargs = "args" in kwargs
    ns = copy.copy(kwargs["args"] if in_kwargs else args[0])
    if getattr(ns, "deepspeed_config", None) is None and getattr(ns, "deepscale_config", None) is not None:
        ns.deepscale_config = None
    ns.deepspeed_config = cfg   # DeepSpeed takes a dict there as well as a path
    if in_kwargs:
        return args, {**kwargs, "args": ns}
    return (ns, *args[1:]), kwargs
