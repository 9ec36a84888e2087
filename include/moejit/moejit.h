/* libmoejit C ABI: for engines that bind from Python or C. Every call returns a moejit_status;
 * on failure moejit_last_error() gives this thread's message. No call throws. */
#ifndef MOEJIT_MOEJIT_H_
#define MOEJIT_MOEJIT_H_

#include <dlpack/dlpack.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum moejit_status {
  MOEJIT_OK = 0,
  MOEJIT_ERROR_INVALID_DESCRIPTOR = 1,
  MOEJIT_ERROR_INVALID_ARGUMENT = 2,
  MOEJIT_ERROR_UNSUPPORTED = 3,
  MOEJIT_ERROR_COMPILE_FAILED = 4,
  MOEJIT_ERROR_CACHE_CORRUPT = 5,
  MOEJIT_ERROR_CACHE = 6,
  MOEJIT_ERROR_DRIVER = 7,
  MOEJIT_ERROR_CAPTURE_MISS = 8,
  MOEJIT_ERROR_IO = 9,
  MOEJIT_ERROR_INTERNAL = 10,
} moejit_status;

typedef enum moejit_shared_gate {
  MOEJIT_SHARED_SIGMOID = 0,
  MOEJIT_SHARED_CONSTANT = 1,
  MOEJIT_SHARED_GIVEN = 2,
} moejit_shared_gate;

/* This thread's last error message ("" after a success). Valid until the thread's next call. */
const char* moejit_last_error(void);

/* Register a shape file; names are then usable by name. */
moejit_status moejit_register_shapes_file(const char* path);

/* See moejit::append_shared in moejit/ops.hpp. stream is a CUstream / cudaStream_t. */
moejit_status moejit_append_shared(const DLTensor* topk_ids, const DLTensor* topk_weights,
                                   const DLTensor* shared_logits, DLTensor* out_ids,
                                   DLTensor* out_weights, int64_t shared_base, float scale,
                                   moejit_shared_gate gate, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* MOEJIT_MOEJIT_H_ */
