"""The host ring (``connector/staging.py``): each step takes only its own rows, in order, and
rows handed out are never handed out again before the drain thread releases them."""

from __future__ import annotations

import queue
import random
import threading

import pytest
import torch

from vllm_gdn_hs.connector.staging import HostRing

L, H = 2, 4


def ring(num_slots=2, max_tokens=8) -> HostRing:
    return HostRing(num_slots, max_tokens, L, H, torch.bfloat16, torch.device("cpu"))


def step(n: int, value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows all ``value % 128`` (exact in bf16: the ring holds far fewer than 128 steps), and
    positions all ``value``."""
    return torch.full((n, L, H), value % 128, dtype=torch.bfloat16), torch.full((n,), value)


def test_small_steps_go_on_while_a_large_one_is_filed():
    """A decode step after a prefill step as large as the largest: it takes one row, not a
    step's worth, so the engine waits only once every row is in use."""
    r = ring()
    large, waited = r.take(8)  # the drain thread is still filing it
    assert waited == 0
    small = []
    for _ in range(8):
        assert r._fit(1) is not None  # room at once (else take would wait for ever here)
        slot, waited = r.take(1)
        assert waited == 0
        small.append(slot)
    assert r._fit(1) is None  # every row in use: the next step must wait

    taken = queue.Queue()
    t = threading.Thread(target=lambda: taken.put(r.take(1)), daemon=True)
    t.start()
    large.release()  # the large step filed: its rows come back
    slot, _ = taken.get(timeout=10)
    assert slot.start == 0  # the freed rows at the ring's start, after the wrap
    for s in [*small, slot]:
        s.release()
    assert not r.live


def test_rows_are_not_handed_out_twice_across_wraps():
    """Steps of random sizes through a ring that wraps many times, with a drain that files
    them slowly and in order: every step reads back exactly the rows it put in."""
    r = ring(num_slots=2, max_tokens=8)
    handed = queue.Queue()
    bad = []

    def drain():
        while (item := handed.get()) is not None:
            slot, value, n = item
            got_rows = slot.hidden_states.float().unique().tolist()
            got_pos = slot.positions.unique().tolist()
            if slot.positions.shape[0] != n or got_rows != [value % 128] or got_pos != [value]:
                bad.append((value, n, got_rows, got_pos))
            threading.Event().wait(random.random() / 2000)
            slot.release()

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    rng = random.Random(0)
    for value in range(1, 400):
        n = rng.randint(1, 8)
        slot, _ = r.copy_out(*step(n, value))
        handed.put((slot, value, n))
    handed.put(None)
    t.join(30)
    assert not t.is_alive() and not bad, bad[:3]
    assert not r.live


def test_a_step_the_ring_cannot_hold_is_refused():
    r = ring(num_slots=1, max_tokens=8)
    with pytest.raises(ValueError, match="a step of 9 rows in a ring of 8"):
        r.take(9)
    with pytest.raises(ValueError):
        r.take(0)


def test_a_slot_is_filled_one_layer_at_a_time():
    """``fill_layer`` puts each layer's rows into its column of the slot's [tokens, L, H] rows
    the drain reads, leaving the other columns and the ring's other rows alone; ``finish`` adds
    the norms and positions. On CPU the copies are plain ones (on the GPU one strided DMA a
    layer, on the ring's side stream) and there is no ``copied`` event."""
    r = ring()
    r.hidden_states.fill_(-1)
    slot, _ = r.take(3)
    layers = [torch.full((3, H), float(j + 1), dtype=torch.bfloat16) for j in range(L)]
    for j, rows in enumerate(layers):
        slot.fill_layer(j, rows)
    norms, positions = torch.rand(3, L), torch.arange(3)
    slot.finish(norms, positions)
    assert torch.equal(slot.hidden_states, torch.stack(layers, dim=1))
    assert slot.hidden_states.is_contiguous()  # token-major: each request's rows in one block
    assert (r.hidden_states[3:] == -1).all()
    assert torch.equal(slot.norms, norms) and torch.equal(slot.positions, positions)
    assert slot.copied is None
