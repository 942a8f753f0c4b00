"""The base of a storage backend's own options (a field of the connector's config)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class StorageOptions(BaseModel):
    def check_config(self, cfg: Any) -> None:
        """Check or settle the connector's other options (``cfg``: the ``HiddenStatesConfig``
        being validated, which holds these options) as this backend needs them."""
