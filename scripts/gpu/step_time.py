#!/usr/bin/env python3
"""Measure the emulator's step-time terms on a GPU and fit them (the H200 profile's calibration).

    python3 scripts/gpu/step_time.py --out step_time.json      # on the GPU, about a minute
    python3 scripts/gpu/step_time.py --tiny --device cpu       # the same code path, tiny shapes

A stand-in for Qwen3-Coder-30B-A3B with the model's shapes and random bf16 weights (~60 GB):
48 layers of RMSNorm, fused QKV projection, grouped-query attention over a KV cache, output
projection, router and a mixture of 128 experts (8 per token, routed uniformly so a batch of
N tokens touches 128·(1 − (15/16)^N) experts, as the emulator's ``w`` term assumes), and the
logits of each sequence's last token. One engine step is captured in a CUDA graph and timed
with CUDA events over a grid of prefill chunks and decode batches; the times are fitted to

    t = a + w·(1 − (15/16)^N) + b·P + c·D + d_dec·K_dec + d_pf·A_pf

with non-negative coefficients, the features and the profile's prediction taken from the
emulator's own step-time model (``marsproxy/emulator/step_time.py``; docs/emulator.md defines the
terms). It times the GPU's work only: a real vLLM adds its scheduler, sampler and detokenizer on
the CPU to every step, which is part of the profile's ``a`` and not measured here. Needs PyTorch
and this repository (none of marsproxy's dependencies).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this repository's marsproxy
from marsproxy.emulator.profiles import get_profile
from marsproxy.emulator.step_time import StepBatch, StepTimeCoeffs, step_duration


@dataclass(frozen=True)
class Shapes:
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_per_token: int
    expert_ffn: int
    vocab: int


QWEN3_30B_A3B = Shapes(48, 2048, 32, 4, 128, 128, 8, 768, 151_936)
TINY = Shapes(2, 64, 4, 2, 16, 16, 2, 32, 1000)

# The H200 profile as shipped, for the side-by-side column.
PROFILE_STEP = get_profile("h200-qwen3-coder-30b-a3b").step
TERMS = ("a", "w", "b", "c", "d_dec", "d_pf")
PROFILE = {t: getattr(PROFILE_STEP, t) for t in TERMS}


@dataclass(frozen=True)
class Point:
    """One step: a prefill chunk of ``n`` tokens after ``o`` cached ones, ``d`` decoding
    sequences of ``k`` context tokens each."""

    n: int = 0
    o: int = 0
    d: int = 0
    k: int = 0

    @property
    def tokens(self) -> int:
        return self.n + self.d

    def batch(self) -> StepBatch:
        b = StepBatch()
        if self.n:
            b.add_prefill(self.n, self.o)
        for _ in range(self.d):
            b.add_decode(self.k)
        return b

    def features(self) -> list[float]:
        """What each term of the step-time form multiplies, in ``TERMS`` order."""
        b = self.batch()
        return [1.0, 1.0 - PROFILE_STEP.expert_keep**b.num_tokens, b.prefill_tokens,
                b.decode_seqs, b.decode_context, b.prefill_pairs]


def grid(tiny: bool) -> list[Point]:
    if tiny:
        return [Point(d=1, k=16), Point(d=4, k=64), Point(n=32), Point(n=16, o=64),
                Point(n=16, d=2, k=32), Point(d=8, k=16), Point(n=64)]
    decode = [Point(d=d, k=1024) for d in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)]
    decode += [Point(d=d, k=k) for d in (16, 64, 256) for k in (8192, 32768)]
    prefill = [Point(n=n) for n in (128, 512, 2048, 4096, 8192)]
    prefill += [Point(n=2048, o=o) for o in (8192, 32768, 98304)] + [Point(n=8192, o=32768)]
    mixed = [Point(n=2048, o=8192, d=64, k=8192), Point(n=512, d=256, k=4096),
             Point(n=8192, d=32, k=16384)]
    return decode + prefill + mixed


class Model:
    """Random weights of the model's shapes; :meth:`step` runs one engine step's kernels."""

    def __init__(self, s: Shapes, dev: torch.device, dtype: torch.dtype) -> None:
        self.s, self.dev, self.dtype = s, dev, dtype
        qkv = (s.q_heads + 2 * s.kv_heads) * s.head_dim

        def w(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, device=dev, dtype=dtype).normal_(0.0, 0.02)

        self.layers = [
            {
                "qkv": w(s.hidden, qkv),
                "o": w(s.q_heads * s.head_dim, s.hidden),
                "router": w(s.hidden, s.experts),
                "w13": w(s.experts, s.hidden, 2 * s.expert_ffn),
                "w2": w(s.experts, s.expert_ffn, s.hidden),
                "n1": torch.ones(s.hidden, device=dev, dtype=dtype),
                "n2": torch.ones(s.hidden, device=dev, dtype=dtype),
            }
            for _ in range(s.layers)
        ]
        self.lm_head = w(s.hidden, s.vocab)

    def weight_bytes(self) -> int:
        per = sum(t.numel() * t.element_size() for t in self.layers[0].values())
        return per * len(self.layers) + self.lm_head.numel() * self.lm_head.element_size()


class Step:
    """The static tensors of one point and the function a CUDA graph captures."""

    def __init__(self, m: Model, p: Point, gqa: str) -> None:
        s, dev, dt = m.s, m.dev, m.dtype
        self.m, self.p, self.gqa = m, p, gqa
        t = p.tokens
        self.x = torch.randn(t, s.hidden, device=dev, dtype=dt)
        # Uniform routing, balanced: the expected number of experts a batch touches, an equal
        # share of the batch's t·8 assignments each (a contiguous slice of the expert weights).
        keep = 1.0 - s.experts_per_token / s.experts  # share of experts a token leaves alone
        self.used = max(1, min(s.experts, round(s.experts * (1.0 - keep**t))))
        self.per_expert = math.ceil(t * s.experts_per_token / self.used)
        slots = self.used * self.per_expert
        self.route = torch.arange(slots, device=dev) % t
        self.gate = torch.full((slots, 1), 1.0 / s.experts_per_token, device=dev, dtype=dt)
        # One KV cache stands in for every layer's: the bytes read per layer are the same.
        kvh, hd = s.kv_heads, s.head_dim
        self.kc = torch.randn(p.d, kvh, max(p.k, 1), hd, device=dev, dtype=dt) if p.d else None
        self.vc = torch.randn_like(self.kc) if self.kc is not None else None
        heads = s.q_heads if gqa == "expand" else kvh
        self.kp = torch.randn(1, heads, p.o, hd, device=dev, dtype=dt) if p.n and p.o else None
        self.vp = torch.randn_like(self.kp) if self.kp is not None else None
        self.last = torch.arange(p.d, device=dev)
        if p.n:
            self.last = torch.cat([self.last, torch.tensor([t - 1], device=dev)])

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, p = self.m.s, self.p
        hd, qh, kvh = s.head_dim, s.q_heads, s.kv_heads
        parts = []
        if p.d:
            # Decode: each sequence's query heads against its cached keys (grouped: the 8 query
            # heads of a KV head read it once), as a paged decode kernel reads the cache.
            qd = q[p.n :].view(p.d, kvh, qh // kvh, hd)
            self.kc[:, :, -1].copy_(k[p.n :].view(p.d, kvh, hd))  # the step's new key
            sc = torch.matmul(qd, self.kc.transpose(-1, -2)) * hd**-0.5
            pr = torch.softmax(sc.float(), dim=-1).to(q.dtype)
            parts.append(torch.matmul(pr, self.vc).reshape(p.d, qh * hd))
        if p.n:
            qp = q[: p.n].view(1, p.n, qh, hd).transpose(1, 2)
            kn = k[: p.n].view(1, p.n, kvh, hd).transpose(1, 2)
            vn = v[: p.n].view(1, p.n, kvh, hd).transpose(1, 2)
            if self.gqa == "expand":
                kn, vn = (t.repeat_interleave(qh // kvh, dim=1) for t in (kn, vn))
            gqa = self.gqa == "native"
            # The chunk against itself (causal) and against the cached prefix (all of it): the
            # (query, key) pairs of a chunked prefill; only the time matters here, not the sum.
            out = F.scaled_dot_product_attention(qp, kn, vn, is_causal=True, enable_gqa=gqa)
            if self.kp is not None:
                out = out + F.scaled_dot_product_attention(qp, self.kp, self.vp, enable_gqa=gqa)
            parts.insert(0, out.transpose(1, 2).reshape(p.n, qh * hd))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def __call__(self) -> torch.Tensor:
        s = self.m.s
        x = self.x
        qd, kvd = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
        for layer in self.m.layers:
            h = F.rms_norm(x, (s.hidden,), layer["n1"])
            q, k, v = torch.split(h @ layer["qkv"], [qd, kvd, kvd], dim=-1)
            x = x + self.attention(q, k, v) @ layer["o"]
            h = F.rms_norm(x, (s.hidden,), layer["n2"])
            torch.topk(torch.softmax((h @ layer["router"]).float(), -1), s.experts_per_token)
            xs = h[self.route].view(self.used, self.per_expert, s.hidden)
            gu = torch.bmm(xs, layer["w13"][: self.used])
            act = F.silu(gu[..., : s.expert_ffn]) * gu[..., s.expert_ffn :]
            y = torch.bmm(act, layer["w2"][: self.used]).view(-1, s.hidden) * self.gate
            x = x + torch.zeros_like(h).index_add_(0, self.route, y)
        return x[self.last] @ self.m.lm_head


def gqa_mode(dev: torch.device, dtype: torch.dtype) -> str:
    """``native`` when SDPA's flash kernel takes grouped KV heads here, else ``expand``."""
    if dev.type != "cuda":
        return "expand"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 8, 64, 64, device=dev, dtype=dtype)
    kv = torch.randn(1, 2, 64, 64, device=dev, dtype=dtype)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return "native"
    except RuntimeError:
        return "expand"


