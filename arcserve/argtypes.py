"""argparse value types shared by the command lines (`arcserve serve | generate`, `bench serve`):
vLLM's readable integers and numbers checked against a range."""

from __future__ import annotations

import argparse

_SCALE = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_int(text: str) -> int:
    """vLLM's readable integers: 4096, 4k (4,000), 4K (4,096), 25.6k, 2G (2 * 2**30)."""
    t = text.strip()
    try:
        if t and t[-1] in _SCALE:
            value = float(t[:-1]) * _SCALE[t[-1]]
            if value != int(value):
                raise ValueError
            return int(value)
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r} (e.g. 4096, 4k = 4,000, 4K = 4,096)") from None


def ranged(kind, low, high=None):
    """An argparse type: a `kind` number in [low, high]."""

    def parse(text: str):
        try:
            v = human_int(text) if kind is int else kind(text)
        except (ValueError, argparse.ArgumentTypeError):
            v = None
        if v is None or v < low or (high is not None and v > high):
            span = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be a number {span}, got {text!r}")
        return v

    return parse
