"""Request bodies: read within the size limit, parse, and adjust only where the proxy must."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from marsproxy.core.identity import Route
from marsproxy.core.lax_bool import vllm_true

SCHEDULED_ROUTES: dict[str, Route] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}


class BodyError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


async def read_limited(request: web.Request, max_bytes: int) -> bytes:
    """The whole body, or ``BodyError(413)`` as soon as it is known to be too large."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise BodyError(
            413,
            "body_too_large",
            f"request body of {request.content_length} bytes exceeds server.max_body_bytes"
            f" ({max_bytes})",
        )
    try:
        if request.content_length is not None and "Content-Encoding" not in request.headers:
            # Known and within the limit: one read (aiohttp stops at Content-Length). An encoded
            # body goes through the counting loop: its decoded size is not bounded by the header.
            return await request.read()
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.content.iter_chunked(64 * 1024):
            size += len(chunk)
            if size > max_bytes:
                raise BodyError(
                    413, "body_too_large",
                    f"request body exceeds server.max_body_bytes ({max_bytes})",
                )
            chunks.append(chunk)
    except (HttpProcessingError, web.RequestPayloadError) as exc:
        # Bad chunking, or a Content-Encoding that does not decode.
        raise BodyError(
            400, "invalid_body", f"request body cannot be read ({type(exc).__name__})"
        ) from exc
    return b"".join(chunks)


@dataclass
class ParsedBody:
    obj: dict[str, Any]
    raw: bytes  # what goes upstream: the original bytes unless the proxy changed something
    stream: bool
    strip_usage_chunk: bool  # the proxy added include_usage; the client did not ask for it


def parse_body(route: Route, raw: bytes) -> ParsedBody:
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise BodyError(400, "invalid_json", f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # nesting deeper than the interpreter's stack
        raise BodyError(400, "invalid_json", "request body is nested too deeply") from exc
    if not isinstance(obj, dict):
        raise BodyError(400, "invalid_body", "request body must be a JSON object")
    stream = vllm_true(obj.get("stream"))
    strip = False
    if stream and route in ("chat", "completions"):
        opts = obj.get("stream_options")
        if not (isinstance(opts, dict) and vllm_true(opts.get("include_usage"))):
            # Ask for usage on the client's behalf; the relay drops the extra chunk again.
            raw = _with_include_usage(raw, obj)
            strip = True
    return ParsedBody(obj, raw, stream, strip)


def dump_json(value: Any) -> bytes:
    """``value`` as compact JSON bytes, non-ASCII text as UTF-8. A string with a lone surrogate
    (JSON allows ``"\\ud83d"``, and clients that cut text at UTF-16 boundaries send it) has no
    UTF-8 form: such a body is written with escapes, as the client wrote it. A body that parsed
    but nests too deep to be written again from here is the client's error (``BodyError``)."""
    try:
        try:
            return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
        except UnicodeEncodeError:
            return json.dumps(value, separators=(",", ":")).encode()
    except RecursionError as exc:
        raise BodyError(400, "invalid_json", "request body is nested too deeply") from exc


def splice_new_key(raw: bytes, obj: dict[str, Any], key: str, value: Any) -> bytes:
    """``raw`` with a top-level ``key`` it does not have yet, set in ``obj`` (its parse) too.

    Spliced in before the object's closing brace: the client's bytes go upstream unchanged
    otherwise, and nothing is re-serialized (this runs on every request that the proxy edits).
    """
    assert key not in obj
    sep = b"," if obj else b""
    obj[key] = value
    end = len(raw.rstrip(b" \t\r\n")) - 1  # the closing brace (parsed as an object)
    item = dump_json({key: value})[1:-1]
    return raw[:end] + sep + item + raw[end:]


def set_key(raw: bytes, obj: dict[str, Any], key: str, value: Any) -> bytes:
    """``raw`` (and ``obj``) with top-level ``key`` set to ``value``: spliced in when new,
    unchanged when it already holds ``value``, else the body serialized again."""
    if key not in obj:
        return splice_new_key(raw, obj, key, value)
    if obj[key] == value:
        return raw
    obj[key] = value
    return dump_json(obj)


def _with_include_usage(raw: bytes, obj: dict[str, Any]) -> bytes:
    """``raw`` asking for usage; ``obj`` (its parse) gets the same ``stream_options``.

    The common case, no ``stream_options`` at all, splices the key in before the object's
    closing brace: the client's bytes go upstream unchanged otherwise, and nothing is
    re-serialized. Only a client that sent ``stream_options`` without ``include_usage`` gets
    its body serialized again, with the key merged in.
    """
    if "stream_options" not in obj:
        return splice_new_key(raw, obj, "stream_options", {"include_usage": True})
    opts = obj["stream_options"]
    base = opts if isinstance(opts, dict) else {}
    obj["stream_options"] = {**base, "include_usage": True}
    return dump_json(obj)
