"""A GPU request (``GpuRequest``) and its vocabulary: device ids, counts, vendors, models and
memory sizes.

Each rule lives here once, so the Python API (``GpuRequest``), the CLI flags and every platform
adapter in ``vmsandbox.compat`` accept and reject exactly the same spellings, and the allocator
matches models and memory the same way for all of them. Every failure is an ``InvalidArgument``
whose message names the field, the value and what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

from vmsandbox.errors import InvalidArgument
from vmsandbox.host.bdf import MAX_DEVICE, parse_bdf

MiB = 1 << 20
GPU_VENDORS = ("nvidia", "amd")

# Drivers report slightly less memory than the marketing size (reserved regions, ECC): an
# "80GB" H100 reports 81559 MiB, 0.44% short of 80 GiB. A device may fall short of a request by
# at most this many percent; a 40 GB A100 stays far outside any 48 GiB or 80 GB request.
MEMORY_TOLERANCE_PERCENT = 1

DEVICE_ID_SPELLINGS = (
    "a PCI address ('0000:41:00.0', '41:00.0', 'pci_0000_41_00_0'), an NVIDIA UUID "
    "('GPU-' then 32 hex digits grouped 8-4-4-4-12), a ROCm UUID ('GPU-' then 16 hex "
    "digits), a DRM card name ('card1') or an inventory index ('0', '3')"
)
_UUID_RE = re.compile(r"gpu-[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}", re.I | re.A)
# ROCm names an AMD GPU "GPU-" plus the 16 hex digits of amdgpu's sysfs ``unique_id``
# (rocminfo's "Uuid", ROCR_VISIBLE_DEVICES); the DRM core names its card nodes cardN.
_ROCM_UUID_RE = re.compile(r"gpu-[0-9a-f]{16}", re.I | re.A)
_DRM_CARD_RE = re.compile(r"card([0-9]{1,4})", re.I | re.A)
_INDEX_RE = re.compile(r"[0-9]{1,4}", re.A)

_PREFIXES = "kMGTPE"  # "K" is read as "k"
_DECIMAL_UNITS = {p: 1000 ** (i + 1) for i, p in enumerate(_PREFIXES)} | {"K": 1000}
_BINARY_UNITS = {p: 1024 ** (i + 1) for i, p in enumerate(_PREFIXES)} | {"K": 1024}
_QUANTITY_RE = re.compile(r"([0-9]{1,30})(?:\.([0-9]{1,30}))?\s*(?:([kKMGTPE])(i?))?(B?)", re.A)
_QUANTITY_EXAMPLES = "such as '40Gi', '80GB', '1.5Ti' or a whole number of bytes"
_QUANTITY_UNITS = (
    "units are case-sensitive: k, M, G, T, P, E are powers of 1000 and Ki, Mi, Gi, Ti, Pi, Ei "
    "powers of 1024, each optionally followed by B"
)
_BINARY_QUANTITY_UNITS = "every unit is binary here: 80G = 80GB = 80Gi = 80GiB = 80 x 2^30 bytes"

_WORD_SPLIT_RE = re.compile(r"[\W_]+")
_SHOW_MAX = 80


def shown(value: object) -> str:
    """``repr(value)`` cut short enough for an error message; never raises."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # too deep, or an int with too many digits
        text = f"<{type(value).__name__}>"
    return text if len(text) <= _SHOW_MAX else text[: _SHOW_MAX - 3] + "..."


def invalid(field: str, value: object, message: str) -> InvalidArgument:
    """An ``InvalidArgument`` carrying the field and the (shortened) value in its details."""
    return InvalidArgument(message, details={"field": field, "value": shown(value)})


