"""A small JSON Schema checker for the keywords msgspec's generated schemas use.

It refuses a schema with any other keyword (so it can never pass a value by ignoring a rule
it does not know) and, with `closed=True`, refuses object keys a schema does not list (so
the server cannot send an undocumented field).
"""
from __future__ import annotations

_RULES = {"$ref", "anyOf", "enum", "type", "properties", "required", "additionalProperties",
          "items", "minimum", "maximum"}
_NOTES = {"title", "description", "default", "discriminator", "$schema", "$defs"}
_TYPES = {"null": lambda v: v is None, "boolean": lambda v: isinstance(v, bool),
          "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "string": lambda v: isinstance(v, str), "array": lambda v: isinstance(v, list),
          "object": lambda v: isinstance(v, dict)}


def errors(value, schema: dict, root: dict, closed: bool = True, at: str = "$") -> list[str]:
    """Where `value` breaks `schema` (empty: it conforms)."""
    unknown = set(schema) - _RULES - _NOTES
    assert not unknown, f"schema keyword(s) this checker does not know: {unknown}"
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/$defs/")
        return errors(value, root["$defs"][name], root, closed, at)
    if "anyOf" in schema:
        if any(not errors(value, option, root, closed, at) for option in schema["anyOf"]):
            return []
        return [f"{at}: {value!r} matches none of {len(schema['anyOf'])} options"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{at}: {value!r} not in {schema['enum']}"]
    if "type" in schema and not _TYPES[schema["type"]](value):
        return [f"{at}: {value!r} is not {schema['type']}"]
    found = []
    if "minimum" in schema and value < schema["minimum"]:
        found.append(f"{at}: {value} < {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        found.append(f"{at}: {value} > {schema['maximum']}")
    if "items" in schema:
        for i, item in enumerate(value):
            found += errors(item, schema["items"], root, closed, f"{at}[{i}]")
    if isinstance(value, dict):
        found += _object_errors(value, schema, root, closed, at)
    return found


def _object_errors(value: dict, schema: dict, root: dict, closed: bool, at: str) -> list[str]:
    properties = schema.get("properties", {})
    found = [f"{at}: missing {key!r}" for key in schema.get("required", []) if key not in value]
    for key, item in value.items():
        if key in properties:
            found += errors(item, properties[key], root, closed, f"{at}.{key}")
        elif "additionalProperties" in schema:
            found += errors(item, schema["additionalProperties"], root, closed, f"{at}.{key}")
        elif closed:
            found.append(f"{at}: {key!r} is not in the schema")
    return found
