"""Verification: which hidden-state files are complete (:mod:`.check`), and how far they are from
HF transformers on the same weights (:mod:`.reference`, :mod:`.checkpoint`). Nothing of the
runtime imports it."""
