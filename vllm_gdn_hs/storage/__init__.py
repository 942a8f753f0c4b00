"""Where a request's hidden states go: one module per backend (:mod:`.base`, :mod:`.registry`)."""
