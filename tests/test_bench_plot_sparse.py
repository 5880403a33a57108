"""bench/plot_sparse.py: the decode peers' names read as selection and budget, every result kind becomes a point,
and the chart is written (matplotlib, CPU)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from plot_sparse import peer_label, points  # noqa: E402


@pytest.mark.parametrize("name, want", [
    ("quest_2048", ("blocks", 2048)),
    ("quest_pages_4096", ("pages", 4096)),
    ("quest_pages_2048_rerank2", ("pages + rerank 2", 2048)),
    ("quest_4096_topk", ("blocks topk", 4096)),
])
def test_peer_names_read_as_selection_and_budget(name, want):
    assert peer_label(name) == want


RESULTS = [
    {"prefill_attention": [{"context": 32768, "stride": 16, "density": 0.18, "speedup_vs_fastest_dense": 2.3}]},
    {"e2e_prefill_random": [{"context": 131071, "density": 0.21, "speedup": 1.91, "speedup_one_copy": 1.92,
                             "speedup_threshold_0.1": 3.1, "density_threshold_0.1": 0.11},
                            {"context": 32767, "density": 0.24, "speedup": 1.26}]},
    {"offload_decode": [{"batch": 4, "context": 130560, "dense": {"decode_ms": 1295.5},
                         "quest_pages_2048_rerank2": {"decode_ms": 49.7, "speedup_vs_dense": 26.0}}],
     "gpu_only_decode": [{"batch": 1, "context": 131072, "quest_2048": {"speedup_vs_dense": 1.1}}]},
]


def test_every_result_kind_becomes_a_point():
    prefill, e2e, decode, by_density = points(RESULTS)
    assert prefill == [(32768, 16, 0.18, 2.3)]
    assert e2e == [(131071, 0.21, 1.92), (32767, 0.24, 1.26)]  # the default's speed-up (one-copy tiles)
    assert by_density == [(131071, 0.21, 1.92), (131071, 0.11, 3.1), (32767, 0.24, 1.26)]  # with threshold peers
    assert decode == [("offload 4 x 128K", "pages + rerank 2", 2048, 26.0), ("GPU-only 1 x 128K", "blocks", 2048, 1.1)]


def test_the_chart_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    files = []
    for i, result in enumerate(RESULTS):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(result))
    out = tmp_path / "sparse.png"
    subprocess.run([sys.executable, str(BENCH / "plot_sparse.py"), str(out), *map(str, files)], check=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
