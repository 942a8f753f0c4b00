"""``vllm-gdn-hs check DIR``: after (or during) a run, which hidden-state files are sound:
complete, being written, lost or broken (the reasons below). Only headers are read, unless
``--rows``; ``--reference MODEL`` holds a sample to HF transformers (:func:`run_spot_check`),
which alone sees a wrong state that is finite and not zero (a recycled GDN state, shifted rows).
"""

from __future__ import annotations

import os
import stat
import sys
import time
from collections import Counter, defaultdict
from contextlib import closing
from typing import Any

from vllm_gdn_hs.files import SUFFIX, hidden_states_of, is_temp, layout, read_header
from vllm_gdn_hs.locks import LOCK_SUFFIX, lock_held

# What can be wrong with a request, as reported (one line per kind, every path in --list).
LOST = "lost (a lock nobody holds and no file: the writer died; resend these requests)"
BROKEN = "broken (truncated, or not a speculators hidden-states file)"
ROWS = "bad rows (NaN/Inf or all-zero)"
LAYOUT = "other layer layout than the rest of the folder"
TEMP = "temp files of writers that are gone (check no server still writes here, then delete)"
UNREADABLE = "locks this user may not open (run check as the server's user)"
ODD = "not regular files (a FIFO, socket or device under a hidden-states name; not opened)"
TEMP_AGE_S = 600  # a writer renames its temp file within seconds


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _stale_temp(path: str, pid: int, now: float) -> str | None:
    """Why a temp file looks abandoned, or None: old, even with a pid (0: safetensors'), as a
    writer on another host has a pid this one cannot see."""
    try:
        age = now - os.lstat(path).st_mtime
    except FileNotFoundError:
        return None  # renamed into place meanwhile
    if age < TEMP_AGE_S or (pid and _pid_alive(pid)):
        return None
    who = f"process {pid} not running on this host" if pid else "a safetensors temp file"
    return f"untouched for {age / 60:.0f} min, {who}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _request(out: dict, path: str, has_lock: bool, rows: bool) -> tuple | None:
    """Sort one request (``path``: its file); its layout when complete. A live run moves on
    after the listing: what looks wrong is looked at again."""
    held = lock_held(path + LOCK_SUFFIX) if has_lock else False
    if held:
        out["being_written"] += 1
        return None
    if not os.path.exists(path):
        if not os.path.exists(path + LOCK_SUFFIX):
            out["gone"] += 1  # read and moved away (offline generation), or just consumed
        elif lock_held(path + LOCK_SUFFIX):
            out["being_written"] += 1  # a writer took its lock after the listing
        elif os.path.exists(path):
            return _request(out, path, False, rows)  # finished after the listing
        elif held is None:
            out["problems"][UNREADABLE].append((path + LOCK_SUFFIX, "permission denied"))
        else:
            out["problems"][LOST].append((path + LOCK_SUFFIX, "no file"))
        return None
    kind = BROKEN
    try:
        size = os.path.getsize(path)
        t, layers, hidden, dtype = layout(read_header(path))
        kind = ROWS
        if rows:
            from safetensors.torch import load_file

            from vllm_gdn_hs.rows import check_rows

            if why := check_rows(hidden_states_of(load_file(path))):
                raise ValueError(why)
    except FileNotFoundError:
        out["gone"] += 1
        return None
    except Exception as e:  # a damaged header can be any JSON: every failure is reported
        out["problems"][kind].append((path, str(e) or type(e).__name__))
        return None
    out["complete"] += 1
    out["unread"] += has_lock
    out["tokens"] += t
    out["bytes"] += size
    return layers, hidden, dtype


def scan(root: str, rows: bool = False, progress_s: float = 10.0) -> dict:
    """Sort every request under ``root``, a folder at a time; counts, totals, problem paths."""
    counts = ("complete", "unread", "being_written", "gone", "links", "tokens", "bytes")
    out: dict[str, Any] = dict.fromkeys(counts, 0)
    out |= {"layouts": Counter(), "problems": defaultdict(list)}  # kind -> [(path, detail)]
    paths_by_layout = defaultdict(list)
    last, now = time.monotonic(), time.time()
    for folder, _, names in os.walk(root):
        files, locks = set(), set()
        for name in names:
            path = os.path.join(folder, name)
            pid = is_temp(name)
            if pid is None and not name.endswith((SUFFIX, SUFFIX + LOCK_SUFFIX)):
                continue
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue  # moved on since the listing
            if stat.S_ISLNK(mode):
                out["links"] += 1  # a real file is counted where it is, once
                continue
            if not stat.S_ISREG(mode):
                out["problems"][ODD].append((path, "not a regular file"))
            elif pid is not None:
                if why := _stale_temp(path, pid, now):
                    out["problems"][TEMP].append((path, why))
            elif name.endswith(SUFFIX):
                files.add(path)
            else:
                locks.add(path[: -len(LOCK_SUFFIX)])
        for path in sorted(files | locks):
            if lay := _request(out, path, path in locks, rows):
                out["layouts"][lay] += 1
                paths_by_layout[lay].append(path)
            if time.monotonic() - last > progress_s:
                print(f"checked {out['complete']:,} complete files ...", file=sys.stderr)
                last = time.monotonic()
    if len(out["layouts"]) > 1:  # one folder, one layer set: the odd ones out are suspect
        usual = out["layouts"].most_common(1)[0][0]
        for lay, paths in paths_by_layout.items():
            if lay != usual:
                why = "{} layers x {} {}, the folder's others {} x {} {}".format(*lay, *usual)
                out["problems"][LAYOUT] += [(p, why) for p in paths]
    out["complete_paths"] = sorted(p for paths in paths_by_layout.values() for p in paths)
    return out


