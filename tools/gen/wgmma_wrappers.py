# Prints the mma_m64nNk16 wrappers of kernels/moe/wgmma.cuh (their operand lists are too long
# to type): python3 tools/gen/wgmma_wrappers.py
def gen(n):
    regs = n // 2
    a = ", ".join(f"%{regs + i}" for i in range(4))
    L = []
    L.append(f"__device__ __forceinline__ void mma_m64n{n}k16(float (&d)[{regs}], const u32 (&a)[4],")
    L.append("                                                 u64 desc_b) {")
    L.append("  asm volatile(")
    L.append(f'      "{{ .reg .pred p; setp.ne.b32 p, %{regs + 5}, 0; "')
    L.append(f'      "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 "')
    parts = [", ".join(f"%{i}" for i in range(j, min(j + 12, regs))) for j in range(0, regs, 12)]
    L.append('      "{"')
    for k, p in enumerate(parts):
        sep = ", " if k + 1 < len(parts) else ""
        L.append(f'      "{p}{sep}"')
    L.append(f'      "}}, {{{a}}}, %{regs + 4}, p, 1, 1, 0; }}"')
    outs = [f'"+f"(d[{i}])' for i in range(regs)]
    rows = [", ".join(outs[j:j + 6]) for j in range(0, regs, 6)]
    L.append("      : " + rows[0] + ("," if len(rows) > 1 else ""))
    for k, r in enumerate(rows[1:]):
        L.append("        " + r + ("," if k + 2 < len(rows) else ""))
    L.append('      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));')
    L.append("}")
    return "\n".join(L)
for n in (16, 32, 48, 64, 96, 128, 192, 256):
    print(gen(n)); print()
