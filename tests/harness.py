"""The CPU tests' harness: vllm_gdn_hs.cpu_engine (vLLM's configs, KV cache specs and Scheduler
on a machine without a GPU). Test files that ``import harness`` are not collected on a GPU
machine (tests/conftest.py)."""

from vllm_gdn_hs.cpu_engine import *  # noqa: F403
from vllm_gdn_hs.cpu_engine import _init_dist  # noqa: F401
