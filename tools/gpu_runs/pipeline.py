"""Run: PYTHONPATH=tests/gpu:tests python3 tools/gpu_runs/pipeline.py --out DIR
[--backend file|fp8|both] [--steps N] (CUDA GPU, vLLM, the plugin installed, speculators 0.9.0
+ hs-connectors 0.9.0, transformers; from the repository root, with vLLM's folder first on
PYTHONPATH on the offline machine, as run_gpu_suite.sh puts it).

speculators' real pipeline against ``vllm-gdn-hs launch`` on a tiny Qwen3.5 hybrid (built here
with ``tests/tiny_models.py``; a byte-level tokenizer built with ``tokenizers``, a chat template
and Qwen3-VL processor files, as real Qwen3.5/3.6 checkpoints ship them). Nothing is
downloaded; the chat dataset is written here from a fixed seed. Every speculators step is its
0.9.0 package CLI (``python -m speculators ...``), not a copy of its ``scripts/``:

1. ``speculators prepare-data``, rendered by our server's ``/v1/chat/completions/render``;
2. ``vllm-gdn-hs launch`` per backend (``file``, ``fp8``) in the background, until /health;
3. ``speculators generate-offline-data``, SIGKILLed once about half the samples exist and run
   again: every ``hs_{i}.safetensors`` exactly once, the first run's files untouched (inode,
   mtime); then ``speculators train --on-missing generate`` (online: each file read, then
   deleted) for a short run against the same server;
4. ``speculators train`` of a tiny EAGLE-3 and a tiny DFlash drafter (``--steps``) on each
   backend's files (the trainer's reader: ``--hidden-states-backend file|fp8``);
5. the same training on files of a small HF-transformers extractor (bf16, the same weights,
   forward hooks: ``vllm_gdn_hs.verify.reference``), ``--seeds`` seeds of each for the run-to-run
   noise.

Writes DIR/pipeline.json (each step's status and seconds, each run's losses, the noise, ours
vs HF, the verdict) and a few logs; exits 1 on failure. The bar: every step runs, every run's
loss falls, and each drafter trained on our files ends (mean final loss over seeds) within
the noise of HF's (the spread of its final losses over seeds). Bulky files go to --work.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

try:
    import launched  # tests/gpu/launched.py, through PYTHONPATH (the usage line above)
except ModuleNotFoundError as e:
    sys.exit(f"{e}: run with PYTHONPATH=tests/gpu:tests from the repository root")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS = [1, 3, 6]  # the launcher appends N = 8; the trainer gets these three
NUM_LAYERS = 8
MAX_MODEL_LEN = 1024
SEQ_LENGTH = 512  # prepare-data's window
TOTAL_SEQ_LEN = 1024  # tokens packed into one training step
TRAIN_RATIO = 0.9  # speculators' default train/val split
DRAFTERS = ("eagle3", "dflash")
DRAFT_LAYERS = {"eagle3": 1, "dflash": 2}  # tiny drafters (speculators' defaults: 1 and 5)
NOISE_FLOOR = 0.01  # the bar's floor under the seeds' spread, relative to HF's mean loss
LOG = "[pipeline]"
# Speculators' own code in every child: offline (no network on the device; without it
# transformers and vLLM wait on the hub), one wide log line per metrics record.
CHILD_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # no flashinfer on the device (vLLM 0.26.0)
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    "COLUMNS": "2000",  # rich's log width: records wrap less (the parser copes either way)
}
# The trainer without torch.compile: with torch 2.11, dynamo fails to trace speculators
# 0.9.0's fused Triton loss inside the compiled drafter ("ListVariable ... is already tracked
# for mutation"); the same fused loss runs eagerly. Tiny drafters gain nothing from compiling.
TRAIN_ENV = {"TORCHDYNAMO_DISABLE": "1"}

WORDS = (
    "alpha beta gamma delta red green blue one two three four five cat dog bird fish "
    "sun moon star tree river stone cloud rain wind fire"
).split()
TASKS = ("repeat", "reverse", "count", "upper", "first")


def say(msg: str) -> None:
    print(f"{LOG} {msg}", flush=True)


# -- the dataset and the model folder ------------------------------------------------------


def answer(task: str, words: list[str]) -> str:
    if task == "repeat":
        return " ".join(words)
    if task == "reverse":
        return " ".join(reversed(words))
    if task == "count":
        return f"{len(words)} words"
    if task == "upper":
        return " ".join(words).upper()
    return words[0]


def conversations(n: int = 300, seed: int = 0) -> list[dict]:
    """``n`` short ShareGPT-style conversations (``from``/``value``, as speculators reads
    them), made from ``seed``: a task on a few words and its answer; one in five has a second
    turn (prepare-data makes one row per assistant turn)."""
    rng = random.Random(seed)
    out = []

    def turn():
        task, words = rng.choice(TASKS), rng.choices(WORDS, k=rng.randint(2, 7))
        return [
            {"from": "human", "value": f"{task}: {' '.join(words)}"},
            {"from": "gpt", "value": answer(task, words)},
        ]

    for i in range(n):
        conv = turn() + (turn() if rng.random() < 0.2 else [])
        out.append({"id": f"conv-{i}", "conversations": conv})
    return out


def write_dataset(path: str, n: int = 300, seed: int = 0) -> int:
    """The conversations as JSONL at ``path``; returns how many assistant turns they hold."""
    convs = conversations(n, seed)
    with open(path, "w") as f:
        for c in convs:
            f.write(json.dumps(c) + "\n")
    return sum(t["from"] == "gpt" for c in convs for t in c["conversations"])


def write_processor_files(model_dir: str) -> str:
    """Qwen3-VL image/video processor configs and chat_template.jinja, as a Qwen3.5 checkpoint
    has them: transformers' AutoProcessor then gives speculators a processor (its multimodal
    path, as with real Qwen3.5/3.6), with the tokenizer's chat template."""
    from soak import CHAT_TEMPLATE

    image = dict(
        size={"longest_edge": 16777216, "shortest_edge": 65536},
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        processor_class="Qwen3VLProcessor",
    )
    files = {
        "preprocessor_config.json": dict(image, image_processor_type="Qwen2VLImageProcessorFast"),
        "video_preprocessor_config.json": dict(
            image, video_processor_type="Qwen3VLVideoProcessor", fps=2
        ),
    }
    for name, content in files.items():
        with open(os.path.join(model_dir, name), "w") as f:
            json.dump(content, f, indent=1)
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    return model_dir


