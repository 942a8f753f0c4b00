"""Run: python -m pytest tests/test_soak.py -q (CPU, no network): CPU parts of
tools/gpu_runs/soak.py.

The tokenizer (loaded by transformers and rendered by vLLM's own chat renderer), the request
plan, the containment snapshot, ``vllm-gdn-hs check``'s parsing and the verdict; and the
whole client (requests, reading files, the folder deletion, the verdict) against a small
fake server that follows vLLM 0.20.1's request ids and the connector's file contract.
"""

from __future__ import annotations

import http.server
import json
import os
import secrets
import subprocess
import threading
import time

import launched  # tests/gpu/launched.py (pytest's pythonpath, pyproject.toml)
import pytest
import soak  # tools/gpu_runs/soak.py (the same)
import torch
from tiny_models import hybrid_config_dict, write_config

from vllm_gdn_hs import files, locks
from vllm_gdn_hs.config import request_params

TEXTS = ["hi", "héllo wörld 名前 🙂", "a\nb\tc <|im_end|> {{ x }}", "x" * 300]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("model"))
    write_config(path, hybrid_config_dict())
    return soak.build_tokenizer(path)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_tokenizer_round_trips_with_a_chat_template(tokenizer):
    assert len(tokenizer) == 1024
    specials = [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id]
    assert specials == [0, 1, 2]
    assert tokenizer.convert_ids_to_tokens([1000, 1003]) == ["<|image_pad|>", "<|vision_end|>"]
    for text in TEXTS:
        ids = soak.render(tokenizer, text)
        messages = [{"role": "user", "content": text}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert prompt.startswith("<s><|im_start|>user\n") and prompt.endswith("assistant\n")
        assert tokenizer.decode(ids) == prompt
        assert max(ids) < 1000
    tokenizer.decode(list(range(1024)))  # every id the model may sample decodes


def test_vllm_renders_chat_as_we_expect(model_dir, tokenizer):
    """vLLM's own renderer (tokenizer loading, template resolution) gives our token ids."""
    if torch.cuda.is_available():
        pytest.skip("needs vLLM's CpuPlatform (tests/harness.py), which would break GPU tests")
    import harness
    from vllm.renderers.params import ChatParams
    from vllm.renderers.registry import renderer_from_config

    args = harness.engine_args(model_dir, max_model_len=soak.MAX_MODEL_LEN)
    args.skip_tokenizer_init = False
    renderer = renderer_from_config(args.create_engine_config())
    kwargs = dict(add_generation_prompt=True, continue_final_message=False, documents=None)
    params = ChatParams(chat_template_kwargs=dict(kwargs, reasoning_effort=None))
    for text in TEXTS:
        _, prompt = renderer.render_messages([{"role": "user", "content": text}], params)
        assert prompt["prompt_token_ids"] == soak.render(tokenizer, text)


def test_plan_covers_every_kind():
    plan = soak.make_plan(1000, seed=0)
    assert len(plan) >= 1000 and [x["i"] for x in plan] == list(range(len(plan)))
    assert soak.parse_args(["--out", "x"]).concurrency >= 32
    kinds = {x["kind"] for x in plan}
    assert {"plain", "include_output_tokens", "disconnect", "over_max_model_len"} <= kinds
    assert {f"params:{k}" for k in soak.BAD_PARAMS} <= kinds
    seen = {(x["kind"], x["endpoint"], x["via"]) for x in plan}
    for name, rid in soak.HOSTILE_IDS.items():
        vias = ["body", "header"] if soak.header_safe(rid) else ["body"]
        assert soak.header_safe(rid) != any(c in rid for c in "\0\r\n")
        for endpoint in soak.ENDPOINTS:
            assert all((f"id:{name}", endpoint, via) in seen for via in vias), (name, endpoint)
    assert ("id:nul", "chat", "header") not in seen and ("id:control", "chat", "header") not in seen
    escapes = [x["rid"] for x in plan if x["kind"] == "id:escape"]
    assert len(set(escapes)) == len(escapes) and all("{n}" not in r for r in escapes)
    for x in plan:
        body = soak.request_body(x, "m")
        assert ("request_id" in body) == (x["via"] == "body")
        if x["kind"] == "over_max_model_len":
            assert len(x["prompt"] or x["text"].encode()) > soak.MAX_MODEL_LEN
        elif x["prompt"] is not None:
            assert len(x["prompt"]) + x["max_tokens"] <= soak.MAX_MODEL_LEN
        else:  # one token per byte, and 20 of the chat template
            assert len(x["text"].encode()) + 20 + x["max_tokens"] <= soak.MAX_MODEL_LEN
    assert sum(x["kind"] == "plain" for x in plan) >= 500


def test_bodies_pass_vllms_request_models():
    """vLLM 0.20.1's own request models take every planned body (a list for
    kv_transfer_params alone is refused), and the connector refuses exactly the bad
    kv_transfer_params the plan expects it to."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    models = dict(completions=CompletionRequest, chat=ChatCompletionRequest)
    models["responses"] = ResponsesRequest
    for x in soak.make_plan(0, seed=2):
        body = soak.request_body(x, "m")
        if x["kind"] == "params:list":
            with pytest.raises(ValidationError, match="valid dictionary"):
                models[x["endpoint"]].model_validate(body)
            continue
        request = models[x["endpoint"]].model_validate(body)
        assert request.kv_transfer_params == x["params"]
        assert x["via"] != "body" or request.request_id == x["rid"]
    for params, expect in soak.BAD_PARAMS.values():
        if isinstance(params, dict):
            refused = expect == ["refused"]
            try:
                request_params(params)
                assert not refused, params
            except ValueError:
                assert refused, params


def test_hostile_headers_through_uvicorn():
    """X-Request-Id as vLLM's server reads it (uvicorn, its request-id middleware): what
    external_id expects, or a 400 with a reason from the HTTP parser."""
    import importlib

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    for where in (  # where vLLM keeps its request-id middleware: 0.33.0, 0.26.0, 0.20.1
        "vllm.entrypoints.serve.middleware.x_request_id",
        "vllm.entrypoints.serve.utils.server_utils",
        "vllm.entrypoints.openai.server_utils",
    ):
        try:
            XRequestIdMiddleware = importlib.import_module(where).XRequestIdMiddleware
            break
        except ImportError:
            continue
    else:
        pytest.fail("vLLM's XRequestIdMiddleware moved: add its module here")

    async def completions(request):  # the engine's request id, as vLLM's endpoint makes it
        kv = {"hidden_states_error": f"cmpl-{request.headers.get('X-Request-Id')}-0"}
        return JSONResponse({"kv_transfer_params": kv})

    route = Route("/v1/completions", completions, methods=["POST"])
    app = XRequestIdMiddleware(Starlette(routes=[route]))
    port = launched.free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", interface="asgi3")
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    statuses = {}
    try:
        for name, rid in soak.HOSTILE_IDS.items():
            if soak.header_safe(rid):
                item = soak.new_item(name, "completions", [], via="header", rid=rid, prompt=[1])
                rec = soak.send(f"http://127.0.0.1:{port}", item, "m")
                statuses[name] = rec["status"]
                if rec["status"] == 200:
                    assert rec["kv"]["hidden_states_error"] == soak.external_id(item), name
                else:
                    assert rec["status"] == 400 and rec["reason"], (name, rec)
    finally:
        server.should_exit = True
    assert statuses["unicode"] == statuses["long"] == 200 and statuses["control_header"] == 400


def test_file_names_follow_the_request_id():
    for rid in [*soak.HOSTILE_IDS.values(), "soak-disc-3"]:
        for endpoint in soak.ENDPOINTS:
            item = soak.new_item("id", endpoint, ["file"], via="body", rid=rid)
            external = soak.external_id(item)
            path = "/hs/" + files.file_name(external + "-" + secrets.token_hex(4))
            assert soak.name_matches(path, external), (rid, endpoint)
            other = "/hs/" + files.file_name(external + "x-" + secrets.token_hex(4))
            assert not soak.name_matches(other, external) or len(external) > 150
    header = soak.new_item("id", "responses", ["file"], via="header", rid="x")
    assert soak.external_id(header) is None  # the responses endpoint ignores the header


def test_snapshot_flags_files_outside_the_folder_only(tmp_path):
    top, root = tmp_path / "tmp", tmp_path / "out" / "root"
    folder = root / "hs"
    for d in (top / "sub", root / "cwd", folder):
        d.mkdir(parents=True)
    roots = {str(top): 2, str(root): None}
    before = soak.snapshot(roots, str(folder))
    planted = [top / "soak-escape-1-0-abc.safetensors", root / "cwd" / "x.safetensors.lock"]
    harmless = [top / "other.txt", top / "sub" / "deep", top / ("a" * 64 + "-model.lock")]
    inside = [folder / "x.safetensors", folder / "x.safetensors.lock", folder / "soak-disc-1"]
    for path in planted + harmless + inside:
        path.write_text("")
    (top / "sub" / "deep").unlink()
    (top / "sub" / "deep").mkdir()
    (top / "sub" / "deep" / "too-deep.safetensors").write_text("")  # below /tmp's depth
    after = soak.snapshot(roots, str(folder))
    assert soak.outside_entries(before, after) == sorted(map(str, planted))


def test_check_is_parsed(tmp_path):
    folder = str(tmp_path / "hs")
    os.makedirs(folder)
    for name in ("a", "b"):
        path = files.request_path(folder, name)
        fd = locks.take_lock(path)
        files.write_file(path, torch.ones(3, 4, 8, dtype=torch.bfloat16), torch.arange(3))
        locks.release_lock(fd, path, remove=False)
        locks.wait_for_file(path)
    open(files.request_path(folder, "lost") + locks.LOCK_SUFFIX, "w").close()
    check = soak.run_check(folder, str(tmp_path / "list.txt"))
    assert check["complete"] == 2 and check["problems"] == {"lost": 1} and check["rc"] == 1


def test_a_file_is_checked_with_the_hf_reference(tmp_path):
    """The soak's read-and-check of one file with the real HFReference (CPU here)."""
    from tiny_models import build_tiny_hybrid

    import vllm_gdn_hs.verify.reference as reference

    if not hasattr(reference, "HFReference"):
        pytest.skip("vllm_gdn_hs.verify.reference.HFReference not there yet")
    ref = reference.HFReference(build_tiny_hybrid(str(tmp_path / "m")), soak.LAYER_IDS, "cpu")
    folder = str(tmp_path / "hs")
    client = soak.Soak("http://unused", "m", folder, ref)
    seq = list(range(3, 40))
    for name, rows in [("good", ref(seq)[1]), ("shifted", ref([1] + seq[:-1])[1])]:
        path = files.request_path(folder, name)
        locks.release_lock(locks.take_lock(path), path, remove=False)
        files.write_file(path, rows, torch.tensor(seq))
        verdict = client._read_and_check({}, path, seq)
        assert (verdict == "ok") == (name == "good"), verdict
    assert not os.path.exists(path + locks.LOCK_SUFFIX) and os.path.exists(path)  # read, kept
    assert reference.worst_by_layer(client.checks)["worst_ratio"] > 1


def _rec(kind="plain", status=200, kv=None, **kw):
    rec = dict(i=0, kind=kind, endpoint="completions", via=None, rid=None, expect=["file"])
    return rec | dict(status=status, kv=kv, reason=None, t_sent=1.0, t_done=2.0) | kw


def _clean(folder):
    path = os.path.join(folder, "a.safetensors")
    ok = dict(kv={"hidden_states_path": path}, path=path, inside=True, verify="ok")
    records = [_rec(**ok), _rec("final", **ok)]
    records.append(_rec("params:x", kv={"hidden_states_error": "bad"}, expect=["refused"]))
    records.append(_rec("over", 400, reason="too long", expect=["http_400"]))
    records.append(_rec("disconnect", None, expect=["none"]))
    ctx = dict(health_at_end=200, check={"complete": 2, "problems": {}}, verified_on_disk=2)
    return records, ctx


def test_verdict(tmp_path):
    folder = str(tmp_path)
    records, ctx = _clean(folder)
    summary = soak.evaluate(records, ctx)
    assert summary["passed"], summary["failures"]
    assert summary["outcomes"] == {"file": 2, "refused": 1, "http_400": 1, "none": 1}

    def failures(extra, **ctx_kw):
        records, ctx = _clean(folder)
        return set(soak.evaluate(records + [extra], ctx | ctx_kw)["failures"])

    outside = {"hidden_states_path": "/etc/passwd"}
    assert failures(_rec(kv=outside, path="/etc/passwd", inside=False)) == {"path_outside_folder"}
    assert failures(_rec(status=400, reason="", expect=["http_400"])) == {"refused_without_reason"}
    assert failures(_rec(kv={})) == {"refused_without_reason"}
    assert failures(_rec(status=500, reason="boom")) == {"server_error"}
    assert failures(_rec(kv={"hidden_states_error": "x"})) == {"unexpected_outcome"}
    assert failures(_rec(status=None, reason="reset")) == {"no_response"}
    kv = {"hidden_states_path": os.path.join(folder, "b.safetensors")}
    missing = _rec(kv=kv, path=kv["hidden_states_path"], inside=True, verify="missing")
    assert failures(missing | dict(t_missing=3.0)) == {"file_missing"}
    deletion = {"start": 2.5, "end": 2.6}
    records, ctx = _clean(folder)
    summary = soak.evaluate(records + [missing | dict(t_missing=3.0)], ctx | {"deletion": deletion})
    assert summary["passed"] and summary["files"]["gone_with_folder"] == 1
    late = missing | dict(t_sent=2.7, t_missing=3.0)  # sent after the deletion: must be there
    assert failures(late, deletion=deletion) == {"file_missing"}
    assert failures(_rec(**_clean(folder)[0][0]), verified_on_disk=3) == {"check_count"}
    assert "created_outside_folder" in failures(_rec(**_clean(folder)[0][0]), outside=["/tmp/x"])
    assert "server_down_at_end" in failures(_rec(**_clean(folder)[0][0]), health_at_end=None)


# -- the client against a fake server ----------------------------------------------------


class FakeServer(http.server.ThreadingHTTPServer):
    """vLLM 0.20.1's request ids and responses, the connector's files (no model)."""

    daemon_threads, request_queue_size = True, 128  # uvicorn's backlog is 2048

    def __init__(self, folder, tokenizer):
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.folder, self.tokenizer, self.leak = folder, tokenizer, None


class FakeHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self._reply(200, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        endpoint = next(k for k, v in soak.ENDPOINTS.items() if v == self.path)
        if endpoint == "completions":
            prompt = body["prompt"]
        else:
            text = body["input"] if endpoint == "responses" else body["messages"][0]["content"]
            prompt = soak.render(self.server.tokenizer, text)
        kv = body.get("kv_transfer_params")
        if len(prompt) >= soak.MAX_MODEL_LEN or not isinstance(kv, (dict, type(None))):
            return self._reply(400, {"error": {"message": "bad request", "code": 400}})
        base = self.headers.get("X-Request-Id") if endpoint != "responses" else None
        base = base or body.get("request_id") or secrets.token_hex(8)
        external = {"completions": f"cmpl-{base}-0", "chat": f"chatcmpl-{base}"}
        engine_id = external.get(endpoint, f"{base}_0") + "-" + secrets.token_hex(4)
        outputs = [7] * body.get("max_tokens", body.get("max_output_tokens", 1))
        if "soak-disc-" in engine_id:
            time.sleep(0.3)  # aborted when the client goes: no file, no lock
            return self._reply(200, {})
        try:
            params = request_params(kv)
        except ValueError as e:
            out = {"hidden_states_error": str(e)}
        else:
            path = files.request_path(self.server.folder, engine_id)
            seq = prompt + (outputs[:-1] if params.include_output_tokens else [])
            if self.server.leak and "soak-escape" in engine_id:  # as a broken connector would
                open(os.path.join(self.server.leak, "soak-escape-1.safetensors"), "w").close()
            out = {"hidden_states_path": path}
            rows = torch.ones(len(seq), 4, 8, dtype=torch.bfloat16)
            fd = None
            try:  # the folder deletion may take the file, as it may the connector's
                fd = locks.take_lock(path)
                files.write_file(path, rows, torch.tensor(seq))
            except Exception:  # safetensors' error for a vanished folder is no OSError
                pass
            finally:
                locks.release_lock(fd, path, remove=False)
        choice = {"token_ids": outputs, "prompt_token_ids": prompt}
        self._reply(
            200, {"choices": [choice], "prompt_token_ids": prompt, "kv_transfer_params": out}
        )

    def _reply(self, status, data):
        raw = json.dumps(data).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
        except OSError:
            pass  # the client has gone


class FakeReference:
    """HFReference's interface; each file's error grows with its length (1e-5 per token, HF
    bf16's 1e-3), so the summary's worst ratio tells whether the client fed every file in."""

    def __init__(self):
        self.lengths: list[int] = []  # of each sequence the client checked

    def __call__(self, prompt):  # soak.main warms the reference up
        return None

    def pooled(self):
        return {"files": 1, "ours": [1e-3] * 4, "hf_bf16": [2e-3] * 4, "ratio": [0.5] * 4,
                "problems": []}  # fmt: skip

    def check(self, data, seq):
        ok = data["token_ids"].tolist() == seq and data["hidden_states"].shape[0] == len(seq)
        self.lengths.append(len(seq))
        ours = [1e-5 * len(seq)] * 4
        return {"problems": [] if ok else ["differs"], "ours": ours, "hf_bf16": [1e-3] * 4}


@pytest.mark.parametrize("leak", [False, True])
def test_main_against_a_fake_server(tmp_path, monkeypatch, leak):
    """soak.main from the model build to soak.json, with the server, the model and the
    reference faked; a server that writes where an escaping id points must fail it."""
    import tiny_models
    from transformers import AutoTokenizer

    import vllm_gdn_hs.verify.reference

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(soak, "TMP", str(tmp))
    monkeypatch.setattr(soak, "LOCK_GRACE_S", 0)
    refs: list[FakeReference] = []
    monkeypatch.setattr(
        vllm_gdn_hs.verify.reference,
        "HFReference",
        lambda *a, **kw: refs.append(FakeReference()) or refs[-1],
    )
    build = lambda path: write_config(path, hybrid_config_dict())  # noqa: E731
    monkeypatch.setattr(tiny_models, "build_tiny_hybrid", build)
    servers = []

    def start_server(model_dir, folder, log, cwd):
        servers.append(FakeServer(folder, AutoTokenizer.from_pretrained(model_dir)))
        servers[-1].leak = str(tmp) if leak else None
        threading.Thread(target=servers[-1].serve_forever, daemon=True).start()
        proc = subprocess.Popen(["sleep", "600"], start_new_session=True)  # stopped by main
        return proc, f"http://127.0.0.1:{servers[-1].server_address[1]}"

    monkeypatch.setattr(soak, "start_server", start_server)
    out = tmp_path / "out"
    try:
        rc = soak.main(["--out", str(out), "--requests", "450", "--concurrency", "16"])
    finally:
        servers[0].shutdown()
    summary = json.loads((out / "soak.json").read_text())
    assert (out / "server-tail.log").exists()
    if leak:
        assert rc == 1 and not summary["passed"]
        assert {"created_outside_folder", "escape_target_exists"} <= set(summary["failures"])
        return
    assert rc == 0 and summary["passed"], json.dumps(summary["failures"], indent=1)
    assert summary["max_in_flight"] > 8 and summary["deletion"]["passes"] >= 1
    files_, outcomes = summary["files"], summary["outcomes"]
    assert files_["verified"] + files_["gone_with_folder"] == outcomes["file"]
    assert files_["on_disk"] == files_["check"] > 0
    assert outcomes["none"] == 60 and outcomes["refused"] >= 27 and outcomes["http_400"] >= 24
    # Every file the client read went through the reference once, and the worst of them is
    # in the summary (the longest sequence: 1e-5 per token against HF bf16's 1e-3).
    (ref,) = refs
    assert len(ref.lengths) == files_["verified"]
    assert summary["accuracy"]["worst_file"]["worst_ratio"] == round(max(ref.lengths) / 100, 3)
    assert summary["args"]["requests"] == 450
    assert len(json.dumps(summary)) < 20_000
