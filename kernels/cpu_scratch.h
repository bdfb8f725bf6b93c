/* A per-thread scratch buffer that grows as needed and is never shrunk, shared by the CPU
 * kernels (each keeps its own: `static __thread struct scratch name;`). */
#ifndef DUPLEX_CPU_SCRATCH_H
#define DUPLEX_CPU_SCRATCH_H
#include <stddef.h>
#include <stdlib.h>

struct scratch {
    void *data;
    size_t bytes;
};

/* at least `bytes` of s's memory (its old contents are not kept), NULL when out of memory */
static inline void *scratch_grow(struct scratch *s, size_t bytes) {
    if (bytes > s->bytes) {
        free(s->data);
        s->data = malloc(bytes);
        s->bytes = s->data ? bytes : 0;
    }
    return s->data;
}
#endif
