"""vllm-gdn-hs: hidden-state extraction for GDN hybrid models on vLLM.

vLLM loads the plugin through the ``vllm.general_plugins`` entry point
(:func:`vllm_gdn_hs.plugin.register`); the names shared by its parts are in
:mod:`vllm_gdn_hs.names`.
"""

from importlib.metadata import version

__version__ = version("vllm-gdn-hs")
