"""The docs stay references: the module map matches the tree, config keys they name exist,
links between them resolve, and nothing points outside the repository."""

from __future__ import annotations

import importlib.util
import re
import sys
import typing
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import BaseModel

from marsproxy.config import MarsConfig

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def _module_map() -> ModuleType:
    spec = importlib.util.spec_from_file_location("module_map", REPO / "scripts" / "module_map.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["module_map"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_module_map_in_architecture_md_is_current() -> None:
    mm = _module_map()
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    stale = "docs/architecture.md's module map is stale: run `make module-map`"
    assert mm.updated(text) == text, stale


def test_module_map_walks_nested_packages_and_skips_caches(tmp_path: Path) -> None:
    mm = _module_map()
    root = tmp_path / "pkg"
    (root / "deep" / "deeper").mkdir(parents=True)
    (root / "__pycache__").mkdir()
    (root / "__init__.py").write_text('"""The package."""\n')
    (root / "a.py").write_text('"""Holds A (spec §5.2). More text.\n\nDetail."""\n')
    (root / "deep" / "__init__.py").write_text("")
    (root / "deep" / "b.py").write_text('"""Holds ``B`` | and :class:`C`\nacross lines."""\n')
    (root / "deep" / "deeper" / "__init__.py").write_text("")
    (root / "deep" / "deeper" / "c.py").write_text("x = 1\n")
    (root / "__pycache__" / "a.cpython-311.py").write_text('"""Cached."""\n')
    (root / "data").mkdir()  # not a package: no __init__.py
    (root / "data" / "d.py").write_text('"""Not a module of the package."""\n')

    out = mm.render(root)
    assert "#### `pkg/`\nThe package.\n" in out
    assert "| `a.py` | Holds A. |" in out  # first sentence, the outside reference dropped
    assert "#### `pkg/deep/`" in out
    assert "| `b.py` | Holds `B` \\| and `C` across lines. |" in out
    assert "| `c.py` |  |" in out  # no docstring: listed, empty
    assert "Cached" not in out and "d.py" not in out

    doc = "# T\n\nbefore\n" + mm.BEGIN + "stale map\n" + mm.END + "after\n"
    new = mm.updated(doc)
    assert new.startswith("# T\n\nbefore\n" + mm.BEGIN) and new.endswith(mm.END + "after\n")
    assert "stale map" not in new and mm.updated(new) == new
    with pytest.raises(SystemExit):
        mm.updated("# no markers\n")


def _config_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        key = prefix + name
        keys.add(key)
        args = typing.get_args(field.annotation) or (field.annotation,)
        for arg in args:
            inner = typing.get_args(arg) or (arg,)  # list[WorkerConfig], tuple[...]
            for t in inner:
                if isinstance(t, type) and issubclass(t, BaseModel):
                    keys |= _config_keys(t, key + ".")
    return keys


CONFIG_KEYS = _config_keys(MarsConfig)
SECTIONS = {k for k in CONFIG_KEYS if "." not in k}
# `section.key[.more]` in backticks, optionally with a value (`admission.window_max: 64`, `=…`).
_KEY = re.compile(r"`([a-z_]+(?:\.[a-z_0-9]+)+)(?:\s*[:=][^`]*)?`")


def _dotted_keys(text: str) -> set[str]:
    return {m.group(1) for m in _KEY.finditer(text) if m.group(1).split(".")[0] in SECTIONS}


def test_config_key_walk_finds_nested_keys() -> None:
    assert {"admission.window_max", "probes.cpu.tool_cpus", "store.tls.ca_file",
            "workers.url", "tools.location"} <= CONFIG_KEYS


@pytest.mark.parametrize("doc", ["tuning.md", "clients.md"])
def test_every_config_key_named_in_the_doc_exists(doc: str) -> None:
    named = _dotted_keys((DOCS / doc).read_text(encoding="utf-8"))
    assert len(named) >= 5, f"docs/{doc} names hardly any config keys: is the pattern right?"
    unknown = sorted(named - CONFIG_KEYS)
    assert not unknown, f"docs/{doc} names config keys that do not exist: {unknown}"


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.name} links to missing files: {broken}"


# configuration.md is generated from the config's field descriptions (the config's own test).
_OUTSIDE = re.compile(r"DESIGN\b|\.\./shared|shared/(?:notes|seeds|traces)")


@pytest.mark.parametrize(
    "page", [p for p in _pages() if p.name != "configuration.md"], ids=lambda p: p.name
)
def test_docs_refer_to_nothing_outside_the_repository(page: Path) -> None:
    mm = _module_map()
    text = page.read_text(encoding="utf-8")
    if mm.BEGIN in text:  # the map quotes the modules' docstrings: their own business
        head, _, rest = text.partition(mm.BEGIN)
        text = head + rest.partition(mm.END)[2]
    hits = [m.group(0) for m in _OUTSIDE.finditer(text)]
    assert not hits, f"{page.name} refers outside the repository: {hits}"
