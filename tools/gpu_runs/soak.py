"""Run: PYTHONPATH=tests/gpu:tests python tools/gpu_runs/soak.py --out OUTDIR [--requests N]
(CUDA GPU, vLLM, the plugin; from the repository root, with vLLM's folder first on PYTHONPATH
on the offline machine, as run_gpu_suite.sh puts it).

A GPU soak with hostile clients. A tiny Qwen3.5 hybrid model with a locally built tokenizer
is served through ``vllm-gdn-hs launch``; >= 1000 shuffled requests (speculators' prefills,
include_output_tokens, client disconnects, hostile request ids in bodies and headers, bad
kv_transfer_params, prompts over max_model_len) hit the completions, chat and responses
endpoints while the hidden-states folder is deleted once. Each file is read as speculators
reads it and checked against HF transformers (``HFReference``); nothing may appear outside
the folder. Writes OUTDIR/soak.json and OUTDIR/server-tail.log; exits 1 on any failure.
OUTDIR/root and OUTDIR/model are made afresh.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import http.client
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

from vllm_gdn_hs import files

try:
    import launched  # tests/gpu/launched.py, through PYTHONPATH (the usage line above)
except ModuleNotFoundError as e:
    sys.exit(f"{e}: run with PYTHONPATH=tests/gpu:tests from the repository root")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS = [1, 3, 6]  # the launcher appends N = 8
LAYER_IDS = LAYERS + [8]
MAX_MODEL_LEN = 512
TMP = "/tmp"  # scanned for files that escaped the folder
LOCK_GRACE_S = 10  # an aborted request's lock must be gone this long after the run
ENDPOINTS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
}
# Request ids from the network; {n} is numbered per request. Ids holding NUL, CR or LF
# cannot travel in an HTTP header: those go in the JSON body only.
HOSTILE_IDS = {
    "escape": "../../../tmp/soak-escape-{n}",
    "escape_deep": "../" * 16 + "tmp/soak-escape-{n}",
    "absolute": "/tmp/soak-abs-{n}",
    "nul": "nul\x00byte",
    "control": "a\nb\r\t\x1b",
    "control_header": "a\tb\x1b\x7f",
    "dot": ".",
    "dotdot": "..",
    "long": "x" * 10_000,
    "unicode": "ünï©ødé-名前-🙂",
    "percent": "%2e%2e",
}
# kv_transfer_params -> the outcomes allowed (see outcome()).
BAD_PARAMS = {
    "path_int": ({"hidden_states_path": 123}, ["refused"]),
    "include_str": ({"include_output_tokens": "false"}, ["refused"]),
    "include_float": ({"include_output_tokens": 1e308}, ["refused"]),
    "path_etc_passwd": ({"hidden_states_path": "/etc/passwd"}, ["file"]),  # ignored
    "huge_keys": ({"x" * 1000: "y" * 100_000}, ["file"]),
    "list": ([1, 2], ["refused", "http_400"]),
}
WORDS = ["the", "model", "hidden", "state", "drafter", "héllo", "wörld", "名前", "🙂", "token"]
NOTES = [
    "X-Request-Id cannot carry NUL, CR or LF: ids holding them are sent in the JSON body only",
    "non-ASCII X-Request-Id values are sent as UTF-8 bytes; the server reads them as latin-1",
    "/v1/responses takes its id from the body only (vLLM 0.20.1 ignores X-Request-Id there)",
    "gone_with_folder: a file missing after the folder deletion began, of a request sent "
    "before it ended; a request sent after the deletion must have its file",
]
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# -- the tokenizer -------------------------------------------------------------------------


def build_tokenizer(model_dir: str, vocab_size: int = 1024) -> str:
    """A byte-level BPE tokenizer (no merges: one token per byte) over the model's vocab:
    specials 0-4, bytes 5-260, filler tokens up to 999, and the image/video ids 1000-1003
    and the rest as special tokens. Writes tokenizer.json and tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's byte chars
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + k) for k, b in enumerate(b for b in range(256) if b not in chars)})
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({chars[b]: len(SPECIAL_TOKENS) + b for b in range(256)})
    while len(vocab) < 1000:
        vocab["".join(chars[c] for c in f"t{len(vocab)}".encode())] = len(vocab)
    reserved = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    # <|endoftext|> in the vocabulary: transformers 5.19 loads a Qwen3.5 model's tokenizer
    # as Qwen3_5Tokenizer, which adds it as one more token where it is missing.
    reserved += ["<|endoftext|>"] + [f"<|reserved_{i}|>" for i in range(1005, vocab_size)]
    vocab.update({t: 1000 + k for k, t in enumerate(reserved)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS + reserved])
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    config = dict(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    config.update(bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=512)
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return model_dir


def render(tokenizer, text: str) -> list[int]:
    """The prompt token ids of one user message, as vLLM's chat renderer makes them."""
    messages = [{"role": "user", "content": text}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


# -- the plan ------------------------------------------------------------------------------


def header_safe(request_id: str) -> bool:
    return not any(c in request_id for c in "\x00\r\n")


def new_item(kind: str, endpoint: str, expect: list, **kw) -> dict:
    """One planned request; ``expect``: the outcomes allowed (see :func:`outcome`)."""
    item = dict(kind=kind, endpoint=endpoint, expect=expect, max_tokens=1, outputs=False)
    return dict.fromkeys(["via", "rid", "params", "prompt", "text"]) | item | kw


def make_plan(requests: int = 1000, seed: int = 0, max_model_len: int = MAX_MODEL_LEN) -> list:
    """The requests, shuffled: every kind below, then plain prefills up to ``requests``."""
    rng = random.Random(seed)
    plan: list[dict] = []

    def text(n_bytes: int) -> str:  # one token per byte, plus the template's ~20
        words = []
        while len(" ".join(words).encode()) < n_bytes:
            words.append(rng.choice(WORDS))
        return " ".join(words).encode()[:n_bytes].decode(errors="ignore") or "hi"

    def add(kind, endpoint, expect, length=None, **kw):
        """``length``: prompt tokens (completions) or message bytes (chat, responses)."""
        length = length or rng.randint(1, max_model_len - 48)
        if endpoint == "completions":
            kw.setdefault("prompt", [rng.randrange(1000) for _ in range(length)])
        else:
            kw.setdefault("text", text(length))
        plan.append(new_item(kind, endpoint, expect, **kw))

    for _ in range(2):
        for name, template in HOSTILE_IDS.items():
            for endpoint in ENDPOINTS:
                for via in ("body", "header"):
                    rid = template.replace("{n}", str(len(plan)))
                    if via == "header" and not header_safe(rid):
                        continue
                    expect = ["file"] if via == "body" else ["file", "http_400"]
                    add(f"id:{name}", endpoint, expect, via=via, rid=rid)
    for _ in range(3):
        for name, (params, expect) in BAD_PARAMS.items():
            for endpoint in ENDPOINTS:
                add(f"params:{name}", endpoint, expect, params=params)
    for endpoint in [*ENDPOINTS] * 5:
        add("over_max_model_len", endpoint, ["http_400"], rng.randint(1, 200) + max_model_len)
    for k in range(60):  # long generations, the connection closed after 50 ms
        disc = dict(via="body", rid=f"soak-disc-{len(plan)}", max_tokens=max_model_len - 112)
        add("disconnect", ["completions", "chat"][k % 2], ["none"], 16, **disc)
    for k in range(150):
        outputs = dict(params={"include_output_tokens": True}, outputs=True)
        endpoint = ["completions", "chat", "completions"][k % 3]
        add("include_output_tokens", endpoint, ["file"], max_tokens=rng.randint(8, 16), **outputs)
    while len(plan) < requests:
        add("plain", rng.choices(list(ENDPOINTS), [70, 15, 15])[0], ["file"])
    rng.shuffle(plan)
    for i, item in enumerate(plan):
        item["i"] = i
    return plan


def prepare(plan: list, tokenizer) -> list:
    """Fill in the prompt token ids of chat and responses requests (rendered locally)."""
    for item in plan:
        if item["text"] is not None:
            item["prompt"] = render(tokenizer, item["text"])
    return plan


def request_body(item: dict, model: str) -> dict:
    body: dict = {"model": model}
    n, messages = item["max_tokens"], [{"role": "user", "content": item["text"]}]
    if item["endpoint"] == "completions":
        body.update(prompt=item["prompt"], max_tokens=n, return_token_ids=True)
    elif item["endpoint"] == "chat":
        body.update(messages=messages, max_tokens=n, return_token_ids=True)
    else:
        body.update(input=item["text"], max_output_tokens=n, store=False)
    if item["max_tokens"] > 1 and item["endpoint"] != "responses":
        body["ignore_eos"] = True  # exactly max_tokens outputs; a disconnect stays running
    if item["params"] is not None:
        body["kv_transfer_params"] = item["params"]
    if item["via"] == "body":
        body["request_id"] = item["rid"]
    return body


def external_id(item: dict) -> str | None:
    """The request id the API server gives the engine (vLLM adds ``-`` + 8 random
    characters); None where it is random."""
    rid = item["rid"]
    if rid is None or (item["via"] == "header" and item["endpoint"] == "responses"):
        return None
    if item["via"] == "header":
        rid = rid.encode().decode("latin-1")  # how the server reads the header's bytes
    if item["endpoint"] == "completions":
        return f"cmpl-{rid}-0"
    return f"chatcmpl-{rid}" if item["endpoint"] == "chat" else f"{rid}_0"


def name_matches(path: str, external: str) -> bool:
    """Whether ``path`` is named ``files.file_name`` of ``external`` + ``-XXXXXXXX``."""
    shape, name = files.file_name(external + "-" + "0" * 8), os.path.basename(path)
    if "~" in shape:  # hashed: the encoded start is kept, then "~" and a digest
        return len(name) == len(shape) and name.startswith(shape[: shape.index("~") + 1])
    stem = shape[: -len(files.SUFFIX) - 8]
    return len(name) == len(shape) and name.startswith(stem) and name.endswith(files.SUFFIX)


# -- sending and reading -------------------------------------------------------------------


def error_text(data, raw: bytes) -> str:
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data.get("message")))
        msg = err.get("message") if isinstance(err, dict) else err
        if msg:
            return str(msg)
    return raw.decode(errors="replace").strip()


