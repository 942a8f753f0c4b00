"""The ``vllm-gdn-hs`` command: doctor, launch, check, demo."""

from __future__ import annotations

import argparse
import sys

from vllm_gdn_hs.model_info import flat, layer_ids_arg


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        # The launcher owns its whole command line (speculators' interface).
        from vllm_gdn_hs.launch import main as launch_main

        return launch_main(argv[1:], prog="vllm-gdn-hs launch")
    parser = argparse.ArgumentParser(
        prog="vllm-gdn-hs", description="Hidden-state extraction for GDN hybrid models on vLLM."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="check the install; works without a GPU")
    doc.add_argument(
        "--model",
        help="a HF model folder or hub id to inspect (hybrid? layers? hidden size?); a hub id "
        "is read from the local HF cache, or its config.json downloaded",
    )
    doc.add_argument(
        "--hidden-states-path",
        help="the folder files will go to: writable? free space? write speed (writes 1 GiB)?",
    )
    doc.add_argument(
        "--mooncake-master",
        metavar="HOST:PORT",
        help="for the mooncake backends: does a Mooncake wheel load here, and does the master "
        "answer? (on every server and trainer host)",
    )
    sub.add_parser(
        "launch",
        help="start vllm serve for hidden-state extraction "
        "(drop-in for speculators' launch_vllm.py)",
    )
    chk = sub.add_parser(
        "check",
        help="after or during a run: which hidden-state files are complete, being written, "
        "lost or broken (exit 1 if any are lost or broken)",
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
    demo = sub.add_parser(
        "demo",
        help="extract hidden states from a tiny hybrid model on the "
        "GPU and check them against HF transformers",
    )
    demo.add_argument("--workdir", default="/tmp/vllm_gdn_hs_demo")
    args = parser.parse_args(argv)
    if args.command == "check":
        args.layer_ids = flat(args.layer_ids)
    if args.command == "doctor":
        from vllm_gdn_hs.doctor import run_doctor

        return run_doctor(args.model, args.hidden_states_path, args.mooncake_master)
    if args.command == "check":
        from vllm_gdn_hs.check import run_check

        if args.reference and not args.layer_ids:
            parser.error("--reference needs --layer-ids (the ids the server extracted)")
        spot = None
        if args.reference:
            from functools import partial

            from vllm_gdn_hs.spot_check import run_spot_check

            spot = partial(
                run_spot_check,
                args.dir,
                model=args.reference,
                layer_ids=args.layer_ids,
                files=args.files,
                max_tokens=args.max_tokens,
                device=args.device,
            )
        return run_check(args.dir, args.rows, args.expect, args.list, spot)
    from vllm_gdn_hs.demo import run_demo

    return run_demo(args.workdir)


if __name__ == "__main__":
    sys.exit(main())
