"""The ``mooncake`` backend's options (``kv_connector_extra_config["mooncake"]``, hs-connectors'
``MooncakeStoreConfig`` keys), apart so that the launcher checks them without torch or vLLM."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from typing import Any, Literal

from pydantic import ConfigDict, Field

from vllm_gdn_hs.names import CONNECTOR_NAME
from vllm_gdn_hs.storage.base import StorageOptions

GIB = 1024**3


class MooncakeOptions(StorageOptions):
    """Where the Mooncake store is and how this server joins it, as docs/mooncake.md explains."""

    model_config = ConfigDict(extra="forbid")

    local_hostname: str = Field("localhost", min_length=1)  # where others reach us
    metadata_server: str = Field("P2PHANDSHAKE", min_length=1)
    master_server_address: str = Field("127.0.0.1:50051", pattern=r"^\S+:\d{1,5}$")
    global_segment_size: int = Field(4 * GIB, ge=0)
    local_buffer_size: int = Field(2 * GIB, ge=0)
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = ""
    unread_copy_size: int = Field(4 * GIB, ge=0)
    # speculators' --mooncake-writer-threads; here it sizes the connector's write_workers.
    num_writer_threads: int = Field(4, ge=1, le=64)

    def check_config(self, cfg: Any) -> None:
        if cfg.allow_custom_save_path:
            raise ValueError(
                "allow_custom_save_path does not apply to the mooncake backend (it writes no "
                "files): drop it"
            )
        threads = self.num_writer_threads
        if "write_workers" not in cfg.model_fields_set:
            cfg.write_workers = threads
        elif cfg.write_workers != threads:
            raise ValueError(
                f"write_workers={cfg.write_workers} and mooncake.num_writer_threads={threads} "
                "name the same thing: set one (--mooncake-writer-threads)"
            )


def check_master(options: MooncakeOptions, timeout: float = 5.0) -> None:
    """ValueError naming the address unless the master accepts a TCP connection (Mooncake's
    setup retries for 90 s, then says -1)."""
    host, _, port = options.master_server_address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise ValueError(
            f"{CONNECTOR_NAME}: cannot reach the Mooncake master at "
            f"{options.master_server_address} ({e}): start mooncake_master there "
            "(docs/mooncake.md), or pass its address with --mooncake-master "
            "(kv_connector_extra_config.mooncake.master_server_address)"
        ) from None


def advertise_address(local_hostname: str | None) -> None:
    """Have Mooncake's TCP transport advertise ``local_hostname``, an IP address, not its first
    interface's (``MC_TCP_BIND_ADDRESS``, unless set)."""
    if os.environ.get("MC_TCP_BIND_ADDRESS") or not local_hostname:
        return
    with contextlib.suppress(ValueError):  # a host name: Mooncake's own choice
        ipaddress.ip_address(local_hostname.strip("[]"))
        os.environ["MC_TCP_BIND_ADDRESS"] = local_hostname.strip("[]")
