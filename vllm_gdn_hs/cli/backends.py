"""The launcher's half of each ``--hidden-states-backend`` (speculators' names): its options,
its storage check and its ``kv_transfer_config`` (the connector's half: :mod:`vllm_gdn_hs.storage`).
"""

from __future__ import annotations

import argparse
import os
from importlib import metadata
from typing import Any, ClassVar

from pydantic import ValidationError

from vllm_gdn_hs import probes, version
from vllm_gdn_hs.cli.host import Row
from vllm_gdn_hs.cli.serve_args import LaunchError
from vllm_gdn_hs.config import HiddenStatesConfig, extra_config, kv_transfer_config, problems
from vllm_gdn_hs.names import CONNECTOR_NAME
from vllm_gdn_hs.storage.mooncake_options import MooncakeOptions, check_master

# Connector options the launcher sets from its own flags.
LAUNCHER_OPTIONS = {
    "shared_storage_path": "--hidden-states-path",
    "layer_ids": "--target-layer-ids",
    "fp8": "--hidden-states-backend fp8 or mooncake-fp8",
    "mooncake": "--hidden-states-backend mooncake and its --mooncake-* options",
}


class FileLaunch:
    """speculators' ``file`` backend: one safetensors file per request."""

    options: ClassVar[dict[str, Any]] = {}  # connector options this backend sets

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--hidden-states-path",
            default="/tmp/hidden_states",
            help="The directory to save hidden states to. Default '/tmp/hidden_states'",
        )

    @classmethod
    def check_storage(cls, args: argparse.Namespace) -> None:
        """The folder must take files (a dry run probes where it leaves nothing behind)."""
        path = cls.storage_options(args)["shared_storage_path"]
        if why := probes.check_storage_path(path, make=not args.dry_run):
            raise LaunchError(
                f"--hidden-states-path {path} is not writable ({why}): pass a folder this user "
                "can write to"
            )

    @classmethod
    def storage_options(cls, args: argparse.Namespace) -> dict:
        path = os.path.abspath(os.path.expanduser(args.hidden_states_path))
        return {"shared_storage_path": path, **cls.options}

    @classmethod
    def build_kv_transfer_config(cls, args: argparse.Namespace, user: dict) -> dict:
        """Ours, with the user's ``--kv-transfer-config`` settings merged in."""
        for key, ours in (("kv_connector", CONNECTOR_NAME), ("kv_role", "kv_producer")):
            if user.get(key, ours) != ours:
                raise LaunchError(
                    f"--kv-transfer-config {key}={user[key]!r}: the launcher runs {key} "
                    f"{ours!r}; drop {key}"
                )
        extra = extra_config(user)
        for key, use in LAUNCHER_OPTIONS.items():
            if key in extra:
                raise LaunchError(
                    f"--kv-transfer-config kv_connector_extra_config.{key} is set by the "
                    f"launcher: use {use} instead"
                )
        try:
            HiddenStatesConfig(**extra, **cls.storage_options(args))
        except (ValidationError, TypeError) as e:
            why = problems(e) if isinstance(e, ValidationError) else str(e)
            fields = HiddenStatesConfig.model_fields
            keys = ", ".join(k for k in fields if k not in LAUNCHER_OPTIONS)
            raise LaunchError(
                f"--kv-transfer-config kv_connector_extra_config: {why} (options: {keys})"
            ) from None
        return {**user, **kv_transfer_config(**cls.storage_options(args), **extra)}


class FP8Launch(FileLaunch):
    """speculators' ``fp8`` backend: float8_e4m3fn rows, one fp32 scale per token."""

    options: ClassVar[dict[str, Any]] = {"fp8": True}


class MooncakeLaunch(FileLaunch):
    """speculators' ``mooncake`` backend, with hs-connectors' own ``--mooncake-*`` options."""

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        from hs_connectors.transfer import MooncakeBackend as Theirs

        Theirs.add_launch_args(parser)

    @classmethod
    def check_storage(cls, args: argparse.Namespace) -> None:
        """The master must answer before vLLM starts (not with --dry-run: no network)."""
        if not args.dry_run:
            check_master(MooncakeOptions(**cls.storage_options(args)["mooncake"]))

    @classmethod
    def storage_options(cls, args: argparse.Namespace) -> dict:
        """``mooncake`` as hs-connectors' launcher has it, less fields a later one adds."""
        from hs_connectors.transfer import MooncakeBackend as Theirs

        theirs = extra_config(Theirs.build_kv_transfer_config(args))
        ours = {k: v for k, v in theirs["mooncake"].items() if k in MooncakeOptions.model_fields}
        return {**theirs, "mooncake": ours, **cls.options}


class MooncakeFP8Launch(MooncakeLaunch, FP8Launch):
    """``mooncake`` with fp8 objects; not speculators': trainers run :mod:`.train`."""


BACKENDS: dict[str, type[FileLaunch]] = {
    "file": FileLaunch,
    "fp8": FP8Launch,
    "mooncake": MooncakeLaunch,
    "mooncake-fp8": MooncakeFP8Launch,
}


def mooncake_checks(master: str) -> list[Row]:
    """A Mooncake wheel that loads, and the master at ``master`` (host:port) answering."""
    # hs-connectors' Mooncake wheels (-non-cuda, -cuda13, ...) all install the package "mooncake"
    dists = metadata.packages_distributions().get("mooncake", [])
    wheels = [f"{d} {version.installed(d)}" for d in sorted(set(dists))]
    problem = None
    if not wheels:
        problem = (
            "pip install mooncake-transfer-engine-non-cuda (CPU hosts; GPU hosts: the "
            "-cuda13 wheel for vLLM's CUDA 13 builds, docs/mooncake.md)"
        )
    else:
        try:
            import mooncake.store  # noqa: F401
        except ImportError as e:
            problem = f"{e}: apt-get install -y libibverbs1 (Debian/Ubuntu)"
    rows = [("mooncake", ", ".join(wheels) or "not installed", problem)]
    try:
        check_master(MooncakeOptions(master_server_address=master))
        rows.append(("mooncake master", f"{master} answers", None))
    except ValueError as e:  # a malformed address, or none listening
        msg = e.errors()[0]["msg"] if hasattr(e, "errors") else str(e)
        rows.append(("mooncake master", master, msg))
    return rows
