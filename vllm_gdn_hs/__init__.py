"""vllm-gdn-hs: hidden-state extraction for GDN hybrid models on vLLM (the plugin's entry point
is :func:`vllm_gdn_hs.plugin.register`)."""

from importlib import metadata

__version__ = metadata.version("vllm-gdn-hs")  # no bare `version`: it names our module
