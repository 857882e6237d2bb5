"""Canonical forms of prompt histories, for chain matching of id-less sessions.

Agent prompts are append-only: each call resends the previous messages, the reply it got and
something new. To recognise that, a request's history is reduced to a sequence of canonical
*units* (a chat message, or a byte of prompt text) whose prefixes can be hashed cheaply. Only
what a client echoes back faithfully goes into a unit (role, text, tool call name/arguments,
tool call id); ids, names of parts and formatting a client may rewrite are left out.

Pure code: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

HistoryKind = Literal["chat", "text", "tokens"]

_DIGEST = 16


def _encode(text: str) -> bytes:
    # JSON may carry lone surrogates ("\ud800"); they hash as themselves instead of failing.
    return text.encode("utf-8", "surrogatepass")


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def _text_of(content: Any) -> str:
    """Text of a message content: a string, or a list of parts (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out: list[str] = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    out.append(text)
                elif part.get("type") not in ("tool_use", "tool_result"):
                    # Images and other non-text parts: their full form, so they still count.
                    out.append(_dumps(part))
        return "".join(out)
    return _dumps(content)


def _unit(role: str, text: str, calls: Sequence[tuple[str, str]] = (), call_id: str = "") -> bytes:
    return _encode(_dumps([role, text, [list(c) for c in calls], call_id]))


def _args_text(args: Any) -> str:
    """Tool call arguments as one canonical string (clients may re-serialise the JSON)."""
    if isinstance(args, str):
        try:
            return _dumps(json.loads(args))
        except (ValueError, RecursionError):  # not JSON, or nested deeper than the stack
            return args
    return _dumps(args)


def chat_message_unit(msg: Any) -> bytes:
    """One OpenAI chat message → its canonical unit."""
    if not isinstance(msg, Mapping):
        return _unit("?", _dumps(msg))
    calls: list[tuple[str, str]] = []
    tool_calls = msg.get("tool_calls")
    for tc in tool_calls if isinstance(tool_calls, list) else ():
        fn = tc.get("function") if isinstance(tc, Mapping) else None
        if isinstance(fn, Mapping):
            calls.append((str(fn.get("name", "")), _args_text(fn.get("arguments", ""))))
    call_id = msg.get("tool_call_id")
    return _unit(
        str(msg.get("role", "")),
        _text_of(msg.get("content")),
        calls,
        call_id if isinstance(call_id, str) else "",
    )


def chat_units(messages: Iterable[Any]) -> list[bytes]:
    return [chat_message_unit(m) for m in messages]


def chat_reply_unit(text: str, tool_calls: Sequence[tuple[str, str]]) -> bytes:
    """The assistant message a client will echo after receiving this reply."""
    return _unit("assistant", text, [(n, _args_text(a)) for n, a in tool_calls])


def anthropic_message_unit(msg: Any) -> bytes:
    """One Anthropic /v1/messages message (content string or blocks) → its canonical unit."""
    if not isinstance(msg, Mapping):
        return _unit("?", _dumps(msg))
    content = msg.get("content")
    calls: list[tuple[str, str]] = []
    call_id = ""
    if isinstance(content, list):
        for block in content:
            if not isinstance(block, Mapping):
                continue
            if block.get("type") == "tool_use":
                calls.append((str(block.get("name", "")), _args_text(block.get("input", {}))))
            elif block.get("type") == "tool_result":
                call_id += str(block.get("tool_use_id", ""))
                calls.append(("=", _text_of(block.get("content"))))
    return _unit(str(msg.get("role", "")), _text_of(content), calls, call_id)


def anthropic_units(system: Any, messages: Iterable[Any]) -> list[bytes]:
    head = [_unit("system", _text_of(system))] if system else []
    return head + [anthropic_message_unit(m) for m in messages]


def responses_item_unit(item: Any) -> bytes:
    """One /v1/responses input or output item → its canonical unit."""
    if isinstance(item, str):
        return _unit("user", item)
    if not isinstance(item, Mapping):
        return _unit("?", _dumps(item))
    kind = item.get("type", "message")
    if kind == "function_call":
        call = (str(item.get("name", "")), _args_text(item.get("arguments")))
        return _unit("assistant", "", [call])
    if kind == "function_call_output":
        return _unit("tool", _text_of(item.get("output")), (), str(item.get("call_id", "")))
    if kind == "message":
        return _unit(str(item.get("role", "")), _text_of(item.get("content")))
    # Reasoning and other items: clients may drop or keep them; keep their text.
    return _unit(str(kind), _text_of(item.get("content") or item.get("summary")))


def responses_units(instructions: Any, input_: Any) -> list[bytes]:
    head = [_unit("system", _text_of(instructions))] if instructions else []
    if isinstance(input_, str):
        return [*head, _unit("user", input_)]
    if isinstance(input_, list):
        return head + [
            responses_item_unit(i)
            for i in input_
            if not (isinstance(i, Mapping) and i.get("type") == "reasoning")
        ]
    return head


def responses_output_units(output: Any) -> list[bytes]:
    if not isinstance(output, list):
        return []
    return [
        responses_item_unit(i)
        for i in output
        if not (isinstance(i, Mapping) and i.get("type") == "reasoning")
    ]


class History:
    """A request's prompt history, hashable at every prefix length.

    ``chat``: units are canonical messages, length counts messages. ``text`` and ``tokens``:
    units are bytes of UTF-8 text / 4-byte token ids, length counts text bytes / tokens.
    Sessions keep only a history's (length, hash) key, never its text, so a table of long
    agent contexts stays small.
    """

    __slots__ = ("_final", "_rolling", "data", "kind", "units")

    def __init__(self, kind: HistoryKind, units: Sequence[bytes] = (), data: bytes = b"") -> None:
        self.kind = kind
        self.units = tuple(units)
        self.data = data
        self._rolling: list[bytes] = []
        self._final: Any = None  # the rolling hasher after the last unit (chat)

    @staticmethod
    def of_units(units: Sequence[bytes]) -> History:
        return History("chat", units)

    @staticmethod
    def of_text(text: str) -> History:
        return History("text", data=_encode(text))

    @staticmethod
    def of_tokens(tokens: Sequence[int]) -> History:
        data = b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens)
        return History("tokens", data=data)

    @property
    def length(self) -> int:
        if self.kind == "chat":
            return len(self.units)
        return len(self.data) // (4 if self.kind == "tokens" else 1)

    def _roll(self) -> None:
        # Rolling hash: one pass gives every prefix's digest (length-prefixed units, so the
        # boundaries between messages are part of what is hashed).
        h = hashlib.blake2b(digest_size=_DIGEST)
        for u in self.units:
            _feed(h, u)
            self._rolling.append(h.copy().digest())
        self._final = h

    def prefix_hash(self, k: int) -> bytes:
        """Hash of the first ``k`` units (0 < k <= length)."""
        if self.kind != "chat":
            width = 4 if self.kind == "tokens" else 1
            return hashlib.blake2b(self.data[: k * width], digest_size=_DIGEST).digest()
        if self._final is None:
            self._roll()
        return self._rolling[k - 1]

    def key(self) -> tuple[int, bytes]:
        """(length, hash) of the whole history: what a retry of this request will match."""
        return self.length, self.prefix_hash(self.length)

    def key_after(self, reply: Reply) -> tuple[int, bytes]:
        """(length, hash) of this history followed by its reply: what the next request starts
        with. Equal to ``prefix_hash`` of a longer history with those units, by construction."""
        if self.kind == "chat":
            if self._final is None:
                self._roll()
            h = self._final.copy()
            for u in reply.units:
                _feed(h, u)
            return self.length + len(reply.units), h.digest()
        if self.kind == "text":
            tail = _encode(reply.text)
            h = hashlib.blake2b(self.data, digest_size=_DIGEST)
            h.update(tail)
            return self.length + len(tail), h.digest()
        # Token prompts: the reply's token ids are unknown, so the prompt alone is the prefix.
        return self.key()


def _feed(h: Any, unit: bytes) -> None:
    h.update(len(unit).to_bytes(8, "little"))
    h.update(unit)


@dataclass(frozen=True)
class Reply:
    """What a session's last request got back, in the form the next request will echo."""

    units: tuple[bytes, ...] = ()
    text: str = ""
