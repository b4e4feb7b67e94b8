"""The emulated-link description of a run as one typed value (`EmulatedLink`), parsed once.

`taco-jax launch --link` measures the links of its network namespaces (`emulate.Cluster.measure_links`)
and hands every process the description as the config field `--emulated-link JSON` (so config.json
records it); the config's check, `--min-bytes auto`, the step watchdog and summary.json all read it
through `EmulatedLink.parse`, which parses a given text once."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json


@dataclasses.dataclass(frozen=True, eq=False)
class EmulatedLink:
    """The links of a run under `taco-jax launch --link`.

    Attributes:
      tiers: {tier ("link": one link for all; "intra" / "inter": within / between emulated nodes):
        {"requested_bit_per_s", "measured_bit_per_s" (TCP payload, median over the tier's links),
        "measured_wire_bit_per_s", "mss", "measured_min_bit_per_s", "burst_bytes",
        "receive_burst_bytes"}} (a hand-written description may hold fewer numbers).
      tensor_tier: the tier the tensor axis runs over ("intra" when there are nodes, else the one tier), or None.
      record: the whole description as measured (adds "link" (the `--link` text), "processes",
        "nodes", "node_of_process", "addresses", "links" (each measured link), "method"); what
        summary.json records as "emulated_link".
    """

    tiers: dict
    tensor_tier: str | None
    record: dict

    @classmethod
    def from_dict(cls, record: dict) -> EmulatedLink:
        """The value of a description dict (as `Cluster.measure_links` returns it). Raises ValueError
        when `record` is not a dict."""
        if not isinstance(record, dict):
            raise ValueError(f"the link description must be a JSON object, not {type(record).__name__}")
        return cls(record.get("tiers") or {}, record.get("tensor_tier"), record)

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def parse(text: str) -> EmulatedLink | None:
        """The value of `text` (a run's `--emulated-link`, JSON), None for "". Parsed once per text (the
        same value for every caller; do not mutate its dicts, `as_dict` gives a copy).
        Raises ValueError "emulated_link is not JSON: ..." for malformed JSON, or from `from_dict`."""
        if not text:
            return None
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"emulated_link is not JSON: {e}") from None
        return EmulatedLink.from_dict(record)

    def to_json(self) -> str:
        """The description as the JSON text `--emulated-link` takes."""
        return json.dumps(self.record)

    def as_dict(self) -> dict:
        """A copy of the description (summary.json's "emulated_link")."""
        return copy.deepcopy(self.record)

    @property
    def tensor_bytes_per_s(self) -> float | None:
        """Measured payload bytes/s of the tier the tensor axis runs over, or None when none is named."""
        if not self.tensor_tier:
            return None
        return self.tiers[self.tensor_tier]["measured_bit_per_s"] / 8
