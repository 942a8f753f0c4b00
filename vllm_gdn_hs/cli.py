"""The ``vllm-gdn-hs`` command: doctor, launch, demo."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        # The launcher owns its whole command line (speculators' interface).
        from vllm_gdn_hs.launch import main as launch_main

        return launch_main(argv[1:], prog="vllm-gdn-hs launch")
    parser = argparse.ArgumentParser(prog="vllm-gdn-hs", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="check the install; works without a GPU")
    doc.add_argument("--model", help="a HF model folder to inspect (hybrid? layers? hidden size?)")
    doc.add_argument(
        "--hidden-states-path",
        help="the folder files will go to: writable? free space? write speed (writes 1 GiB)?",
    )
    sub.add_parser(
        "launch",
        help="start vllm serve for hidden-state extraction "
        "(drop-in for speculators' launch_vllm.py)",
    )
    demo = sub.add_parser(
        "demo",
        help="extract hidden states from a tiny hybrid model on the "
        "GPU and check them against HF transformers",
    )
    demo.add_argument("--workdir", default="/tmp/vllm_gdn_hs_demo")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from vllm_gdn_hs.doctor import run_doctor

        return run_doctor(args.model, args.hidden_states_path)
    from vllm_gdn_hs.demo import run_demo

    return run_demo(args.workdir)


if __name__ == "__main__":
    sys.exit(main())
