"""The CPU tests' harness: vllm_gdn_hs.cpu_engine (vLLM's configs, KV cache specs and Scheduler
on a machine without a GPU). Test files that ``import harness`` are not collected on a GPU
machine (tests/conftest.py)."""

from vllm_gdn_hs.cpu_engine import *  # noqa: F403
from vllm_gdn_hs.cpu_engine import _init_dist  # noqa: F401


def serve_parser():
    """vLLM's own ``vllm serve`` argument parser (its module moved in 0.33.0)."""
    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser  # 0.33.0
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