def send(url: str, item: dict, model: str, timeout: float = 120.0) -> dict:
    """POST one request over its own connection; a disconnect closes it after 50 ms."""
    u = urllib.parse.urlsplit(url)
    body = json.dumps(request_body(item, model)).encode()
    rec: dict = {"t_sent": time.monotonic(), "status": None, "reason": None}
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.putrequest("POST", ENDPOINTS[item["endpoint"]], skip_accept_encoding=True)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        if item["via"] == "header":
            conn.putheader("X-Request-Id", item["rid"].encode())
        conn.endheaders(body)
        if item["kind"] == "disconnect":
            time.sleep(0.05)
            return rec
        resp = conn.getresponse()
        rec["status"], raw = resp.status, resp.read()
    except (OSError, http.client.HTTPException) as e:
        rec["reason"] = f"{type(e).__name__}: {e}"
        return rec
    finally:
        conn.close()
        rec["t_done"] = time.monotonic()
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if rec["status"] != 200 or not isinstance(data, dict):
        rec["reason"] = error_text(data, raw)
        return rec
    rec["kv"] = data.get("kv_transfer_params")
    choice = (data.get("choices") or [{}])[0]
    rec["outputs"] = choice.get("token_ids")
    where = choice if item["endpoint"] == "completions" else data
    rec["prompt_ids"] = where.get("prompt_token_ids")
    return rec


