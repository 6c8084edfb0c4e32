"""The cluster a plan is made for: how many nodes, how many devices each, which device.

A cluster is named by a spec string ``NODESxDEVICESxDEVICE`` (``"2x8xH100"``,
``"1x4xcpu"``; the device is looked up case-insensitively in
:data:`autopar.cost.devices.DEVICES`), or described by a dict / JSON / YAML file
that may override any device figure::

    {"nodes": 2, "devices_per_node": 8,
     "device": {"base": "H100", "hbm_bytes": 42949672960}}

``device`` is a catalog name, a dict with ``base`` plus overrides, or a dict of
every figure (what :meth:`Cluster.to_dict` writes, so a plan file records the
figures it was planned with). Ranks are numbered node-major: rank ``r`` lives on
node ``r // devices_per_node``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.cost.comm import Link, group_link, pipeline_links
from autopar.cost.devices import DEVICES, DeviceSpec, lookup_device
from autopar.errors import ClusterSpecError

__all__ = ["Cluster", "parse_cluster"]

_FORM = "expected NODESxDEVICESxDEVICE, e.g. '2x8xH100', or a JSON/YAML cluster file"
_FILE_SUFFIXES = (".json", ".yaml", ".yml")
_KEYS = ("nodes", "devices_per_node", "device")


def _known_devices() -> str:
    return f"known devices: {', '.join(DEVICES)}"


def _check_positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterSpecError(f"{owner}: {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A homogeneous cluster of ``nodes`` nodes with ``devices_per_node`` devices each."""

    nodes: int
    """Number of nodes (machines)."""
    devices_per_node: int
    """Devices (GPUs, or gloo processes on CPU) per node, joined by NVLink or equivalent."""
    device: DeviceSpec
    """Figures of every device; from the catalog, possibly with overrides."""

    def __post_init__(self) -> None:
        _check_positive_int("Cluster", "nodes", self.nodes)
        _check_positive_int("Cluster", "devices_per_node", self.devices_per_node)
        if not isinstance(self.device, DeviceSpec):
            raise TypeError(
                f"Cluster: device must be a DeviceSpec (see autopar.cost.devices.lookup_device), "
                f"got {type(self.device).__name__}"
            )

    @property
    def world_size(self) -> int:
        """Total number of devices (ranks)."""
        return self.nodes * self.devices_per_node

    @property
    def spec(self) -> str:
        """The spec string, e.g. ``"2x8xH100"`` (device overrides are not shown)."""
        return f"{self.nodes}x{self.devices_per_node}x{self.device.name}"

    def link_for_group(self, group_size: int, stride: int = 1) -> Link:
        """Bottleneck link of a mesh axis of ``group_size`` ranks ``stride`` apart.

        NVLink figures when every group of the axis lies inside one node, the per-GPU
        network figures otherwise (see :func:`autopar.cost.comm.group_link`).
        """
        if self.nodes == 1:
            # Every rank shares the node: nothing crosses the network.
            return group_link(group_size=1, stride=1, devices_per_node=1, device=self.device)
        return group_link(group_size=group_size, stride=stride,
                          devices_per_node=self.devices_per_node, device=self.device)

    def pipeline_links(self, *, pp: int, dp: int, tp: int, n_stages: int | None = None) -> tuple[Link, ...]:
        """The link of each cut between consecutive pipeline stages (``n_stages`` stages,
        default ``pp``; stage ``s`` on pipeline rank ``s % pp``), from the ranks on either
        side as the runtime lays them out (see :func:`autopar.cost.comm.pipeline_links`)."""
        return pipeline_links(pp=pp, dp=dp, tp=tp, n_stages=n_stages or pp,
                              devices_per_node=self.devices_per_node, device=self.device)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict with every device figure; :meth:`from_dict` reads it back."""
        return {
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "device": self.device.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "cluster dict") -> Cluster:
        """Build from ``{"nodes", "devices_per_node", "device"}``; ``source`` names it in errors."""
        if not isinstance(data, Mapping):
            raise ClusterSpecError(
                f"{source}: expected a mapping with keys {list(_KEYS)}, got {type(data).__name__}"
            )
        missing = [key for key in _KEYS if key not in data]
        unknown = sorted(str(key) for key in data if key not in _KEYS)
        if missing or unknown:
            raise ClusterSpecError(
                f"{source}: missing keys {missing}, unknown keys {unknown}; "
                f"expected exactly {list(_KEYS)}"
            )
        for key in ("nodes", "devices_per_node"):
            _check_positive_int(source, key, data[key])
        return cls(nodes=data["nodes"], devices_per_node=data["devices_per_node"],
                   device=_device_from_value(data["device"], source=source))

    @classmethod
    def from_spec(cls, spec: str | Cluster | Mapping[str, Any] | os.PathLike[str],
                  **device_overrides: Any) -> Cluster:
        """:func:`parse_cluster`, then :meth:`with_overrides` (e.g. ``hbm_bytes=40e9``)."""
        cluster = parse_cluster(spec)
        return cluster.with_overrides(**device_overrides) if device_overrides else cluster

    def with_overrides(self, **device_fields: Any) -> Cluster:
        """A copy whose device has some figures replaced (``peak_flops_per_s`` may be partial)."""
        try:
            device = self.device.with_overrides(**device_fields)
        except ValueError as exc:
            raise ClusterSpecError(f"cluster {self.spec}: {exc}") from None
        return Cluster(nodes=self.nodes, devices_per_node=self.devices_per_node, device=device)


def _device_from_value(value: Any, *, source: str) -> DeviceSpec:
    try:
        if isinstance(value, str):
            return lookup_device(value)
        if isinstance(value, Mapping):
            if "base" in value:
                overrides = {key: val for key, val in value.items() if key != "base"}
                return lookup_device(value["base"]).with_overrides(**overrides)
            return DeviceSpec.from_dict(value)
    except ValueError as exc:
        raise ClusterSpecError(f"{source}: device: {exc}") from None
    raise ClusterSpecError(
        f"{source}: device must be a name, a dict with 'base' plus overrides, or a dict of "
        f"every figure; got {value!r}; {_known_devices()}"
    )


def _spec_error(spec: str, reason: str) -> ClusterSpecError:
    return ClusterSpecError(f"invalid cluster spec {spec!r}: {reason}; {_FORM}; {_known_devices()}")


def _parse_spec_string(spec: str) -> Cluster:
    text = spec.strip()
    if not text:
        raise _spec_error(spec, "it is empty")
    parts = re.split("[xX]", text, maxsplit=2)
    if len(parts) != 3:
        raise _spec_error(spec, f"it has {len(parts)} part(s), not 3")
    counts = {}
    for label, part in (("node count", parts[0]), ("devices per node", parts[1])):
        if not re.fullmatch(r"[0-9]+", part.strip()) or int(part) < 1:
            raise _spec_error(spec, f"{label} {part.strip()!r} is not a positive integer")
        counts[label] = int(part)
    try:
        device = lookup_device(parts[2])
    except ValueError:
        raise _spec_error(spec, f"unknown device {parts[2]!r}") from None
    return Cluster(nodes=counts["node count"], devices_per_node=counts["devices per node"],
                   device=device)


def _load_file(path: Path) -> Cluster:
    source = f"cluster file {str(path)!r}"
    try:
        text = path.read_text()
    except OSError as exc:
        raise ClusterSpecError(f"{source}: cannot read it ({exc.strerror or exc}); {_FORM}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ClusterSpecError(
                f"{source}: reading YAML needs PyYAML, which is not installed; "
                f"install pyyaml or write the cluster as a JSON file"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ClusterSpecError(f"{source}: not valid YAML ({' '.join(str(exc).split())})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ClusterSpecError(f"{source}: not valid JSON ({exc})") from None
    return Cluster.from_dict(data, source=source)


def parse_cluster(spec: str | Cluster | Mapping[str, Any] | os.PathLike[str]) -> Cluster:
    """A :class:`Cluster` from a spec string, a dict, a JSON/YAML file path, or a Cluster.

    Strings ending in ``.json``, ``.yaml`` or ``.yml`` or containing a path separator
    are read as files; other strings must be ``NODESxDEVICESxDEVICE``. Raises
    :class:`autopar.errors.ClusterSpecError` (a ``ValueError``) with the bad value,
    the accepted form and the known devices; ``TypeError`` for other argument types.
    """
    if isinstance(spec, Cluster):
        return spec
    if isinstance(spec, Mapping):
        return Cluster.from_dict(spec)
    if isinstance(spec, os.PathLike):
        return _load_file(Path(spec))
    if isinstance(spec, str):
        text = spec.strip()
        if text.lower().endswith(_FILE_SUFFIXES) or "/" in text or os.sep in text:
            return _load_file(Path(text))
        return _parse_spec_string(spec)
    raise TypeError(
        f"cluster must be a spec string such as '2x8xH100', a dict, a path to a JSON/YAML "
        f"file or a Cluster; got {type(spec).__name__}"
    )
