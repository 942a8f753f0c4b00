"""The ``vllm-gdn-hs`` command: doctor, config, launch, check, demo. Each subcommand imports
vLLM, torch or the hub client only when it runs, so that ``--help`` answers at once."""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from vllm_gdn_hs.cli import model_info
from vllm_gdn_hs.cli.model_info import flat, layer_ids_arg


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        # The launcher owns its whole command line (speculators' interface).
        from vllm_gdn_hs.cli.launch import main as launch_main

        return launch_main(argv[1:], prog="vllm-gdn-hs launch")
    parser = argparse.ArgumentParser(
        prog="vllm-gdn-hs",
        description="Hidden states of chosen layers of GDN hybrid models (Qwen3.5/3.6) served "
        "by vLLM, one file per request, for training speculative-decoding drafters.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {metadata.version('vllm-gdn-hs')}"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, text: str) -> argparse.ArgumentParser:
        fmt = argparse.ArgumentDefaultsHelpFormatter
        return sub.add_parser(name, help=text, description=text, formatter_class=fmt)

    doc = add(
        "doctor",
        "Check the install (offline, in seconds, writing nothing), and where asked a model, a "
        "folder and a Mooncake master; no GPU needed. Exit status 1 if any check fails.",
    )
    doc.add_argument(
        "--model",
        help="a HF model folder or hub id to inspect (hybrid? layers? hidden size?); a hub id "
        "is read from the local HF cache, or its config.json downloaded",
    )
    doc.add_argument(
        "--hidden-states-path",
        help="the folder files will go to: could the launcher make it? free space? write speed "
        "(a 1 GiB probe file, said before it is written, then removed)?",
    )
    doc.add_argument(
        "--target-layer-ids",
        type=layer_ids_arg,
        nargs="+",
        help="with --model and --hidden-states-path: the ids you will launch with, for the bytes "
        "per token (default: the launcher's)",
    )
    doc.add_argument(
        "--load",
        action="store_true",
        help="also load the plugin through vLLM's own loader and apply its patches, as vllm "
        "serve does (imports vLLM and torch: about a minute on 2 cores)",
    )
    doc.add_argument(
        "--mooncake-master",
        metavar="HOST:PORT",
        help="for the mooncake backends: does a Mooncake wheel load here, and does the master "
        "answer? (on every server and trainer host)",
    )
    cfg = add(
        "config",
        "Write a supported model's config.json into a folder, without network: enough for "
        "launch --dry-run and doctor on a machine that cannot reach the HF hub.",
    )
    cfg.add_argument("model", choices=model_info.PACKAGED_CONFIGS, help="the model's hub id")
    cfg.add_argument("dir", help="the folder to write config.json into (made if missing)")
    sub.add_parser(
        "launch",
        help="start vllm serve for hidden-state extraction "
        "(drop-in for speculators' launch_vllm.py)",
    )
    chk = add(
        "check",
        "After or during a run: which hidden-state files are complete, being written, lost or "
        "broken. Exit status 1 if any are lost or broken.",
    )
    chk.add_argument("dir", help="the --hidden-states-path folder")
    chk.add_argument(
        "--rows", action="store_true", help="also load every row: NaN/Inf or all-zero (slower)"
    )
    chk.add_argument("--expect", type=int, help="the number of requests sent: report missing")
    chk.add_argument("--list", metavar="FILE", help="write problem paths, with reasons, to FILE")
    chk.add_argument(
        "--reference",
        metavar="MODEL",
        help="also hold a sample of the files to HF transformers on this model folder (the "
        "served weights): fp32 is the truth, each file's error at most 3x HF bf16's",
    )
    chk.add_argument(
        "--layer-ids",
        type=layer_ids_arg,
        nargs="+",
        help="with --reference: the layer ids served, e.g. 1 16 31 or 1,16,31",
    )
    chk.add_argument("--files", type=int, default=8, help="with --reference: files to sample")
    chk.add_argument(
        "--max-tokens", type=int, default=512, help="with --reference: tokens per file judged"
    )
    chk.add_argument(
        "--device", default="cpu", help="with --reference: where HF runs (cpu, cuda:1, ...)"
    )
    demo = add(
        "demo",
        "Extract hidden states from a tiny hybrid model on the GPU and hold every file to HF "
        "transformers on the same weights.",
    )
    demo.add_argument(
        "--workdir",
        default="/tmp/vllm_gdn_hs_demo",
        help="where the tiny model, its hidden-state files and the reference go",
    )
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from vllm_gdn_hs.cli.doctor import run_doctor

        ids = flat(args.target_layer_ids)
        return run_doctor(args.model, args.hidden_states_path, args.mooncake_master, ids, args.load)
    if args.command == "config":
        print(f"wrote {model_info.write_config(args.model, args.dir)}")
        return 0
    if args.command == "check":
        from vllm_gdn_hs.verify.check import run_check, run_spot_check

        ids, ref = flat(args.layer_ids) or [], args.reference
        if ref and not ids:
            parser.error("--reference needs --layer-ids (the ids the server extracted)")

        def spot(paths: list[str]) -> int:
            try:
                folder = model_info.reference_folder(ref, ids)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            return run_spot_check(
                args.dir, paths, folder, ids, args.files, args.max_tokens, args.device
            )

        return run_check(args.dir, args.rows, args.expect, args.list, spot if ref else None)
    from vllm_gdn_hs.cli.demo import run_demo

    return run_demo(args.workdir)
