"""The environment variables the executors read ($SOFTPRIOR_CHECKPOINT_SECONDS,
$SOFTPRIOR_RAY_MAX_RETRIES, $SOFTPRIOR_SHARED_STORE): a value they cannot use is a ``SettingError``,
one line at the CLI naming the variable.
"""

from __future__ import annotations

import math
import os


class SettingError(ValueError):
    """An environment variable the executors read holds a value they cannot use (one line at the CLI)."""


def _env_int(name: str, default: int) -> int:
    """An integer from the environment (``default`` when unset); a value that is not one is a one-line
    error naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingError(f"${name} must be an integer, got {raw!r}") from None


def _env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment (``default`` when unset); anything else is a
    one-line error naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise SettingError(f"${name} must be a positive number of seconds, got {raw!r}")
    return value


def _env_flag(name: str) -> bool:
    """A yes/no switch from the environment: unset, 0, false, no or off is no; 1, true, yes or on is yes;
    anything else a one-line error naming the variable."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise SettingError(f"${name} must be 1 or 0 (yes / no), got {raw!r}")
