"""The shared remote store on Redis: the four backend primitives of `RemoteStore` over redis-py.

Keys (a namespace, the fingerprint of the model and KV layout, the user):
  {namespace}:{fingerprint}:{user}:manifest          a hash {version, body}: the manifest, set last
  {namespace}:{fingerprint}:{user}:{version}:{block} one host block's bytes (all layer groups), never rewritten
Blocks are written with a pending expiry (`pending_ttl_s`) and made persistent by the one Lua script that swaps a
manifest in (only if the current one is still the one the writer read, and only if every block it names exists); the
blocks the replaced manifest named and the new one does not get `stale_ttl_s` to live, so a reader of the old
manifest still finishes. Reads land groups of about `fetch_bytes` from MGETs of about `mget_bytes`, pipelined over
up to `connections` connections of the pool, the values received straight into the host blocks (tier/redis_reply.py).
Every call is bounded by `timeout_s`; redis-py's own retries are off (the store backs off itself). The password goes
in through a credential provider, so no repr of the client shows it, and no error or log line carries it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.credentials import UsernamePasswordCredentialProvider
from redis.retry import Retry

from layerflow.tier.layout import KVLayout
from layerflow.tier.remote_faults import RemoteFault
from layerflow.tier.redis_fetch import ParallelMgets
from layerflow.tier.redis_reply import ReplyError
from layerflow.tier.redis_url import check_namespace, check_url, redacted_url
from layerflow.tier.remote_manifest import Manifest
from layerflow.tier.remote_store import Landed, RemoteStore
from layerflow.tier.ssd import HostBlocks

# KEYS[1] the manifest; KEYS[2 .. 1+keep] the blocks the new manifest names; the other KEYS the old one's to expire.
# ARGV: expected current version ('' none), new version ('' delete), new body, keep, stale ttl (ms).
SWAP_SCRIPT = """
local current = redis.call('HGET', KEYS[1], 'version') or ''
if current ~= ARGV[1] then return 'moved' end
local keep = tonumber(ARGV[4])
for i = 2, keep + 1 do
  if redis.call('EXISTS', KEYS[i]) == 0 then return 'missing' end
