"""The process's own memory mappings, from /proc/self/smaps (Linux)."""

from __future__ import annotations


def mapping_of(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps entry of the mapping that holds `address` (its fields, plus
    "start"), or None when no mapping holds it."""
    entry: dict[str, str] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                start, end = (int(bound, 16) for bound in head.split("-"))
                if entry is not None:
                    return entry
                entry = {"start": str(start)} if start <= address < end else None
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    return entry