def build_model(model_dir: str) -> str:
    """The tiny hybrid's weights, tokenizer, chat template and processor files."""
    from soak import build_tokenizer
    from tiny_models import build_tiny_hybrid

    build_tokenizer(build_tiny_hybrid(model_dir))
    return write_processor_files(model_dir)


# -- the command lines ---------------------------------------------------------------------


def speculators(*args: str) -> list[str]:
    """speculators' console script, run as a module of this interpreter."""
    return [sys.executable, "-m", "speculators", *args]


def server_command(
    model: str, folder: str, port: int, backend: str = "file", gpu_memory: float = 0.25
) -> list[str]:
    """``vllm-gdn-hs launch`` with the GPU machine's flags (triton GDN prefill, eager); it
    keeps the tokenizer: prepare-data renders on this server."""
    cmd = [sys.executable, "-m", "vllm_gdn_hs.cli", "launch", model]
    cmd += ["--hidden-states-path", folder, "--target-layer-ids", *map(str, LAYERS)]
    if backend != "file":
        cmd += ["--hidden-states-backend", backend]
    cmd += ["--", "--port", str(port), "--host", "127.0.0.1"]
    cmd += ["--gpu-memory-utilization", str(gpu_memory), "--max-model-len", str(MAX_MODEL_LEN)]
    cmd += ["--enforce-eager", "--disable-uvicorn-access-log"]
    return cmd + ["--additional-config", json.dumps({"gdn_prefill_backend": "triton"})]


def prepare_args(model: str, data: str, out: str, endpoint: str, workers: int = 4) -> list[str]:
    """``speculators prepare-data``'s arguments; ``endpoint``: the server's base URL."""
    args = ["prepare-data", "--model", model, "--data", data, "--output", out]
    args += ["--seq-length", str(SEQ_LENGTH), "--render-endpoint", endpoint]
    return args + ["--num-preprocessing-workers", str(workers), "--seed", "0"]


