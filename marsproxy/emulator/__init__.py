"""Emulated vLLM worker: a pure engine model (``engine``, ``kv_cache``, ``step_time``,
``profiles``, ``tokenizer``) and an aiohttp server with vLLM's HTTP surface (``server``)."""
