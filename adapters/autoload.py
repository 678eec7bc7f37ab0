"""Automatic activation: unchanged programs are protected by their configuration alone.

Installed as ``shardsafe-autoload.pth`` in site-packages (setup.py puts it there, for wheels and editable
installs alike), so every interpreter start imports this module. It imports nothing but ``sys``, ``os`` and
:mod:`shardsafe.env` (standard library only: where the environment is read) and puts one finder on
``sys.meta_path``; the rest of shardsafe is imported only when the program itself
imports a framework the finder knows and then asks for protection:

- ``megatron.training`` (Megatron-LM's loop): with ``--shardsafe`` on the command line, ``pretrain`` and, from
  megatron-core 0.18 on, ``parse_and_validate_args`` are wrapped so that the shardsafe flags parse and the hooks
  are installed: an unmodified ``pretrain_gpt.py`` is protected by its flags alone.
- ``deepspeed``: once DeepSpeed's package has loaded, ``deepspeed.initialize`` is wrapped. A call whose config
  (a dict, a JSON/HJSON path, ``config_params``, or ``args.deepspeed_config``, as DeepSpeed itself accepts it)
  has a ``"shardsafe"`` block that is not ``{"enabled": false}`` goes to
  :func:`shardsafe.adapters.deepspeed.protect` with DeepSpeed's own initialize; any other call goes straight to
  DeepSpeed's initialize, and nothing more of shardsafe is imported. Programs that call it through a wrapper
  (HF Accelerate / ``Trainer``, Lightning) reach the same wrapper: they look ``deepspeed.initialize`` up at
  call time.
- Lightning (``lightning.pytorch`` or ``pytorch_lightning``): its checkpoint connector's
  ``restore_training_state`` and the training epoch loop's ``on_run_start`` are wrapped on their classes; they
  are Lightning's own unless the strategy's DeepSpeed engine is protected, and then
  :mod:`shardsafe.adapters.lightning` resumes ``Trainer.fit`` at the restored step.
- ``transformers.trainer``: once HF's Trainer module has loaded, the ``Trainer`` methods named in
  :data:`HF_TRAINER_HOOKS` are wrapped on the class. Each looks at ``trainer.model_wrapped.shardsafe`` (set by
  the ``deepspeed`` branch above when HF's DeepSpeed config has the block) and, when the engine is not protected,
  is HF's own method and nothing more; otherwise :mod:`shardsafe.adapters.hf` makes a restored snapshot resume the
  Trainer as ``resume_from_checkpoint`` would (global step, data position, LR schedule, RNG).

``SHARDSAFE_AUTO=0`` in the environment turns all of this off (the finder is not installed); the explicit
``shardsafe.adapters.deepspeed.initialize`` keeps working either way.

Why a meta-path finder and not a patch at startup: importing DeepSpeed costs seconds and programs that never
use it must not pay that, nor see a different ``deepspeed`` module; the finder only wraps the loader of the one
module it names and hands every other import back untouched.
"""
from __future__ import annotations

import os
import sys

from shardsafe import env

ENV_AUTO = env.AUTO
"""``0`` (or ``false``/``off``/``no``) turns the automatic activation off."""

_BUSY: set[str] = set()
FAILED: dict[str, str] = {}
"""Module -> why its activation failed. A protected engine built for a program whose resume hooks are missing
would restore a snapshot its training loop then ignores: the deepspeed branch refuses that case."""


def disabled() -> bool:
    return not env.auto_enabled()


class _Loader:
    """The framework's own loader, plus a patch once the module has executed."""

    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        try:
            self._patch(module)
        except Exception as e:  # noqa: BLE001 - activation must never break the user's import
            FAILED[module.__name__] = f"{type(e).__name__}: {e}"
            sys.stderr.write(f"shardsafe: automatic activation for {module.__name__} failed ({type(e).__name__}: "
                             f"{e}); the program runs unprotected. Set {ENV_AUTO}=0 to silence this.\n")

    def __getattr__(self, name):   # is_package, get_resource_reader, get_code, ... of the real loader
        return getattr(self._loader, name)


