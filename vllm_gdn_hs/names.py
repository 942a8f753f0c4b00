"""The names every part of the plugin shares: the connector's name and module, and the logger.

Apart from the package's face so that any module can import them without importing the rest
(and without torch or vLLM: vLLM's logger is imported on first use)."""

from __future__ import annotations

import logging

CONNECTOR_NAME = "HybridHiddenStatesConnector"
CONNECTOR_MODULE = "vllm_gdn_hs.connector"


def init_logger(name: str) -> logging.Logger:
    """vLLM's ``init_logger`` for one of our modules, inside the ``vllm`` logger tree: vLLM's
    logging setup covers only that tree, and a logger outside it would drop every INFO line."""
    from vllm.logger import init_logger as vllm_init_logger

    return vllm_init_logger(f"vllm.{name}")
