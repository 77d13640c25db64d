"""Settings given as text on a command line (`KEY=JSON`), and the error that names the key at fault."""
from __future__ import annotations

import json


class ConfigError(ValueError):
    """A bad study config. The message starts with the dotted key at fault."""


def parse_set(pairs) -> dict:
    """`KEY=VALUE` strings -> dict; VALUE is JSON when it parses as JSON, else kept as a string."""
    out = {}
    for kv in pairs or ():
        key, sep, val = kv.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {kv!r}")
        try:
            out[key] = json.loads(val)
        except json.JSONDecodeError:
            out[key] = val
    return out
