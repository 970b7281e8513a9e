"""The static ISA reading (turbine_fmha.isa) on hand-written assembly: the
main loop is the backward-branch region with the most MFMA instructions,
the innermost where regions nest."""

from __future__ import annotations

from turbine_fmha.build.isa import main_loop

ASM = """kernel:
\ts_mov_b32 s0, 0
\tv_mfma_f32_16x16x16_f16 v[0:3], v[4:5], v[6:7], v[0:3]
.LBB0_1:
\ts_add_u32 s0, s0, 1
.LBB0_2:
\tglobal_load_dwordx4 v[8:11], v[12:13], off
\tds_read_b128 v[14:17], v18
\tds_read_b64 v[20:21], v18 offset:16
\tv_mfma_f32_16x16x16_f16 v[0:3], v[14:15], v[16:17], v[0:3]
\tv_mfma_f32_16x16x16_f16 v[0:3], v[20:21], v[8:9], v[0:3]
\tv_exp_f32 v22, v22
\tv_max_f32 v23, v23, v22
\tds_write_b64 v18, v[8:9]
\ts_cbranch_scc1 .LBB0_2
\tv_add_f32 v24, v24, v25
\ts_cbranch_scc0 .LBB0_1
\tv_mfma_f32_16x16x16_f16 v[0:3], v[4:5], v[6:7], v[0:3]
\ts_cbranch_vccz .LBB0_3
.LBB0_3:
\ts_endpgm
"""


def test_main_loop_is_the_innermost_region_with_the_most_mfma():
    loop = main_loop(ASM)
    # .LBB0_2 .. s_cbranch_scc1: the outer region has the same 2 MFMA and
    # more instructions; the forward branch to .LBB0_3 closes no loop.
    assert loop == dict(
        instructions=9,
        mfma=2,
        mfma_ops=["v_mfma_f32_16x16x16_f16"],
        valu=2,
        salu=1,
        lds_reads=2,
        lds_writes=1,
        global_loads=1,
    )


def test_no_loop():
    assert main_loop("kernel:\n\tv_mov_b32 v0, 0\n\ts_endpgm\n") is None
