"""Hostile and faulty input, end to end through vLLM's real Scheduler and our worker side.

Run: python -m pytest tests/test_hostile.py -q (CPU, no network).
Request ids are formed as each entry point forms them (``cmpl-<id>-<i>`` for completions,
``chatcmpl-<id>`` for chat, ``<id>`` for responses), then put through vLLM's own
``InputProcessor.assign_request_id`` (random suffix, or none under
VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1). The requests run through the real Scheduler; its
connector metadata drives a worker-side connector whose rows are written to real files. The
rows reach it through the patched model runner, as on the GPU: V1's ``_model_forward``
inside vLLM's own ``KVConnectorModelRunnerMixin`` hooks (``harness.V1Runner``) and, where
Model Runner V2 is patched, V2's ``execute_model`` between vLLM's own V2 connector hooks
(``harness.V2Runner``), with padding rows after the scheduled ones, as CUDA graphs pad. The
only fake is the GPU's model: each step's rows are made up from the scheduled positions. Faults are
injected at each per-request stage (path, lock, host buffers, drain, write). The pass:
nothing is created outside the folder, no exception reaches vLLM, and every other request
in the same steps still gets its file.
"""

from __future__ import annotations

import logging
import os
import uuid

import harness
import pytest
import torch
from test_connector_scheduler import make_scheduler
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.request import Request

from vllm_gdn_hs import files, locks
from vllm_gdn_hs.connector import HybridHiddenStatesConnector, request_rows
from vllm_gdn_hs.version import has_v1_runner

_ABS = f"/tmp/vllm-gdn-hs-hostile-{uuid.uuid4().hex[:8]}"  # must never come into being
HOSTILE_IDS = {
    "dotdot": "../../outside/x",
    # up to / and down to a name of this run's own: a shared /tmp's x is not this test's
    "deep-dotdot": "../" * 8 + _ABS.lstrip("/") + "-deep/x",
    "absolute": _ABS + "/x",
    "nul": "nul\x00byte",
    "newline": "a\nb",
    "control": "\r\t\x1b[31m\x7f",
    "dot": ".",
    "dotdot-exact": "..",
    "long": "x" * 10_000,
    "non-ascii": "ünï©ødé-名前-🙂",
    "percent": "%2e%2e%2f",
    "slash": "/",
    "empty": "",
}
ENTRY_POINTS = {  # how vLLM's OpenAI server forms the engine's request id from the client's
    "completions": lambda rid: f"cmpl-{rid}-0",
    "chat": lambda rid: f"chatcmpl-{rid}",
    "responses": lambda rid: rid,
}


def engine_request(rid: str, prompt: list[int], max_tokens: int = 1, params=None) -> Request:
    extra = {"kv_transfer_params": params} if params is not None else None
    ecr = EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=max_tokens, extra_args=extra),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    InputProcessor.assign_request_id(ecr)  # vLLM's own: random suffix unless disabled
    return Request.from_engine_core_request(ecr, block_hasher=None)


