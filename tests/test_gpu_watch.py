"""bench/gpu_watch.py reads nvidia-smi's CSV (``--query-gpu=timestamp,index,memory.used,utilization.gpu
--format=csv,noheader,nounits``); the GPU benches only run on the lent machine, so the parsing is
checked here on lines in that format."""

from __future__ import annotations

import sys
import time

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from gpu_watch import GpuSampler, read_rows  # noqa: E402

LINES = """2026/12/01 03:00:00.123, 0, 1024, 0
2026/12/01 03:00:01.120, 1, 2048, 90
2026/12/01 03:00:02.118, 0, 30720, 100
2026/12/01 03:00:02.118, 1, 4096, 2
[Unknown Error]
2026/12/01 03:00:03.101, 0, 20480, 3
"""


def test_peaks_and_idle_share_from_nvidia_smi_lines(tmp_path):
    path = tmp_path / "gpu.csv"
    path.write_text(LINES)
    sampler = GpuSampler(str(path), start=False)
    assert sampler.peaks() == {"gpu0": {"peak_gib": 30.0, "mean_util": 34.3},
                               "gpu1": {"peak_gib": 4.0, "mean_util": 46.0}}
    since = time.mktime(time.strptime("2026/12/01 03:00:02", "%Y/%m/%d %H:%M:%S"))
    assert sampler.idle_share(since) == {"gpu0": {"samples": 2, "idle_share": 0.5, "mean_util": 51.5},
                                         "gpu1": {"samples": 1, "idle_share": 1.0, "mean_util": 2.0}}


def test_read_rows_waits_for_whole_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_rows(str(path)) == []
    path.write_text('{"step": 0}\n{"step": 1}\n')
    assert read_rows(str(path)) == [{"step": 0}, {"step": 1}]
    path.write_text('{"step": 0}\n{"ste')
    assert read_rows(str(path)) == []