class Finder:
    """A ``sys.meta_path`` finder for the modules in :data:`PATCHES` only (importlib's MetaPathFinder
    protocol: ``find_spec`` returns None for every other name)."""

    def find_spec(self, name, path=None, target=None):
        patch = PATCHES.get(name)
        if patch is None or name in _BUSY:
            return None
        import importlib.util
        _BUSY.add(name)
        try:   # the spec the other finders give (this one declines while asked again inside)
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
        finally:
            _BUSY.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader, patch)
        return spec


def holder_socket(environ=os.environ) -> str:
    """Where this node's holder of the job named by ``SHARDSAFE_JOB_ID`` listens ("" without a job id): computed
    by shardsafe.env (standard library only), so that a program whose job has no holder on this node imports
    nothing more of shardsafe. Only whether the path exists is asked here: the early open verifies the directory
    (owner, mode) and the holder's uid before it uses anything."""
    return env.holder_socket(environ)


def _early_open() -> None:
    """A trainer (``RANK`` set) of a job whose holder runs on this node maps and verifies its newest held snapshot
    while it sets up (shardsafe.holder.early_open), from the moment its framework loads: the earliest point a
    trainer that torchrun started itself reaches (the fork server's children start it before the script runs). The
    early open decides whether this process is the trainer (not a DataLoader worker or another process the trainer
    started: ``early_open.trainer_process``)."""
    sock = holder_socket()
    if os.environ.get("RANK") and sock and os.path.exists(sock):
        try:
            from shardsafe.holder import early_open
            early_open.start()
        except Exception:  # noqa: BLE001 - an optimisation only: the restore opens the slot itself
            pass


def _patch_deepspeed(module) -> None:
    import functools
    _early_open()
    original = module.initialize
    if getattr(original, "__shardsafe_auto__", False):
        return

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        from .ds_config import keep_global_batch, reformed, wants_protection   # stdlib only; at the first call
        # A job the launcher re-formed at another size keeps its global batch, protected or not (the ConfigError
        # when it cannot ends the run with a record: the launcher must not restart it the same way). HF's Trainer
        # and Lightning count the accumulation in their own loops, from their own settings: DeepSpeed's must stay
        # theirs (a batch they do not keep is refused at restore, naming it).
        if reformed() and not _called_from(("transformers.", "accelerate.", "lightning.",
                                                               "pytorch_lightning.")):
            from shardsafe.fatal import install_excepthook
            install_excepthook()
            args, kwargs = keep_global_batch(args, kwargs)
        if not wants_protection(args, kwargs):
            return original(*args, **kwargs)
        from shardsafe.fatal import install_excepthook
        install_excepthook()   # the errors below end a protected run: the launcher must not restart it
        from shardsafe.holder.early_open import ENV_TRAINER, trainer_process
        if not trainer_process():
            sys.stderr.write(f"shardsafe: deepspeed.initialize in a process the trainer (pid "
                             f"{env.get(ENV_TRAINER).split(':')[0]}) started, with its rank's environment: not "
                             "protected here (its snapshots would overwrite the trainer's); only the trainer is.\n")
            return original(*args, **kwargs)
        why = FAILED.get("transformers.trainer")
        if why and _called_from(("transformers.", "accelerate.")):
            from shardsafe.config import ConfigError
            raise ConfigError(f"shardsafe cannot resume this Hugging Face Trainer ({why}): its engine would restore "
                              "a snapshot the Trainer's loop then ignores. Set \"enabled\": false in the "
                              "\"shardsafe\" block, or use the transformers version shardsafe is tested with (5.24).")
        why = next((w for m, w in FAILED.items() if m.startswith(("lightning.pytorch.", "pytorch_lightning."))), None)
        if why and _called_from(("lightning.", "pytorch_lightning.")):
            from shardsafe.config import ConfigError
            raise ConfigError(f"shardsafe cannot resume this Lightning fit ({why}): its engine would restore a "
                              "snapshot Lightning's loop then ignores. Set \"enabled\": false in the \"shardsafe\" "
                              "block, or use the Lightning version shardsafe is tested with (2.6.6).")
        from shardsafe.adapters.deepspeed import protect
        return protect(original, args, kwargs, auto=f"{ENV_AUTO}=0")

    initialize.__shardsafe_auto__ = True   # functools.wraps also sets __wrapped__ = DeepSpeed's own
    module.initialize = initialize


