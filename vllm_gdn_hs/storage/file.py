"""The file backend: one safetensors file per request (:mod:`vllm_gdn_hs.files`), its ``.lock``
held from :meth:`FileStorage.start` until the file is complete."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from vllm_gdn_hs import files, locks, probes
from vllm_gdn_hs.names import CONNECTOR_NAME, init_logger
from vllm_gdn_hs.storage.base import HiddenStatesStorage, RowShape, StorageConfig, StoredRequest

if TYPE_CHECKING:
    import torch

logger = init_logger(__name__)


class FileStorage(HiddenStatesStorage):
    def __init__(self, cfg: StorageConfig):
        super().__init__(cfg)
        self.storage_path = os.path.abspath(cfg.shared_storage_path)
        self.custom_root = os.path.abspath(cfg.custom_save_root or self.storage_path)

    def open_scheduler_side(self, shape: RowShape) -> None:
        if why := probes.check_storage_path(self.storage_path):
            raise ValueError(
                f"{CONNECTOR_NAME}: shared_storage_path {self.storage_path!r} is not "
                f"writable ({why}); pass a writable folder: --hidden-states-path DIR to the "
                'launcher, or "shared_storage_path" in --kv-transfer-config\'s '
                "kv_connector_extra_config"
            )
        logger.info("layers %s -> %s", shape.layer_ids, self.storage_path)
        if self.cfg.allow_custom_save_path:
            logger.warning(
                "allow_custom_save_path is on: any client may choose where its file is "
                "written, anywhere under %s (custom_save_root)",
                self.custom_root,
            )

    def place_for(self, req_id: str, custom: str | None) -> str:
        if custom is not None and self.cfg.allow_custom_save_path:
            path = files.custom_path(custom, self.custom_root)
        else:
            if custom is not None:  # the response names the file's real path
                logger.warning(
                    "request %r: hidden_states_path ignored (allow_custom_save_path is off)", req_id
                )
            path = files.request_path(self.storage_path, req_id)
        if os.path.lexists(path) or os.path.lexists(path + locks.LOCK_SUFFIX):  # not read yet
            raise ValueError(
                f"{path} already exists and has not been read; send a new request id, or move "
                "the earlier file away"
            )
        return path

    def response(self, place: str, num_tokens: int, include_output_tokens: bool) -> dict:
        return {"hidden_states_path": place}

    def start(self, req_id: str, place: str) -> StoredRequest:
        fd = locks.take_lock(place) if self.cfg.use_synchronization_lock else None
        return StoredRequest(req_id, place, fd)

    def write(
        self,
        request: StoredRequest,
        hidden_states: torch.Tensor,
        token_ids: torch.Tensor,
        scales: torch.Tensor | None,
    ) -> None:
        request.begin_write()
        written = False
        try:
            files.write_file(request.path, hidden_states, token_ids, scales)
            written = True
        finally:  # a failed write's lock goes too (unless abandon took it), so its reader fails
            with request.mutex:
                self._release_locked(request, not written and request.state != "abandoned")

    def abandon(self, request: StoredRequest, why: str = "") -> None:
        with request.mutex:
            if request.state == "open":
                self._release_locked(request, remove=True)
            elif request.state == "writing":
                # The lock file goes now (the writer closes its descriptor when it ends).
                with contextlib.suppress(FileNotFoundError):
                    os.remove(request.path + locks.LOCK_SUFFIX)
                request.state = "abandoned"

    @staticmethod
    def _release_locked(request: StoredRequest, remove: bool) -> None:
        fd, request.handle = request.handle, None
        request.state = "done" if request.state != "abandoned" else "abandoned"
        locks.release_lock(fd, request.path, remove=remove)