def generate_args(
    model: str, endpoint: str, prepared: str, out: str, backend: str, concurrency: int = 32
) -> list[str]:
    """``speculators generate-offline-data``'s arguments; ``endpoint`` ends in /v1. No
    ``--validate-outputs`` for the fp8 backend: speculators 0.9.0's check calls
    ``torch.aminmax`` on ``hidden_states``, which torch has no float8 CPU kernel for (its own
    fp8 connector's files fail it alike); the trainer's fp8 reader still reads every file."""
    args = ["generate-offline-data", "--model", model, "--endpoint", endpoint]
    args += ["--preprocessed-data", prepared, "--output", out, "--concurrency", str(concurrency)]
    return args + (["--validate-outputs"] if backend != "fp8" else []) + ["--fail-on-error"]


def train_args(
    *,
    model: str,
    prepared: str,
    hidden_states: str,
    backend: str,
    drafter: str,
    seed: int,
    steps: int,
    epochs: int,
    save: str,
    online_endpoint: str | None = None,
    attn: str = "sdpa",
    workers: int = 2,
) -> list[str]:
    """``speculators train``'s arguments: offline (``--on-missing raise``) on the files in
    ``hidden_states``, or online (``--on-missing generate``; generated files are deleted once
    read, 0.9.0's only behaviour) against ``online_endpoint`` (ends in /v1)."""
    args = ["train", "--verifier-name-or-path", model, "--data-path", prepared]
    args += ["--hidden-states-backend", backend, "--hidden-states-path", hidden_states]
    args += ["--speculator-type", drafter, "--num-layers", str(DRAFT_LAYERS[drafter])]
    args += ["--target-layer-ids", *map(str, LAYERS), "--draft-attn-impl", attn]
    args += ["--total-seq-len", str(TOTAL_SEQ_LEN), "--train-data-ratio", str(TRAIN_RATIO)]
    args += ["--max-steps", str(steps), "--epochs", str(epochs), "--seed", str(seed)]
    args += ["--checkpoint-freq", str(epochs), "--no-resume-from-checkpoint"]
    args += ["--save-path", save, "--log-dir", os.path.join(save, "logs")]
    args += ["--num-workers", str(workers), "--prefetch-factor", "2"]
    if online_endpoint:
        return args + ["--on-missing", "generate", "--vllm-endpoint", online_endpoint]
    return args + ["--on-missing", "raise"]


def steps_per_epoch(prepared: str, seed: int, total_seq_len: int = TOTAL_SEQ_LEN) -> int:
    """Training steps in one epoch: speculators' own packing sampler over the train split."""
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = list(load_from_disk(prepared).with_format(None)["seq_len"])
    train = lengths[: int(len(lengths) * TRAIN_RATIO)]
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=total_seq_len, lengths=train, num_replicas=1, rank=0, seed=seed
    )
    return len(sampler)


def epochs_for(steps: int, per_epoch: int) -> int:
    """Epochs that hold ``steps`` steps: the trainer stops at --max-steps in the last one
    (with more epochs, each later one would still run one step and a validation)."""
    return max(1, math.ceil(steps / max(1, per_epoch)))


# -- the trainer's log ---------------------------------------------------------------------

_NUM = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|nan|inf|-inf)"
_STEP = re.compile(r"(?<![\w/])global_step=(\d+)")
_TRAIN_LOSS = re.compile(r"(?<![\w/])train/loss=" + _NUM)
_VAL_LOSS = re.compile(r"(?<![\w/])val/loss_epoch=" + _NUM)


def parse_losses(text: str) -> dict:
    """The losses in a ``speculators train`` log (rich's console lines; a record may wrap).

    Each training record is ``train/loss=X, ..., global_step=N`` (the trainer's metrics dict,
    flattened by speculators' FormatDictFilter), each validation record has
    ``val/loss_epoch=X``. Returns ``{"train": [(step, loss)], "val": [loss per epoch]}``."""
    train, start = [], 0
    for m in _STEP.finditer(text):
        loss = _TRAIN_LOSS.search(text, start, m.start())
        if loss:
            train.append((int(m.group(1)), float(loss.group(1))))
        start = m.end()
    return {"train": train, "val": [float(v) for v in _VAL_LOSS.findall(text)]}


