"""Reused outgoing messages (paraminit.sendbuf): a message anyone still holds never changes."""

from __future__ import annotations

import threading

import crc32c
import numpy as np
import reference

from paraminit import wire
from paraminit.sendbuf import MessagePool, new_message
from paraminit_client import param, plan_of
from paraminit_server import backends
from paraminit_server import plan as planlib
from paraminit_server.caller import Caller
from paraminit_server.config import ServerConfig
from paraminit_server.materializer import Materializer, StreamStart


def test_new_message_is_written_through_its_view() -> None:
    m = new_message(1000)
    m.view[:] = np.arange(1000) % 251
    assert isinstance(m.data, bytes) and len(m.data) == 1000
    assert m.data == (np.arange(1000) % 251).astype(np.uint8).tobytes()


def test_pool_reuses_only_messages_nobody_holds() -> None:
    pool = MessagePool(1 << 20)
    a = pool.take(4096)
    a.view[:] = 7
    held, a_id = a.data, id(a)  # a consumer keeps the bytes; the writer lets go of the message
    del a
    b = pool.take(4096)
    assert id(b) != a_id  # the held one is not handed out
    c = pool.take(4096)
    assert c is not b  # nor one a writer still holds
    b.view[:] = 9
    c.view[:] = 9  # writing the others leaves the held one alone
    b_id, c_id = id(b), id(c)
    del b, c
    assert held == b"\x07" * 4096
    again = pool.take(4096)
    assert id(again) in (b_id, c_id)  # a free one comes back, never the held one
    del again, held
    assert {id(pool.take(4096)) for _ in range(3)} <= {a_id, b_id, c_id}  # all free now: no new ones
    assert pool.take(100).view.shape == (100,)  # sizes never mix
    assert pool.held == 3 * 4096 + 100


def test_pool_keeps_at_most_its_budget_and_clear_drops_everything() -> None:
    pool = MessagePool(3 * 1024)
    held = [pool.take(1024).data for _ in range(5)]  # all held: five distinct messages
    assert len({id(h) for h in held}) == 5
    assert pool.held == 3 * 1024
    pool.clear()
    assert pool.held == 0
    m = pool.take(1024)
    assert all(m.data is not h for h in held)


def test_streams_through_the_shared_pool_keep_every_message_intact() -> None:
    """Two concurrent streams with many slabs and small chunks, every message kept by the consumer until the
    end (so nothing may be reused under it): each decodes, checks its CRC32C and equals the reference."""
    config = ServerConfig(backend="cpu", metrics_port=0, slab_bytes=64 << 10, chunk_bytes=8 << 10)
    plane = Materializer(config, backends.create("cpu"))
    plans = [plan_of([param("w", [96 * 1024], {"uniform": {"lo": -1, "hi": 1, "seed": s}})]) for s in (3, 4)]
    kept: list[list[bytes]] = [[], []]

    def run(i: int) -> None:
        for item in plane.stream(plans[i], Caller()):
            if not isinstance(item, StreamStart):
                assert isinstance(item, bytes)
                kept[i].append(item)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        out = np.full(96 * 1024 * 4, 0xAB, dtype=np.uint8)  # poisoned
        for raw in kept[i]:
            c = wire.decode_response(raw)
            assert isinstance(c, wire.Chunk) and crc32c.crc32c(c.data) == c.crc32c
            out[c.offset:c.offset + len(c.data)] = np.frombuffer(c.data, dtype=np.uint8)
        want = reference.materialize(planlib.resolve(plans[i])[0])
        np.testing.assert_array_equal(out.view(np.float32), want.reshape(-1))
    assert plane.messages.held > 0
