"""Layer ids (k: the residual stream after k decoder layers): speculators' defaults and rule,
and the check the launcher and the connector share."""

from __future__ import annotations


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """speculators' default target layers."""
    n = num_hidden_layers
    return [2, n // 2, n - 3, n]


def target_layer_ids(
    given: list[int] | None, num_hidden_layers: int, last: bool = True
) -> list[int]:
    """speculators' rule: the defaults, or the ids given plus the last layer (with ``last``)."""
    n = num_hidden_layers
    ids = list(given or default_layer_ids(n))
    return [*ids, n] if given and last and n not in ids else ids


def validate_layer_ids(layer_ids: list[int], num_hidden_layers: int) -> list[int]:
    n = num_hidden_layers
    if bad := [i for i in layer_ids if not 0 <= int(i) <= n]:
        raise ValueError(
            f"layer ids {bad} are out of range: this model has {n} layers, so ids must be "
            f"in 0..{n} (id {n} is the last layer's output, before the final norm)"
        )
    if dup := sorted({i for i in layer_ids if layer_ids.count(i) > 1}):
        raise ValueError(f"layer ids {dup} are repeated; give each layer id once")
    if not layer_ids:
        raise ValueError("no layer ids given; pass at least one")
    return [int(i) for i in layer_ids]
