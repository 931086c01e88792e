"""Declarative weight mapping: canonical names <- checkpoint names, strict.

Every family lists canonical names (with a ``{layer}`` placeholder) and, per format, the
checkpoint name of each. Resolution reports every missing and every unexpected weight in one
error: a checkpoint either loads completely or not at all (never ``strict=False``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

from ..errors import CheckpointError

_MAX_LISTED = 20


def resolve_weight_names(
    required: list[str],
    optional: list[str],
    aliases: dict[str, str],
    num_layers: int | Mapping[str, int],
    available: Iterable[str],
    ignored_patterns: Iterable[str],
    source: str,
) -> dict[str, str]:
    """Return {canonical name: checkpoint name} or raise CheckpointError listing all problems.

    ``num_layers`` is the block count for ``{layer}``, or a mapping placeholder -> count when a
    model has stacks of different depths (an encoder-decoder: ``{layer}`` and ``{encoder_layer}``).
    """
    available = set(available)
    counts = {"layer": num_layers} if isinstance(num_layers, int) else dict(num_layers)
    mapping: dict[str, str] = {}
    missing: list[str] = []
    for templates, needed in ((required, True), (optional, False)):
        for template in templates:
            for index in template_indices(template, counts):
                canonical = template.format(**index)
                checkpoint_name = aliases[template].format(**index)
                if checkpoint_name in available:
                    mapping[canonical] = checkpoint_name
                elif needed:
                    missing.append(checkpoint_name)
    used = set(mapping.values())
    ignored = [re.compile(p) for p in ignored_patterns]
    unexpected = sorted(n for n in available - used if not any(p.match(n) for p in ignored))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing weight(s): {_listing(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected weight(s): {_listing(unexpected)}")
        raise CheckpointError(f"checkpoint {source} does not match its config: " + "; ".join(parts))
    return mapping


def template_indices(template: str, counts: Mapping[str, int]) -> list[dict[str, int]]:
    """The placeholder values a template expands to: one per block for ``{layer}``-like names."""
    placeholder = next((name for name in counts if f"{{{name}}}" in template), None)
    return [{placeholder: i} for i in range(counts[placeholder])] if placeholder else [{}]


def check_weight_shapes(module: ModuleType, config: Any, mapping: dict[str, str],
                        shape_of: Callable[[str], Sequence[int]], source: str, gguf: bool = False) -> None:
    """Compare every weight's shape (read from the checkpoint's header, before any data) with what
    the family declares for this config (``weight_shapes(config)``, HF layout); one CheckpointError
    lists every tensor of the wrong shape, so none ever reaches a matmul. ``gguf``: shapes are
    GGUF's, converted by the family's ``gguf_shape_to_hf`` where its layout differs."""
    declared = getattr(module, "weight_shapes", None)
    if declared is None:  # a family that declares no shapes (tests/unit/test_hardening.py flags it)
        return
    expected = {}
    for template, shape in declared(config).items():
        for index in template_indices(template, config.layer_counts):
            expected[template.format(**index)] = tuple(shape)
    to_hf = getattr(module, "gguf_shape_to_hf", None) if gguf else None
    wrong = []
    for canonical, name in mapping.items():
        found = tuple(int(d) for d in shape_of(name))
        if to_hf is not None:
            found = tuple(to_hf(canonical, found))
        want = expected.get(canonical)
        if want is not None and found != want:
            wrong.append(f"{name} (expected {list(want)}, found {list(found)})")
    if wrong:
        raise CheckpointError(f"checkpoint {source} has {len(wrong)} weight(s) whose shape does not match its "
                              f"config: {_listing(wrong)}")


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")
