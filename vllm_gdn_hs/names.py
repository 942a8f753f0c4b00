"""The names every part of the plugin shares, importable without the rest, torch or vLLM."""

from __future__ import annotations

import logging

CONNECTOR_NAME = "HybridHiddenStatesConnector"
CONNECTOR_MODULE = "vllm_gdn_hs.connector"


def init_logger(name: str) -> logging.Logger:
    """vLLM's ``init_logger``, inside the ``vllm`` tree (outside, INFO lines are dropped)."""
    from vllm.logger import init_logger as vllm_init_logger

    return vllm_init_logger(f"vllm.{name}")
