"""NvmlProbe on a real GPU: what it reads agrees with ``nvidia-smi`` and follows the GPU's load.

Skipped where NVML sees no GPU (CI); run on a GPU host with
``pytest tests/integration/probes/test_nvml_gpu.py``. The allocation and load tests need
PyTorch with CUDA.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from marsproxy.probes.nvml import GpuPressure, NvmlProbe

GiB = 1 << 30


pytestmark = pytest.mark.gpu


@pytest.fixture
def probe() -> Iterator[NvmlProbe]:
    p = NvmlProbe({"w0": [0]})
    assert p.start(), p.reason
    yield p
    p.stop()


def _smi(field: str) -> float:
    """One GPU 0 field from nvidia-smi (its own NVML client, in MiB for memory)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        pytest.skip("nvidia-smi is not installed")
    out = subprocess.run(
        [exe, "-i", "0", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout
    return float(out.strip())


def _read(probe: NvmlProbe) -> GpuPressure:
    r = probe.read("w0")
    assert r.available, r.reason
    return r


def _torch_cuda() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    torch.zeros(1, device="cuda")  # the CUDA context, before any reading is compared
    torch.cuda.synchronize()
    return torch


def test_readings_agree_with_nvidia_smi(probe: NvmlProbe) -> None:
    r = _read(probe)
    (gpu,) = r.gpus
    assert gpu.index == 0
    assert gpu.memory_total_bytes == pytest.approx(_smi("memory.total") * 2**20, abs=2**20)
    assert 0 < gpu.memory_used_bytes < gpu.memory_total_bytes
    assert 0.0 <= gpu.utilization_pct <= 100.0 and 0.0 <= gpu.memory_utilization_pct <= 100.0
    assert r.memory_used_frac == pytest.approx(gpu.memory_used_bytes / gpu.memory_total_bytes)
    assert probe.read_errors == 0


def test_an_allocation_shows_in_memory_used(probe: NvmlProbe) -> None:
    torch = _torch_cuda()
    before = _read(probe).gpus[0].memory_used_bytes
    block = torch.empty(16 * GiB, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    held = _read(probe).gpus[0].memory_used_bytes
    del block
    torch.cuda.empty_cache()
    after = _read(probe).gpus[0].memory_used_bytes
    # cudaMalloc rounds up to its page size; nothing else of this process allocates meanwhile.
    assert 16 * GiB <= held - before <= 16 * GiB + GiB // 4
    assert after - before < GiB // 4


def test_a_busy_gpu_reads_as_busy_and_idle_again(probe: NvmlProbe) -> None:
    torch = _torch_cuda()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    stop = threading.Event()

    def burn() -> None:
        while not stop.is_set():
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()

    worker = threading.Thread(target=burn, daemon=True)
    worker.start()
    try:
        busy = []
        end = time.monotonic() + 4.0  # NVML's utilization covers its last sample period (≤ 1 s)
        while time.monotonic() < end:
            busy.append(_read(probe).utilization_pct or 0.0)
            time.sleep(0.2)
    finally:
        stop.set()
        worker.join(timeout=30)
    assert max(busy) >= 50.0, busy
    idle = []
    end = time.monotonic() + 4.0
    while time.monotonic() < end:
        idle.append(_read(probe).utilization_pct or 0.0)
        time.sleep(0.2)
    assert min(idle) <= 10.0, idle