class Engine:
    """The real Scheduler and a worker-side connector, stepped as EngineCore steps them; the
    rows of token position p of every request are all p + 1 (the GPU is the only fake)."""

    L = 4  # the harness's default layer ids

    def __init__(self, model: str, storage: str, runner: str | None = None, **extra):
        self.sched = make_scheduler(model, storage, **extra)
        self.cfg = self.sched.vllm_config
        harness._init_dist(self.cfg)
        with set_current_vllm_config(self.cfg):
            self.worker = HybridHiddenStatesConnector(self.cfg, KVConnectorRole.WORKER)
        # The patched runner that hands the rows over: V1's _model_forward or V2's execute_model
        runners = {"v1": harness.V1Runner, "v2": harness.V2Runner}
        runner = runner or ("v1" if has_v1_runner() else "v2")  # the release's default
        self.runner = runners[runner](self.worker, self.cfg)
        self.hidden = self.cfg.model_config.get_hidden_size()
        self.L = len(self.worker.layer_ids)
        self.outputs: dict[str, object] = {}
        self.tokens: dict[str, list[int]] = {}
        self.offset = 0  # added to every row: steps after a change compute other rows
        self.metas: list = []  # the connector metadata of every step

    def add(self, req: Request) -> str:
        self.sched.add_request(req)
        self.tokens[req.request_id] = list(req.prompt_token_ids)
        return req.request_id

    def step(self) -> None:
        so = self.sched.schedule()
        ids = list(so.num_scheduled_tokens)
        sched = []  # (req_id, start, count) in batch order
        for rid in ids:
            n = so.num_scheduled_tokens[rid]
            sched.append((rid, self.sched.requests[rid].num_computed_tokens - n, n))
        # The GPU's forward pass: every layer's row at position p is p + 1; then two NaN
        # padding rows, as CUDA graphs pad (they must never reach a file).
        self.metas.append(so.kv_connector_metadata)
        pos = harness.schedule_positions(sched)
        rows = (pos + 1 + self.offset).to(torch.bfloat16)[:, None].expand(-1, self.hidden)
        nan = torch.full((2, self.hidden), float("nan")).bfloat16()
        self.runner.step(so, sched, [torch.cat([rows, nan])] * self.L, pad=2)
        tokens = [[] if self.sched.requests[r].is_prefill_chunk else [7] for r in ids]
        out = harness.model_runner_output(ids, tokens)
        for eco in self.sched.update_from_output(so, out).values():
            for o in eco.outputs:
                if o.finish_reason:
                    self.outputs[o.request_id] = o

    def run(self, steps: int = 8) -> None:
        for _ in range(steps):
            self.step()
        self.worker.shutdown()

    def params(self, rid: str) -> dict:
        return self.outputs[rid].kv_transfer_params or {}


@pytest.fixture
def root(tmp_path):
    (tmp_path / "hs").mkdir()
    return tmp_path


def assert_file(eng: Engine, rid: str, folder) -> None:
    path = eng.params(rid)["hidden_states_path"]
    assert os.path.dirname(path) == str(folder) and files.inside(path, str(folder))
    assert os.path.basename(path) == files.file_name(rid)
    data = files.load_hidden_states(path)
    n = len(eng.tokens[rid])
    assert data["token_ids"].tolist() == eng.tokens[rid]
    assert torch.equal(data["hidden_states"][:, 0, 0], torch.arange(1, n + 1).bfloat16())


def naive_targets(folder: str, request_ids) -> list[str]:
    """Where each request id would land if it were joined to the folder as a path, for those
    that would leave it (``../../outside/x`` from root/hs is root's parent's outside/x)."""
    targets = [os.path.normpath(os.path.join(folder, r)) for r in request_ids if "\x00" not in r]
    # the folder itself and its ancestors (".", "..", "/", "") are no file that could be made
    return [t for t in targets if os.path.commonpath([t, folder]) not in (t, folder)]


def only_the_folder(root, request_ids=()) -> None:
    """Nothing was created anywhere but in root/hs: not where ``../..`` or an absolute id
    leads, taken as a path from the folder."""
    assert sorted(os.listdir(root)) == ["hs"]
    assert not os.path.exists(_ABS) and not os.path.exists(root.parent / "outside")
    leaked = [t for t in naive_targets(str(root / "hs"), request_ids) if os.path.lexists(t)]
    assert not leaked
    assert not [n for n in os.listdir(root / "hs") if files.is_temp(n) is not None]


@pytest.mark.parametrize("randomized", [True, False], ids=["random-suffix", "ids-as-given"])
def test_hostile_ids_in_every_entry_point_stay_in_the_folder(
    hybrid_model, root, monkeypatch, randomized, runner
):
    if not randomized:
        monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    eng = Engine(hybrid_model, str(root / "hs"), runner)
    normal = [eng.add(engine_request(f"cmpl-normal{i}-0", [1 + i, 2, 3])) for i in range(3)]
    hostile = [
        eng.add(engine_request(form(rid), [5, 6, 7, 8]))
        for form in ENTRY_POINTS.values()
        for rid in HOSTILE_IDS.values()
    ]
    eng.run()
    assert set(eng.outputs) == set(normal + hostile)
    for rid in normal + hostile:  # each id is encoded into a safe name: every request gets one
        assert_file(eng, rid, root / "hs")
    names = os.listdir(root / "hs")
    assert len([n for n in names if n.endswith(files.SUFFIX)]) == len(normal + hostile)
    assert all(len(n.encode()) + len(".lock") <= 255 for n in names)
    escaping = naive_targets(str(root / "hs"), hostile)  # the ids that would escape as paths
    assert str(root.parent / "outside" / "x") in escaping or randomized
    assert any(t.startswith(str(root.parent / "outside" / "x")) for t in escaping)
    only_the_folder(root, hostile)