class Soak:
    """Sends a plan at a fixed concurrency, reads each file as soon as its response is in
    (and leaves it there), and deletes the folder once, mid-run."""

    def __init__(self, url, model, folder, reference, concurrency=48, timeout=60.0, limit=240.0):
        self.url, self.model, self.folder, self.reference = url, model, folder, reference
        self.concurrency, self.timeout = concurrency, timeout
        self.deadline = time.monotonic() + limit  # no request is sent after it
        self.lock, self.ref_lock = threading.Lock(), threading.Lock()
        self.in_flight = self.max_in_flight = self.done = 0
        self.delete_after, self.deletion, self.deleter = None, None, None
        self.checks: list[dict] = []  # HFReference results
        self.reference_s = 0.0

    def run(self, plan: list, delete_after: int | None = None) -> list:
        self.delete_after = delete_after
        with ThreadPoolExecutor(self.concurrency) as pool:
            records = list(pool.map(self.one, plan))
        if self.deleter:
            self.deleter.join()
        return records

    def one(self, item: dict) -> dict:
        rec = {k: item[k] for k in ("i", "kind", "endpoint", "via", "expect")}
        rec.update(rid=None if item["rid"] is None else repr(item["rid"])[:40], status=None)
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if time.monotonic() > self.deadline:
                raise TimeoutError("not sent: the run's time limit had passed")
            rec.update(send(self.url, item, self.model, self.timeout))
            self._judge(item, rec)
        except Exception as e:  # a bug here must not stop the run
            rec["client_error"] = f"{type(e).__name__}: {e}"
        finally:
            with self.lock:
                self.in_flight -= 1
                self.done += 1
                if self.done % 100 == 0:  # a run cut short still shows how far it got
                    print(f"[soak] {self.done} responses, {self.in_flight} in flight", flush=True)
                if self.done == self.delete_after:
                    self.deleter = threading.Thread(target=self._delete_folder)
                    self.deleter.start()
        return rec

    def _judge(self, item: dict, rec: dict) -> None:
        prompt_ids, outputs = rec.pop("prompt_ids", None), rec.pop("outputs", None)
        if rec["status"] == 200 and item["endpoint"] != "responses":
            rec["prompt_ids_ok"] = prompt_ids == item["prompt"]
        kv = rec.get("kv")
        path = kv.get("hidden_states_path") if isinstance(kv, dict) else None
        if path is None:
            return
        rec["path"] = path
        rec["inside"] = isinstance(path, str) and files.inside(path, self.folder)
        if (external := external_id(item)) is not None and isinstance(path, str):
            rec["name_ok"] = name_matches(path, external)
        if not rec["inside"]:
            return  # never opened
        seq = list(item["prompt"])
        if item["outputs"]:
            if not outputs:
                rec["verify"] = "the response has no output token_ids"
                return
            seq += outputs[:-1]  # the last output token was never run through the model
        rec["verify"] = self._read_and_check(rec, path, seq)

    def _read_and_check(self, rec: dict, path: str, seq: list[int]) -> str:
        gave_up = None
        while True:
            try:
                data = files.load_hidden_states(path, timeout=30)
                break
            except Exception as e:
                if os.path.exists(path):
                    return f"unreadable: {type(e).__name__}: {e}"[:300]
                now = time.monotonic()
                if self.deletion is None:  # no lock and no file, and no deletion to blame
                    rec["t_missing"] = now
                    return "missing"
                gave_up = gave_up or now + 10  # its writer may still put it in the new folder
                if now > gave_up:
                    rec["t_missing"] = now
                    return "missing"
                time.sleep(0.1)
        got = data["token_ids"].tolist()
        if got != seq:
            first = next(
                (k for k, (a, b) in enumerate(zip(got, seq, strict=False)) if a != b), None
            )
            return f"token_ids: {len(got)} ids, expected {len(seq)}; first difference at {first}"
        with self.ref_lock:  # one prompt at a time through HF
            t0 = time.monotonic()
            report = self.reference.check(data, seq)
            self.checks.append(report)
            self.reference_s += time.monotonic() - t0
        return "ok" if not report["problems"] else "; ".join(report["problems"])[:300]

    def _delete_folder(self) -> None:
        """rmtree, retried if the server puts new files in while it runs."""
        self.deletion = {"start": time.monotonic(), "after_responses": self.done, "passes": 0}
        errors: list = []
        if sys.version_info >= (3, 12):
            on_error = {"onexc": lambda func, path, e: errors.append(e)}
        else:
            on_error = {"onerror": lambda func, path, info: errors.append(info[1])}
        for _ in range(5):
            errors.clear()
            self.deletion["passes"] += 1
            shutil.rmtree(self.folder, **on_error)
            if all(isinstance(e, FileNotFoundError) for e in errors):
                break
        self.deletion.update(end=time.monotonic(), errors=[str(e)[:200] for e in errors][:3])


