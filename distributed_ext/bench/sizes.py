"""Sizes on the command line and in the tables: parsed with units, shown in binary units."""

from __future__ import annotations

import argparse
import math

WORKLOADS = ("bytes", "state-dict", "export")
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30,
          "gib": 2**30, "t": 2**40, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "tb": 10**12}
_UNIT_NAMES = "B, KiB, MiB, GiB, TiB (binary), KB, MB, GB, TB (decimal)"
# Below this a figure measures the call's fixed cost, not a transfer (and the workloads'
# shapes -- 4096-wide matrices, a Llama model -- cannot be made that small).
MIN_SIZE = 2**20


def parse_size(text: str) -> int:
    """A per-rank size: :func:`parse_bytes`, at least ``MIN_SIZE``."""
    nbytes = parse_bytes(text, minimum=0)
    if nbytes < MIN_SIZE:
        raise argparse.ArgumentTypeError(
            f"size {text!r} is {nbytes} bytes; the benchmark needs at least 1 MiB per rank "
            "(a number without a unit is bytes: --size 1 is one byte; write 1GiB)")
    return nbytes


def parse_bytes(text: str, minimum: int = 1) -> int:
    """'1GiB', '512MiB', '1.5GB', '4096' -> bytes (at least ``minimum``); argparse-friendly
    errors otherwise (naming the units)."""
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in _UNITS or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: expected a positive number with an optional unit ({_UNIT_NAMES}"
            "), e.g. 512MiB, 1GiB, 1.5GB or 1048576 (bytes)"
        )
    nbytes = int(value * _UNITS[unit])
    if nbytes < minimum:
        raise argparse.ArgumentTypeError(f"size {text!r} is under {minimum} byte(s)")
    return nbytes


def format_size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{int(n)} B"