def time_point(step: Step, reps: int, graphs: bool) -> tuple[float, str]:
    """Median seconds of one step, and how it ran (``graph`` or ``eager``)."""
    dev = step.m.dev
    if dev.type != "cuda":
        step()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts), "eager"
    run, how = step, "eager"
    if graphs:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            run, how = g.replay, "graph"
        except RuntimeError as exc:  # an op that cannot be captured: time it eagerly
            print(f"  graph capture failed ({exc}); timing eagerly", file=sys.stderr)
    for _ in range(3):
        run()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts), how


def nnls(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with every coefficient ≥ 0 (Lawson–Hanson active set, small problems),
    on relative errors so a 5 ms decode step weighs as much as a 500 ms prefill."""
    rel = [[f / t for f in r] for r, t in zip(rows, y, strict=True)]
    a = torch.tensor(rel, dtype=torch.float64)
    b = torch.ones(len(y), dtype=torch.float64)
    scale = a.abs().amax(dim=0).clamp_min(1e-300)
    a = a / scale
    n = a.shape[1]
    free: list[int] = []
    x = torch.zeros(n, dtype=torch.float64)
    for _ in range(3 * n):
        grad = a.T @ (b - a @ x)
        cand = [j for j in range(n) if j not in free and grad[j] > 1e-12]
        if not cand:
            break
        free.append(max(cand, key=lambda j: float(grad[j])))
        while True:
            z = torch.zeros(n, dtype=torch.float64)
            sol = torch.linalg.lstsq(a[:, free], b.unsqueeze(1)).solution.squeeze(1)
            z[free] = sol
            if all(z[j] > 0 for j in free):
                x = z
                break
            # Step toward z until a coefficient hits zero; drop it from the free set.
            alpha = min(float(x[j] / (x[j] - z[j])) for j in free if z[j] <= 0)
            x = x + alpha * (z - x)
            free = [j for j in free if x[j] > 1e-15]
    return [float(v) for v in x / scale]


def predict(coef: Mapping[str, float], p: Point) -> float:
    """The emulator's step time of ``p`` with the coefficients ``coef`` (``TERMS``)."""
    return step_duration(StepTimeCoeffs(**coef), p.batch())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a dry run of the code")
    ap.add_argument("--reps", type=int, default=10, help="timed steps per point")
    ap.add_argument("--no-graphs", action="store_true", help="time eagerly (no CUDA graphs)")
    ap.add_argument("--out", default=None, help="JSON file for the points and the fit")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = TINY if args.tiny else QWEN3_30B_A3B
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = Model(shapes, dev, dtype)
    gqa = gqa_mode(dev, dtype)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"{name}: {model.weight_bytes() / 2**30:.1f} GiB of weights in "
          f"{time.perf_counter() - t0:.1f} s; grouped attention: {gqa}", flush=True)
    points, secs, hows = grid(args.tiny), [], []
    for p in points:
        step = Step(model, p, gqa)
        t, how = time_point(step, args.reps, graphs=not args.no_graphs)
        secs.append(t)
        hows.append(how)
        print(f"  n={p.n:5d} o={p.o:6d} d={p.d:5d} k={p.k:6d}  {t * 1e3:9.3f} ms  ({how}, "
              f"{step.used} experts)", flush=True)
        del step
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    fit = dict(zip(TERMS, nnls([p.features() for p in points], secs), strict=True))
    print("\nfit: " + ", ".join(f"{k}={v:.4g}" for k, v in fit.items()))
    print("\n| step | measured ms | fit ms | profile ms | profile / measured |")
    print("|---|---|---|---|---|")
    rows = []
    for p, t, how in zip(points, secs, hows, strict=True):
        f, pr = predict(fit, p), predict(PROFILE, p)
        rows.append({**asdict(p), "measured_s": t, "fit_s": f, "profile_s": pr, "how": how})
        print(f"| n={p.n} o={p.o} d={p.d} k={p.k} | {t * 1e3:.2f} | {f * 1e3:.2f} | "
              f"{pr * 1e3:.2f} | {pr / t:.2f} |")
    if args.out:
        doc = {"device": name, "shapes": asdict(shapes), "gqa": gqa, "torch": torch.__version__,
               "fit": fit, "profile": PROFILE, "points": rows}
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
