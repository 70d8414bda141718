"""The rules a container runtime applies when it loads a CDI spec, checked before we write one.

The runtime's loader (the Go package ``tags.cncf.io/container-device-interface``)
refuses a whole spec file for one bad field, and it does so when a pod starts,
long after the claim was prepared. Checking here turns that late, remote failure
into an error at prepare time that names the field.

The published JSON schema is too weak for this (it allows unknown fields and does
not check env entries, names or versions), so the loader's rules are written out
here. Where the loader is more lenient than this module, the difference is noted;
being stricter than the loader is safe for specs we write ourselves.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any


class InvalidSpecError(ValueError):
    """A spec breaks a CDI rule. ``field`` is where, e.g. ``devices[0].containerEdits.env[1]``."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"invalid CDI spec: {field}: {problem}")
        self.field = field
        self.problem = problem


# Every version the loader knows, oldest first; it rejects any other value.
KNOWN_VERSIONS = ("0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
# The loader's floor: a spec without any newer feature still needs this version.
EARLIEST_VERSION = "0.3.0"

# The OCI lifecycle stages a CDI hook may name.
HOOK_NAMES = frozenset(
    {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
)
DEVICE_NODE_TYPES = ("", "b", "c", "u", "p")

# Vendor and class: a letter first, a letter or digit last, [A-Za-z0-9_.-] between.
_VENDOR_OR_CLASS = re.compile(r"[A-Za-z](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?")
# Device names: a letter or digit first and last, [A-Za-z0-9_.:-] between.
_DEVICE_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?")

# The fields the loader's Go types declare. It decodes strictly, so any other
# field makes the whole file unreadable. (It matches names case-insensitively, as
# Go's JSON decoder does; we require the exact spelling.)
_SPEC_FIELDS = frozenset({"cdiVersion", "kind", "annotations", "devices", "containerEdits"})
_DEVICE_FIELDS = frozenset({"name", "annotations", "containerEdits"})
_EDITS_FIELDS = frozenset(
    {"env", "deviceNodes", "netDevices", "hooks", "mounts", "intelRdt", "additionalGids"}
)
_DEVICE_NODE_FIELDS = frozenset(
    {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}
)
_MOUNT_FIELDS = frozenset({"hostPath", "containerPath", "options", "type"})
_HOOK_FIELDS = frozenset({"hookName", "path", "args", "env", "timeout"})
_NET_DEVICE_FIELDS = frozenset({"hostInterfaceName", "name"})
_INTEL_RDT_FIELDS = frozenset({"closID", "l3CacheSchema", "memBwSchema", "schemata", "enableMonitoring"})

_UINT32_MAX = 2**32 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def check_kind(kind: str, field: str = "kind") -> None:
    """Raise unless ``kind`` is a valid ``vendor/class``."""
    vendor, slash, device_class = kind.partition("/")
    if not slash or not vendor or not device_class:
        raise InvalidSpecError(field, f"{kind!r} is not of the form vendor/class")
    for part, what in ((vendor, "vendor"), (device_class, "class")):
        if not _VENDOR_OR_CLASS.fullmatch(part):
            raise InvalidSpecError(
                field,
                f"{what} {part!r} must start with a letter, end with a letter or digit "
                "and contain only letters, digits, '_', '.' and '-'",
            )


def check_device_name(name: str, field: str = "name") -> None:
    """Raise unless ``name`` is a valid CDI device name (the part after ``=``)."""
    if not _DEVICE_NAME.fullmatch(name):
        raise InvalidSpecError(
            field,
            f"device name {name!r} must start and end with a letter or digit "
            "and contain only letters, digits, '_', '.', ':' and '-'",
        )


class ValidSpec(dict[str, Any]):
    """A spec that passed :func:`validate_spec`: the spec store writes one without checking again.

    Prepare builds each claim's spec once and checks it once; the type carries the verdict from the
    builder to the writer. Never changed after its check: build a new one instead.
    """


class CheckedEdits(dict[str, Any]):
    """Container edits that passed the checks, with the ``cdiVersion`` their content needs.

    Every claim's spec carries the node's common edits (the driver's libraries: dozens of mounts);
    checking them in every spec cost more than the rest of the spec did. Built once per node by
    :func:`checked_edits`, shared by the specs (never changed), and taken as checked by the spec's
    check.
    """

    version: str
    feature: str  # what needs that version


def checked_edits(edits: Mapping[str, Any]) -> CheckedEdits:
    """``edits`` checked as a spec's ``containerEdits``, with the version their content needs."""
    _check_edits(edits, "containerEdits")
    checked = CheckedEdits(edits)
    checked.version, checked.feature = _required_version({"containerEdits": edits, "devices": []})
    return checked


def validated(spec: Mapping[str, Any]) -> ValidSpec:
    """``spec`` checked (:func:`validate_spec`), as a :class:`ValidSpec`."""
    validate_spec(spec)
    return ValidSpec(spec)


def with_minimum_version(spec: Mapping[str, Any]) -> ValidSpec:
    """``spec`` (without a ``cdiVersion``) checked, at the lowest version its content allows.

    The version is derived from the content once, so it cannot be too old: only the rest is checked.
    """
    if "cdiVersion" in spec:
        raise InvalidSpecError("cdiVersion", "is derived from the content; leave it out")
    full = {"cdiVersion": minimum_version(spec), **spec}
    _check_content(full)
    return ValidSpec(full)


def validate_spec(spec: Mapping[str, Any]) -> None:
    """Raise :class:`InvalidSpecError` for the first rule ``spec`` breaks that makes a runtime refuse it."""
    top = _check_content(spec)
    _check_version(_string(top["cdiVersion"], "cdiVersion"), top)


def _check_content(spec: Mapping[str, Any]) -> Mapping[str, Any]:
    """Every rule but the version's floor; returns the spec's top-level object."""
    top = _object(spec, "spec", _SPEC_FIELDS)
    for required in ("cdiVersion", "kind", "devices"):
        if required not in top:
            raise InvalidSpecError(required, "is required")
    check_kind(_string(top["kind"], "kind"))
    if "annotations" in top:
        _check_annotations(top["annotations"], "annotations")
    if "containerEdits" in top and not isinstance(top["containerEdits"], CheckedEdits):
        _check_edits(top["containerEdits"], "containerEdits")

    devices = _array(top["devices"], "devices")
    if not devices:
        raise InvalidSpecError("devices", "a spec needs at least one device")
    names: set[str] = set()
    for index, device_value in enumerate(devices):
        at = f"devices[{index}]"
        device = _object(device_value, at, _DEVICE_FIELDS)
        for required in ("name", "containerEdits"):
            if required not in device:
                raise InvalidSpecError(f"{at}.{required}", "is required")
        name = _string(device["name"], f"{at}.name")
        check_device_name(name, f"{at}.name")
        if name in names:
            raise InvalidSpecError(f"{at}.name", f"device {name!r} is defined more than once")
        names.add(name)
        if "annotations" in device:
            _check_annotations(device["annotations"], f"{at}.annotations")
        edits = _check_edits(device["containerEdits"], f"{at}.containerEdits")
        if not _has_edits(edits):
            raise InvalidSpecError(f"{at}.containerEdits", "a device must edit the container in some way")

    _string(top["cdiVersion"], "cdiVersion")
    return top


def minimum_version(spec: Mapping[str, Any]) -> str:
    """The oldest ``cdiVersion`` whose loader accepts everything ``spec`` uses.

    Declaring the minimum, not the newest, lets the oldest runtime that can read
    the content read it.
    """
    return _required_version(spec)[0]


def _required_version(spec: Mapping[str, Any]) -> tuple[str, str]:
    """The minimum version and the feature that needs it (newest feature wins)."""
    version, feature = next(
        ((version, feature) for version, needs_it, feature in _VERSION_FEATURES if needs_it(spec)),
        (EARLIEST_VERSION, "the base format"),
    )
    edits = spec.get("containerEdits")
    if isinstance(edits, CheckedEdits) and _version_key(edits.version) > _version_key(version):
        return edits.version, edits.feature
    return version, feature


def _check_version(declared: str, spec: Mapping[str, Any]) -> None:
    # The loader accepts an optional leading "v".
    version = declared.removeprefix("v")
    if version not in KNOWN_VERSIONS:
        raise InvalidSpecError(
            "cdiVersion", f"unknown version {declared!r}; known: {', '.join(KNOWN_VERSIONS)}"
        )
    required, feature = _required_version(spec)
    if _version_key(version) < _version_key(required):
        raise InvalidSpecError("cdiVersion", f"{declared} is too old: {feature} needs at least {required}")


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


# --- which content needs which version (the loader's own feature checks) ---------


def _devices(spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    devices = spec.get("devices")
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        yield from (d for d in devices if isinstance(d, Mapping))


def _all_edits(spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for owner in (spec, *_devices(spec)):
        edits = owner.get("containerEdits")
        # Checked edits carry the version they need (_required_version): not scanned again.
        if isinstance(edits, Mapping) and not isinstance(edits, CheckedEdits):
            yield edits


def _items(edits: Mapping[str, Any], field: str) -> list[Any]:
    value = edits.get(field)
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else []


def _uses_net_devices_or_new_rdt(spec: Mapping[str, Any]) -> bool:
    for edits in _all_edits(spec):
        rdt = edits.get("intelRdt")
        if isinstance(rdt, Mapping) and (rdt.get("schemata") is not None or rdt.get("enableMonitoring")):
            return True
        if _items(edits, "netDevices"):
            return True
    return False


def _uses_rdt_or_gids(spec: Mapping[str, Any]) -> bool:
    return any(e.get("intelRdt") is not None or _items(e, "additionalGids") for e in _all_edits(spec))


def _uses_annotations_or_dotted_class(spec: Mapping[str, Any]) -> bool:
    if any(owner.get("annotations") for owner in (spec, *_devices(spec))):
        return True
    kind = spec.get("kind")
    return isinstance(kind, str) and "." in kind.partition("/")[2]


def _uses_digit_names_or_host_paths(spec: Mapping[str, Any]) -> bool:
    for device in _devices(spec):
        name = device.get("name")
        if isinstance(name, str) and "0" <= name[:1] <= "9":
            return True
    return any(
        isinstance(node, Mapping) and node.get("hostPath")
        for edits in _all_edits(spec)
        for node in _items(edits, "deviceNodes")
    )


def _uses_mount_types(spec: Mapping[str, Any]) -> bool:
    return any(
        isinstance(mount, Mapping) and mount.get("type")
        for edits in _all_edits(spec)
        for mount in _items(edits, "mounts")
    )


_VERSION_FEATURES: tuple[tuple[str, Callable[[Mapping[str, Any]], bool], str], ...] = (
    ("1.1.0", _uses_net_devices_or_new_rdt, "netDevices or intelRdt schemata/enableMonitoring"),
    ("0.7.0", _uses_rdt_or_gids, "intelRdt or additionalGids"),
    ("0.6.0", _uses_annotations_or_dotted_class, "annotations or a '.' in the kind's class"),
    (
        "0.5.0",
        _uses_digit_names_or_host_paths,
        "a device name starting with a digit or a device-node hostPath",
    ),
    ("0.4.0", _uses_mount_types, "a mount type"),
)


# --- structure -----------------------------------------------------------------


def _has_edits(edits: Mapping[str, Any]) -> bool:
    lists = ("env", "deviceNodes", "netDevices", "hooks", "mounts", "additionalGids")
    return any(edits.get(name) for name in lists) or edits.get("intelRdt") is not None


def _check_edits(value: Any, at: str) -> Mapping[str, Any]:
    edits = _object(value, at, _EDITS_FIELDS)
    if "env" in edits:
        _check_env(edits["env"], f"{at}.env")
    for index, node in enumerate(_array(edits.get("deviceNodes", []), f"{at}.deviceNodes")):
        _check_device_node(node, f"{at}.deviceNodes[{index}]")
    for index, mount in enumerate(_array(edits.get("mounts", []), f"{at}.mounts")):
        if not _plain_mount(mount):  # the driver root's libraries: dozens of mounts in every spec
            _check_mount(mount, f"{at}.mounts[{index}]")
    for index, hook in enumerate(_array(edits.get("hooks", []), f"{at}.hooks")):
        _check_hook(hook, f"{at}.hooks[{index}]")
    if "netDevices" in edits:
        _check_net_devices(edits["netDevices"], f"{at}.netDevices")
    if edits.get("intelRdt") is not None:
        _check_intel_rdt(edits["intelRdt"], f"{at}.intelRdt")
    for index, gid in enumerate(_array(edits.get("additionalGids", []), f"{at}.additionalGids")):
        _integer(gid, f"{at}.additionalGids[{index}]", 0, _UINT32_MAX)
    return edits


def _check_env(value: Any, at: str) -> None:
    for index, entry in enumerate(_array(value, at)):
        text = _string(entry, f"{at}[{index}]")
        if text.find("=") <= 0:
            raise InvalidSpecError(f"{at}[{index}]", f"{text!r} is not of the form NAME=value")


def _check_device_node(value: Any, at: str) -> None:
    node = _object(value, at, _DEVICE_NODE_FIELDS)
    if not _string(node.get("path", ""), f"{at}.path"):
        raise InvalidSpecError(f"{at}.path", "a device node needs a path")
    if "hostPath" in node:
        _string(node["hostPath"], f"{at}.hostPath")
    node_type = _string(node.get("type", ""), f"{at}.type")
    if node_type not in DEVICE_NODE_TYPES:
        raise InvalidSpecError(f"{at}.type", f'{node_type!r} is not one of "", b, c, u, p')
    permissions = _string(node.get("permissions", ""), f"{at}.permissions")
    # "none" (no cgroup access at all) is the loader's one exception to the rwm letters.
    if permissions != "none" and permissions.strip("rwm"):
        raise InvalidSpecError(f"{at}.permissions", f"{permissions!r} may only contain r, w and m")
    for number in ("major", "minor"):
        if number in node:
            _integer(node[number], f"{at}.{number}", _INT64_MIN, _INT64_MAX)
    for number in ("fileMode", "uid", "gid"):
        if number in node:
            _integer(node[number], f"{at}.{number}", 0, _UINT32_MAX)


def _check_mount(value: Any, at: str) -> None:
    mount = _object(value, at, _MOUNT_FIELDS)
    for path in ("hostPath", "containerPath"):
        if not _string(mount.get(path, ""), f"{at}.{path}"):
            raise InvalidSpecError(f"{at}.{path}", "a mount needs a non-empty path")
    if "options" in mount:
        _strings(mount["options"], f"{at}.options")
    if "type" in mount:
        _string(mount["type"], f"{at}.type")


def _plain_mount(value: Any) -> bool:
    """Whether ``value`` is a valid mount of the usual shape, found without building error locations.

    Stricter than :func:`_check_mount`, which decides (and names the problem) for anything else.
    """
    if type(value) is not dict or not value.keys() <= _MOUNT_FIELDS:
        return False
    host, container, options = value.get("hostPath"), value.get("containerPath"), value.get("options", [])
    return (
        type(host) is str
        and type(container) is str
        and bool(host and container)
        and type(options) is list
        and all(type(option) is str for option in options)
        and type(value.get("type", "")) is str
    )


def _check_hook(value: Any, at: str) -> None:
    hook = _object(value, at, _HOOK_FIELDS)
    name = _string(hook.get("hookName", ""), f"{at}.hookName")
    if name not in HOOK_NAMES:
        raise InvalidSpecError(f"{at}.hookName", f"{name!r} is not one of {', '.join(sorted(HOOK_NAMES))}")
    if not _string(hook.get("path", ""), f"{at}.path"):
        raise InvalidSpecError(f"{at}.path", "a hook needs the path of its executable")
    if "args" in hook:
        _strings(hook["args"], f"{at}.args")
    if "env" in hook:
        _check_env(hook["env"], f"{at}.env")
    if "timeout" in hook:
        # The OCI runtime spec requires a timeout, when given, to be greater than zero.
        _integer(hook["timeout"], f"{at}.timeout", 1, _UINT32_MAX)


def _check_net_devices(value: Any, at: str) -> None:
    host_names: set[str] = set()
    names: set[str] = set()
    for index, device_value in enumerate(_array(value, at)):
        device = _object(device_value, f"{at}[{index}]", _NET_DEVICE_FIELDS)
        for field, seen in (("hostInterfaceName", host_names), ("name", names)):
            name = _string(device.get(field, ""), f"{at}[{index}].{field}")
            if not name:
                raise InvalidSpecError(f"{at}[{index}].{field}", "a net device needs a non-empty name")
            if name in seen:
                raise InvalidSpecError(f"{at}[{index}].{field}", f"{name!r} is used by another net device")
            seen.add(name)


def _check_intel_rdt(value: Any, at: str) -> None:
    rdt = _object(value, at, _INTEL_RDT_FIELDS)
    for field in ("closID", "l3CacheSchema", "memBwSchema"):
        if field in rdt:
            _string(rdt[field], f"{at}.{field}")
    clos_id = rdt.get("closID", "")
    # A CLOS id names a directory under /sys/fs/resctrl; "/" is the root CLOS.
    if clos_id != "/" and (
        clos_id in (".", "..") or len(clos_id) >= 4096 or "/" in clos_id or "\n" in clos_id
    ):
        raise InvalidSpecError(f"{at}.closID", f"{clos_id!r} is not a valid resctrl group name")
    if "schemata" in rdt:
        _strings(rdt["schemata"], f"{at}.schemata")
    if "enableMonitoring" in rdt and not isinstance(rdt["enableMonitoring"], bool):
        raise InvalidSpecError(f"{at}.enableMonitoring", "must be true or false")


def _check_annotations(value: Any, at: str) -> None:
    # The loader's key check never runs for typed maps, so only the shape matters to it.
    annotations = _object(value, at, None)
    for key, text in annotations.items():
        _string(key, f"{at} key")
        _string(text, f"{at}.{key}")


# --- JSON value shapes ---------------------------------------------------------


def _object(value: Any, at: str, fields: frozenset[str] | None) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidSpecError(at, f"must be an object, not {_json_type(value)}")
    if fields is not None and not value.keys() <= fields:
        unknown = sorted(str(key) for key in value if key not in fields)
        if unknown:
            prefix = "" if at == "spec" else f"{at}."
            raise InvalidSpecError(
                f"{prefix}{unknown[0]}",
                f"unknown field; runtimes refuse the whole spec (known here: {', '.join(sorted(fields))})",
            )
    return value


def _array(value: Any, at: str) -> Sequence[Any]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise InvalidSpecError(at, f"must be an array, not {_json_type(value)}")
    return value


def _string(value: Any, at: str) -> str:
    if not isinstance(value, str):
        raise InvalidSpecError(at, f"must be a string, not {_json_type(value)}")
    return value


def _strings(value: Any, at: str) -> None:
    for index, item in enumerate(_array(value, at)):
        _string(item, f"{at}[{index}]")


def _integer(value: Any, at: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSpecError(at, f"must be an integer, not {_json_type(value)}")
    if not low <= value <= high:
        raise InvalidSpecError(at, f"{value} is outside {low}..{high}")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, Sequence):
        return "an array"
    return type(value).__name__