# -- containment, check, and the verdict ---------------------------------------------------

SUSPECT = re.compile(r"soak-|\.safetensors|\.lock")
VLLM_WEIGHTS_LOCK = re.compile(r"^[0-9a-f]{64}.*\.lock$")  # vLLM's model loader lock in /tmp


def snapshot(roots: dict, exclude: str) -> set:
    """Paths under each root down to its depth (1: its entries; None: everything), never
    inside ``exclude``."""
    exclude, found = os.path.abspath(exclude), set()

    def walk(folder: str, depth: int | None) -> None:
        try:
            names = os.listdir(folder)
        except OSError:
            return
        for name in names:
            path = os.path.join(folder, name)
            if path == exclude or path.startswith(exclude + os.sep):
                continue
            found.add(path)
            if (depth is None or depth > 1) and os.path.isdir(path) and not os.path.islink(path):
                walk(path, None if depth is None else depth - 1)

    for root, depth in roots.items():
        walk(os.path.abspath(root), depth)
    return found


def outside_entries(before: set, after: set) -> list[str]:
    """New entries named like a hidden-states file, a lock or a soak id."""
    new = (p for p in after - before if SUSPECT.search(os.path.basename(p)))
    return sorted(p for p in new if not VLLM_WEIGHTS_LOCK.match(os.path.basename(p)))


