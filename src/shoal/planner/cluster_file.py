"""Clusters as text: the strings `--cluster` takes ("64xA100-80GB", "2x4xH100") and the TOML file
that describes a cluster whose devices or links no table in shoal.planner.hardware lists.

`parse_cluster` reads either; `load_cluster` reads a file whose keys, in the units data sheets use
(GB/s, TFLOP/s, microseconds, GiB), override a named base device; `dump_cluster` writes a cluster
back in that form (the file a calibrated profile is kept in). The numbers themselves, and the
Cluster they make, are shoal.planner.hardware's; this module only reads and writes them. No torch
import, so `shoal plan` answers at once.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from shoal.planner.hardware import DEVICES, DTYPES, GB, TERA, US, Cluster, DeviceSpec, GiB, Link, get_device

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the standard library has no TOML reader yet
    tomllib = None  # type: ignore[assignment]  # checked before use (load_cluster)


def _cluster(device: DeviceSpec, num_nodes: int, per_node: int) -> Cluster:
    return Cluster(device=device, num_nodes=num_nodes, per_node=per_node, intra=device.intra, inter=device.inter)


_CLUSTER_RE = re.compile(r"(\d+)\s*[x*]\s*(?:(\d+)\s*[x*]\s*)?(\S.*)", re.IGNORECASE)
_FORMS = "COUNTxDEVICE (64xA100-80GB), NODESxPER_NODExDEVICE (2x4xH100) or a .toml file"


def parse_cluster(text: str) -> Cluster:
    """A cluster from "64xA100-80GB" (whole nodes of the device's usual size, or one node when the
    count is smaller), "2x4xH100" (nodes x devices per node), or a path ending in .toml."""
    text = text.strip()
    if text.lower().endswith(".toml"):
        return load_cluster(text)
    match = _CLUSTER_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"cannot read cluster {text!r}; expected {_FORMS}")
    device = get_device(match.group(3))
    count = int(match.group(1))
    if match.group(2) is not None:
        num_nodes, per_node = count, int(match.group(2))
        if num_nodes < 1 or per_node < 1:
            raise ValueError(f"cluster {text!r}: nodes and devices per node must be positive integers")
        return _cluster(device, num_nodes, per_node)
    n = device.per_node
    if count < 1:
        raise ValueError(f"cluster {text!r}: the device count must be a positive integer, got {count}")
    if count <= n:
        return _cluster(device, 1, count)
    if count % n:
        lower, upper = count // n * n, (count // n + 1) * n
        raise ValueError(f"cluster {text!r}: {count} devices do not fill nodes of {n}; valid counts are 1-{n} "
                         f"or a multiple of {n} (e.g. {lower} or {upper}), or write NODESxPER_NODEx{device.name}")
    return _cluster(device, count // n, n)


# TOML key in friendly units -> (field, base units per friendly unit); None: a string, not a field for `base`.
_TOP_KEYS = ("nodes", "per_node", "device", "intra", "inter")
_LINK_KEYS = {"name": ("name", None), "bandwidth_gbs": ("bandwidth", GB),
              "efficiency": ("efficiency", 1.0), "latency_us": ("latency", US),
              "allreduce_busbw_gbs": ("allreduce_busbw", "pairs_gb")}
_PAIRS = {"pairs": TERA, "pairs_gb": GB}
"""Keys holding [[size, rate], ...] lists, by the unit of their rate: TFLOP/s (GEMM sizes) or GB/s (buffer bytes)."""
_DEVICE_KEYS = {"base": (None, None), "name": ("name", None), "source": ("source", None),
                **{f"peak_tflops_{d}": (d, TERA) for d in DTYPES},
                "matmul_efficiency": ("matmul_efficiency", 1.0), "sustained_clock": ("sustained_clock", 1.0),
                "gemm_square_tflops": ("gemm_square", "pairs"),
                "attention_efficiency": ("attention_efficiency", 1.0), "attention_table": ("attention_table", None),
                "sm_count": ("sm_count", 1), "op_overhead_us": ("op_overhead", US),
                "dtensor_overhead_us": ("dtensor_overhead", US),
                "memory_gib": ("memory_bytes", GiB),
                "memory_bw_gbs": ("memory_bw", GB), "per_node": ("per_node", 1)}


def _scale(value: float, scale: float, inverse: bool = False) -> float:
    """value * scale (or / scale), dividing by 1e6 rather than multiplying by 1e-6: 20 / 1e6 is
    exactly the float 2e-05, 20 * 1e-6 is not."""
    if scale < 1:
        scale, inverse = round(1 / scale), not inverse
    return value / scale if inverse else value * scale


def _read_table(table: object, keys: dict, where: str) -> dict:
    """{field: value in base units} from a TOML table, checking key names and value types."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table, got {table!r}")
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key not in keys:
            raise ValueError(f"{where}: unknown key {key!r}; valid: {', '.join(keys)}")
        field, scale = keys[key]
        if scale in _PAIRS:  # [[size, rate], ...]
            if not (isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value)):
                raise ValueError(f"{where}: {key} must be a list of [size, rate] pairs, got {value!r}")
            out[field] = tuple((int(size), rate * _PAIRS[scale]) for size, rate in value)
        elif scale is None:
            if not isinstance(value, str):
                raise ValueError(f"{where}: {key} must be a string, got {value!r}")
            if field is not None:
                out[field] = value
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: {key} must be a number, got {value!r}")
        else:
            scaled = _scale(value, scale)
            out[field] = round(scaled) if field in ("memory_bytes", "per_node", "sm_count") else scaled
    return out