def test_file_names_are_injective_and_safe():
    ids = [*HOSTILE_IDS.values(), "a%2Fb", "a/b", ".hidden", "%2Ehidden", "x" * 200, "x" * 201]
    names = [files.file_name(i) for i in ids]
    assert len(set(names)) == len(ids)
    for name in names:
        assert "/" not in name and "\x00" not in name and not name.startswith(".")
        assert name not in (".", "..") and len(name.encode()) <= files.MAX_STEM + len(files.SUFFIX)
        assert all(c.isascii() and (c.isalnum() or c in "._-%~") for c in name)
    assert files.file_name("cmpl-3f2a-0-1b2c3d4e") == "cmpl-3f2a-0-1b2c3d4e.safetensors"


BAD_PARAMS = {
    "path-int": ({"hidden_states_path": 123}, "hidden_states_path"),
    "bool-as-string": ({"include_output_tokens": "false"}, "include_output_tokens"),
    "bool-as-huge-float": ({"include_output_tokens": 1e308}, "include_output_tokens"),
    "bool-as-null": ({"include_output_tokens": None}, "include_output_tokens"),
    "path-huge": ({"hidden_states_path": "a" * 100_000}, "hidden_states_path"),
    "a-list": ([1, 2], "must be an object"),
    "a-string": ("include_output_tokens", "must be an object"),
}


def test_hostile_kv_transfer_params_refused_for_that_request_alone(hybrid_model, root, caplog):
    eng = Engine(hybrid_model, str(root / "hs"))
    bad = {k: eng.add(engine_request(k, [1, 2, 3], 4, p)) for k, (p, _) in BAD_PARAMS.items()}
    ok = {
        "unknown-keys": eng.add(engine_request("u", [4, 5], 1, {"x" * 1000: "y" * 100_000})),
        "custom-path-ignored": eng.add(engine_request("c", [4, 5], 1, {"hidden_states_path": "/"})),
        "plain": eng.add(engine_request("p", [6, 7, 8])),
    }
    eng.run()
    for kind, rid in bad.items():
        params = eng.params(rid)
        assert "hidden_states_path" not in params, kind
        assert BAD_PARAMS[kind][1] in params["hidden_states_error"], (kind, params)
    for rid in ok.values():
        assert_file(eng, rid, root / "hs")
    assert len(os.listdir(root / "hs")) == len(ok)  # their files (read: locks taken)
    refusals = [r for r in caplog.records if "no hidden states:" in r.getMessage()]
    assert len(refusals) == len(bad)
    only_the_folder(root)


def test_an_earlier_unread_file_is_never_overwritten(hybrid_model, root, monkeypatch):
    """Two requests with the same id (ids as given): the second is refused while the
    first's file is unread, and gets its file once the first has been read."""
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    eng = Engine(hybrid_model, str(root / "hs"))
    eng.add(engine_request("same", [1, 2, 3]))
    for _ in range(3):
        eng.step()
    first = eng.outputs.pop("same")
    assert eng.worker._worker.drain.flushed(30)
    eng.add(engine_request("same", [9, 9]))
    for _ in range(3):
        eng.step()
    assert "already exists" in eng.outputs.pop("same").kv_transfer_params["hidden_states_error"]
    data = files.load_hidden_states(first.kv_transfer_params["hidden_states_path"])
    assert data["token_ids"].tolist() == [1, 2, 3]  # the first request kept its file
    os.remove(first.kv_transfer_params["hidden_states_path"])  # read and moved away
    eng.add(engine_request("same", [9, 9]))
    eng.tokens["same"] = [9, 9]
    eng.run()
    assert_file(eng, "same", root / "hs")


