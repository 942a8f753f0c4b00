"""Preemption through vLLM's own Scheduler: a resumed request's rows replace the earlier ones.

Run: python -m pytest tests/test_preemption.py -q   (no GPU, no network)
vLLM's Scheduler preempts a running request (its own ``_preempt_request``, as it does when
the KV cache runs out), frees its blocks and computes it again from token 0. Up to 0.33.0 the
resumed request comes back among the cached requests; from 0.34.0 as a new request
(``scheduled_new_reqs``), so the connector's scheduler side lists it as new a second time.
Either way the file must be the one the client was given, holding the rows of the recompute
for every position (prompt and outputs) and the tokens in order. The GPU's forward pass is
the one fake: the rows of position p are p + 1, plus 1,000 once the request was preempted.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_hostile import Engine, engine_request

from vllm_gdn_hs import files
from vllm_gdn_hs.version import has_v1_runner


@pytest.mark.smoke
def test_a_resumed_request_keeps_its_file_with_the_recomputed_rows(hybrid_model, tmp_path, runner):
    eng = Engine(hybrid_model, str(tmp_path), runner=runner)
    prompt = list(range(3, 43))
    params = {"include_output_tokens": True}
    rid = eng.add(engine_request("victim", prompt, max_tokens=6, params=params))
    other = eng.add(engine_request("bystander", list(range(5, 25)), max_tokens=6, params=params))
    eng.step()  # prefill
    eng.step()  # one decode step
    req = eng.sched.requests[rid]
    assert req.num_computed_tokens == len(prompt) + 1
    # vLLM's own preemption, as schedule() runs it when blocks run out: the request leaves the
    # running queue and, preempted instead of scheduled, is not among the step's scheduled
    # requests (0.22.0's schedule() asserts that of a request it resumes).
    eng.sched.running.remove(req)
    eng.sched._preempt_request(req, time.monotonic())
    getattr(eng.sched, "prev_step_scheduled_req_ids", set()).discard(rid)
    eng.offset = 1000  # everything computed from here on, the recompute included
    for _ in range(12):
        if rid in eng.outputs and other in eng.outputs:
            break
        eng.step()
    eng.step()  # the worker side hears of finished requests in the next step's metadata
    eng.worker.shutdown()

    listed = [n.req_id for m in eng.metas for n in m.new_requests]
    assert listed.count(rid) == (1 if has_v1_runner() else 2)  # 0.34.0: resumed as new
    path = eng.params(rid)["hidden_states_path"]
    assert path == files.request_path(str(tmp_path), rid)
    data = files.load_hidden_states(path)
    n = len(prompt) + 5  # six outputs (each 7, the fake sampler's); the last is never run
    assert data["token_ids"].tolist() == [*prompt, *[7] * 5]
    expected = torch.arange(1, n + 1) + 1000  # every position computed again after preemption
    assert torch.equal(data["hidden_states"][:, 0, 0], expected.bfloat16())
    # The bystander's file is untouched by the victim's recompute.
    data = files.load_hidden_states(eng.params(other)["hidden_states_path"])
    assert data["token_ids"].tolist()[:20] == list(range(5, 25))
