"""Hypothesis strategies for the values a JSON schema describes (the subset an OpenAPI document of pydantic models
uses: ``$ref``, ``anyOf``, ``enum``, ``const``, the JSON types with their bounds, ``items``, ``properties``), and
for the values around them: any JSON at all in place of a field, and unknown keys. Numbers and lengths stay small
most of the time, so valid requests stay cheap to serve, with the edges (bounds, huge and non-finite numbers) in
the mix."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

TEXT = st.text(max_size=24)
ANY_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


def one_in(n: int) -> st.SearchStrategy[bool]:
    """True about once in ``n`` draws (not biased towards True as a small integer's bounds are)."""
    return st.sampled_from(range(n)).map(lambda i: i == n - 1)


def _integers(schema: dict[str, Any], inside: bool) -> st.SearchStrategy[int]:
    if "minimum" in schema:
        low = schema["minimum"]
    elif "exclusiveMinimum" in schema:
        low = schema["exclusiveMinimum"] + 1
    else:
        low = 0 if inside else -8
    high = schema.get("maximum", low + 40)
    if inside:
        return st.integers(low, high)
    edges = [low - 1, low, high, high + 1, 0, 1, -1, 2**31, 2**63, -(2**63), 10**30]
    return st.integers(low, max(low, high)) | st.sampled_from(edges)


def _numbers(schema: dict[str, Any], inside: bool) -> st.SearchStrategy[float]:
    low = schema.get("minimum", schema.get("exclusiveMinimum", -4.0))
    high = schema.get("maximum", low + 4.0)
    # The bounds and just inside them, down to the smallest double above a bound of 0.
    near = [low + d for d in (5e-324, 1e-300, 1e-40, 1e-8)] + [high, high - 1e-12]
    if "minimum" in schema:
        near.append(low)
    if not inside:  # and outside them, and the extremes
        near += [low - 0.5, high + 0.5, -0.0, 1e300, -1e300, math.pi]
    in_range = st.floats(low, high, allow_nan=False, exclude_min="exclusiveMinimum" in schema)
    return st.booleans().flatmap(lambda edge: st.sampled_from(near) if edge else in_range)


def _strings(schema: dict[str, Any]) -> st.SearchStrategy[str]:
    size = schema.get("minLength", 0)
    return st.text(min_size=size, max_size=size + 24) | st.sampled_from(["", " ", "\x00", "\ud7ff", "🙂" * 3])


def _arrays(schema: dict[str, Any], defs: dict[str, Any], inside: bool) -> st.SearchStrategy[list[Any]]:
    items = from_schema(schema.get("items", {}), defs, inside)
    size = schema.get("minItems", 0)
    lists = st.lists(items, min_size=size, max_size=size + 4)
    return lists if inside else lists | st.just([])


def _objects(schema: dict[str, Any], defs: dict[str, Any], inside: bool) -> st.SearchStrategy[dict[str, Any]]:
    props = schema.get("properties")
    if not props:
        return st.dictionaries(TEXT, ANY_JSON, max_size=4)
    required = set(schema.get("required", ()))
    fields = {name: from_schema(sub, defs, inside) for name, sub in props.items()}

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        out: dict[str, Any] = {}
        # A few of the optional fields at a time, each as likely as the others: a request that sets every one is
        # refused for one of them.
        chosen = {name for name in sorted(fields) if name not in required and draw(one_in(10))}
        for name in sorted(required | chosen):
            if name in required and draw(one_in(20)):
                continue  # now and then a required field is missing
            out[name] = draw(ANY_JSON if draw(one_in(20)) else fields[name])
        if draw(one_in(10)):
            out[draw(TEXT)] = draw(ANY_JSON)
        return out

    return build()


def from_schema(schema: dict[str, Any], defs: dict[str, Any], inside: bool = False) -> st.SearchStrategy[Any]:
    """Values for ``schema``; ``defs`` holds the documents' components by name for ``$ref``. ``inside``: numbers
    within the schema's bounds only (at and near them), so most values are valid."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(defs[name], defs, inside))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs, inside) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        return _objects(schema, defs, inside)
    builders = {
        "integer": lambda: _integers(schema, inside),
        "number": lambda: _numbers(schema, inside),
        "string": lambda: _strings(schema),
        "boolean": st.booleans,
        "null": st.none,
        "array": lambda: _arrays(schema, defs, inside),
    }
    if kind in builders:
        return builders[kind]()
    return ANY_JSON  # a field of any type
