"""The storage backends by name; a config picks the one whose options it sets, else files."""

from __future__ import annotations

from vllm_gdn_hs.storage.base import HiddenStatesStorage, StorageConfig
from vllm_gdn_hs.storage.file import FileStorage
from vllm_gdn_hs.storage.mooncake import MooncakeStorage

STORAGES: dict[str, type[HiddenStatesStorage]] = {"file": FileStorage, "mooncake": MooncakeStorage}


def storage_for(cfg: StorageConfig) -> HiddenStatesStorage:
    """The backend whose options ``cfg`` sets (``options_field``), else files; not opened yet."""
    for cls in STORAGES.values():
        if cls.options_field and getattr(cfg, cls.options_field, None) is not None:
            return cls(cfg)
    return FileStorage(cfg)