def report(root: str, out: dict, expect: int | None) -> list[str]:
    lines = [
        f"{root}: {out['complete']:,} complete files, {out['tokens']:,} tokens, "
        f"{out['bytes'] / 1e9:,.2f} GB"
        + "".join(f"; {n:,} x [T, {la}, {h}] {d}" for (la, h, d), n in out["layouts"].items())
    ]
    notes = {
        "unread": "of them still have their .lock (not yet read)",
        "being_written": "being written (a live writer holds the lock)",
        "links": "symbolic links not followed (their files count where they are)",
        "gone": "moved or removed while being checked (read by a client)",
    }
    lines += [f"{out[key]:,} {note}" for key, note in notes.items() if out[key]]
    if expect is not None and out["complete"] < expect:
        lines.append(f"expected {expect:,} files: {expect - out['complete']:,} missing")
    for kind, found in sorted(out["problems"].items()):
        lines.append(f"{len(found):,} {kind}; e.g. {found[0][0]}: {found[0][1]}")
    return lines


def run_check(root: str, rows: bool, expect: int | None, list_path: str | None, spot=None) -> int:
    """0: every request is sound (and, with ``expect``, there); 1: problems. ``spot`` judges a
    sample of the complete paths; the worse status wins."""
    if not os.path.isdir(root):
        return _error(f"{root} is not a folder")
    out = scan(root, rows)
    print("\n".join(report(root, out, expect)))
    if list_path:
        with open(list_path, "w") as f:
            for kind, found in sorted(out["problems"].items()):
                f.writelines(f"{p}\t{kind}: {detail}\n" for p, detail in found)
        print(f"problem paths, one per line: PATH<tab>KIND: DETAIL, in {list_path}")
    missing = expect is not None and out["complete"] < expect
    status = 1 if out["problems"] or missing else 0
    return max(status, spot(out["complete_paths"])) if spot else status


def sample(paths: list[str], n: int) -> list[str]:
    return list(paths) if len(paths) <= n else [paths[i * len(paths) // n] for i in range(n)]


def run_spot_check(
    root: str,
    complete_paths: list[str],
    model: str,
    layer_ids: list[int],
    files: int = 8,
    max_tokens: int = 512,
    device: str = "cpu",
) -> int:
    """A sample of ``complete_paths`` against HF transformers on ``model`` (a folder with the
    weights): 0 within the bar; 1: a file or the pooled sample is not; 2: bad input."""
    from safetensors import safe_open

    from vllm_gdn_hs.verify.reference import HFReference, describe_pooled, worst_by_layer

    chosen = sample(complete_paths, files)
    if not chosen:
        return _error(f"no complete file under {root} to check")
    data, width = {}, set()
    for path in chosen:
        try:
            with safe_open(path, "pt") as f:  # the first max_tokens rows of each tensor
                data[path] = {k: f.get_slice(k)[:max_tokens] for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
            width.add(hidden_states_of(data[path]).shape[1])
        except Exception as e:  # truncated or foreign: check's own report lists it
            data.pop(path, None)
            print(f"  {path}: left out, unreadable ({e or type(e).__name__})")
    if not data:
        return _error(f"no readable file among the {len(chosen)} sampled")
    if width != {len(layer_ids)}:
        return _error(
            f"the files hold {sorted(width)} layers, --layer-ids names {len(layer_ids)}; pass the "
            "layer ids the server extracted (in its order, as the launcher prints them)"
        )
    print(
        f"{len(data)} of the complete files under {root}, first {max_tokens} tokens each, "
        f"against HF transformers ({model}, fp32 then bf16 on {device}, one model at a time: "
        f"minutes for a large model on the CPU), layers {layer_ids}",
        flush=True,
    )
    with closing(HFReference(model, layer_ids, device=device, max_cached=len(data))) as ref:
        try:
            ref.precompute([d["token_ids"].tolist() for d in data.values()])
        except (OSError, ValueError) as e:  # no weights, or not this model's
            return _error(f"HF transformers on {model}: {e}")
        bad = 0
        for path, d in data.items():
            result = ref.check(d, d["token_ids"].tolist())
            ratio = worst_by_layer([result]).get("worst_ratio", float("nan"))
            verdict = "; ".join(result["problems"]) or "within the per-file bound"
            print(
                f"  {path}: {len(d['token_ids'])} token(s), worst layer {ratio:.2f} x HF bf16's "
                f"error: {verdict}"
            )
            bad += bool(result["problems"])
        pooled = ref.pooled()
    print(describe_pooled(pooled))
    if bad or pooled["problems"]:
        for line in pooled["problems"]:
            print(f"  {line}")
        print(
            f"FAILED: {bad} of {len(data)} files over the per-file bound"
            + (", the pooled sample over the bar" if pooled["problems"] else "")
            + ". These hidden states are not the model's: do not train on this folder; "
            "run `vllm-gdn-hs doctor` and report the vLLM version and flags"
        )
        return 1
    print("passed: as close to HF fp32 as HF transformers in bf16 is")
    return 0
