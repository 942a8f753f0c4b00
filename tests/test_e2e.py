"""benchmarks/e2e.py against a fake OpenAI server on 127.0.0.1; CPU only, no vLLM server.

Run: python -m pytest tests/test_e2e.py -q
Covers: the request body is speculators' (token ids, max_tokens 1, return_token_ids); plain and
ours get the same serve flags; a whole backend run (start, /health, the workload with
concurrency, every answered file checked, SIGTERM) writes a record with the metadata fields.
No timing is asserted.
"""

from __future__ import annotations

import json
import sys

import e2e  # benchmarks/e2e.py (pytest's pythonpath, pyproject.toml)
import pytest
import records

# A stand-in server: /health, and /v1/completions writing one file per request (its lock
# gone at once) under the directory given, answering as vLLM with our connector does.
FAKE_SERVER = r"""
import json, os, sys, signal
from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler
port, out, log = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.makedirs(out, exist_ok=True)
n = [0]
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data)))
        self.end_headers(); self.wfile.write(data)
    def do_GET(self): self._send({})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(log, "a") as f: f.write(json.dumps(body) + "\n")
        n[0] += 1
        path = os.path.join(out, f"r{n[0]}-{os.getpid()}-{id(body)}.safetensors")
        open(path, "wb").close()
        self._send({"choices": [{"prompt_token_ids": body["prompt"], "token_ids": [7]}],
                    "kv_transfer_params": {"hidden_states_path": path}})
print("INFO Using FlashInfer GDN prefill kernel (requested=auto, head_k_dim=128).", flush=True)
print("INFO Chunked prefill is enabled with max_num_batched_tokens=16384.", flush=True)
s = ThreadingHTTPServer(("127.0.0.1", port), H)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
s.serve_forever()
"""


def test_request_body_is_speculators():
    assert e2e.request_body("m", [5, 6, 7]) == {
        "model": "m",
        "prompt": [5, 6, 7],
        "max_tokens": 1,
        "return_token_ids": True,
    }


def test_plain_and_ours_get_the_same_serve_flags(tmp_path):
    args = e2e.parse_args(
        ["--results", str(tmp_path / "r.json"), "--", "--max-num-seqs", "256", "--enforce-eager"]
    )
    args.model = "/m"
    args.serve_common = e2e.common_serve_flags(args)
    args.backend_dir = lambda b: str(tmp_path / b)
    plain = e2e.serve_command(args, "plain", 8000)
    ours = e2e.serve_command(args, "file", 8000)
    assert plain[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    assert ours[ours.index("--") + 1 :] == plain[5:]
    assert ours[ours.index("--target-layer-ids") + 1 : ours.index("--no-include-last-layer")] == [
        "1", "16", "31", "46", "61", "64"
    ]  # fmt: skip
    assert "--additional-config" not in plain  # default: vLLM chooses the GDN backend
    args.gdn_backend = "triton"
    tri = e2e.common_serve_flags(args)
    assert json.loads(tri[tri.index("--additional-config") + 1]) == {
        "gdn_prefill_backend": "triton"
    }
    assert (
        "VLLM_PLUGINS" in e2e.server_env("plain") and e2e.server_env("plain")["VLLM_PLUGINS"] == ""
    )


def test_a_backend_run_writes_its_record(tmp_path, monkeypatch):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    bodies = tmp_path / "bodies.jsonl"

    def fake_command(args, backend, port):
        return [sys.executable, str(script), str(port), args.backend_dir(backend), str(bodies)]

    monkeypatch.setattr(e2e, "serve_command", fake_command)
    results = tmp_path / "r.json"
    argv = [
        "--shape", "tiny", "--workload", "16x32", "--backends", "file,plain",
        "--concurrency", "4", "--out-dir", str(tmp_path / "hs"), "--results", str(results),
        "--log-dir", str(tmp_path / "logs"), "--model-root", str(tmp_path / "m"),
        "--run", "t1", "--stop-grace", "10", "--", "--max-num-seqs", "256",
    ]  # fmt: skip
    assert e2e.main(argv) == 0
    recs = records.load_records(str(results))
    assert [r["backend"] for r in recs] == ["file", "plain"]
    for r in recs:
        assert r["status"] == "ok", r.get("error") or r.get("log_tail")
        assert r["answered"] == 16 and r["samples_s"] > 0 and r["prompt_tokens_s"] > 0
        for field in ("date", "commit", "gpu", "versions", "runner", "mode", "run"):
            assert field in r
        assert r["gdn_prefill_backend"] == "flashinfer" and r["gdn_backend_requested"] == "default"
        assert (r["max_num_batched_tokens"], r["max_num_seqs"]) == (16384, 256)
        assert r["prefix_caching"] is False and r["kv_sizing"] == "extensible KV cache"
        assert r["mode"] == "cudagraph" and r["run"] == "t1"
    assert recs[0]["files_checked"] == 16 and recs[0]["files_missing"] == 0
    sent = [json.loads(x) for x in bodies.read_text().splitlines()]
    assert len(sent) == 2 * (8 + 16)  # warm-up and workload, per backend
    assert all(b["max_tokens"] == 1 and b["return_token_ids"] is True for b in sent)
    assert all(isinstance(b["prompt"], list) and len(b["prompt"]) == 32 for b in sent)


def test_a_missing_file_fails_the_record(tmp_path):
    answer = {"choices": [{"prompt_token_ids": [1]}], "kv_transfer_params": {}}
    assert e2e.answer_problem(answer, [1], "file") == "no hidden_states_path"
    assert e2e.answer_problem(answer, [1], "plain") is None
    _, missing = e2e.files_ready([str(tmp_path / "nope.safetensors")], timeout=0.05)
    assert missing == [str(tmp_path / "nope.safetensors")]


def test_mooncake_without_its_wheel_is_skipped(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    assert e2e.mooncake_problem() == "skipped: no mooncake wheel"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
