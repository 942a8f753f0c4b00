"""vllm-gdn-hs: hidden-state extraction for GDN hybrid models on vLLM (the plugin's entry point
is :func:`vllm_gdn_hs.plugin.register`)."""

from importlib.metadata import version

__version__ = version("vllm-gdn-hs")
