"""What shardfleet.cache relies on in pymemcache 4.x beyond its documented API, pinned.

``ObjectCache``'s client subclasses pymemcache's ``HashClient`` to keep its ring
policy (retry, mark dead, re-add) while asking every server at once and logging
failures. Those pieces are not public API; if a pymemcache release changes one of
them, a test here fails and names it, instead of the cache silently losing its
failure policy. The socket side (``Client.sock``, ``version()`` connecting) is
pinned on a real memcached in tests/integration/test_cache.py.
Also here: the multi-get reply parser, fed in pieces.
"""

from __future__ import annotations

import inspect

import pytest
from pymemcache.client.base import Client, PooledClient
from pymemcache.client.hash import HashClient
from pymemcache.pool import ObjectPool

from shardfleet.cache import MemcacheReplyError, _hash_client_class, _read_values

WHO = "pymemcache changed what shardfleet.cache relies on: "


def _ring(**kw):
    # a closed port: nothing here connects (no command is sent)
    return HashClient([("127.0.0.1", 9)], use_pooling=True, ignore_exc=False,
                      retry_attempts=kw.pop("retry_attempts", 2),
                      retry_timeout=kw.pop("retry_timeout", 60), dead_timeout=60, **kw)


def test_hash_client_fields_the_subclass_uses():
    hc = _ring()
    assert isinstance(hc.clients, dict) and len(hc.clients) == 1, WHO + "HashClient.clients"
    node = next(iter(hc.clients))
    assert hc.hasher.get_node("k") == node, WHO + "HashClient.hasher.get_node -> clients key"
    assert hc._dead_clients == {} and callable(hc._retry_dead), WHO + "_dead_clients/_retry_dead"
    assert hc._get_client("k") is hc.clients[node], WHO + "HashClient._get_client"
    params = list(inspect.signature(HashClient._safely_run_func).parameters)
    assert params[:4] == ["self", "client", "func", "default_val"], WHO + "_safely_run_func args"


def test_safely_run_func_runs_and_counts_failures():
    hc = _ring()
    client = next(iter(hc.clients.values()))
    assert hc._safely_run_func(client, lambda a, b=0: a + b, None, 1, b=2) == 3, (
        WHO + "_safely_run_func must call func(*args, **kwargs) and return its result")

    def boom():
        raise ConnectionRefusedError("down")

    with pytest.raises(OSError):
        hc._safely_run_func(client, boom, "dflt")
    assert client.server in hc._failed_clients, WHO + "an OSError must mark the server failed"
    called = []
    assert hc._safely_run_func(client, lambda: called.append(1), "dflt") == "dflt", (
        WHO + "a failed server inside retry_timeout must give the default without a call")
    assert not called

    class Odd(Exception):
        pass

    def odd():
        raise Odd

    ok = _ring()
    c2 = next(iter(ok.clients.values()))
    with pytest.raises(Odd):
        ok._safely_run_func(c2, odd, None)
    assert c2.server not in ok._failed_clients, WHO + "non-OSError must not mark a server"


def test_safely_run_func_marks_dead_after_retry_attempts():
    hc = _ring(retry_attempts=1, retry_timeout=-1)

    def boom():
        raise TimeoutError("slow")

    client = next(iter(hc.clients.values()))
    for _ in range(2):  # the first failure, then a failed retry
        with pytest.raises(OSError):
            hc._safely_run_func(client, boom, None)
    # attempts reached: the next call removes the server from the ring
    hc._safely_run_func(client, lambda: None, None)
    assert client.server in hc._dead_clients, WHO + "retry_attempts failures -> dead server"


def test_the_subclass_turns_failures_into_the_default():
    cls = _hash_client_class()
    hc = cls([("127.0.0.1", 9)], use_pooling=True, ignore_exc=False, retry_attempts=2,
             retry_timeout=60, dead_timeout=60)

    class H:
        calls: list = []

        def failed(self, action, exc):
            self.calls.append(action)

    hc.health = H()
    client = next(iter(hc.clients.values()))

    def boom():
        raise ConnectionResetError("gone")

    assert hc._safely_run_func(client, boom, {}) == {}
    assert hc.health.calls and client.server in hc._failed_clients


def test_pooled_client_pool():
    pc = PooledClient(("127.0.0.1", 9), max_pool_size=2)
    assert isinstance(pc.client_pool, ObjectPool), WHO + "PooledClient.client_pool"
    c = pc.client_pool.get()
    assert isinstance(c, Client) and c.sock is None, WHO + "pool gives unconnected Clients"
    pc.client_pool.release(c)
    assert pc.client_pool.get() is c, WHO + "release puts the client back for reuse"
    closed = []
    c.close = lambda: closed.append(1)  # type: ignore[method-assign]
    pc.client_pool.destroy(c)
    assert closed and c not in pc.client_pool.used, WHO + "destroy drops and closes the client"


class Chunks:
    """A socket whose recv hands out a reply in fixed-size pieces."""

    def __init__(self, data: bytes, size: int) -> None:
        self.pieces = [data[i:i + size] for i in range(0, len(data), size)]

    def recv(self, _n: int) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""


def _reply(values: dict[str, bytes]) -> bytes:
    out = b"".join(b"VALUE %s 0 %d\r\n%s\r\n" % (k.encode(), len(v), v)
                   for k, v in values.items())
    return out + b"END\r\n"


@pytest.mark.parametrize("size", [1, 2, 7, 64, 1 << 20])
def test_reply_parser_in_any_pieces(size):
    values = {"sf1:o:1": b'{"a":1}', "sf1:o:2": b"", "sf1:o:3": b"x\r\nEND\r\nVALUE y 0 1\r\n",
              "sf1:o:4": b"\x00tomb", "sf1:o:5": b"z" * 5000}
    assert _read_values(Chunks(_reply(values), size)) == values
    assert _read_values(Chunks(b"END\r\n", size)) == {}


def test_reply_parser_errors():
    with pytest.raises(MemcacheReplyError, match="SERVER_ERROR"):
        _read_values(Chunks(b"SERVER_ERROR out of memory\r\n", 5))
    with pytest.raises(ConnectionError):
        _read_values(Chunks(b"VALUE k 0 10\r\nabc", 4))
    with pytest.raises(ConnectionError):
        _read_values(Chunks(b"VALUE k 0 3\r\nabc\r\nEN", 4))


def test_rendezvous_memo_follows_the_ring():
    from shardfleet.cache import FastRendezvousHash

    h = FastRendezvousHash(["a:1", "b:2", "c:3"])
    keys = [f"sf1:o:{n}" for n in range(300)]
    first = {k: h.get_node(k) for k in keys}
    assert {h.get_node(k) for k in keys} == {"a:1", "b:2", "c:3"}
    assert {k: h.get_node(k) for k in keys} == first, "remembered placements are the same"
    h.remove_node("b:2")
    after = {k: h.get_node(k) for k in keys}
    assert "b:2" not in after.values(), "a removed node is forgotten"
    assert all(after[k] == first[k] for k in keys if first[k] != "b:2"), "others stay put"
    h.add_node("b:2")
    assert {k: h.get_node(k) for k in keys} == first
    fresh = FastRendezvousHash(["c:3", "a:1", "b:2"])
    assert {k: fresh.get_node(k) for k in keys} == first, "order of nodes does not matter"
