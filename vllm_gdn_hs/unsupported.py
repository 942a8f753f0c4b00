"""Stands in for the connector on a vLLM release this plugin does not support.

``register()`` applies no patches there and registers this module under the connector's
name, so that vLLM without our connector runs as if the plugin were absent, while naming
the connector fails as soon as vLLM loads it, with the message that lists the supported
releases, or the vLLM method an untested newer release lacks (importing this module raises
it).
"""

from vllm_gdn_hs.patch import runtime_patches
from vllm_gdn_hs.version import UnsupportedVllmError, check_vllm

check_vllm()  # raises UnsupportedVllmError, naming the supported releases
runtime_patches()  # on an untested vLLM allowed to run: raises naming the method it lacks
raise UnsupportedVllmError("vllm_gdn_hs.unsupported is loaded only on an unsupported vLLM")
