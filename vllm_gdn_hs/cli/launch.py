"""Start ``vllm serve`` for hidden-state extraction: speculators' ``scripts/launch_vllm.py``
(0.9.0) with ``HybridHiddenStatesConnector``. It fails before vLLM starts on bad input, an
unknown option before ``--`` or a vLLM flag that contradicts extraction (:mod:`.serve_args`).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import shlex
import sys
from dataclasses import dataclass

from vllm_gdn_hs import model_support
from vllm_gdn_hs.cli import model_info, serve_args
from vllm_gdn_hs.cli.backends import BACKENDS
from vllm_gdn_hs.cli.serve_args import LaunchError, warn
from vllm_gdn_hs.config import config_from, speculative_config
from vllm_gdn_hs.layer_ids import default_layer_ids, target_layer_ids, validate_layer_ids
from vllm_gdn_hs.patch import runtime_patches
from vllm_gdn_hs.version import ALLOW_UNTESTED, UnsupportedVllmError, check_vllm, is_untested


def make_parser(prog: str = "launch_vllm.py", mooncake: bool = True) -> argparse.ArgumentParser:
    """The launcher's options; ``mooncake=False`` leaves out the ``--mooncake-*`` ones, whose
    definitions (hs-connectors') import torch: seconds that ``--help`` need not wait."""
    parser = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s [-h] MODEL [--hidden-states-backend BACKEND] [--hidden-states-path DIR] "
        "[--target-layer-ids ID [ID ...]] [--include-last-layer | --no-include-last-layer] "
        "[--dry-run] [--trust-remote-code] -- VLLM_ARGS...",
        description="Launch vLLM for hidden states extraction (GDN hybrid and dense models). "
        "Everything after '--' goes to vllm serve unchanged."
        + ("" if mooncake else f" The mooncake backends' options: {prog} MODEL "
           "--hidden-states-backend mooncake --help."),
    )  # fmt: skip
    parser.add_argument("model", help="Model name or path to extract hidden states from")
    parser.add_argument(
        "--hidden-states-backend",
        default="file",
        choices=BACKENDS,
        help="Hidden states transfer backend. Each backend may add its own CLI arguments. "
        "Default: 'file'.",
    )
    backends = [b for name, b in BACKENDS.items() if mooncake or "mooncake" not in name]
    for add_launch_args in dict.fromkeys(b.add_launch_args for b in backends):
        add_launch_args(parser)  # once each: fp8 has the file backend's options
    parser.add_argument(
        "--target-layer-ids",
        type=model_info.layer_ids_arg,
        nargs="+",
        help="(Optional) A list of integer layer ids, separated by spaces or commas. Defaults to "
        "[2, num_hidden_layers // 2, num_hidden_layers - 3]. Note: if set, you must also "
        "pass the same value into the training process",
    )
    parser.add_argument(
        "--include-last-layer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Append the last layer (num_hidden_layers) to target_layer_ids for verifier "
        "hidden states extraction. Default: True",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="Print the command that would be executed without running it",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Allow custom model configuration code while resolving hidden-state layer ids. "
        "Pass the same flag after '--' for vLLM itself.",
    )
    return parser


def parse_args(argv: list[str], prog: str = "launch_vllm.py") -> argparse.Namespace:
    """Launcher options before ``--``; ``vllm_args`` holds everything after it. An unknown
    option is refused (exit 2) with the nearest known one, not forwarded as speculators' does."""
    cut = argv.index("--") if "--" in argv else len(argv)
    argv, after = list(argv[:cut]), list(argv[cut + 1 :])
    mooncake = any("mooncake" in a for a in argv)  # the backend's name, or its options
    parser = make_parser(prog, mooncake)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(unknown_options(parser, unknown))
    args.target_layer_ids = model_info.flat(args.target_layer_ids)
    args.vllm_args = after
    return args