def escape_targets(folder: str) -> list[str]:
    """What the escaping ids would have made, resolved from /tmp and from the folder."""
    found = set()
    for d in (TMP, os.path.normpath(os.path.join(folder, "../../../tmp"))):
        found.update(glob.glob(f"{d}/soak-escape-*") + glob.glob(f"{d}/soak-abs-*"))
    return sorted(found)


def disconnect_leftovers(folder: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(folder) if "soak-disc-" in n)
    except FileNotFoundError:
        return []


def _env() -> dict:
    """This environment, with the repository importable (by its path, last), offline."""
    path = os.pathsep.join(filter(None, [os.getenv("PYTHONPATH"), REPO]))
    return {"HF_HUB_OFFLINE": "1", **os.environ, "PYTHONPATH": path}


def run_check(folder: str, list_path: str) -> dict:
    """``vllm-gdn-hs check FOLDER --list LIST``: its complete count and problem kinds."""
    cmd = [sys.executable, "-m", "vllm_gdn_hs.cli", "check", folder, "--list", list_path]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
    m = re.search(r": ([\d,]+) complete files", p.stdout)
    problems, examples = Counter(), defaultdict(list)
    if os.path.exists(list_path):
        with open(list_path) as f:
            for line in f:
                path, _, rest = line.rstrip("\n").partition("\t")
                kind = re.split(r" \(|:", rest, maxsplit=1)[0]
                problems[kind] += 1
                if len(examples[kind]) < 5:
                    examples[kind].append(f"{path}: {rest}"[:300])
    return {
        "rc": p.returncode,
        "complete": int(m.group(1).replace(",", "")) if m else None,
        "problems": dict(problems),
        "examples": dict(examples),
        "report": p.stdout.splitlines()[:8],
        "stderr": p.stderr[-500:],
    }


def outcome(rec: dict) -> str:
    """file | refused | http_<status> | none (no response) | bare (200, neither)."""
    if rec["status"] is None:
        return "none"
    if rec["status"] != 200:
        return f"http_{rec['status']}"
    kv = rec.get("kv")
    if isinstance(kv, dict) and "hidden_states_path" in kv:
        return "file"
    if isinstance(kv, dict) and kv.get("hidden_states_error"):
        return "refused"
    return "bare"


def _failures_of(rec: dict, deletion: dict | None) -> list[tuple[str, str]]:
    o, expect = outcome(rec), rec["expect"]
    if rec.get("client_error"):
        return [("client_error", rec["client_error"])]
    if o == "none":
        return [] if "none" in expect else [("no_response", rec.get("reason") or "")]
    if rec["status"] >= 500:
        return [("server_error", rec.get("reason") or "")]
    out = []
    if o.startswith("http_") and not rec.get("reason"):
        out.append(("refused_without_reason", "empty error body"))
    if o == "bare":
        out.append(("refused_without_reason", "200 without hidden_states_path or _error"))
    if rec.get("prompt_ids_ok") is False:
        out.append(("prompt_token_ids", "the response's prompt_token_ids differ from the prompt"))
    if o == "file":
        verify = rec.get("verify")
        if not rec.get("inside"):
            out.append(("path_outside_folder", repr(rec.get("path"))[:200]))
        elif verify == "missing":
            sent, missed = rec["t_sent"], rec["t_missing"]
            if not (deletion and sent < deletion["end"] and missed >= deletion["start"]):
                out.append(("file_missing", "no file and no lock"))
        elif verify != "ok":
            out.append(("file_bad", str(verify)))
        if rec.get("name_ok") is False:
            out.append(("file_name_mismatch", os.path.basename(str(rec["path"]))[:120]))
    if o not in expect and o != "bare":
        why = f"{o} (expected {'/'.join(expect)}): {rec.get('reason') or rec.get('kv')}"
        out.append(("unexpected_outcome", why[:300]))
    return out


