"""``python -m vllm_gdn_hs.cli.train``: speculators' ``train`` (arguments unchanged, no vLLM
needed) with the ``mooncake-fp8`` backend registered, whose fp8 objects
:class:`MooncakeFP8Transfer` dequantizes as ``FP8Transfer`` does (docs/mooncake.md).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from hs_connectors import transfer

from vllm_gdn_hs.config import extra_config
from vllm_gdn_hs.names import CONNECTOR_NAME
from vllm_gdn_hs.storage.mooncake_options import advertise_address

BACKEND = "mooncake-fp8"


class MooncakeFP8Transfer(transfer.MooncakeTransfer):
    """hs-connectors' Mooncake reader, then its fp8 reader's dequantization (bf16 passes as is)."""

    dequantize_dtype = torch.bfloat16
    _dequantize = transfer.FP8Transfer._dequantize

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        return self._dequantize(super().get_generated(hs_transfer_params))


class MooncakeFP8Train(transfer.MooncakeBackend):
    """speculators' ``mooncake`` backend (the same ``--mooncake-*`` options) with fp8 objects."""

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> MooncakeFP8Transfer:
        store = transfer.MooncakeBackend.from_train_args(args, data_path).store
        advertise_address(store.config.local_hostname)  # before setup: this host's address
        return MooncakeFP8Transfer(store)

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        """The server side: this package's connector (hs-connectors' has no fp8 objects)."""
        config = transfer.MooncakeBackend.build_kv_transfer_config(args)
        config.pop("kv_connector_module_path")
        config["kv_connector"] = CONNECTOR_NAME
        extra_config(config)["fp8"] = True
        return config


def register() -> None:
    """Add ``mooncake-fp8`` to hs-connectors' registry (once), before speculators reads it."""
    if BACKEND not in transfer.HiddenStatesBackend.registry:
        transfer.HiddenStatesBackend.register(BACKEND)(MooncakeFP8Train)


def main(argv: list[str] | None = None) -> None:
    register()
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    train(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main()