def unknown_options(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """Why ``unknown`` (what the parser left over) is refused, naming the nearest option."""
    word = next((w for w in unknown if w.startswith("-")), unknown[0])
    if not word.startswith("-"):
        return f"unexpected argument {word!r}: flags for vllm serve go after '--'"
    if not any("mooncake" in s for s in parser._option_string_actions):
        with contextlib.suppress(ImportError):  # the mooncake options import torch: only now
            parser = make_parser(parser.prog, mooncake=True)
    known = [s for s in parser._option_string_actions if s.startswith("--")]
    near = difflib.get_close_matches(word.partition("=")[0], known, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}? " if near else ""
    return (
        f"unrecognized launcher option {word}: {hint}flags for vllm serve go after '--' "
        f"({parser.prog} MODEL [options] -- {word} ...)"
    )


def layer_ids(args: argparse.Namespace, num_hidden_layers: int) -> list[int]:
    """speculators' rule: defaults, or the user's ids plus the last layer; checked, then warned."""
    ids = target_layer_ids(args.target_layer_ids, num_hidden_layers, args.include_last_layer)
    ids = validate_layer_ids(ids, num_hidden_layers)  # a ValueError, as LaunchError: main prints it
    if not args.target_layer_ids:
        if not args.include_last_layer:  # speculators' rule, kept: said, not silent
            warn(
                f"--no-include-last-layer applies only to --target-layer-ids; the default ids "
                f"{ids} end with the last layer. To leave it out, pass the ids."
            )
        return ids
    if len(ids) < 2:  # the trainer takes ids[:-1]; ids[-1] is the verifier's hidden state
        example = " ".join(map(str, default_layer_ids(num_hidden_layers)[:-1]))
        raise LaunchError(
            f"--target-layer-ids {' '.join(map(str, args.target_layer_ids))} leaves the trainer "
            f"no layer: each file's last layer ({ids[-1]}) is the verifier's hidden state and "
            f"the trainer conditions on the ones before it; give those, e.g. "
            f"--target-layer-ids {example}"
        )
    warn(
        f"using custom target layer ids {ids}. Pass the same ids, without the last one "
        f"({ids[-1]}), to the training script: it takes the last layer of each file as the "
        "verifier's hidden state."
    )
    if ids[-1] != max(ids):  # files keep this order: the trainer's verifier is ids[-1]
        warn(
            f"the layer ids {ids} do not end with the deepest one, so the trainer would take "
            f"layer {ids[-1]}, not {max(ids)}, as the verifier's hidden state; list them in "
            "increasing order unless that is meant."
        )
    elif ids != sorted(ids):
        warn(
            f"the layer ids {ids} are not in increasing order; the files keep this order, so "
            "the trainer's auxiliary layers come in it too."
        )
    return ids


@dataclass(frozen=True)
class LaunchPlan:
    command: list[str]
    env: dict[str, str]


def build_plan(args: argparse.Namespace, info: model_info.ModelInfo | None = None) -> LaunchPlan:
    """The plan, from the arguments and the model's config alone (:func:`preflight` probes)."""
    backend = BACKENDS[args.hidden_states_backend]
    info = info or model_info.read_model_info(args.model, trust_remote_code=args.trust_remote_code)
    if why := model_support.aux_outputs_problem(info.architectures):
        raise LaunchError(why)
    ids = layer_ids(args, info.num_hidden_layers)
    vllm_args, user_kv = serve_args.take_kv_transfer_config(args.vllm_args)
    serve_args.check_vllm_args(vllm_args, info)
    kv = backend.build_kv_transfer_config(args, user_kv)
    drain_s = config_from(kv).shutdown_drain_s
    command = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model,
        "--speculative_config", json.dumps(speculative_config(ids)),
        "--kv_transfer_config", json.dumps(kv),
        *serve_args.extra_vllm_args(vllm_args, info),
        *serve_args.shutdown_args(vllm_args, drain_s),
        *vllm_args,
    ]  # fmt: skip
    env = serve_args.shutdown_env(drain_s)  # time at shutdown for the answered requests' files
    if is_untested():  # the printed command runs elsewhere too
        env[ALLOW_UNTESTED] = "1"
    return LaunchPlan(command, env)


def gpu_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def preflight(args: argparse.Namespace) -> None:
    """What would fail ``vllm serve`` after minutes: the vLLM release (and the methods the
    patches wrap), a visible GPU (not with --dry-run), the storage."""
    try:
        check_vllm()
        if is_untested():  # allowed: fail here, not in vllm serve, if a patched method is gone
            runtime_patches()
    except UnsupportedVllmError as e:
        raise LaunchError(str(e)) from None
    if not args.dry_run and not gpu_visible():
        cuda = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise LaunchError(
            "no GPU is visible here"
            + (f" (CUDA_VISIBLE_DEVICES={cuda!r})" if cuda is not None else "")
            + ": vllm serve needs one; run on a GPU machine, or add --dry-run to print the command"
        )
    BACKENDS[args.hidden_states_backend].check_storage(args)


def main(argv: list[str] | None = None, prog: str = "launch_vllm.py") -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv, prog)
    except SystemExit as e:  # --help, or argparse's own usage error
        return e.code if isinstance(e.code, int) else 2
    try:
        plan = build_plan(args)
        preflight(args)
    except ValueError as e:  # LaunchError, ModelConfigError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("Would run:" if args.dry_run else "Running command:")
    for key, value in plan.env.items():
        print(f"export {key}={shlex.quote(value)}")
    print(shlex.join(plan.command), flush=True)
    if args.dry_run:
        return 0
    os.environ.update(plan.env)
    os.execvp(plan.command[0], plan.command)
    return 0  # not reached
