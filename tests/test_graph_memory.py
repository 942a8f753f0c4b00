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