def loss_figures(parsed: dict, window: int = 10) -> dict:
    """start: the mean of the first ``window`` steps' losses; end: of the last tenth (at
    least ``window``); final: the last validation loss (the same batches for every seed and
    source), or ``end`` without one."""
    losses = [loss for _, loss in parsed["train"]]
    if not losses:
        return {"steps": 0}
    tail = max(window, len(losses) // 10)
    fig = {
        "steps": len(losses),
        "last_step": parsed["train"][-1][0],
        "first": losses[0],
        "start": sum(losses[:window]) / len(losses[:window]),
        "end": sum(losses[-tail:]) / len(losses[-tail:]),
        "val": parsed["val"],
    }
    fig["final"] = parsed["val"][-1] if parsed["val"] else fig["end"]
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in fig.items()}


# -- the resume check ----------------------------------------------------------------------

_HS = re.compile(r"^hs_(\d+)\.safetensors$")


def snapshot(folder: str) -> dict[str, tuple[int, int, int]]:
    """``hs_{i}.safetensors`` -> (inode, mtime_ns, size)."""
    out = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if _HS.match(name):
            st = os.stat(os.path.join(folder, name))
            out[name] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def resume_check(first: dict, final: dict, others: list[str], expected: int) -> dict:
    """Whether a resumed generation left every sample exactly once: ``first`` and ``final``
    are :func:`snapshot` s after the killed run and after the second; ``others``: any other
    names in the folder at the end."""
    want = {f"hs_{i}.safetensors" for i in range(expected)}
    redone = sorted(n for n, s in first.items() if final.get(n) != s)
    missing = sorted(want - set(final), key=lambda n: int(_HS.match(n).group(1)))
    extra = sorted(set(final) - want) + sorted(others)
    problems = []
    if not 0 < len(first) < expected:
        problems.append(
            f"the first run left {len(first)} of {expected} files: the resume was not exercised"
        )
    if redone:
        problems.append(f"{len(redone)} files of the first run were redone: {redone[:5]}")
    if missing:
        problems.append(f"{len(missing)} samples missing: {missing[:5]}")
    if extra:
        problems.append(f"{len(extra)} unexpected files: {extra[:5]}")
    return {
        "ok": not problems,
        "expected": expected,
        "after_kill": len(first),
        "final": len(final),
        "redone": len(redone),
        "missing": len(missing),
        "unexpected": len(extra),
        "problems": problems,
    }


# -- the verdict ---------------------------------------------------------------------------


def judge(steps: dict, runs: dict, backends: list[str], floor: float = NOISE_FLOOR) -> dict:
    """The bar. ``steps``: name -> {"status", ...}; ``runs``: name -> {"drafter", "source"
    ("hf" or a backend), "seed", "rc", "figures" (:func:`loss_figures`), "steps" wanted}.

    Fails on: a step not ok; a run that failed, logged fewer steps than asked, or whose loss
    did not fall (end >= start); per drafter and backend, ours' mean final loss further from
    HF's than the noise, max(spread of HF's final losses over seeds, ``floor`` x HF's mean)."""
    failures = []
    for name, s in steps.items():
        if s.get("status") != "ok":
            why = s.get("error") or s.get("reason") or "; ".join(s.get("problems", []))
            failures.append(f"step {name}: {s.get('status')} ({why})")
    for name, r in sorted(runs.items()):
        fig = r.get("figures") or {}
        if r.get("rc") != 0:
            failures.append(f"run {name}: exit status {r.get('rc')}")
        elif fig.get("steps", 0) < r["steps"]:
            failures.append(f"run {name}: {fig.get('steps', 0)} of {r['steps']} steps logged")
        elif not fig["end"] < fig["start"]:
            failures.append(f"run {name}: loss did not fall ({fig['start']} -> {fig['end']})")
    comparison = {}
    for drafter in sorted({r["drafter"] for r in runs.values()}):

        def finals(source, drafter=drafter):
            return [
                r["figures"]["final"]
                for r in runs.values()
                if r["drafter"] == drafter
                and r["source"] == source
                and r.get("rc") == 0
                and math.isfinite((r.get("figures") or {}).get("final", math.nan))
            ]

        hf = finals("hf")
        entry: dict = {"hf_final": hf}
        if len(hf) >= 2:
            hf_mean, spread = sum(hf) / len(hf), max(hf) - min(hf)
            noise = max(spread, floor * abs(hf_mean))
            entry.update(hf_mean=hf_mean, hf_spread=spread, noise=noise)
        else:
            failures.append(f"{drafter}: {len(hf)} HF runs: no noise to measure (2 needed)")
        for backend in backends:
            ours = finals(backend)
            e = entry[backend] = {"final": ours}
            if not ours:
                failures.append(f"{drafter} on {backend}: no finished run")
                continue
            mean = sum(ours) / len(ours)
            e.update(mean=mean, spread=max(ours) - min(ours))
            if "noise" in entry:
                diff = mean - entry["hf_mean"]
                e.update(diff_vs_hf=diff, within_noise=abs(diff) <= entry["noise"])
                if not e["within_noise"]:
                    failures.append(
                        f"{drafter} on {backend}: final loss {mean:.4f} vs HF "
                        f"{entry['hf_mean']:.4f} (diff {diff:+.4f}) outside the noise "
                        f"{entry['noise']:.4f}"
                    )
        comparison[drafter] = _rounded(entry)
    return {"passed": not failures, "failures": failures, "comparison": comparison}


