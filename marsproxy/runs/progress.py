"""A progress bar per policy run: tqdm when installed, else one line rewritten in place."""

from __future__ import annotations

import sys
from typing import Any, TextIO


class Progress:
    def __init__(self, label: str, total: int, out: TextIO | None = None) -> None:
        self.label, self.total, self.done = label, total, 0
        self._out = out
        self._bar: Any = None
        if out is None:
            return
        try:
            from tqdm import tqdm
        except ImportError:  # optional: a plain counter does the job
            self._line()
            return
        self._bar = tqdm(total=total, desc=label, unit="session", file=out, leave=True,
                         dynamic_ncols=True, mininterval=0.5)

    def _line(self) -> None:
        if self._out is not None:
            self._out.write(f"\r{self.label}: {self.done}/{self.total} sessions")
            self._out.flush()

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        else:
            self._line()

    def close(self, note: str = "") -> None:
        """Ends the bar; ``note`` (how the run went) stays after it."""
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.close()
        elif self._out is not None:
            self._out.write(f" ({note})\n" if note else "\n")
            self._out.flush()


def stderr_progress(label: str, total: int) -> Progress:
    return Progress(label, total, sys.stderr)