def test_custom_paths_confined_to_their_root(hybrid_model, root):
    custom_root = root / "hs" / "custom"
    eng = Engine(
        hybrid_model,
        str(root / "hs"),
        allow_custom_save_path=True,
        custom_save_root=str(custom_root),
    )
    inside = str(custom_root / "mine.safetensors")
    escapes = [
        str(root / "hs" / "x.safetensors"),  # in the folder, but outside the custom root
        str(custom_root / ".." / ".." / "x.safetensors"),
        _ABS + "/x.safetensors",
        "nul\x00.safetensors",
        str(custom_root / "not-a-safetensors.txt"),
    ]
    ok = eng.add(engine_request("ok", [1, 2], 1, {"hidden_states_path": inside}))
    refused = [
        eng.add(engine_request(f"r{i}", [1, 2], 1, {"hidden_states_path": p}))
        for i, p in enumerate(escapes)
    ]
    link = custom_root / "link"  # a link planted inside the root, pointing out of it
    custom_root.mkdir(parents=True)
    link.symlink_to(root)
    via_link = eng.add(
        engine_request("l", [1, 2], 1, {"hidden_states_path": str(link / "x.safetensors")})
    )
    eng.run()
    assert eng.params(ok) == {"hidden_states_path": inside}
    assert files.load_hidden_states(inside)["token_ids"].tolist() == [1, 2]
    for rid in [*refused, via_link]:
        assert "custom_save_root" in eng.params(rid)["hidden_states_error"], rid
    assert sorted(os.listdir(root)) == ["hs"] and not os.path.exists(_ABS)


STAGES = ["path", "lock", "host-buffer", "drain-prefill", "drain-decode", "write"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_at_any_stage_costs_one_request_its_file(
    hybrid_model, root, monkeypatch, caplog, stage, runner
):
    """The faulty request gets no file and no lock (its reader fails at once), is counted
    and logged once with its id; the engine keeps serving and the others get their files."""
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")  # ids as given
    victim = "victim"
    boom = ValueError("injected fault")

    def for_victim(orig, get_id):
        def fn(*args, **kw):
            if get_id(*args) == victim:
                raise boom
            return orig(*args, **kw)

        return fn

    buf_cls = request_rows.RequestRows
    name_of = {files.file_name(victim): victim}
    if stage == "path":
        monkeypatch.setattr(
            files, "request_path", for_victim(files.request_path, lambda folder, rid: rid)
        )
    elif stage == "lock":
        monkeypatch.setattr(  # the file storage takes the lock as the request starts
            locks,
            "take_lock",
            for_victim(locks.take_lock, lambda p: name_of.get(os.path.basename(p))),
        )
    elif stage == "host-buffer":
        monkeypatch.setattr(
            buf_cls, "_resize", for_victim(buf_cls._resize, lambda self, cap: self.req.req_id)
        )
    elif stage == "drain-prefill":
        monkeypatch.setattr(buf_cls, "put", for_victim(buf_cls.put, lambda s, *a: s.req.req_id))
    elif stage == "drain-decode":
        monkeypatch.setattr(buf_cls, "defer", for_victim(buf_cls.defer, lambda s, *a: s.req.req_id))
    elif stage == "write":
        monkeypatch.setattr(
            files,
            "write_file",
            for_victim(files.write_file, lambda p, *a: name_of.get(os.path.basename(p))),
        )
    eng = Engine(hybrid_model, str(root / "hs"), runner)
    # Decode rows come in short runs; prefill in long ones: the victim has both.
    eng.add(engine_request(victim, list(range(1, 40)), 4, {"include_output_tokens": True}))
    others = [eng.add(engine_request(f"o{i}", list(range(1, 30 + i)), 3)) for i in range(3)]
    eng.run()
    for rid in others:
        assert_file(eng, rid, root / "hs")
    victim_file = os.path.join(root, "hs", files.file_name(victim))
    assert not os.path.exists(victim_file) and not os.path.exists(victim_file + ".lock")
    if stage == "path":  # refused on the scheduler side: the response says why
        assert "injected fault" in eng.params(victim)["hidden_states_error"]
    else:  # on the worker side: counted and logged once with its id
        assert eng.params(victim) == {"hidden_states_path": victim_file}
        with pytest.raises(FileNotFoundError):
            locks.wait_for_file(victim_file, timeout=1)
        logged = [
            r for r in caplog.records if r.levelno >= logging.ERROR and victim in r.getMessage()
        ]
        assert len(logged) == 1, [r.getMessage() for r in logged]
    only_the_folder(root)
