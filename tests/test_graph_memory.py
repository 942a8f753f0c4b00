"""benchmarks/graph_memory.py on snapshots in torch.cuda.memory._snapshot()'s format; CPU only.

Run: python -m pytest tests/test_graph_memory.py -q
Covers: only segments of a private (graph) pool count; live blocks are keyed by the first frames
of vLLM's and the plugin's code on their stacks, free blocks counted apart; --compare orders the
keys by their difference.
"""

from __future__ import annotations

import graph_memory  # benchmarks/ (pytest's pythonpath, pyproject.toml)


def frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


AUX = [
    frame("/usr/lib/python3.12/site-packages/torch/nn/modules/module.py", 1, "_call_impl"),
    frame("/tmp/site/vllm/model_executor/models/interfaces.py", 1661, "_maybe_add_hidden_state"),
    frame("/tmp/site/vllm/models/qwen3_5/nvidia/model.py", 591, "forward"),
]
MLP = [frame("/tmp/site/vllm/models/qwen3_5/nvidia/model.py", 300, "mlp")]


def snapshot(aux_blocks: int) -> dict:
    """One default-pool segment (never counted) and one graph-pool segment."""
    blocks = [{"size": 4 << 20, "state": "active_allocated", "frames": AUX}] * aux_blocks
    blocks += [{"size": 2 << 20, "state": "active_allocated", "frames": MLP}]
    blocks += [{"size": 1 << 20, "state": "inactive", "frames": []}]
    return {
        "segments": [
            {"segment_pool_id": (0, 0), "total_size": 1 << 30, "blocks": blocks},
            {"segment_pool_id": (0, 1), "total_size": 64 << 20, "blocks": blocks},
        ]
    }


def test_graph_pools_live_blocks_by_the_code_that_made_them():
    s = graph_memory.graph_pool_summary(snapshot(3))
    assert s["graph_pool_bytes"] == 64 << 20 and s["pools"] == {"(0, 1)": 64 << 20}
    assert s["free_in_pools_bytes"] == 1 << 20
    aux_key = (
        "vllm/model_executor/models/interfaces.py:1661 _maybe_add_hidden_state < "
        "vllm/models/qwen3_5/nvidia/model.py:591 forward"
    )
    assert s["live"] == [
        {"key": aux_key, "bytes": 12 << 20, "blocks": 3},
        {"key": "vllm/models/qwen3_5/nvidia/model.py:300 mlp", "bytes": 2 << 20, "blocks": 1},
    ]
    rows = graph_memory.compare(graph_memory.graph_pool_summary(snapshot(1)), s)
    assert rows[0] == (aux_key, 4 << 20, 12 << 20)
    assert rows[1][1] == rows[1][2] == 2 << 20


MARK = {
    "action": "alloc",
    "size": graph_memory.MARK_BYTES,
    "addr": 1,
    "frames": [frame("/repo/benchmarks/graph_memory.py", 1, "_mark")],
}


def event(action: str, addr: int, size: int, frames=AUX) -> dict:
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_capture_windows_sum_segments_and_what_outlives_them_by_the_code_that_asked():
    trace = [
        event("segment_alloc", 90, 1 << 30, MLP),  # before the window: not counted
        MARK,
        event("free_requested", 1, graph_memory.MARK_BYTES, MARK["frames"]),
        event("segment_alloc", 100, 20 << 20),
        event("alloc", 100, 4 << 20),  # alive at the window's end
        event("alloc", 200, 4 << 20, MLP),
        event("free_completed", 200, 4 << 20, MLP),  # freed inside: not alive
        event("free_completed", 90, 1 << 20, MLP),  # allocated before: ignored
        event("segment_free", 300, 2 << 20, MLP),
        MARK,
        event("alloc", 400, 8 << 20),  # after the window
    ]
    [w] = graph_memory.window_summary(trace)
    aux_key = graph_memory.stack_key(AUX)
    assert w["segments_allocated"] == [{"key": aux_key, "bytes": 20 << 20, "blocks": 1}]
    assert w["segments_allocated_bytes"] == 20 << 20 and w["segments_freed_bytes"] == 2 << 20
    assert w["alive_at_end"] == [{"key": aux_key, "bytes": 4 << 20, "blocks": 1}]
    assert w["alive_at_end_bytes"] == 4 << 20


def test_an_allocation_of_the_marks_size_elsewhere_is_no_mark():
    other = dict(MARK, frames=MLP)
    assert not graph_memory.is_mark(other) and graph_memory.is_mark(MARK)
    assert graph_memory.window_summary([MARK, other, event("alloc", 5, 1 << 20)]) == []
