"""The engine's on/off switches from the environment (the table in docs/architecture.md, "Engine
switches"): one reading of their values for every module that has one."""

import os


def env_switch(name: str, default: bool) -> bool:
    """`name` read as a switch: 1 / true / on, or 0 / false / off (any case, spaces ignored);
    unset or anything else: `default`."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "on"):
        return True
    if value in ("0", "false", "off"):
        return False
    return default
