"""Stands in for the connector on a vLLM release this plugin does not support: ``register()``
registers it under the connector's name, so that vLLM runs as if the plugin were absent while
naming the connector fails, with the reason, as soon as vLLM imports this module.
"""

from vllm_gdn_hs.patch import runtime_patches
from vllm_gdn_hs.version import UnsupportedVllmError, check_vllm

check_vllm()  # raises UnsupportedVllmError, naming the supported releases
runtime_patches()  # on an untested vLLM allowed to run: raises naming the method it lacks
raise UnsupportedVllmError("vllm_gdn_hs.unsupported is loaded only on an unsupported vLLM")
