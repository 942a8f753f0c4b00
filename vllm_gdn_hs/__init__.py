"""vllm-gdn-hs: hidden-state extraction for GDN hybrid models on vLLM.

vLLM calls :func:`register` in every process it starts, through the
``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

__version__ = "0.1.0"

CONNECTOR_NAME = "HybridHiddenStatesConnector"
CONNECTOR_MODULE = "vllm_gdn_hs.connector"

_registered = False


def init_logger(name: str):
    """vLLM's ``init_logger`` for one of our modules, named inside the ``vllm`` logger tree.

    vLLM's logging setup (its handler, ``VLLM_LOGGING_LEVEL``, ``VLLM_LOGGING_CONFIG_PATH``)
    covers the ``vllm`` logger only; a logger outside it would drop every INFO line, the
    writer's progress and shutdown lines among them.
    """
    from vllm.logger import init_logger as vllm_init_logger

    return vllm_init_logger(f"vllm.{name}")


def register() -> None:
    """Check the vLLM version, apply its runtime patches, register the connector.

    Idempotent and cheap: the connector is registered by module path, so its
    torch-heavy code is imported only when a config names it. The patches are applied in
    every process and are inert unless the engine's config names our connector
    (``tests/test_register.py`` shows the config is then stock vLLM's). On a vLLM release the
    plugin does not support it never raises (vLLM calls it in every process, also those
    that never use the connector): it logs one warning, applies nothing, and registers
    :mod:`vllm_gdn_hs.unsupported` under the connector's name, so that naming the
    connector fails with the list of supported releases. A newer, untested release runs
    only with ``VLLM_GDN_HS_ALLOW_UNTESTED_VLLM=1`` and every method the patches wrap
    present, and says so in one warning.
    """
    global _registered
    if _registered:
        return
    from vllm_gdn_hs.patch import apply_patches
    from vllm_gdn_hs.version import UnsupportedVllmError, check_vllm, is_untested, untested_note

    logger = init_logger(__name__)
    module = CONNECTOR_MODULE
    try:
        version = check_vllm()
        apply_patches()  # on an untested vLLM, first probes every method the patches wrap
        if is_untested():
            logger.warning("%s", untested_note(version))
    except UnsupportedVllmError as e:
        logger.warning("%s; %s is not usable, vLLM runs without it", e, __name__)
        module = "vllm_gdn_hs.unsupported"
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, module, CONNECTOR_NAME)
    _registered = True
