"""Secrets never reach the logs: a logging filter that masks credentials in every record.

Handlers of the proxy's process get :class:`RedactingFilter` (see :func:`install`); it rewrites
the message, its arguments and any traceback text before a formatter sees them. What it masks:
``Bearer``/``Basic`` credentials, the values of credential-like headers and query parameters
(Authorization, x-api-key, api_key, token, ...), OpenAI/Anthropic-style ``sk-...`` keys, and the
exact secrets it is given (the admin token).
"""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Iterable

MASK = "[REDACTED]"

# Credential schemes followed by their token.
_SCHEME = re.compile(r"(?i)\b(bearer|basic)(\s+)[^\s'\",;\\]+")
# `name: value` / `name=value` / `'name': 'value'` for credential-like names.
_NAMED = re.compile(
    r"(?i)((?:proxy-)?authorization|x-api-key|api[-_]?key|x-mars-admin-token|access[-_]?token"
    r"|secret|password|passwd)(['\"]?\s*[:=]\s*(?:b?['\"])?)"
    r"(?!\[REDACTED\])(?:(?:bearer|basic)\s+)?[^\s'\",;&\\]+"
)
_KEYS = re.compile(r"\b(sk-(?:ant-)?)[A-Za-z0-9_\-]{6,}")


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every credential it contains replaced by ``[REDACTED]``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    text = _SCHEME.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    text = _NAMED.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    return _KEYS.sub(lambda m: f"{m.group(1)}{MASK}", text)


class RedactingFilter(logging.Filter):
    """Masks credentials in a record's message and traceback; never drops a record."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self._secrets = tuple(s for s in secrets if s)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string must not lose the record, nor leak its args
            message = str(record.msg)
        record.msg, record.args = redact(message, self._secrets), None
        if record.exc_info and not record.exc_text:
            record.exc_text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        if record.exc_text:
            record.exc_text = redact(record.exc_text, self._secrets)
        if record.stack_info:
            record.stack_info = redact(record.stack_info, self._secrets)
        return True


def install(secrets: Iterable[str] = (), logger: logging.Logger | None = None) -> None:
    """Put the filter on every handler of ``logger`` (the root logger by default)."""
    target = logger if logger is not None else logging.getLogger()
    filt = RedactingFilter(secrets)
    for handler in target.handlers:
        handler.addFilter(filt)
