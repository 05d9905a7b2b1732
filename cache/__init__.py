"""Visual-token cache: content keys and a byte-bounded LRU."""

from cache.keys import content_key, library_versions, salted
from cache.lru import CachedEmbedding, CacheStats, EmbeddingCache, owning

__all__ = ["CacheStats", "CachedEmbedding", "EmbeddingCache", "content_key", "library_versions", "owning", "salted"]
