/* Built as strict C99 against the installed package: moejit.h must be a C header (no C++ outside
 * its extern "C" guard). Registers an inline shape, resolves it, asks its weight layout and a
 * workspace size, and checks that a bad argument returns a status with a message. No GPU. */
#include <moejit/moejit.h>
#include <stdio.h>
#include <string.h>

static const char* kShapes =
    "{\"shapes\": [{\"name\": \"consumer-c-moe\", \"num_experts\": 32, \"top_k\": 4,"
    " \"hidden\": 2048, \"intermediate\": 768, \"activation\": {\"kind\": \"swiglu\"}}]}";

static int fail(const char* what, moejit_status status) {
  fprintf(stderr, "c consumer: %s: status %d: %s\n", what, (int)status, moejit_last_error());
  return 1;
}

int main(void) {
  moejit_moe* moe = NULL;
  moejit_moe_weight_layout layout = {.struct_size = sizeof(moejit_moe_weight_layout)};
  moejit_status status;
  size_t workspace = 0;
  const char* why = NULL;

  printf("c consumer: libmoejit %s, weight layout %d\n", moejit_version(),
         moejit_moe_weight_layout_version());
  status = moejit_register_shapes(kShapes, "c-consumer");
  if (status != MOEJIT_OK) return fail("moejit_register_shapes", status);
  status = moejit_moe_create("consumer-c-moe", &moe);
  if (status != MOEJIT_OK) return fail("moejit_moe_create", status);
  status = moejit_moe_get_weight_layout(moe, &layout);
  if (status != MOEJIT_OK) return fail("moejit_moe_get_weight_layout", status);
  /* 32 experts x 2I x H of 4-bit weights. */
  if (layout.w13_bytes != (size_t)32 * 2 * 768 * 2048 / 2) {
    fprintf(stderr, "c consumer: w13_bytes %zu, expected %zu\n", layout.w13_bytes,
            (size_t)32 * 2 * 768 * 2048 / 2);
    return 1;
  }
  status = moejit_moe_workspace_bytes(moe, 64, &workspace);
  if (status != MOEJIT_OK) return fail("moejit_moe_workspace_bytes", status);
  status = moejit_moe_decode_problem(moe, &why);
  if (status != MOEJIT_OK || why == NULL) return fail("moejit_moe_decode_problem", status);

  /* A bad argument: a status and this thread's message naming it, nothing thrown. */
  status = moejit_moe_workspace_bytes(moe, 64, NULL);
  if (status != MOEJIT_ERROR_INVALID_ARGUMENT || strlen(moejit_last_error()) == 0) {
    fprintf(stderr, "c consumer: a null out pointer gave status %d, message \"%s\"\n",
            (int)status, moejit_last_error());
    return 1;
  }
  printf("c consumer: w13 %zu bytes, workspace for T = 64: %zu bytes; a null out: %s\n",
         layout.w13_bytes, workspace, moejit_last_error());
  moejit_moe_destroy(moe);
  return 0;
}