end
for i = 2, keep + 1 do redis.call('PERSIST', KEYS[i]) end
for i = keep + 2, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[5]) end
if ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('HSET', KEYS[1], 'version', ARGV[2], 'body', ARGV[3])
end
return 'ok'
"""


class RedisStore(RemoteStore):
    """`RemoteStore` on the Redis server at `url` (see the module docstring)."""

    def __init__(self, url: str, layout: KVLayout, fingerprint: str, *, namespace: str = "layerflow",
                 password: str | None = None, timeout_s: float = 1.0, connections: int = 4,
                 fetch_bytes: int = 4 << 20, mget_bytes: int = 1 << 20, stale_ttl_s: float = 60.0,
                 pending_ttl_s: float = 600.0, queue_jobs: int = 32, queue_bytes: int = 1 << 30) -> None:
        check_url(url)
        check_namespace(namespace)
        for key, value in (("timeout_s", timeout_s), ("stale_ttl_s", stale_ttl_s), ("pending_ttl_s", pending_ttl_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{key}={value!r}: must be a positive number")
        for key, value in (("connections", connections), ("fetch_bytes", fetch_bytes), ("mget_bytes", mget_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key}={value!r}: must be a positive integer")
        self.url, self.timeout_s, self.connections = redacted_url(url), float(timeout_s), connections
        self._prefix = f"{namespace}:{fingerprint}:"
        self._secret = password
        self._stale_ms, self._pending_ms = int(stale_ttl_s * 1000), int(pending_ttl_s * 1000)
        self.blocks_per_group = max(1, fetch_bytes // layout.page_bytes)
        self.blocks_per_mget = min(self.blocks_per_group, max(1, mget_bytes // layout.page_bytes))
        credentials = UsernamePasswordCredentialProvider(urlsplit(url).username, password) if password else None
        self._connections = redis.BlockingConnectionPool.from_url(
            url, credential_provider=credentials, socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s, timeout=self.timeout_s, max_connections=connections + 1,
            retry=Retry(NoBackoff(), 0))
        self._redis = redis.Redis(connection_pool=self._connections)
        self._swap = self._redis.register_script(SWAP_SCRIPT)
        self._readers = ThreadPoolExecutor(connections, thread_name_prefix="layerflow-redis-read")
        super().__init__(layout, fingerprint, f"redis {self.url}", queue_jobs=queue_jobs, queue_bytes=queue_bytes)
        self._check_password()

    def _check_password(self) -> None:
        """A refused password is a configuration error (raised); a server that is down is an outage (misses)."""
        try:
            with self._faults():
                self._redis.ping()
        except RemoteFault as e:
            if e.reason.startswith("authentication refused"):
                self.close()
                raise ValueError(f"the Redis server at {self.url} refused the connection: wrong or missing "
                                 f"password (remote_password_file / remote_password_env)") from None
            self.outage.failed(e.reason)

    @contextlib.contextmanager
    def _faults(self):
        """redis-py's errors as a RemoteFault whose reason says what happened (never the password)."""
        try:
            yield
        except redis.AuthenticationError:
            raise RemoteFault("authentication refused") from None
        except redis.TimeoutError:
            raise RemoteFault(f"no answer within {self.timeout_s} s") from None
        except redis.ConnectionError as e:
            raise RemoteFault(f"unreachable ({self._scrub(e)})") from None
        except redis.exceptions.OutOfMemoryError as e:
            raise RemoteFault(f"out of memory ({self._scrub(e)})") from None
        except (redis.ResponseError, ReplyError) as e:
            raise RemoteFault(f"refused ({self._scrub(e)})") from None
        except TimeoutError:   # a socket read by a ReplyReader
            raise RemoteFault(f"no answer within {self.timeout_s} s") from None
        except ConnectionError as e:
            raise RemoteFault(f"unreachable ({self._scrub(e)})") from None
        except (redis.RedisError, OSError) as e:
            raise RemoteFault(f"{type(e).__name__} ({self._scrub(e)})") from None

    def _scrub(self, error: BaseException) -> str:
        """The error's text, printable, short, and without the password."""
        text = str(error)
        text = text.replace(self._secret, "<password>") if self._secret else text
        text = "".join(c if c.isprintable() else "?" for c in text)
        return text if len(text) <= 200 else text[:200] + "..."

    # ---- keys -----------------------------------------------------------------------------

    def _manifest_key(self, user: str) -> str:
        return f"{self._prefix}{user}:manifest"

    def _block_keys(self, user: str, manifest: Manifest, count: int | None = None) -> list[str]:
        versions = manifest.block_versions()[:count]
        return [f"{self._prefix}{user}:{version}:{i}" for i, version in enumerate(versions)]

    # ---- primitives -----------------------------------------------------------------------

    def _read_manifest(self, user: str) -> Manifest | None:
        with self._faults():
            version, body = self._redis.hmget(self._manifest_key(user), ["version", "body"])
        if version is None or body is None:
            return None
        manifest = Manifest.decode(body, self.fingerprint, self.page_size, self.block_bytes)
        return manifest if manifest is not None and manifest.version.encode() == version else None

    def _fetch(self, user: str, manifest: Manifest, host: HostBlocks, blocks: list[int]) -> Iterator[Landed]:
        """MGETs of `blocks_per_mget` keys over up to `connections` connections, two in flight on each, every
        connection read by its own thread (`ParallelMgets`: the values land straight in the host blocks, hashed as
        they do), yielded in order in groups of `blocks_per_group`. Small MGETs cost the server less (it copies each
        reply into buffers of its own before the socket, and its CPU per fetch grew with the bytes in flight); larger
        groups cost the consumer less."""
        keys = self._block_keys(user, manifest, len(blocks))
        mgets = [(s, keys[s:s + self.blocks_per_mget]) for s in range(0, len(keys), self.blocks_per_mget)]
        conns, reads, clean = [], None, False
        try:
            with self._faults():
                conns = [self._connections.get_connection() for _ in range(min(self.connections, len(mgets)))]
                reads = ParallelMgets(self._readers, conns, mgets, lambda index: host(blocks[index]))
                first, landed = 0, []
                for i, (_, group) in enumerate(reads):
                    landed += group
                    if len(landed) >= self.blocks_per_group or i == len(mgets) - 1:
                        yield first, landed
                        first, landed = first + len(landed), []
            clean = True
        finally:
            if reads is not None:   # no reader may still write into a host block once this returns
                reads.close(clean)
            for conn in conns:
                if not clean:   # replies may still be on their way: this connection's stream is out of step
                    conn.disconnect()
                self._connections.release(conn)

    def _put_blocks(self, user: str, version: str, blocks: Sequence[tuple[int, bytes]]) -> None:
        with self._faults():
            pipe = self._redis.pipeline(transaction=False)
            for i, data in blocks:
                pipe.set(f"{self._prefix}{user}:{version}:{i}", data, px=self._pending_ms)
            for answer in pipe.execute(raise_on_error=False):   # raised plain: redis-py would quote the bytes
                if isinstance(answer, Exception):
                    raise answer

    def _swap_manifest(self, user: str, old: Manifest | None, new: Manifest | None) -> str:
        keep = self._block_keys(user, new) if new is not None else []
        named = set(keep)
        stale = [k for k in self._block_keys(user, old) if k not in named] if old is not None else []
        args = [old.version if old else "", new.version if new else "", new.encode() if new else b"",
                len(keep), self._stale_ms]
        with self._faults():
            outcome = self._swap(keys=[self._manifest_key(user)] + keep + stale, args=args)
        return outcome.decode() if isinstance(outcome, bytes) else str(outcome)

    def _close_backend(self) -> None:
        self._readers.shutdown(wait=True)
        self._redis.close()
        self._connections.disconnect()