def require_count(value: object, field: str) -> int:
    """A number of GPUs: an ``int`` (not a bool) of at least 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(
            field, value, f"{field} must be a whole number of GPUs (an integer), got {shown(value)}"
        )
    if value < 1:
        raise invalid(field, value, f"{field} must be greater than 0, got {shown(value)}")
    return value


def normalise_vendor(value: object, field: str = "vendor") -> str:
    """A GPU vendor, trimmed and lower-cased: ``nvidia`` or ``amd``."""
    vendor = value.strip().lower() if isinstance(value, str) else None
    if vendor not in GPU_VENDORS:
        raise invalid(
            field,
            value,
            f"{field} {shown(value)} is not a GPU vendor: use {' or '.join(GPU_VENDORS)}",
        )
    return vendor


def model_words(text: str) -> tuple[str, ...]:
    """The case-folded words of a model or device name; any non-alphanumeric char separates."""
    return tuple(word for word in _WORD_SPLIT_RE.split(text.casefold()) if word)


def normalise_model(value: object, field: str = "model") -> str:
    """A model filter: a string with at least one letter or digit, trimmed."""
    if not isinstance(value, str) or not model_words(value):
        raise invalid(
            field,
            value,
            f"{field} {shown(value)} is not a GPU model: give a name such as 'H100' or "
            "'A100-SXM4-80GB', or leave it out to accept any model",
        )
    return value.strip()


def model_matches(model: str, device_name: str) -> bool:
    """Whether ``model``'s words appear, in order and adjacent, among ``device_name``'s words.

    Case-insensitive, and whole words only: "H100" and "h100 80gb" match "NVIDIA H100 80GB
    HBM3", "A100-SXM4-80GB" matches "NVIDIA A100-SXM4-80GB", while "A10" matches neither
    "NVIDIA A100" nor "NVIDIA A10G". A model with no letters or digits matches nothing.
    """
    want, have = model_words(model), model_words(device_name)
    if not want:
        return False
    return any(have[i : i + len(want)] == want for i in range(len(have) - len(want) + 1))


def normalise_device_id(raw: str, field: str = "devices") -> str:
    """One device id in canonical form.

    PCI addresses in any common spelling become ``0000:41:00.0`` (lowercase, domain of at least
    four digits); NVIDIA and ROCm UUIDs become ``GPU-`` plus lowercase hex; DRM card names
    become ``card`` plus the number without leading zeros, as are inventory indexes. UUIDs,
    card names and indexes are resolved against the inventory at allocation time.
    """
    text = raw.strip() if isinstance(raw, str) else None
    if not text:
        raise invalid(
            field, raw, f"{field} {shown(raw)} is not a device id: use {DEVICE_ID_SPELLINGS}"
        )
    if bdf := parse_bdf(text, libvirt=True):
        if bdf.slot <= MAX_DEVICE:
            return str(bdf)
        raise invalid(
            field, raw, f"{field} {shown(raw)} is not a PCI address: the device number is 00-1f"
        )
    if _UUID_RE.fullmatch(text) or _ROCM_UUID_RE.fullmatch(text):
        return "GPU-" + text[4:].lower()
    if match := _DRM_CARD_RE.fullmatch(text):
        return f"card{int(match.group(1))}"
    if _INDEX_RE.fullmatch(text):
        return str(int(text))
    if text[:4].upper() == "MIG-":
        raise invalid(
            field,
            raw,
            f"{field} {shown(raw)} is a MIG instance: passthrough gives whole GPUs, so name the "
            f"GPU itself with {DEVICE_ID_SPELLINGS}",
        )
    raise invalid(field, raw, f"{field} {shown(raw)} is not a device id: use {DEVICE_ID_SPELLINGS}")


def normalise_device_ids(raw: Iterable[str], field: str = "devices") -> tuple[str, ...]:
    """Device ids in canonical form, in the given order; one GPU named twice is rejected."""
    seen: dict[str, str] = {}
    for item in raw:
        canonical = normalise_device_id(item, field)
        if canonical in seen:
            raise invalid(
                field,
                item,
                f"{field} names GPU {canonical} twice ({shown(seen[canonical])} and "
                f"{shown(item)}): list each device once",
            )
        seen[canonical] = item
    return tuple(seen)


def check_count_matches_devices(
    count: int | None, devices: tuple[str, ...], count_field: str, devices_field: str
) -> None:
    """A count given together with device ids must equal the number of ids."""
    if count is not None and devices and count != len(devices):
        raise invalid(
            count_field,
            count,
            f"{count_field} {count} does not match the {len(devices)} device(s) in "
            f"{devices_field}: leave {count_field} out or make it {len(devices)}",
        )


def parse_memory_quantity(
    value: str | int | float,
    field: str,
    *,
    binary_units: bool = False,
    allow_zero: bool = False,
) -> int:
    """A memory size in bytes, from a Kubernetes quantity or a number of bytes.

    Strings: a number, optional spaces, and an optional unit: ``k``/``K``, ``M``, ``G``, ``T``,
    ``P``, ``E`` (powers of 1000) or the same with ``i`` (powers of 1024), each optionally
    followed by ``B``; so ``80G`` = ``80GB`` = 80 x 10^9 and ``80Gi`` = ``80GiB`` = 80 x 2^30.
    Units are case-sensitive (Kubernetes reads ``m`` as milli, so no lowercase ``m`` or ``g``).
    A decimal number (``1.5Gi``) is allowed when the result is a whole number of bytes. Ints,
    and floats with no fractional part, are bytes.

    ``binary_units`` reads every unit as binary (FlowMesh's rule: ``80G`` = ``80Gi``);
    ``allow_zero`` accepts 0, which callers read as "no constraint". Anything else, including
    negative sizes, NaN and infinities, is rejected with examples of what is allowed.
    """
    original = value
    units_help = _BINARY_QUANTITY_UNITS if binary_units else _QUANTITY_UNITS
    bad = invalid(
        field,
        value,
        f"{field} {shown(value)} is not a memory size: use a quantity {_QUANTITY_EXAMPLES} "
        f"({units_help})",
    )
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise bad
    if isinstance(value, str):
        match = _QUANTITY_RE.fullmatch(value.strip())
        if not match:
            raise bad
        whole, fraction, prefix, binary, _ = match.groups()
        number = Fraction(f"{whole}.{fraction or 0}")
        if prefix:
            number *= (_BINARY_UNITS if binary or binary_units else _DECIMAL_UNITS)[prefix]
        if number.denominator != 1:
            raise invalid(
                field,
                value,
                f"{field} {shown(value)} is not a whole number of bytes: use a quantity "
                f"{_QUANTITY_EXAMPLES}",
            )
        value = int(number)
    if value < 0 or (value == 0 and not allow_zero):
        raise invalid(
            field,
            original,
            f"{field} {shown(original)} must be greater than 0: use a quantity "
            f"{_QUANTITY_EXAMPLES}",
        )
    return value


def bytes_to_mib(size: int) -> int:
    """A size in bytes as whole MiB, rounded up, so a minimum is never weakened."""
    return -(-size // MiB)


def memory_satisfies(required_mib: int, device_mib: int) -> bool:
    """Whether a device with ``device_mib`` meets a minimum of ``required_mib``.

    The device may fall short by up to MEMORY_TOLERANCE_PERCENT (1%): an H100 reporting 81559
    MiB meets both "80GiB" (81920 MiB) and "80GB" (76294 MiB); a 40 GB A100 (40960 MiB) meets
    neither "80GB" nor "48GiB".
    """
    return device_mib * 100 >= required_mib * (100 - MEMORY_TOLERANCE_PERCENT)


@dataclass(frozen=True)
class GpuRequest:
    """Which GPUs a sandbox wants. No count, devices or ``all`` means one GPU.

    Validated and normalised on construction by the rules above:
    ``devices`` holds canonical BDFs (``0000:41:00.0``), NVIDIA or ROCm UUIDs (``GPU-...``), DRM
    card names (``card1``) or inventory indexes (as strings), in the order given; all but BDFs
    are resolved against the inventory at allocation time. ``count`` with ``devices`` must equal
    their number; ``all`` excludes both. ``vendor``, ``model`` (whole-word match) and
    ``min_memory_mib`` filter.
    """

    count: int | None = None
    devices: tuple[str, ...] = ()
    all: bool = False
    vendor: str | None = None
    model: str | None = None
    min_memory_mib: int | None = None

    def __post_init__(self) -> None:
        if self.count is not None:
            require_count(self.count, "count")
        if not isinstance(self.devices, tuple | list):
            raise invalid(
                "devices",
                self.devices,
                f"devices must be a list of device ids, got {shown(self.devices)}",
            )
        object.__setattr__(self, "devices", normalise_device_ids(self.devices, "devices"))
        if not isinstance(self.all, bool):
            raise invalid("all", self.all, f"all must be true or false, got {shown(self.all)}")
        if self.vendor is not None:
            object.__setattr__(self, "vendor", normalise_vendor(self.vendor, "vendor"))
        if self.model is not None:
            object.__setattr__(self, "model", normalise_model(self.model, "model"))
        if self.min_memory_mib is not None and (
            isinstance(self.min_memory_mib, bool)
            or not isinstance(self.min_memory_mib, int)
            or self.min_memory_mib < 1
        ):
            raise invalid(
                "min_memory_mib",
                self.min_memory_mib,
                f"min_memory_mib must be a whole number of MiB greater than 0, "
                f"got {shown(self.min_memory_mib)}",
            )
        if self.all and (self.count is not None or self.devices):
            taken = "count" if self.count is not None else "devices"
            raise invalid(
                taken,
                getattr(self, taken),
                f"all=True takes every free GPU, so {taken} cannot be given with it: "
                f"drop {taken} or all",
            )
        check_count_matches_devices(self.count, self.devices, "count", "devices")

    def wanted(self) -> int | None:
        """How many GPUs this asks for; None means every free one (``all``)."""
        if self.all:
            return None
        return self.count or len(self.devices) or 1
