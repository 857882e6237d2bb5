#!/usr/bin/env python3
"""Per-request overhead of marsproxy against direct, nginx and LiteLLM (issue 9).

    .venv/bin/python benchmarks/overhead/run.py --install   # wrk, nginx, LiteLLM venv (once)
    .venv/bin/python benchmarks/overhead/run.py             # everything, about 15 minutes

See docs/performance.md; the code is marsproxy/bench/overhead.py.
"""

from pathlib import Path

from marsproxy.bench.overhead import main

if __name__ == "__main__":
    main(config_dir=Path(__file__).resolve().parent)
