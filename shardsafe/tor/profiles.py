"""Published failure profiles for ``shardsafe tor project --profile NAME``, with their figures and sources.

Each profile turns published numbers into :class:`~shardsafe.tor.classes.Rates` per node-hour (8-GPU nodes)
and keeps the published anchors (an MTTF, an ETTR) that tests and docs/tor.md check the projection against.
The mapping of the Llama 3 causes to failure classes is the one docs/tor.md states and argues; rates of the
other profiles are split into classes with the same shares, because those papers give totals, not causes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .classes import CLASSES, Rates
from .errors import TorError

__all__ = ["Profile", "PROFILES", "LLAMA3_CAUSES", "get_profile"]

# Llama 3 (Llama Team, Meta, "The Llama 3 Herd of Models", arXiv 2407.21783, Table 5): 419 unexpected
# interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs (2,048 nodes of 8); the paper attributes
# about 78 % to confirmed hardware issues. cause -> (interruptions, class); the counts add up to 419. Table 5's
# percentages are not all count/419 (faulty GPU: printed 30.1 %, 148/419 = 35.3 %), so the counts are used.
# Why each class: docs/tor.md, "Published profiles".
LLAMA3_CAUSES: dict[str, tuple[int, str]] = {
    "faulty GPU": (148, "node"),
    "GPU HBM3 memory": (72, "node"),
    "software bug": (54, "process"),
    "network switch/cable": (35, "rack"),
    "host maintenance (unplanned)": (32, "node"),
    "GPU SRAM memory": (19, "node"),
    "GPU system processor": (17, "node"),
    "NIC": (7, "node"),
    "NCCL watchdog timeouts": (7, "process"),
    "silent data corruption": (6, "node"),
    "GPU thermal interface + sensor": (6, "slow"),
    "SSD": (3, "node"),
    "power supply": (3, "node"),
    "server chassis": (2, "node"),
    "IO expansion board": (2, "node"),
    "dependency": (2, "process"),
    "CPU": (2, "node"),
    "system memory": (2, "node"),
}

LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16384
NODE_HOURS_PER_DAY = 24.0
assert sum(n for n, _ in LLAMA3_CAUSES.values()) == LLAMA3_INTERRUPTIONS


def _llama3_shares() -> dict[str, float]:
    """Each class's share of the 419 interruptions: process 63, node 315, rack 35, slow 6 (of 419)."""
    shares = {c: 0.0 for c in CLASSES}
    for n, cls in LLAMA3_CAUSES.values():
        shares[cls] += n / LLAMA3_INTERRUPTIONS
    return shares


def _split(total_per_node_hour: float, source: str) -> Rates:
    sh = _llama3_shares()
    return Rates(**{c: total_per_node_hour * sh[c] for c in CLASSES}, source=source)


@dataclass(frozen=True, kw_only=True)
class Profile:
    name: str
    title: str
    source: str
    gpus: int
    """The scale the figures were published for (the projection's default scale with this profile)."""
    total_per_node_hour: float
    figures: dict[str, Any] = field(default_factory=dict)
    """Published numbers (and the derivation of the rate) exactly as docs/tor.md cites them."""
    anchors: dict[str, Any] = field(default_factory=dict)
    """Published outcomes the projection can be compared with."""

    def rates(self) -> Rates:
        return _split(self.total_per_node_hour, f"profile {self.name}: {self.source}")

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "source": self.source, "gpus": self.gpus,
                "total_per_node_hour": self.total_per_node_hour, "rates_per_node_hour": self.rates().as_dict(),
                "class_shares": _llama3_shares(), "figures": self.figures, "anchors": self.anchors}


_LLAMA3_RATE = LLAMA3_INTERRUPTIONS / (LLAMA3_GPUS / 8 * LLAMA3_DAYS * NODE_HOURS_PER_DAY)

PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile(
        name="llama3", title="Llama 3 405B pre-training (Meta)",
        source="Llama Team (AI @ Meta), The Llama 3 Herd of Models, arXiv 2407.21783 (2024), Table 5",
        gpus=LLAMA3_GPUS, total_per_node_hour=_LLAMA3_RATE,
        figures={"interruptions": LLAMA3_INTERRUPTIONS, "days": LLAMA3_DAYS, "gpus": LLAMA3_GPUS,
                 "hardware_share": "about 78 % (the paper's figure)",
                 "causes": {k: v[0] for k, v in LLAMA3_CAUSES.items()},
                 "cause_class": {k: v[1] for k, v in LLAMA3_CAUSES.items()},
                 "rate": "419 / (2048 nodes x 54 days x 24 h) = 1.579e-4 per node-hour"},
        anchors={"job_mtbf_h_at_16384_gpus": LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS,
                 "effective_training_time": "> 90 % (the paper's figure)"}),
    Profile(
        name="meta-rsc1", title="Meta RSC-1 research cluster (16k A100)",
        source="Kokolis et al., Revisiting Reliability in Large-Scale Machine Learning Research Clusters, "
               "arXiv 2410.21680 (HPCA 2025)",
        gpus=16384, total_per_node_hour=6.50 / 1000 / NODE_HOURS_PER_DAY,
        figures={"failures_per_1000_node_days": 6.50, "gpus_per_node": 8,
                 "rate": "6.50 / (1000 x 24 h) = 2.708e-4 per node-hour",
                 "class_shares": "Llama 3 shares (the paper gives the total rate, not this split)"},
        anchors={"job_mttf_h_at_16384_gpus": 1.8, "ettr_5min_checkpoints_at_16384_gpus": 0.93,
                 "ettr_60min_checkpoints_at_16384_gpus": 0.70}),
    Profile(
        name="meta-rsc2", title="Meta RSC-2 research cluster (8k A100)",
        source="Kokolis et al., arXiv 2410.21680 (HPCA 2025)",
        gpus=8192, total_per_node_hour=2.34 / 1000 / NODE_HOURS_PER_DAY,
        figures={"failures_per_1000_node_days": 2.34, "gpus_per_node": 8,
                 "rate": "2.34 / (1000 x 24 h) = 9.75e-5 per node-hour",
                 "class_shares": "Llama 3 shares (the paper gives the total rate, not this split)"},
        anchors={}),
    Profile(
        name="byterobust", title="ByteDance ByteRobust production training (9,600 GPUs)",
        source="ByteDance, ByteRobust (2025): ETTR up to 97 % on 9,600 GPUs (as summarised in the project's "
               "reference notes; the paper body was not read). It publishes no failure rate: the Llama 3 "
               "rate and shares stand in, so only the ETTR anchor is ByteRobust's",
        gpus=9600, total_per_node_hour=_LLAMA3_RATE,
        figures={"gpus": 9600, "rates": "not published per class; the Llama 3 rate and shares are used"},
        anchors={"ettr": 0.97}),
)}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise TorError(f"--profile {name!r}: expected one of {', '.join(PROFILES)} "
                         "(or pass --rates FILE.json with rates per node-hour)") from None
