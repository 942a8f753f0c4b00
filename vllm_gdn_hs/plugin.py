"""The ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process."""

from __future__ import annotations

from vllm_gdn_hs.names import CONNECTOR_MODULE, CONNECTOR_NAME, init_logger

_registered = False


def register() -> None:
    """Register the connector by module path (imported only when a config names it). On an
    unsupported vLLM it warns and registers :mod:`vllm_gdn_hs.unsupported` instead."""
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
