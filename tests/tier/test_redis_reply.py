"""ReplyReader: MGET replies of a real redis-server received straight into views, and the wire cases a server only
produces when something breaks (a reply that trickles in, a connection closed mid-value, garbage, silence), sent by
the far end of a socket pair."""

import os
import socket
import threading

import pytest
import redis

from layerflow.tier.redis_reply import HEADER_BYTES, ReplyError, ReplyReader
from layerflow.tier.remote_manifest import block_checksum, block_hasher


@pytest.fixture
def connection(redis_url):
    """A redis-py connection to the session server, lent by its pool as the store's are."""
    pool = redis.ConnectionPool.from_url(redis_url)
    conn = pool.get_connection()
    yield conn
    pool.release(conn)
    pool.disconnect()


def views_of(*sizes: int) -> tuple[list[bytearray], list[memoryview]]:
    buffers = [bytearray(b"\xee" * n) for n in sizes]
    return buffers, [memoryview(b) for b in buffers]


def test_values_land_in_the_views_with_their_digest_and_a_missing_key_is_none(redis_server, connection):
    client = redis_server.client()
    values = {"a": os.urandom(3 * HEADER_BYTES + 5), "c": os.urandom(3 * HEADER_BYTES + 5)}
    client.mset(values)
    connection.send_command("MGET", "a", "b", "c")
    reader = ReplyReader(connection._sock)
    assert reader.array() == 3
    for key in ("a", "b", "c"):
        buffers, views = views_of(HEADER_BYTES, 2 * HEADER_BYTES + 5)   # a block of two layer groups
        digest = block_hasher()
        length = reader.bulk_into(views, digest)
        if key == "b":
            assert length is None and buffers[0] == b"\xee" * HEADER_BYTES
        else:
            assert length == len(values[key]) and b"".join(buffers) == values[key]
            assert digest.intdigest() == block_checksum(values[key])
    connection.send_command("PING")                          # redis-py reads on in step with the server
    assert connection.read_response() == b"PONG"


def test_a_value_of_another_length_is_read_past_untouched_and_the_stream_stays_in_step(redis_server, connection):
    client = redis_server.client()
    client.mset({"short": b"x" * 100, "long": os.urandom(5 * HEADER_BYTES), "right": b"r" * 1000})
    connection.send_command("MGET", "short", "long", "right")
    connection.send_command("MGET", "right")
    reader = ReplyReader(connection._sock)
    assert reader.array() == 3
    buffers, views = views_of(1000)
    assert reader.bulk_into(views, block_hasher()) == 100
    assert reader.bulk_into(views, block_hasher()) == 5 * HEADER_BYTES
    assert buffers[0] == b"\xee" * 1000                      # neither wrong-sized value touched the view
    assert reader.bulk_into(views, block_hasher()) == 1000 and buffers[0] == b"r" * 1000
    assert reader.array() == 1                               # the next reply starts where this one ended
    buffers, views = views_of(1000)
    assert reader.bulk_into(views, block_hasher()) == 1000 and buffers[0] == b"r" * 1000


def test_an_error_reply_is_a_reply_error_with_the_servers_text(connection):
    connection.send_command("MGET")
    with pytest.raises(ReplyError, match="wrong number of arguments"):
        ReplyReader(connection._sock).array()


@pytest.fixture
def wire():
    """(the reader's socket, the far end) of a connected socket pair; the reader's receives time out after 2 s."""
    near, far = socket.socketpair()
    near.settimeout(2.0)
    yield near, far
    near.close()
    far.close()


def send_slowly(far: socket.socket, data: bytes) -> threading.Thread:
    """`data` sent one byte per send from a thread, so every header and value arrives in pieces."""
    def run() -> None:
        for i in range(len(data)):
            far.sendall(data[i:i + 1])
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_reply_that_arrives_byte_by_byte_and_a_resp3_null_are_read_whole(wire):
    near, far = wire
    sender = send_slowly(far, b"*3\r\n$5\r\nhello\r\n_\r\n$-1\r\n")
    reader = ReplyReader(near)
    assert reader.array() == 3
    buffers, views = views_of(2, 3)
    digest = block_hasher()
    assert reader.bulk_into(views, digest) == 5 and b"".join(buffers) == b"hello"
    assert digest.intdigest() == block_checksum(b"hello")
    assert reader.bulk_into(views, block_hasher()) is None
    assert reader.bulk_into(views, block_hasher()) is None
    sender.join()


@pytest.mark.parametrize("data, error, match", [
    (b"*1\r\n$10\r\nabc", ConnectionError, "closed"),                  # closed in the middle of a value
    (b"*1\r\n$3\r\nabcXY", ReplyError, "not followed by CRLF"),
    (b"*1\r\n$x1\r\n", ReplyError, "'x1' is not a number"),
    (b"*1\r\n:7\r\n", ReplyError, "expected a bulk string, got ':'"),
    (b"*1\r\n$" + b"9" * HEADER_BYTES, ReplyError, f"longer than {HEADER_BYTES} bytes"),
])
def test_a_broken_reply_is_an_error_naming_what_broke(wire, data, error, match):
    near, far = wire
    far.sendall(data)
    far.shutdown(socket.SHUT_WR)
    reader = ReplyReader(near)
    with pytest.raises(error, match=match):
        assert reader.array() == 1
        reader.bulk_into(views_of(3)[1], block_hasher())


def test_a_silent_server_is_a_timeout(wire):
    near, far = wire
    near.settimeout(0.2)
    far.sendall(b"*1\r\n$4\r\nab")
    reader = ReplyReader(near)
    assert reader.array() == 1
    with pytest.raises(TimeoutError):
        reader.bulk_into(views_of(4)[1], block_hasher())
