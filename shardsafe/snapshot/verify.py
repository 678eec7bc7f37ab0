"""Opening a snapshot's payload before a restore uses it, and the checks it must pass first: its layout against
the live tensors, the run fingerprint, every xxh3 segment, and the adapter's own checks (shardsafe/snapshot/
restore.py runs them on every rank and votes on the answers before any rank applies)."""
from __future__ import annotations

import logging
from typing import Any, Callable

from .. import fingerprint as fpr
from ..holder.protocol import HolderFailure
from ..payload import manifest as mf
from .pinning import PinnedMapping
from .state import StateAdapter

log = logging.getLogger(__name__)


def open_verified(opener: Callable[[], tuple], adapter: StateAdapter, live, *, populate: bool = False,
                   h2d: str = "pinned", st: Any = None) -> tuple:
    """Open a payload (holder slot or file) and check it: layout against the live tensors, every xxh3
    segment, then the adapter's own checks. ``opener`` returns (manifest, mapping, whether the mapping's page
    tables are filled already, whether its segments verified already: the early open's, same sealing, same
    manifest); ``populate``: fill them beside the hash otherwise. Returns (manifest, mapping,
    problems, corrupt): the mapping is a
    PinnedMapping (closed by the caller; its ``mm`` is None when nothing opened), being page-locked for the
    H2D copies while the segments verify when a live tensor is on a GPU; corrupt says the problems are bytes
    that fail their checksums (repairable from parity)."""
    manifest, pin, corrupt = None, PinnedMapping(None, {}), False
    try:
        manifest, mm, populated, verified = opener()
        pin = PinnedMapping(mm, {})
        try:
            mf.check_matches(manifest, live, tuple(adapter.optional_prefixes))
        except ValueError as e:
            # Another layout: the adapter can usually say which setting changed (ZeRO stage, DP size, ...).
            said = adapter_problems(adapter, manifest, mm)
            return manifest, pin, said or [str(e)], False
        another = other_run(manifest, st)
        if another:   # the adapter's own words first where it has any (a changed stage, schedule, ...)
            return manifest, pin, adapter_problems(adapter, manifest, mm) or another, False
        pin = PinnedMapping(mm, live, h2d)   # the layout matches: pin beside the verification
        bad = []
        if not verified:
            bad = mf.verify_mapping(manifest, mm, populate=populate and not populated)
        corrupt = bool(bad)
        if not bad:
            bad = adapter_problems(adapter, manifest, mm)
    except (HolderFailure, OSError, ValueError, KeyError, AttributeError) as e:
        bad = [str(e) or type(e).__name__]
    return manifest, pin, bad, corrupt


def other_run(manifest: dict, st: Any) -> list[str]:
    """Why ``manifest`` is another run's snapshot (empty: this run's, or not compared, or ``force``)."""
    if st is None or st.fingerprint is None:
        return []
    diff = fpr.differences(manifest.get("fingerprint"), st.fingerprint)
    if not diff:
        return []
    if st.force:
        log.warning("[rank %d] resume \"force\": applying version %s of another run: %s", st.rank,
                    manifest.get("version"), "; ".join(diff[:3]))
        return []
    return [f"another run's snapshot (its fingerprint differs: {diff[0]}"
            + (f"; {len(diff) - 1} more field(s)" if len(diff) > 1 else "")
            + "). Nothing of it is applied: start this run with resume \"never\" (drops the old versions) or a new "
              "job_id, or resume \"force\" if it is the same run (shardsafe.fingerprint)"]


def adapter_problems(adapter: StateAdapter, manifest: dict, mm) -> list[str]:
    """The adapter's own checks of a verified payload (layout, optimizer config, LR schedule...), without
    touching live state. They join the vote because ``apply`` may be collective (Megatron's param
    all-gather): a snapshot that one rank would refuse must be refused by every rank before any applies."""
    views = mf.views(manifest, mm)
    try:
        return [str(p) for p in adapter.validate(views, mf.from_jsonable(manifest["meta"]))]
    except Exception as e:  # a validator bug must not leave the other ranks waiting in the vote
        return [f"{type(adapter).__name__}.validate failed: {type(e).__name__}: {e}"]
    finally:
        del views
