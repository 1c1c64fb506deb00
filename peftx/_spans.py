"""The layer-span grammar of paths. transformers names one layer by its index
(`layers.3.mlp`); a `peftx.models.LayerStack` segment holding layers `first..last` is named
`"first-last"` (`layers.0-11.mlp`). Models, the selection DSL and PEFT's targets all read
paths with these functions."""

import re

_SPAN = re.compile(r"(\d+)-(\d+)")
# a layer index or a span, as a regex fragment: groups `idx` and, for a span, `last`
INDEX_OR_SPAN = r"(?P<idx>\d+)(?:-(?P<last>\d+))?"


def span_name(first: int, last: int) -> str:
    """The name of a segment holding layers `first..last` (inclusive)."""
    return f"{first}-{last}"


def parse_span(name: str) -> tuple[int, int] | None:
    """`(first, last)` for a segment name such as `"0-11"`, else None."""
    match = _SPAN.fullmatch(name)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def find_span(path: str) -> tuple[list[str], int, tuple[int, int]] | None:
    """The first span in a dotted `path`: its parts, the span part's position among them,
    and `(first, last)`; None for a path with no span."""
    parts = path.split(".")
    for j, part in enumerate(parts):
        if (span := parse_span(part)) is not None:
            return parts, j, span
    return None