def _called_from(prefixes: tuple[str, ...]) -> bool:
    """Whether a caller up the stack is a module of one of these packages (HF's Trainer reaches
    deepspeed.initialize through accelerate)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if name.startswith(prefixes):
            return True
        f = f.f_back
    return False


def megatron_wanted(argv: list[str] | None = None) -> bool:
    """Megatron-LM programs ask for shardsafe on their command line: ``--shardsafe`` (protection on) or any
    ``--shardsafe-*`` flag (the flags must parse either way; without ``--shardsafe`` the hooks pass through)."""
    return any(a == "--shardsafe" or a.startswith("--shardsafe-") for a in (sys.argv if argv is None else argv))


def _patch_megatron_training(module) -> None:
    """``megatron.training`` has loaded (its ``training`` and ``arguments`` modules with it): ``pretrain`` (both
    names an entry script imports it by) and, from megatron-core 0.18 on, where the script parses arguments
    itself first, ``parse_and_validate_args`` are wrapped. A call whose command line has ``--shardsafe`` gets
    shardsafe's flags added to Megatron's parser and the hooks installed; any other call goes straight to
    Megatron's own, and nothing of shardsafe is imported. (Decided at call time, not at import: a fork server
    imports Megatron once, before the command line of the trainer it forks exists.)"""
    import functools
    if megatron_wanted():
        _early_open()
    training = sys.modules.get(module.__name__ + ".training")
    arguments = sys.modules.get(module.__name__ + ".arguments")
    original = getattr(training, "pretrain", None) or getattr(module, "pretrain", None)
    if original is not None and not getattr(original, "__shardsafe_auto__", False):
        @functools.wraps(original)
        def pretrain(*args, **kwargs):
            if not megatron_wanted():
                return original(*args, **kwargs)
            if _rank0() and "--shardsafe" in sys.argv:
                sys.stderr.write("shardsafe: --shardsafe on the command line: Megatron-LM's pretrain is protected "
                                 f"(automatic activation; {ENV_AUTO}=0 turns it off)\n")
            from shardsafe.adapters.megatron import protected_pretrain
            return protected_pretrain(original, args, kwargs)

        pretrain.__shardsafe_auto__ = True
        for owner in (module, training):
            if owner is not None and getattr(owner, "pretrain", None) is original:
                owner.pretrain = pretrain
    parse = getattr(arguments, "parse_and_validate_args", None) if arguments is not None else None
    if parse is not None and not getattr(parse, "__shardsafe_auto__", False):
        @functools.wraps(parse)
        def parse_and_validate_args(*args, extra_args_provider=None, **kwargs):
            if megatron_wanted():
                from shardsafe.adapters.megatron.args import compose_extra_args_provider
                extra_args_provider = compose_extra_args_provider(extra_args_provider)
            return parse(*args, extra_args_provider=extra_args_provider, **kwargs)

        parse_and_validate_args.__shardsafe_auto__ = True
        arguments.parse_and_validate_args = parse_and_validate_args
        if getattr(module, "parse_and_validate_args", None) is parse:
            module.parse_and_validate_args = parse_and_validate_args


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


HF_TRAINER_HOOKS = ("_prepare_for_training", "_run_epoch", "_load_optimizer_and_scheduler", "_load_scaler")
"""The ``transformers.Trainer`` methods wrapped (the same as ``shardsafe.adapters.hf.HOOKS``)."""


def _protected_engine(trainer) -> bool:
    return getattr(getattr(trainer, "model_wrapped", None), "shardsafe", None) is not None


def _patch_transformers_trainer(module) -> None:
    """``transformers.trainer`` has loaded: the :data:`HF_TRAINER_HOOKS` methods of ``Trainer`` are wrapped on
    the class. Each is HF's own method, and nothing of shardsafe is imported, unless the trainer's DeepSpeed
    engine is protected (``engine.shardsafe``, set by the ``deepspeed`` branch from HF's config dict)."""
    import functools
    cls = getattr(module, "Trainer", None)
    if cls is None or getattr(cls, "__shardsafe_auto__", False):
        return
    missing = [n for n in HF_TRAINER_HOOKS if not callable(getattr(cls, n, None))]
    if missing:   # another transformers: say so instead of a restore that HF's loop would then ignore
        raise AttributeError(f"transformers.Trainer has no {', '.join(missing)} (shardsafe resumes the Trainer "
                             "through them; transformers 5.24 is tested)")

    def wrap(name, original):
        if name == "_prepare_for_training":   # the engine (and its restore) exists only after HF's method
            @functools.wraps(original)
            def method(self, *args, **kwargs):
                out = original(self, *args, **kwargs)
                if _protected_engine(self):
                    from shardsafe.adapters.hf import after_prepare_call
                    after_prepare_call(original, self, args, kwargs)
                return out
        else:
            @functools.wraps(original)
            def method(self, *args, **kwargs):
                if not _protected_engine(self):
                    return original(self, *args, **kwargs)
                from shardsafe.adapters.hf import call
                return call(name, original, self, args, kwargs)
        method.__shardsafe_auto__ = True
        return method

    for name in HF_TRAINER_HOOKS:
        setattr(cls, name, wrap(name, getattr(cls, name)))
    cls.__shardsafe_auto__ = True


def _lightning_protected(trainer) -> bool:
    engine = getattr(getattr(trainer, "strategy", None), "model", None)
    return getattr(engine, "shardsafe", None) is not None


def _wrap_after(module, cls_name: str, name: str, after) -> None:
    """``cls_name.name`` of ``module`` (a Lightning loop class) runs Lightning's own method, then
    ``after(self, *args)``, which decides for itself whether anything of shardsafe is needed."""
    import functools
    cls = getattr(module, cls_name, None)
    original = getattr(cls, name, None)
    if original is None:
        raise AttributeError(f"{module.__name__} has no {cls_name}.{name} (shardsafe resumes Lightning through it; "
                             "Lightning 2.6.6 is tested)")
    if getattr(original, "__shardsafe_auto__", False):
        return

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        after(self, *args)
        return out

    method.__shardsafe_auto__ = True
    setattr(cls, name, method)


def _after_restore_training_state(connector) -> None:
    if _lightning_protected(connector.trainer):
        from shardsafe.adapters.lightning import after_restore_training_state
        after_restore_training_state(connector)


def _after_epoch_run_start(epoch_loop, data_fetcher) -> None:
    if "_shardsafe_resume" in epoch_loop.trainer.__dict__:
        from shardsafe.adapters.lightning import after_epoch_run_start
        after_epoch_run_start(epoch_loop, data_fetcher)


def _patch_lightning_connector(module) -> None:
    """Lightning's checkpoint connector has loaded: ``_CheckpointConnector.restore_training_state`` (once per
    ``fit``, after the strategy built the engine) is wrapped; past Lightning's own method it does nothing unless
    the strategy's DeepSpeed engine is protected, and then :mod:`shardsafe.adapters.lightning` records the fit
    loop at every snapshot and places it at the restored step."""
    _wrap_after(module, "_CheckpointConnector", "restore_training_state", _after_restore_training_state)


def _patch_lightning_epoch_loop(module) -> None:
    """Lightning's training epoch loop has loaded: ``_TrainingEpochLoop.on_run_start`` is wrapped (the epoch of
    a restored step skips the batches already trained and puts the snapshot's RNG back)."""
    _wrap_after(module, "_TrainingEpochLoop", "on_run_start", _after_epoch_run_start)


PATCHES = {"deepspeed": _patch_deepspeed, "megatron.training": _patch_megatron_training,
           "transformers.trainer": _patch_transformers_trainer}
# Lightning ships the same code under two package names (``lightning`` and the standalone ``pytorch_lightning``).
for _pkg in ("lightning.pytorch", "pytorch_lightning"):
    PATCHES[f"{_pkg}.trainer.connectors.checkpoint_connector"] = _patch_lightning_connector
    PATCHES[f"{_pkg}.loops.training_epoch_loop"] = _patch_lightning_epoch_loop
del _pkg


def install() -> None:
    """Called by shardsafe-autoload.pth at every interpreter start."""
    if disabled() or any(isinstance(f, Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, Finder())
    for name, patch in PATCHES.items():   # imported before this ran (an interactive session, a test)
        mod = sys.modules.get(name)
        if mod is not None:
            patch(mod)
