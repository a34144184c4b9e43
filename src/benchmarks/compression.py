"""The gradient compressors on the per-step hot path: compress / decompress milliseconds, throughput and wire
bytes per compressor and size, and sampled top-k against ``torch.topk`` alone. ``scripts/bench_compression.py``
runs it; its ``--help`` says what each figure means.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch

from src.compression import HEADER_SIZE, IDENTITY, build_compressor, decompress

CONFIGS = {
    "identity": {"name": "identity"},
    "topk_exact_0.01": {"name": "topk", "ratio": 0.01, "selection": "exact"},
    "topk_sampled_0.01": {"name": "topk", "ratio": 0.01, "selection": "sampled"},
    "quantization_8bit": {"name": "quantization", "bits": 8, "bucket_size": 512},
    "quantization_4bit": {"name": "quantization", "bits": 4, "bucket_size": 512},
    "quantization_2bit": {"name": "quantization", "bits": 2, "bucket_size": 512},
}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def _bench_compressor(config: dict, x: torch.Tensor, repeats: int) -> dict:
    options = {key: value for key, value in config.items() if key != "name"}
    compressor = build_compressor(config["name"], **options)
    generator = torch.Generator().manual_seed(0)
    payload = compressor.compress(x, generator)  # warm-up
    decompress(payload)
    compress_s, decompress_s, total_s = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        payload = compressor.compress(x, generator)
        middle = time.perf_counter()
        decompress(payload)
        end = time.perf_counter()
        compress_s.append(middle - start)
        decompress_s.append(end - middle)
        total_s.append(end - start)
    total = statistics.median(total_s)
    input_mb = x.numel() * 4 / 1e6
    identity_bytes = IDENTITY.wire_size_for(x.numel())
    return {
        "compress_ms": _ms(statistics.median(compress_s)),
        "decompress_ms": _ms(statistics.median(decompress_s)),
        "compress_decompress_ms": _ms(total),
        "mb_per_s": round(input_mb / total, 1),
        "wire_bytes": len(payload),
        "compression_ratio": round(identity_bytes / len(payload), 3),
    }


def _bench_torch_topk(x: torch.Tensor, repeats: int) -> float:
    magnitudes = x.abs()
    k = max(1, x.numel() // 100)
    torch.topk(magnitudes, k, sorted=False)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.topk(magnitudes, k, sorted=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_benchmark(sizes: list[int], repeats: int, command: str) -> dict:
    """Every compressor of ``CONFIGS`` at every size, ``repeats`` times; ``command`` is recorded with them."""
    num_threads = os.cpu_count() or 1
    torch.set_num_threads(num_threads)
    started = time.perf_counter()
    results = {
        "command": command,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "num_threads": num_threads,
        "repeats": repeats,
        "header_bytes": HEADER_SIZE,
        "load_average_before": [round(v, 2) for v in os.getloadavg()],
        "sizes": {},
    }
    for numel in sizes:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(1234))
        entry = {name: _bench_compressor(config, x, repeats) for name, config in CONFIGS.items()}
        topk_s = _bench_torch_topk(x, repeats)
        sampled = entry["topk_sampled_0.01"]
        entry["torch_topk_1pct_ms"] = _ms(topk_s)
        entry["sampled_topk_speedup"] = {
            "compress_vs_torch_topk": round(topk_s * 1e3 / sampled["compress_ms"], 2),
            "compress_decompress_vs_torch_topk": round(topk_s * 1e3 / sampled["compress_decompress_ms"], 2),
            "compress_vs_exact_compress": round(entry["topk_exact_0.01"]["compress_ms"] / sampled["compress_ms"], 2),
        }
        results["sizes"][str(numel)] = entry
    results["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    results["wall_s"] = round(time.perf_counter() - started, 1)
    return results