def example(rec: dict, detail: str) -> str:
    via = f"/{rec['via']}" if rec.get("via") else ""
    who = f"#{rec['i']} {rec['endpoint']}{via} {rec['kind']} id={rec.get('rid')}"
    return f"{who} status={rec.get('status')}: {detail}"[:400]


def evaluate(records: list, ctx: dict) -> dict:
    """The verdict on every response and on the folder; ``passed`` False on any failure."""
    failures: dict = defaultdict(lambda: {"count": 0, "examples": []})

    def fail(kind: str, detail: str) -> None:
        failures[kind]["count"] += 1
        if len(failures[kind]["examples"]) < 5:
            failures[kind]["examples"].append(detail)

    counts: dict = defaultdict(Counter)
    tally = Counter(verified=0, gone_with_folder=0)
    for rec in records:
        o = outcome(rec)
        counts[rec["kind"]][f"{rec['endpoint']}{'/' + rec['via'] if rec['via'] else ''} {o}"] += 1
        found = _failures_of(rec, ctx.get("deletion"))
        for kind, detail in found:
            fail(kind, example(rec, detail))
        if o == "file" and rec.get("inside"):
            if rec.get("verify") == "ok":
                tally["verified"] += 1
            elif rec.get("verify") == "missing" and all(k != "file_missing" for k, _ in found):
                tally["gone_with_folder"] += 1  # taken by the folder deletion: not a failure
            else:
                tally["failed"] += 1
    if ctx.get("fatal"):
        fail("fatal", ctx["fatal"][-2000:])
    for problem in (ctx.get("pooled") or {}).get("problems", []):
        fail("pooled_accuracy", problem)
    if ctx.get("health_at_end") != 200:
        fail("server_down_at_end", f"/health answered {ctx.get('health_at_end')}")
    finals = [r for r in records if r["kind"] == "final"]
    if not finals or finals[0].get("verify") != "ok":
        fail("server_down_at_end", "the last plain completion got no valid file")
    for path in ctx.get("outside", []):
        fail("created_outside_folder", path[:300])
    for path in ctx.get("escapes", []):
        fail("escape_target_exists", path[:300])
    for name in ctx.get("disconnect_leftovers", []):
        fail("disconnect_left_files", name[:300])
    check = ctx.get("check") or {}
    for kind, n in check.get("problems", {}).items():
        fail("check_problems", f"{n} {kind}, e.g. {check.get('examples', {}).get(kind)}"[:400])
    if check.get("complete") != ctx.get("verified_on_disk"):
        why = f"{check.get('complete')} complete files, {ctx.get('verified_on_disk')} verified"
        fail("check_count", why)
    return {
        "passed": not failures,
        "requests": len(records),
        "outcomes": dict(Counter(outcome(r) for r in records)),
        "files": {**tally, "on_disk": ctx.get("verified_on_disk"), "check": check.get("complete")},
        "failures": dict(failures),
        "counts": {k: dict(sorted(v.items())) for k, v in sorted(counts.items())},
    }


# -- the server and the run ----------------------------------------------------------------


def start_server(model_dir: str, folder: str, log, cwd: str) -> tuple:
    """``vllm-gdn-hs launch`` in a session of its own, its output into ``log``."""
    serve = ["--enable-request-id-headers", "--disable-uvicorn-access-log"]
    return launched.start(
        model_dir, folder, LAYERS, log, *serve, max_model_len=MAX_MODEL_LEN, cwd=cwd, env=_env()
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder (OUTDIR)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=240, help="s to send requests in")
    return p.parse_args(argv)