def _rounded(x):
    if isinstance(x, float):
        return round(x, 5)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


# -- running things ------------------------------------------------------------------------


class Steps:
    """Each step's status and seconds; a step that raises is recorded as failed."""

    def __init__(self):
        self.record: dict[str, dict] = {}

    @contextlib.contextmanager
    def run(self, name: str):
        entry = self.record[name] = {"status": "running"}
        t = time.monotonic()
        say(f"{name}: started")
        try:
            yield entry
        except Exception as e:
            entry.update(status="failed", error=f"{type(e).__name__}: {e}"[-2000:])
        else:
            if entry["status"] == "running":
                entry["status"] = "ok"
        finally:
            entry["seconds"] = round(time.monotonic() - t, 1)
            say(f"{name}: {entry['status']} after {entry['seconds']} s")

    def skip(self, name: str, reason: str) -> None:
        self.record[name] = {"status": "skipped", "reason": reason, "seconds": 0}
        say(f"{name}: skipped ({reason})")

    def ok(self, *names: str) -> bool:
        return all(self.record.get(n, {}).get("status") == "ok" for n in names)


def child_env(extra: dict | None = None) -> dict:
    path = os.pathsep.join(filter(None, [os.getenv("PYTHONPATH"), REPO]))
    return {**os.environ, **CHILD_ENV, **(extra or {}), "PYTHONPATH": path}


def run_logged(
    cmd: list[str], log_path: str, timeout: float, cwd: str | None = None, env: dict | None = None
) -> int:
    """Run ``cmd`` to the end in a session of its own, output into ``log_path``."""
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(env), cwd=cwd,
            start_new_session=True,
        )  # fmt: skip
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            name = cmd[3] if len(cmd) > 3 else cmd[0]
            raise TimeoutError(f"{name} ran past {timeout:.0f} s") from None


def kill_group(proc, sig=signal.SIGKILL, wait: float = 30) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the session we started it in
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(wait)


def tail(path: str, chars: int = 4000) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return f.read()[-chars:]
    return ""


