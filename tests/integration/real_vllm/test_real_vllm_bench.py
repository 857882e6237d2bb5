"""``marsproxy bench live --vllm-url`` end to end against a real vLLM 0.32 (CPU build, tiny
random model), as ``scripts/real-vllm/bench.sh`` runs it on the medium one: the server is
measured (model, context, tokenizer, speed), each policy starts from an empty prefix cache, the
agents' prompts follow the trace's lengths in the real tokenizer, and continuations hit the
prefix cache (cached tokens come back in the usage: warm resumes).

Needs ``scripts/real-vllm/setup.sh`` and ``MARS_REAL_VLLM_TESTS=1``, like the other tests
here; the server (`vllm_dev`, conftest.py) is shared with the other modules that can use it,
one start (20-60 s on 2 cores); ~10 s of traffic.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from marsproxy.runs.arrivals import ArrivalSpec
from marsproxy.runs.trace import load_trace
from marsproxy.runs.workload import REGIMES, WorkloadSpec, build_workload


def test_bench_live_against_a_real_vllm(vllm_dev: str, tmp_path: Path) -> None:
    vllm = vllm_dev
    out = tmp_path / "live"
    args = ["bench", "live", "--vllm-url", vllm, "--vllm-priority", "true",
            "--regimes", "8k", "--token-scale", "0.1", "--max-turns", "4",
            "--tool-time-scale", "0.1", "--sessions", "3", "--rates", "0",
            "--policies", "mars", "--no-plots", "--out", str(out)]
    r = subprocess.run([sys.executable, "-m", "marsproxy.cli", *args], capture_output=True,
                       text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    data: dict[str, Any] = json.loads((out / "results.json").read_text())
    facts = data["meta"]["real vLLM"]
    assert facts["model"] == "tiny" and facts["max_model_len"] == 4096
    assert 2.0 < facts["chars_per_token"] < 8.0, facts
    assert facts["prefill_tok_s"] > 0 and facts["decode_tok_s"] > 0, facts
    assert data["meta"]["prefix cache between policies"].startswith("emptied"), data["meta"]
    runs = {run["policy"]: run for run in data["runs"]}
    assert set(runs) == {"direct", "mars"}
    for run in runs.values():
        assert run["extra"]["prefix_cache_reset"] == [True]
        assert run["summary"]["finished"] == 3, run["summary"]
        assert run["summary"]["warm_resume_rate"] > 0.5, run["summary"]
        assert all(s["ideal_s"] > 0 for s in run["sessions"])
    # Prompts are sized in the server's tokenizer: within 8 % of the plan (the chat template's
    # markers and the tokenizer's ratio on this text vary a little; 4 characters per token, the
    # emulator's, would be ~15 % short), the first and the last call of every session.
    spec = WorkloadSpec(sessions=3, seed=0, regime_peak_tokens=REGIMES["8k"], token_scale=0.1,
                        tool_time_scale=0.1, max_turns=4, arrivals=ArrivalSpec("poisson", 0.0),
                        max_context_tokens=4096 - 1024)
    planned = {s.id: s.turns for s in build_workload(load_trace(), spec).sessions}
    got = {s["id"]: s["turns"] for s in runs["direct"]["sessions"]}
    assert set(got) == set(planned)
    for sid, turns in planned.items():
        for i in (0, -1):
            want, sent = turns[i].input_tokens, got[sid][i]["prompt_tokens"]
            assert abs(sent - want) <= 0.08 * want + 16, (sid, i, sent, want)
