"""A page pool: which pages of a paged KV pool hold what, decided on the host. The engine's
allocator and prefix cache, and under `paged.FreeList` the row tables of the tests.

    pool = PagePool(n_pages=512)
    keys = prefix_keys(prompt_ids, page_size=32)       # one key per full page of the prompt
    hit = pool.match(keys)                             # cached pages of its longest prefix
    pool.acquire(hit)                                  # the request holds them now
    pages = hit + pool.allocate(n_more)                # fresh pages for the rest
    pool.publish(pages[i], keys[i])                    # page i is full: later prompts may hit it
    pool.release(pages)                                # the request is done or preempted

Every page has a reference count: how many running requests hold it. A page nobody holds
is free, and the free pages queue in the order they were released (least recently used
first): `allocate` takes from the front. A free page that holds a published prefix stays
in the cache, and a later prompt with that prefix takes it back out of the queue
(`acquire`), until `allocate` reuses it for other tokens: only then is its key forgotten
(lazy eviction, as vLLM's block pool does).

Prefix keys are chained over full pages, `key_i = sha256(key_{i-1} || tokens of page i)`,
so a key names the whole prefix up to the end of its page, never one page's tokens alone.
Only full pages of committed tokens are published: a page still being written is never
shared. The pool is plain Python state on the host; the device sees only the page table
that the engine builds from it.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from jaxdec.errors import JaxdecError


def prefix_keys(tokens: Sequence[int], page_size: int, parent: bytes = b"") -> list[bytes]:
    """The chained key of every full page of `tokens` (a trailing partial page has none)."""
    ids = np.asarray(tokens, dtype=np.int32)
    keys, key = [], parent
    for start in range(0, len(ids) - page_size + 1, page_size):
        key = hashlib.sha256(key + ids[start:start + page_size].tobytes()).digest()
        keys.append(key)
    return keys


class PagePool:
    """Reference-counted pages with a free queue in LRU order and a prefix cache."""

    def __init__(self, n_pages: int, order: Sequence[int] | None = None):
        """`order`: the order the pages are first handed out in (default 0, 1, ...)."""
        if n_pages < 1:
            raise JaxdecError(f"a page pool needs at least one page, got {n_pages}")
        self.n_pages = int(n_pages)
        self.refs = np.zeros(self.n_pages, np.int32)
        order = range(self.n_pages) if order is None else [int(p) for p in order]
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(order)
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self.evictions = 0  # cached pages reused for other tokens

    @property
    def n_free(self) -> int:
        """Pages nobody holds (cached ones among them)."""
        return len(self._free)

    def free_pages(self) -> list[int]:
        """The pages nobody holds, in the order `allocate` takes them."""
        return list(self._free)

    @property
    def n_used(self) -> int:
        return self.n_pages - len(self._free)

    @property
    def n_cached(self) -> int:
        """Pages holding a published prefix (held or free)."""
        return len(self._key_of)

    def caches(self, page: int) -> bool:
        """Whether `page` holds a published prefix."""
        return page in self._key_of

    def allocate(self, n: int) -> list[int]:
        """n pages nobody holds, least recently released first; the caller holds them."""
        if n > len(self._free):
            raise JaxdecError(f"the page pool has {len(self._free)} free pages, {n} were asked for")
        pages = []
        for _ in range(n):
            page, _ = self._free.popitem(last=False)
            key = self._key_of.pop(page, None)
            if key is not None:
                del self._page_of[key]
                self.evictions += 1
            self.refs[page] = 1
            pages.append(page)
        return pages

    def acquire(self, pages: Iterable[int]) -> None:
        """Hold pages another request holds or the cache keeps (a prefix hit)."""
        for page in pages:
            if self.refs[page] == 0:
                if page not in self._key_of:
                    raise JaxdecError(f"page {page} is free and caches nothing: allocate it instead")
                del self._free[page]
            self.refs[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """Let go of pages. The last holder's release queues a page as free; a request's
        pages are queued last page first, so its tail is reused before its head (the
        head is the prefix most likely to be hit again)."""
        for page in reversed(pages):
            if self.refs[page] <= 0:
                raise JaxdecError(f"page {page} is released more often than it was held")
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self._free[page] = None

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest run of `keys` from the first (not acquired)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def publish(self, page: int, key: bytes) -> None:
        """Page `page` (held) is full and holds the prefix `key`. If another page already
        caches that prefix the first one stays the cached one."""
        if self.refs[page] <= 0:
            raise JaxdecError(f"page {page} is not held: only a held, full page is published")
        if key in self._page_of or page in self._key_of:
            return
        self._page_of[key] = page
        self._key_of[page] = key