class Server:
    def __init__(self, model: str, folder: str, backend: str, log_path: str):
        self.backend, self.folder, self.log_path = backend, folder, log_path
        port = launched.free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        cmd = server_command(model, folder, port, backend)
        self.log.write("$ " + " ".join(cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=child_env(),
            start_new_session=True,
        )  # fmt: skip

    def wait(self, timeout: float) -> None:
        launched.wait_healthy(self.proc, self.url, self.log_path, timeout)

    def stop(self) -> None:
        launched.stop(self.proc, grace=60)
        self.log.close()


def count_hs(folder: str) -> int:
    with contextlib.suppress(OSError):
        return sum(bool(_HS.match(n)) for n in os.listdir(folder))
    return 0


def generate_with_resume(model, server, prepared, out, expected, log_dir, limit) -> dict:
    """The generator, SIGKILLed once half the samples exist, then run again to the end.
    The server's folder and ``out`` share a file system, so the generator's move of each
    file is a rename (across file systems it would copy, and a kill could truncate)."""
    endpoint = server.url + "/v1"
    log1, log2 = f"{log_dir}/generate-1.log", f"{log_dir}/generate-2.log"
    cmd = speculators(*generate_args(model, endpoint, prepared, out, server.backend, 2))
    with open(log1, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True
        )
        deadline = time.monotonic() + limit
        while count_hs(out) < expected / 2 and proc.poll() is None:
            if time.monotonic() > deadline:
                kill_group(proc)
                raise TimeoutError(f"generator run 1: {count_hs(out)} files after {limit} s")
            time.sleep(0.01)
        kill_group(proc)
    first = snapshot(out)
    say(f"generator killed with {len(first)} of {expected} files (rc {proc.returncode})")
    cmd = speculators(*generate_args(model, endpoint, prepared, out, server.backend))
    rc = run_logged(cmd, log2, limit)
    final = snapshot(out)
    others = [n for n in os.listdir(out) if n not in final]
    result = resume_check(first, final, others, expected)
    m = re.search(r"Processing (\d+) samples", tail(log2, 10**6))
    result.update(rc_second=rc, processed_second=int(m.group(1)) if m else None)
    if rc != 0:
        result["ok"] = False
        result["problems"].append(f"generator run 2 exited {rc}")
    if result["processed_second"] not in (None, expected - len(first)):
        result["ok"] = False
        result["problems"].append(
            f"run 2 processed {result['processed_second']}, not the {expected - len(first)} left"
        )
    return result


def hf_extract(model_dir: str, prepared: str, out: str) -> dict:
    """hs_{i}.safetensors from HF transformers (bf16, forward hooks on the same weights), in
    the layout our files have: hidden_states [T, 4, H] bf16, token_ids [T] int64."""
    import torch
    from datasets import load_from_disk

    from vllm_gdn_hs.files import write_file
    from vllm_gdn_hs.verify.reference import hf_hidden_states, load_hf_model

    os.makedirs(out, exist_ok=True)
    model = load_hf_model(model_dir, "cuda", torch.bfloat16)
    rows = load_from_disk(prepared).with_format(None)["input_ids"]
    for i, ids in enumerate(rows):
        (hs,) = hf_hidden_states(model, [ids], LAYERS + [NUM_LAYERS])
        write_file(f"{out}/hs_{i}.safetensors", hs.contiguous(), torch.tensor(ids))
    del model
    torch.cuda.empty_cache()
    return {"files": count_hs(out)}


def train_run(spec: dict, limit: float) -> dict:
    """One ``speculators train``; its losses from its log."""
    t = time.monotonic()
    os.makedirs(spec["save"], exist_ok=True)
    log = os.path.join(spec["save"], "train.log")
    try:
        rc = run_logged(speculators(*spec["args"]), log, limit, env=TRAIN_ENV)
    except TimeoutError as e:
        rc, spec["error"] = 124, str(e)
    text = tail(log, 10**8)
    spec.update(rc=rc, seconds=round(time.monotonic() - t, 1))
    spec["figures"] = loss_figures(parse_losses(text))
    if rc != 0:
        spec["log_tail"] = text[-1500:]
    fig = spec["figures"]
    say(
        f"train {spec['name']}: rc {rc}, {fig.get('steps', 0)} steps, loss "
        f"{fig.get('start')} -> {fig.get('end')}, final {fig.get('final')} ({spec['seconds']} s)"
    )
    return spec


# -- main ----------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="speculators' real pipeline against vllm-gdn-hs launch")
    p.add_argument("--out", required=True, help="summary and logs (DIR/pipeline.json)")
    p.add_argument("--backend", choices=["file", "fp8", "both"], default="both")
    p.add_argument("--steps", type=int, default=300, help="training steps per run")
    p.add_argument("--seeds", type=int, default=3, help="seeds per drafter and source")
    p.add_argument("--samples", type=int, default=300, help="conversations in the dataset")
    p.add_argument("--online-steps", type=int, default=20)
    p.add_argument("--jobs", type=int, default=6, help="training runs at a time on the GPU")
    p.add_argument("--draft-attn-impl", default="sdpa", help="sdpa: no flex-attention compile")
    p.add_argument("--work", default=None, help="bulky files (default /dev/shm or /tmp)")
    p.add_argument("--time-limit", type=float, default=560, help="s for the whole run")
    return p.parse_args(argv)


def main(argv=None) -> int:  # noqa: C901  (one pipeline, in order)
    args = parse_args(argv)
    t0 = time.monotonic()
    deadline = t0 + args.time_limit

    def left(cap: float) -> float:
        return max(1.0, min(cap, deadline - time.monotonic()))

    backends = ["file", "fp8"] if args.backend == "both" else [args.backend]
    primary = backends[0]
    out = os.path.abspath(args.out)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    work = os.path.abspath(args.work or os.path.join(shm, "vllm-gdn-hs-pipeline"))
    logs = os.path.join(work, "logs")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(logs)
    os.makedirs(out, exist_ok=True)
    model, data, prepared = f"{work}/model", f"{work}/chat.jsonl", f"{work}/prepared"
    steps, runs, servers, info = Steps(), {}, {}, {}
    say(f"work in {work}; backends {backends}; {args.steps} steps x {args.seeds} seeds")

    with steps.run("build") as s:
        build_model(model)
        s["assistant_turns"] = write_dataset(data, args.samples)
    try:
        if steps.ok("build"):
            for b in backends:  # all start at once: their startups overlap
                servers[b] = Server(model, f"{work}/hs-{b}/server", b, f"{logs}/server-{b}.log")
        for b in backends:
            with steps.run(f"server_{b}") as s:
                if b not in servers:
                    raise RuntimeError("not started: the build failed")
                servers[b].wait(left(300))
        with steps.run("prepare") as s:
            if not steps.ok(f"server_{primary}"):
                raise RuntimeError(f"no {primary} server to render on")
            cmd = speculators(*prepare_args(model, data, prepared, servers[primary].url))
            rc = run_logged(cmd, f"{logs}/prepare.log", left(240))
            if rc != 0:
                raise RuntimeError(f"prepare-data exited {rc}:\n{tail(f'{logs}/prepare.log')}")
            from datasets import load_from_disk

            info["rows"] = s["rows"] = len(load_from_disk(prepared))
            say(f"prepared {info['rows']} rows")
        ready = steps.ok("prepare")

        def gen_primary():
            with steps.run(f"generate_{primary}_resume") as s:
                folder = f"{work}/hs-{primary}/files"
                res = generate_with_resume(
                    model, servers[primary], prepared, folder, info["rows"], logs, left(240)
                )
                s.update(res)
                if not res["ok"]:
                    s["status"] = "failed"

        def gen_other(b):
            with steps.run(f"generate_{b}") as s:
                folder = f"{work}/hs-{b}/files"
                cmd = speculators(
                    *generate_args(model, servers[b].url + "/v1", prepared, folder, b)
                )
                s["validate_outputs"] = "--validate-outputs" in cmd
                rc = run_logged(cmd, f"{logs}/generate-{b}.log", left(240))
                s.update(rc=rc, files=count_hs(folder), expected=info["rows"])
                if rc != 0 or s["files"] != info["rows"]:
                    s["status"] = "failed"

        def hf():
            with steps.run("hf_extract") as s:
                s.update(hf_extract(model, prepared, f"{work}/hs-hf"))
                if s["files"] != info["rows"]:
                    s["status"] = "failed"

        if ready:
            jobs = [gen_primary, hf] + [lambda b=b: gen_other(b) for b in backends[1:]]
            threads = [threading.Thread(target=j) for j in jobs]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        else:
            for name in [f"generate_{primary}_resume", "hf_extract"]:
                steps.skip(name, "prepare failed")
            for b in backends[1:]:
                steps.skip(f"generate_{b}", "prepare failed")

        def online():
            with steps.run("online") as s:
                if not steps.ok(f"server_{primary}"):
                    raise RuntimeError("no server")
                folder = servers[primary].folder
                before = sorted(os.listdir(folder))  # the killed generator's leftovers
                empty = f"{work}/online-empty"
                os.makedirs(empty)
                spec = dict(name="online", drafter="eagle3", source="online", seed=0)
                spec.update(steps=args.online_steps, save=f"{work}/runs/online")
                spec["args"] = train_args(
                    model=model, prepared=prepared, hidden_states=empty, backend=primary,
                    drafter="eagle3", seed=0, steps=args.online_steps,
                    epochs=epochs_for(args.online_steps, info["steps_per_epoch"][0]),
                    save=spec["save"], online_endpoint=servers[primary].url + "/v1",
                    attn=args.draft_attn_impl,
                )  # fmt: skip
                train_run(spec, left(240))
                after = sorted(os.listdir(folder))
                s.update(rc=spec["rc"], figures=spec["figures"], leftover_before=len(before))
                s["left_behind"] = sorted(set(after) - set(before))[:20]
                if spec["rc"] != 0 or spec["figures"].get("steps", 0) < args.online_steps:
                    s["status"] = "failed"
                    s["log_tail"] = spec.get("log_tail")
                if s["left_behind"] or os.listdir(empty):
                    s["status"] = "failed"  # on-generate delete: nothing may stay

        sources = {"hf": ("file", f"{work}/hs-hf", "hf_extract")}
        sources[primary] = (primary, f"{work}/hs-{primary}/files", f"generate_{primary}_resume")
        for b in backends[1:]:
            sources[b] = (b, f"{work}/hs-{b}/files", f"generate_{b}")
        specs = []
        if ready:
            per_epoch = {s: steps_per_epoch(prepared, s) for s in range(args.seeds)}
            info["steps_per_epoch"] = per_epoch
            for drafter in DRAFTERS:
                for source, (reader, folder, needs) in sources.items():
                    for seed in range(args.seeds):
                        name = f"{drafter}-{source}-s{seed}"
                        if not steps.ok(needs):
                            runs[name] = dict(
                                drafter=drafter, source=source, seed=seed, steps=args.steps,
                                rc=None, error=f"{needs} failed",
                            )  # fmt: skip
                            continue
                        epochs = epochs_for(args.steps, per_epoch[seed])
                        save = f"{work}/runs/{name}"
                        spec = dict(name=name, drafter=drafter, source=source, seed=seed)
                        spec.update(steps=args.steps, save=save, epochs=epochs)
                        spec["args"] = train_args(
                            model=model, prepared=prepared, hidden_states=folder,
                            backend=reader, drafter=drafter, seed=seed, steps=args.steps,
                            epochs=epochs, save=save, attn=args.draft_attn_impl,
                        )  # fmt: skip
                        specs.append(spec)
        with steps.run("train") as s:
            if not ready:
                raise RuntimeError("prepare failed")
            with ThreadPoolExecutor(max(1, args.jobs)) as pool:
                online_done = pool.submit(online)
                done = list(pool.map(lambda sp: train_run(sp, left(420)), specs))
                online_done.result()
            for spec in done:
                runs[spec["name"]] = {k: v for k, v in spec.items() if k not in ("args", "save")}
            s["runs"] = len(done)
            s["failed"] = sum(r["rc"] != 0 for r in done)
            if s["failed"]:
                s["status"] = "failed"
    finally:
        for srv in servers.values():
            srv.stop()

    verdict = judge(steps.record, runs, backends)
    summary = {
        "passed": verdict["passed"],
        "failures": verdict["failures"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        "gpu": _gpu(),
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "work")},
        "setup": {
            "model": f"tiny Qwen3.5 hybrid ({NUM_LAYERS} layers, hidden 256), layers {LAYERS}+[8]",
            "total_seq_len": TOTAL_SEQ_LEN,
            "draft_layers": DRAFT_LAYERS,
            "noise": f"max(spread of HF's final losses over seeds, {NOISE_FLOOR} x HF's mean)",
            **info,
        },
        "steps": steps.record,
        "comparison": verdict["comparison"],
        "runs": runs,
        "total_s": round(time.monotonic() - t0, 1),
    }
    with open(os.path.join(out, "pipeline.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    _copy_logs(work, logs, out)
    state = "passed" if summary["passed"] else "FAILED: " + "; ".join(summary["failures"][:5])
    say(f"{state} ({summary['total_s']} s); {out}/pipeline.json")
    return 0 if summary["passed"] else 1


def _copy_logs(work: str, logs: str, out: str) -> None:
    """A few short logs to DIR (the device brings back at most 8 files)."""
    groups = {
        "servers.log": sorted(p for p in os.listdir(logs) if p.startswith("server-")),
        "steps.log": sorted(p for p in os.listdir(logs) if not p.startswith("server-")),
    }
    for name, parts in groups.items():
        with open(os.path.join(out, name), "w") as f:
            for p in parts:
                f.write(f"===== {p} (tail)\n{tail(os.path.join(logs, p), 6000)}\n")
    runs = os.path.join(work, "runs")
    with open(os.path.join(out, "train.log"), "w") as f:
        for r in sorted(os.listdir(runs)) if os.path.isdir(runs) else []:
            f.write(f"===== {r} (tail)\n{tail(os.path.join(runs, r, 'train.log'), 2500)}\n")


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("vllm", "speculators", "hs-connectors", "torch", "transformers", "vllm-gdn-hs"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _gpu():
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