def _link_from(table: object, base: Link | None, where: str) -> Link:
    fields = {**(dataclasses.asdict(base) if base else {}), **_read_table(table, _LINK_KEYS, where)}
    required = [f.name for f in dataclasses.fields(Link) if f.default is dataclasses.MISSING]
    missing = [k for k, (f, _) in _LINK_KEYS.items() if f in required and f not in fields]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)} (no base device to take them from)")
    return Link(**fields)


def load_cluster(path: str | Path) -> Cluster:
    """A cluster from a TOML file: `nodes`, `per_node`, `device` (a name, or a [device] table whose
    keys override an optional `base` device), and [intra]/[inter] tables overriding its links."""
    path = Path(path)
    if tomllib is None:
        raise ValueError(f"{path}: reading TOML needs Python >= 3.11 (tomllib)")
    try:
        data = tomllib.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"cannot read cluster file {str(path)!r}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not valid TOML: {err}") from None
    unknown = [k for k in data if k not in _TOP_KEYS]
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r}; valid: {', '.join(_TOP_KEYS)}")
    spec = data.get("device")
    if spec is None:
        raise ValueError(f"{path}: missing device (a name: {', '.join(DEVICES)}; or a [device] table)")
    table = {"base": spec} if isinstance(spec, str) else spec
    device_fields = _read_table(table, _DEVICE_KEYS, f"{path} [device]")
    base = get_device(table["base"]) if "base" in table else None
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(DeviceSpec)} if base else {}
    peak = dict(fields.get("peak_flops", {}))
    peak.update({d: device_fields.pop(d) for d in DTYPES if d in device_fields})
    fields.update(device_fields, peak_flops=peak)
    required = [f.name for f in dataclasses.fields(DeviceSpec) if f.default is dataclasses.MISSING]
    missing = [k for k, (f, _) in _DEVICE_KEYS.items() if f in required and f not in fields]
    if missing or not peak:
        missing += [] if peak else ["peak_tflops_<dtype>"]
        raise ValueError(f"{path} [device]: missing {', '.join(missing)}, or set base to one of {', '.join(DEVICES)}")
    for level in ("intra", "inter"):
        fields[level] = _link_from(data.get(level, {}), fields.get(level), f"{path} [{level}]")
    device = DeviceSpec(**fields)
    nodes, per_node = data.get("nodes", 1), data.get("per_node", device.per_node)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (nodes, per_node)):
        raise ValueError(f"{path}: nodes and per_node must be positive integers, got {nodes!r} and {per_node!r}")
    return Cluster(device=device, num_nodes=nodes, per_node=per_node, intra=device.intra, inter=device.inter)


def dump_cluster(cluster: Cluster) -> str:
    """TOML text that `load_cluster` reads back into this cluster (the file form of a calibrated
    profile). The cluster's links are written as the device's."""
    def table(values: dict, keys: dict) -> list[str]:
        def text(value: object, scale: object) -> str:
            if scale in _PAIRS:
                return json.dumps([[size, rate / _PAIRS[scale]] for size, rate in value])  # type: ignore[attr-defined]  # pairs
            # the key tables pair each field with its scale: a number scales a number
            return json.dumps(value) if scale in (None, 1) else repr(_scale(value, scale, True))  # type: ignore[arg-type]  # see above

        as_text = {key: text(values[field], scale) for key, (field, scale) in keys.items()
                   if values.get(field) not in (None, ())}
        return [f"{key} = {text}" for key, text in as_text.items()]

    device = {**dataclasses.asdict(cluster.device), **cluster.device.peak_flops}
    lines = [f"nodes = {cluster.num_nodes}", f"per_node = {cluster.per_node}", "", "[device]"]
    lines += table(device, _DEVICE_KEYS)
    for level in ("intra", "inter"):
        lines += ["", f"[{level}]", *table(dataclasses.asdict(getattr(cluster, level)), _LINK_KEYS)]
    return "\n".join(lines) + "\n"
