"""What a user wrote, read strictly and explained: the YAML of a config file, and the messages of
values that do not validate.

A file is parsed from its bytes under its own name, so that every syntax error (bytes that are
not UTF-8 included) names the file, line and column; a key given twice in one mapping is an
error, where YAML loaders keep the last one and drop the rest (a second ``admission:`` block
would silently undo the first). A validation message names the key and the value it got, except
where the value is a whole section (the check names its keys) or a credential.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import ValidationError
from yaml.constructor import ConstructorError

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Hashable] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:  # `<<: *base` keys may be overridden, as YAML says
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # the base loader refuses it with its own message
            if key in seen:
                raise ConstructorError("while constructing a mapping", node.start_mark,
                                       f"found the key {key!r} twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml_file(path: Path) -> Any:
    """The file's YAML document; ``OSError`` if it cannot be read, ``yaml.YAMLError`` (whose
    text names the file) if it is not YAML, not UTF-8, or gives a key twice."""
    with path.open("rb") as f:
        return yaml.load(f, Loader=_UniqueKeyLoader)  # a SafeLoader: no tags run code


# Keys whose values are credentials, or URLs that may carry one.
_SECRET_KEYS = frozenset({"admin_token"})
_URL_KEYS = frozenset({"redis_url", "url"})


def _shown(key: str, value: Any) -> str:
    last = key.rsplit(".", 1)[-1]
    if last in _SECRET_KEYS:
        return "(value hidden)"
    if last in _URL_KEYS and isinstance(value, str) and urlsplit(value).password is not None:
        return "(a URL with a password, hidden)"
    return repr(value)


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        elif err["type"] == "value_error":  # our own checks, which name what they refused
            lines.append(f"  {key}: {err['msg'].removeprefix('Value error, ')}")
        elif isinstance(value, Mapping):
            lines.append(f"  {key}: {err['msg']}")
        else:
            lines.append(f"  {key}: {err['msg']} (got {_shown(key, value)})")
    return "\n".join(lines)
