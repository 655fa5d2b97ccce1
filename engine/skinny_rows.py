"""How many rows a linear layer runs on the skinny kernel before oneDNN takes it (a pure policy over the host's
facts, chosen once per dtype at load: ``engine.linear_prepack.skinny_max_rows``).

Each limit is where the two met in decode steps of ``small`` (context 512), switching the limit every few steps in
one process:

- fp32 on AVX-512 with the kernel's software prefetch (Intel): 128 rows. On a 2-core Xeon (Sapphire Rapids class),
  a limit of 128 against 64 took 0.96-0.97 / 0.96-0.98 / 0.96-0.99 of the time at batch 80 / 96 / 128 (two runs);
  256 gained under 1.2% at batch 160 and 256, so it stays 128.
- bf16 on a CPU with AMX, with the kernel's own AMX pass (its AVX-512 build): 64 rows. Both multiply on the matrix
  unit then; on a 2-core Xeon with AMX (L3 480 MiB), three alternating rounds of steps against the limit of 16
  below: limits of 64 / 96 / 128 took 0.88 / 0.88 / 0.85 of the time at batch 32, 0.97 / 0.98 / 0.98 at 48,
  0.97 / 0.98 / 0.98 at 64, 0.99 / 1.01 / 1.00 at 96, 0.99 / 0.99 / 1.04 at 128.
- bf16 on a CPU with AMX, the kernel without it (an AVX2 build there): 16 rows. There oneDNN multiplies bf16 on
  the matrix unit while the skinny kernel widens to fp32 on the vector units: on the same Xeon a limit of 16
  against 64 took 0.98 / 0.93 / 0.89 / 0.87 of the time at batch 24 / 32 / 48 / 64 (8 rows: the same as 16 at
  batch 16), and 128 took 1.27-1.28x as long at batch 96-128.
  Again on such a Xeon (AMX, L3 480 MiB), four alternating rounds of steps against a limit of 16: a limit of 8 took
  1.15x as long at batch 12 and 0.98-1.01 at 16-32; limits of 24 and 32 took 1.07 and 1.08x as long at batch 24,
  and 32 took 1.19x at batch 32. (Intel CPUs widen bf16 rather than take the kernel's dot-product pass,
  ``engine/kernels/cpu_features.h``; with that pass pinned, oneDNN's AMX GEMM was faster from 12 rows on.)
- fp32 on AVX2 on an AMD Zen 2 (family 17h, model 30h and later): 4096 rows, the default step budget. On a
  2-core EPYC (family 23 model 49, L3 16 MiB) the kernel ran the `small` model's QKV, O, gate/up, down and LM-head
  shapes at 1.0-1.3x oneDNN's speed at every row count tried, 64 to 4096 (at 128 rows 115-174 against 85-145
  GFLOP/s; at 4096, with its rows taken in chunks of 256, 140-177 against 129-163). In one process, switching
  engines step by step: a limit of 128 against 64 took 0.87 / 0.90 / 0.92 of the time of decode steps at batch
  80 / 96 / 128 (context 256); 1024 against 64 took 0.80 / 0.85 / 0.88 of the time of prefill steps of ~1000
  mixed tokens / one 1024-token prompt / one 256-token prompt; 4096 against 1024 took 0.82 of the time of steps
  of ~4000 mixed tokens (the offline workload's) and the same below 1024. (On a Zen 3 the kernel ran 0.77-1.28x
  oneDNN at 128 rows: the rule below holds there.)
- Where oneDNN has no GEMM of the dtype at all (bf16 on a CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT): every
  row count (``ALL_ROWS``), there being nothing to hand over to; ``F.linear``'s bf16 GEMM ran at 5-8 GFLOP/s on
  the Zen 2 above, the kernel's at 121-141 from 256 to 1024 rows.
- Everything else: 64 rows (measured on AVX-512 without AMX, and on AVX2: ``engine.linear_prepack``). bf16 on a
  2-core Zen 4 EPYC (AVX512_BF16, no AMX) with the kernel's dot-product pass: its four linears of a `small` layer
  took 0.76 / 0.90 / 0.96 / 1.02 / 1.06 of oneDNN's time at 16 / 32 / 48 / 64 / 96 rows, and decode steps with a
  limit of 128 against 64 took 1.04-1.10x as long at batch 80-128 (two alternating runs), so 64 holds there too.
"""

from __future__ import annotations

DEFAULT_ROWS = 64
AMX_BF16_ROWS = 16
PREFETCHED_FP32_ROWS = 128
ZEN2_FP32_ROWS = 4096
# Where oneDNN cannot multiply the dtype at all (bf16 on an AVX2-only CPU) there is nothing to hand over to.
ALL_ROWS = 2**31 - 1


def skinny_row_limit(
    weight_dtype: str,
    isa: str,
    fp32_prefetch: bool,
    amx: bool,
    skinny_amx: bool = False,
    amd_zen2: bool = False,
    onednn: bool = True,
) -> int:
    """The most rows a linear of ``weight_dtype`` ("float32", "bfloat16", ...) runs on the skinny kernel, on a CPU
    whose vector ISA torch reports as ``isa`` ("AVX512", "AVX2", ...), where the kernel prefetches fp32 weights in
    software or not, with AMX tiles for oneDNN or not, and for the kernel's own bf16 pass or not (``skinny_amx``:
    an AVX-512 build of the kernel; an AVX2 build on the same CPU has none), on an AMD Zen 2 or not, where oneDNN
    multiplies ``weight_dtype`` or not."""
    if not onednn:
        return ALL_ROWS
    if weight_dtype == "bfloat16" and amx and not skinny_amx:
        return AMX_BF16_ROWS
    if weight_dtype == "float32" and isa == "AVX2" and amd_zen2:
        return ZEN2_FP32_ROWS
    if weight_dtype == "float32" and isa == "AVX512" and fp32_prefetch:
        return PREFETCHED_FP32_ROWS
    return DEFAULT_ROWS
