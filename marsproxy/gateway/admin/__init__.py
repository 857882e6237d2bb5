"""The admin API under ``/mars/v1`` and ``/mars/ui``: its handlers and models, the state
document, the OpenAPI description and the live page."""
