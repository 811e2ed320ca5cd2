"""Byte sizes as people write them: "12GB", "300MB", "1.5GiB", "512KiB", "4096"; and
durations as the commands print them.

One parser shared by the CLI (`--mem`) and the library (`plan_memory`, profiles).
KB/MB/GB/TB are decimal (1000^k), KiB/MiB/GiB/TiB binary (1024^k), as the SI and IEC
say; a plain number (or "B") is bytes. Case is ignored ("12gb", "1.5gib").
"""
from __future__ import annotations

import re

from netdsl.errors import NetdslError

UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)(?:[eE](?P<exp>[+-]?\d+))?"
                      r"\s*(?P<unit>[a-zA-Z]*)\s*$")


class SizeError(NetdslError):
    """A byte size that cannot be read."""


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes in `text`; raises SizeError naming `what` (e.g. "--mem") when it is bad."""
    if isinstance(text, bool):
        raise SizeError(f"{what}: expected a size such as 12GB, got {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise SizeError(f"{what}: a size must be positive, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if m is None:
        raise SizeError(f"{what}: cannot read {text!r} as a size; write a number with an "
                        "optional unit: bytes, KB/MB/GB/TB (powers of 1000) or "
                        "KiB/MiB/GiB/TiB (powers of 1024), e.g. 12GB, 300MB, 1.5GiB")
    unit = m.group("unit").lower()
    if unit not in UNITS:
        hint = {"k": "KB or KiB", "m": "MB or MiB", "g": "GB or GiB",
                "t": "TB or TiB"}.get(unit, "")
        raise SizeError(f"{what}: unknown unit {m.group('unit')!r} in {text!r}; use B, "
                        "KB, MB, GB, TB (decimal) or KiB, MiB, GiB, TiB (binary)"
                        + (f" (did you mean {hint}?)" if hint else ""))
    value = float(m.group("num")) * 10 ** int(m.group("exp") or 0) * UNITS[unit]
    if value <= 0:
        raise SizeError(f"{what}: a size must be positive, got {text!r}")
    if value < 1:
        raise SizeError(f"{what}: {text!r} is less than one byte")
    return int(round(value))


def format_bytes(n: float) -> str:
    """Bytes as every command prints them: decimal prefixes, as --mem takes budgets
    (12e9 -> '12.00 GB', 1536 -> '1.54 kB'); --json gives bytes."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}B"
    return f"{int(n)} B"


def format_seconds(s: float) -> str:
    """A duration at a scale that shows its digits: 0.2514 -> '0.251 s', 0.004123 ->
    '4.12 ms', 0.00054 -> '0.540 ms', 3.2e-5 -> '32.0 us' (a small network's predicted
    step on a GPU profile is microseconds)."""
    if abs(s) >= 0.1 or s == 0:
        return f"{s:,.3f} s"
    if abs(s) >= 1e-4:
        return f"{s * 1e3:.{2 if abs(s) >= 1e-3 else 3}f} ms"
    return f"{s * 1e6:.1f} us"
