"""Sizes as llama.cpp users write and read them: binary units, '16GiB' in, '12.34 GiB' out."""

from __future__ import annotations

import math
import re

from ..errors import UsageError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int, flag: str = "--vram") -> int:
    """'16GiB', '16G', '16GB', '1.5GiB', '900MiB', '900M' or a byte count -> bytes.

    Every unit is binary (G = GB = GiB = 2**30): a "16 GB" card holds 16 GiB, and
    llama.cpp users write sizes that way.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m or (m.group(3) and not m.group(2) and m.group(3).lower() != "b"):
            raise UsageError(f"{flag}: cannot read {text!r} as a size",
                            hint="write e.g. 16GiB, 16G, 900MiB or a byte count")
        number, unit = m.group(1), m.group(2).lower()
        if not unit and "." in number:
            raise UsageError(f"{flag}: {text!r} is a fraction of a byte", hint="add a unit, e.g. 1.5GiB")
        value = math.floor(float(number) * _UNIT[unit]) if "." in number else int(number) * _UNIT[unit]
    if value <= 0:
        raise UsageError(f"{flag}: size must be positive, got {text!r}")
    return value


def parse_sizes(text: str, n_devices: int | None = None, flag: str = "--vram") -> tuple[int, ...]:
    """One size per device, comma-separated in -dev order ('16GiB,12GiB'); one size means each
    device gets it. `n_devices` None: as many as written. UsageError naming `flag` otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    if any(not p for p in parts):
        raise UsageError(f"{flag} {text}: an empty size", hint="write one size per device, e.g. 16GiB,12GiB")
    sizes = tuple(parse_size(p, flag) for p in parts)
    if n_devices is None:
        return sizes
    if len(sizes) == 1:
        return sizes * max(1, n_devices)
    if len(sizes) != n_devices:
        raise UsageError(f"{flag} {text}: {len(sizes)} sizes for {n_devices} device{'s' * (n_devices != 1)}",
                         hint="give one size per device in -dev order, or one size for each")
    return sizes


def gib(n: int) -> str:
    """Bytes as '12.34 GiB' for messages."""
    return f"{n / GiB:.2f} GiB"


def shortfall(n: int) -> str:
    """A difference in bytes, in a unit that keeps it visible: '1.25 GiB', '3.4 MiB', '12.0 KiB', '17 B'."""
    if n >= GiB:
        return gib(n)
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"


def fmt_bytes(n: int) -> str:
    """'812.3 MiB' below 1 GiB, '12.34 GiB' above; negative sizes keep their sign."""
    sign, n = ("-", -n) if n < 0 else ("", n)
    if n >= GiB:
        return f"{sign}{n / GiB:.2f} GiB"
    return f"{sign}{n / MiB:.1f} MiB"
