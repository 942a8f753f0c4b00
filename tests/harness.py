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


def runner_step(connector, scheduler_output, vllm_config, forward=None):
    """One step of the worker side, driven as vLLM's model runner drives a KV connector: vLLM's
    own ``KVConnectorModelRunnerMixin`` binds the step's metadata and calls the connector's
    hooks around ``forward()`` (the model's forward pass, where our runner patch hands over
    the rows) in the release's own order (from 0.29.0 ``start_load_kv`` comes only after
    the forward). A step without scheduled tokens takes vLLM's no-forward path, as the runner
    does. ``connector`` is the process's KV transfer group for the step."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as M

    saved, kv_transfer_state._KV_CONNECTOR_AGENT = kv_transfer_state._KV_CONNECTOR_AGENT, connector
    try:
        if not scheduler_output.total_num_scheduled_tokens:
            return M.kv_connector_no_forward(scheduler_output, vllm_config)
        with (
            set_forward_context(None, vllm_config),
            M.maybe_get_kv_connector_output(scheduler_output),
        ):
            return forward()
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = saved


def scheduler_output(metadata, num_scheduled_tokens=(), finished_req_ids=()):
    """vLLM's own (empty) SchedulerOutput carrying a connector's metadata, for a worker-side
    step without a Scheduler."""
    from vllm.v1.core.sched.output import SchedulerOutput

    so = SchedulerOutput.make_empty()
    so.kv_connector_metadata = metadata
    so.num_scheduled_tokens = dict(num_scheduled_tokens)
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    so.finished_req_ids = set(finished_req_ids)
    return so
