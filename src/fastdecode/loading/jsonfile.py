"""Reading the small JSON files of a model folder, with the error type of whoever asks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import FastDecodeError


def read_json_object(path: Path, what: str, error: type[FastDecodeError]) -> dict[str, Any]:
    """The JSON object in ``path``; ``error`` naming ``what`` and the path if it is unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"cannot read {what} {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{what} {path} is not a JSON object")
    return data
