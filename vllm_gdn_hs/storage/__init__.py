"""Where a request's hidden states go: one module per storage backend, each with its
scheduler side (where a request goes, what its response says) and its worker side (the
write), behind :class:`~vllm_gdn_hs.storage.base.HiddenStatesStorage`; the registry picks
one for a config (:mod:`.registry`)."""
