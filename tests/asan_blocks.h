/* What the AddressSanitizer harnesses (the tests/..._asan.c files) feed the block kernels: `count` blocks of
 * `bytes` random bytes each, with small fp16 scales where a type keeps them (values do not matter
 * there, only which bytes are read). */
#include <stdint.h>
#include <stdlib.h>

static uint8_t *blocks(int64_t count, int64_t bytes) {
    uint8_t *p = malloc((size_t)(count * bytes));
    for (int64_t i = 0; i < count * bytes; i++) p[i] = (uint8_t)rand();
    for (int64_t b = 0; b < count; b++) { /* 0x2000: an fp16 of 2^-7 wherever a type keeps its scales */
        p[b * bytes] = 0, p[b * bytes + 1] = 0x20, p[b * bytes + 2] = 0, p[b * bytes + 3] = 0x20;
        p[b * bytes + bytes - 2] = 0, p[b * bytes + bytes - 1] = 0x20;
    }
    return p;
}
