"""bench/memtrace.py's replay of allocator events: the peak it reports and what was live."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from memtrace import origin, replay  # noqa: E402

GIB = 2**30


def _frames(line: int) -> list[dict]:
    return [{"filename": "/usr/lib/torch/nn.py", "line": 1, "name": "f"},
            {"filename": "/x/src/slipstream/weights/linear.py", "line": line, "name": "g"}]


def test_replay_reports_the_reserved_peak_and_its_live_tensors():
    events = [
        {"action": "segment_alloc", "addr": 0, "size": 2 * GIB},
        {"action": "alloc", "addr": 0, "size": GIB, "frames": _frames(10)},
        {"action": "alloc", "addr": GIB, "size": GIB // 2, "frames": _frames(20)},
        {"action": "segment_alloc", "addr": 4 * GIB, "size": GIB},  # peak: 3 GiB reserved
        {"action": "alloc", "addr": 4 * GIB, "size": GIB // 4, "frames": _frames(10)},
        {"action": "free_requested", "addr": 0, "size": GIB},
        {"action": "free_completed", "addr": 0, "size": GIB},
        {"action": "segment_free", "addr": 4 * GIB, "size": GIB},
        {"action": "segment_alloc", "addr": 8 * GIB, "size": GIB // 2},  # below the peak
    ]
    s = replay(events)
    assert s["peak_reserved_gib"] == 3.0
    assert s["allocated_at_peak_gib"] == 1.5  # the third alloc came after the peak
    where = {r["where"]: r["gib"] for r in s["live_at_peak"]}
    assert where == {"slipstream/weights/linear.py:10 g": 1.0,
                     "slipstream/weights/linear.py:20 g": 0.5}


def test_origin_without_our_frames_says_so():
    assert origin([{"filename": "/usr/lib/torch/x.py", "line": 3, "name": "h"}]) \
        == "(no slipstream frame)"
    assert replay([])["error"]
