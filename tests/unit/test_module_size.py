"""No module of the package is over 400 lines: small modules named for what they hold."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "marsproxy"
LIMIT = 400


def _sizes() -> dict[str, int]:
    return {
        str(p.relative_to(PACKAGE)): len(p.read_text(encoding="utf-8").splitlines())
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def test_no_module_is_over_the_limit() -> None:
    over = {m: n for m, n in _sizes().items() if n > LIMIT}
    assert not over, f"modules over {LIMIT} lines (split them along their seams): {over}"

