"""The command line: ``vllm-gdn-hs`` (:mod:`.main`), the launcher and its vLLM arguments, the
doctor, the demo and the trainers' entry. Nothing of the runtime imports it."""

from vllm_gdn_hs.cli.main import main

__all__ = ["main"]
