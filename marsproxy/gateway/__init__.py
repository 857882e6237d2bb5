"""The aiohttp gateway: OpenAI-compatible routes relayed to the worker of each session.

Entry points: ``app.create_app(cfg)``, ``app.serve(cfg)``, ``app.start(cfg)``.
"""
