/* Snapshot copy with its checksums fused: copy a buffer into a holder slot and xxh3-64 every segment of what
 * landed, each piece hashed right after it was copied, while it is still in the core's cache.
 *
 * Why: copying a segment and hashing it afterwards reads the segment from DRAM twice (once to copy, once to
 * hash). From DRAM the hash is memory-bound and costs a large part of a copy again; hashed piece by piece from
 * the cache, xxh3 (AVX2) runs several times faster than from DRAM and adds no DRAM traffic. A piece is small
 * enough to stay in a core's L2 (256 KiB): memcpy writes it with ordinary stores there (glibc switches to
 * non-temporal stores only for copies far larger).
 *
 * The xxh3 implementation is not compiled in: the caller passes the streaming API (create/reset/update/
 * digest/free) of the library it verified (libxxhash's runtime-dispatched AVX2/AVX-512 build, or
 * python-xxhash's extension), so the digests are that library's, equal to the manifest's xxh3 by
 * construction, and this file needs no xxhash header. Loaded through ctypes (kernels/copy_hash.py), which releases
 * the GIL for the length of a call: one call per segment batch, not per piece.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define SHARDSAFE_CPU_ABI_VERSION 1

typedef void *(*xxh3_create_fn)(void);
typedef int (*xxh3_free_fn)(void *state);
typedef int (*xxh3_reset_fn)(void *state);
typedef int (*xxh3_update_fn)(void *state, const void *input, size_t len);
typedef uint64_t (*xxh3_digest_fn)(const void *state);

/* The XXH3 streaming API of one library (XXH3_createState, XXH3_freeState, XXH3_64bits_reset,
 * XXH3_64bits_update[_dispatch], XXH3_64bits_digest): a state made by one library is only passed to the
 * same library's functions. */
typedef struct {
    xxh3_create_fn create;
    xxh3_free_fn free;
    xxh3_reset_fn reset;
    xxh3_update_fn update;
    xxh3_digest_fn digest;
} shardsafe_xxh3_api;

int shardsafe_cpu_abi_version(void) { return SHARDSAFE_CPU_ABI_VERSION; }

/* Copy n bytes from src to dst; out[k] = xxh3-64 of dst[k*seg, min((k+1)*seg, n)) for every segment k.
 * piece (> 0) bytes are copied, then hashed, at a time. Returns 0; -1 when an argument is unusable or the
 * library could not allocate a hash state (nothing is copied then); -2 when the library reports an error
 * (dst holds the copy, out is incomplete). The buffers must not overlap. */
int shardsafe_copy_hash(void *dst, const void *src, size_t n, size_t seg, size_t piece,
                        const shardsafe_xxh3_api *api, uint64_t *out) {
    if (api == NULL || seg == 0 || piece == 0 || (n > 0 && (dst == NULL || src == NULL || out == NULL)))
        return -1;
    if (n == 0)
        return 0;
    void *state = api->create();
    if (state == NULL)
        return -1;
    unsigned char *d = (unsigned char *)dst;
    const unsigned char *s = (const unsigned char *)src;
    int rc = 0;
    size_t k = 0;
    for (size_t a = 0; a < n && rc == 0; a += seg, k++) {
        size_t end = a + seg < n ? a + seg : n;
        if (api->reset(state) != 0) {
            rc = -2;
            break;
        }
        for (size_t p = a; p < end; p += piece) {
            size_t len = p + piece < end ? piece : end - p;
            memcpy(d + p, s + p, len);
            if (api->update(state, d + p, len) != 0) {
                rc = -2;
                break;
            }
        }
        if (rc == 0)
            out[k] = api->digest(state);
    }
    api->free(state);
    return rc;
}