def final_item(seed: int) -> dict:
    """A plain completion for the end: the server must still answer with a valid file."""
    rng = random.Random(seed + 1)
    return new_item("final", "completions", ["file"], i=-1, prompt=rng.choices(range(1000), k=64))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tiny_models import build_tiny_hybrid
    from transformers import AutoTokenizer

    from vllm_gdn_hs.verify.reference import HFReference, worst_by_layer

    t0 = time.monotonic()
    out = os.path.abspath(args.out)
    root, model_dir = os.path.join(out, "root"), os.path.join(out, "model")
    folder, cwd, log_path = os.path.join(root, "hs"), os.path.join(root, "cwd"), f"{out}/server.log"
    for path in (root, model_dir):
        shutil.rmtree(path, ignore_errors=True)
    os.makedirs(cwd)
    build_tokenizer(build_tiny_hybrid(model_dir))
    plan = prepare(make_plan(args.requests, args.seed), AutoTokenizer.from_pretrained(model_dir))
    reference = HFReference(model_dir, LAYER_IDS, device="cuda")
    reference([1, 2, 3])  # load HF's models before vLLM measures the GPU's free memory
    roots = {TMP: 2, root: None, os.getcwd(): 1}  # the server runs in root/cwd
    before = snapshot(roots, folder)
    ctx: dict = {}
    records: list = []
    timings = {"build_s": round(time.monotonic() - t0, 1)}
    soak = None
    with open(log_path, "w") as log:
        proc, url = start_server(model_dir, folder, log, cwd)
        try:
            t1 = time.monotonic()
            launched.wait_healthy(proc, url, log_path)
            timings["server_start_s"] = round(time.monotonic() - t1, 1)
            print(f"[soak] server healthy after {timings['server_start_s']} s", flush=True)
            soak = Soak(url, model_dir, folder, reference, args.concurrency, limit=args.time_limit)
            t1 = time.monotonic()
            records = soak.run(plan, delete_after=len(plan) // 2)
            timings["requests_s"] = round(time.monotonic() - t1, 1)
            ctx["health_at_end"] = launched.health(url)
            soak.deadline = float("inf")
            records.append(soak.one(final_item(args.seed)))
            time.sleep(LOCK_GRACE_S)
            ctx["disconnect_leftovers"] = disconnect_leftovers(folder)
        except Exception as e:
            ctx["fatal"] = f"{type(e).__name__}: {e}"
        finally:
            launched.stop(proc)
    ctx["pooled"] = reference.pooled()  # the run's accuracy bar, per layer, over every file
    ctx["check"] = run_check(folder, os.path.join(out, "check-problems.txt"))
    ctx["verified_on_disk"] = sum(
        r.get("verify") == "ok" and os.path.exists(r["path"]) for r in records
    )
    ctx["outside"] = outside_entries(before, snapshot(roots, folder))
    ctx["escapes"] = escape_targets(folder)
    deletion = None
    if soak is not None and soak.deletion:
        d = ctx["deletion"] = soak.deletion
        deletion = {k: d[k] for k in ("after_responses", "passes", "errors")}
        deletion.update(at_s=round(d["start"] - t0, 1), took_s=round(d["end"] - d["start"], 3))
    summary = evaluate(records, ctx)
    with open(log_path, errors="replace") as f:
        lines = f.read().splitlines()
    with open(os.path.join(out, "server-tail.log"), "w") as f:
        f.write("\n".join(lines[-200:]) + "\n")
    latencies = sorted(r["t_done"] - r["t_sent"] for r in records if r.get("status"))
    timings.update(total_s=round(time.monotonic() - t0, 1))
    if latencies:
        timings["latency_p50_s"] = round(latencies[len(latencies) // 2], 3)
        timings["latency_max_s"] = round(latencies[-1], 3)
    if soak is not None:
        timings["reference_s"] = round(soak.reference_s, 1)
    from vllm_gdn_hs.version import installed_vllm

    summary = {
        "passed": summary["passed"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "vllm": str(installed_vllm()),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "args": {"requests": len(plan), "concurrency": args.concurrency, "seed": args.seed},
        "max_in_flight": soak.max_in_flight if soak else 0,
        "timings": timings,
        "deletion": deletion,
        "accuracy": {
            "worst_file": worst_by_layer(soak.checks) if soak else {},
            "pooled": {
                "files": ctx["pooled"]["files"],
                **{
                    k: [round(x, 4) for x in ctx["pooled"][k]] for k in ("ours", "hf_bf16", "ratio")
                },
            },
        },
        "check": {k: ctx["check"][k] for k in ("rc", "complete", "problems", "report")},
        "server_log": {w: sum(w in line for line in lines) for w in ("ERROR", "Traceback")},
        "notes": NOTES,
        **{k: v for k, v in summary.items() if k != "passed"},
    }
    text = json.dumps(summary, indent=1, ensure_ascii=False)
    text = re.sub(r"\[\s+([-\d.e,\s]+?)\s+\]", lambda m: f"[{' '.join(m[1].split())}]", text)
    with open(os.path.join(out, "soak.json"), "w") as f:
        f.write(text + "\n")  # lists of numbers on one line each
    verdict = "passed" if summary["passed"] else f"FAILED ({', '.join(summary['failures'])})"
    print(f"soak {verdict}: {summary['outcomes']}; files {summary['files']}; {out}/soak.json")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
