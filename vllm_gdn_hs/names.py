"""The names every part of the plugin shares, importable without the rest, torch or vLLM."""

from __future__ import annotations

import logging

CONNECTOR_NAME = "HybridHiddenStatesConnector"
CONNECTOR_MODULE = "vllm_gdn_hs.connector"


class ConnectorLogger(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"{CONNECTOR_NAME}: {msg}", kwargs


def init_logger(name: str) -> ConnectorLogger:
    """vLLM's ``init_logger``, inside the ``vllm`` tree (outside, INFO lines are dropped)."""
    from vllm.logger import init_logger as vllm_init_logger

    return ConnectorLogger(vllm_init_logger(f"vllm.{name}"))
