"""Which unscheduled paths the proxy relays to a worker: the inference API by default, the rest
only when the operator lists it (``auth.passthrough_routes``) or calls it with the admin token.

vLLM 0.32 serves more than inference on the same port: elastic scaling, and with its
development or LoRA switches ``/pause``, ``/sleep``, ``/collective_rpc``, adapter loading,
profiling. Relaying every path would hand all of it to any client of the proxy. The pure
:func:`classify` decides; :class:`PassthroughGate` answers a refusal (OpenAI-shaped 403 for a
known operator route, 404 for anything else) before the relay reads the body. docs/security.md
lists the routes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Literal

from aiohttp import web

from marsproxy.gateway.http.auth import AdminAuth
from marsproxy.gateway.http.bodies import SCHEDULED_ROUTES
from marsproxy.gateway.http.errors import error_response
from marsproxy.telemetry.tallies import Tally

# vLLM 0.32's client-facing routes beyond the scheduled ones (docs "Online Serving": OpenAI,
# Anthropic, Cohere, SageMaker, pooling, speech-to-text, renderer and utility APIs).
INFERENCE_ROUTES: frozenset[str] = frozenset({
    "/v1/models",
    "/v1/chat/completions/batch",
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/v2/embed",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/invocations",
    "/tokenize",
    "/detokenize",
    "/health",
    "/ping",
    "/version",
})
# Stored responses: GET /v1/responses/{id}, POST /v1/responses/{id}/cancel.
INFERENCE_PREFIXES: tuple[str, ...] = ("/v1/responses/",)


def stored_response_id(path: str) -> str | None:
    """The response id a stored response's route names (``None``: another route)."""
    rid = path.removeprefix("/v1/responses/").split("/", 1)[0]
    return rid if path.startswith("/v1/responses/") and rid else None


# vLLM 0.32's operator routes (elastic EP, dev mode, LoRA runtime loading, profiling, server
# internals, API docs): refused with 403 rather than 404, so an operator sees why.
OPERATOR_ROUTES: frozenset[str] = frozenset({
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/pause",
    "/resume",
    "/is_paused",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/collective_rpc",
    "/init_weight_transfer_engine",
    "/update_weights",
    "/get_world_size",
    "/server_info",
    "/load",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/start_profile",
    "/stop_profile",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
    "/openapi.json",
})

Verdict = Literal["relay", "wrong_method", "operator", "unknown"]


def classify(method: str, path: str, listed: Iterable[str] = ()) -> Verdict:
    """What the proxy does with an unscheduled request: relay it, or refuse it as a wrong
    method on a scheduled route (405), a known operator route (403) or an unknown path (404).

    ``listed`` are the operator's extra routes: an exact path, or a prefix ending in ``*``
    (``"/*"`` relays everything). ``OPTIONS`` (a CORS preflight) is relayed wherever the real
    method would be.
    """
    if path in SCHEDULED_ROUTES:  # only POST reaches the scheduler; anything else lands here
        return "relay" if method == "OPTIONS" else "wrong_method"
    if path in INFERENCE_ROUTES or path.startswith(INFERENCE_PREFIXES):
        return "relay"
    for entry in listed:
        if path == entry or (entry.endswith("*") and path.startswith(entry[:-1])):
            return "relay"
    return "operator" if path in OPERATOR_ROUTES else "unknown"


async def allowed_methods(request: web.Request) -> set[str]:
    """The methods the app's own routes serve at this path, the catch-alls (``{tail}``) aside:
    empty when the path is not one of them."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if not resource.canonical.endswith("{tail}"):
            allowed |= (await resource.resolve(request))[1]
    return allowed


def method_not_allowed(request: web.Request, allowed: set[str]) -> web.Response:
    methods = sorted(allowed)
    return error_response(
        405, f"{request.method} {request.path}: allowed {', '.join(methods)}",
        code="method_not_allowed", headers={"Allow": ",".join(methods)},
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class PassthroughGate:
    """Wraps the pass-through handler: relays what :func:`classify` allows, or what a caller
    with the admin token asks for; answers the rest itself, with a log line."""

    def __init__(self, auth: AdminAuth, listed: Iterable[str], refused: Tally) -> None:
        self._auth = auth
        self._listed = tuple(listed)
        self._refused = refused

    async def refusal(self, request: web.Request) -> web.Response | None:
        verdict = classify(request.method, request.path, self._listed)
        if verdict == "relay":
            return None
        allowed = {"POST"} if verdict == "wrong_method" else await allowed_methods(request)
        if allowed:  # a path the proxy serves itself (/healthz, ...), with another method
            resp = method_not_allowed(request, allowed)
        elif self._auth.enabled and self._auth.allows(request.headers.get("Authorization")):
            return None  # the operator may reach any route of the workers
        elif verdict == "operator":
            resp = error_response(
                403,
                f"{request.path} is an operator route of the workers: call it with the admin"
                " token, or list it in auth.passthrough_routes",
                code="operator_route",
            )
        else:
            resp = error_response(
                404,
                f"{request.method} {request.path}: not a route the proxy serves or relays"
                " (auth.passthrough_routes lists more)",
                code="unknown_route",
            )
        if request.body_exists:
            resp.force_close()  # its body is never read
        self._refused.labels(str(resp.status)).inc()
        return resp

    def wrap(self, handler: Handler) -> Handler:
        async def gated(request: web.Request) -> web.StreamResponse:
            refused = await self.refusal(request)
            return refused if refused is not None else await handler(request)

        return gated
