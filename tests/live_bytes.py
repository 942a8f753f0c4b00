"""The peak of tensor memory that code allocates, measured on CPU: the test-side stand-in for
the CUDA caching allocator's ``allocated_bytes.all.peak`` that vLLM's KV sizing reads.

Counts every new tensor (not on an input's storage) an aten op returns while the mode is on,
until that tensor is freed; tensors made before (weights, pinned host buffers) and views of
them are not counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.owned: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {  # an output on an input's storage is a view of it or written in place
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self.owned or key in inputs:
                continue
            self.owned.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self.owned.discard(key)
        self.live -= size
