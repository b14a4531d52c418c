"""The Hopper MXFP8 GEMM in CuTe DSL (sm_90a): ``out = a @ weight`` for a few
rows, the weight streamed by TMA, both operands upcast exactly to BF16 for
wgmma with FP32 accumulation. Triton twin: ``gemm/mxfp8_gemm_kernel.py`` (the
same contract; the path the CPU suite runs and the fallback elsewhere).

**Swap-AB.** The weight [N, K] is wgmma's A operand (its M side: 64 weight
rows per warpgroup, ``warpgroups`` of them per CTA), the activation rows are
its B operand (its N side: ``tokens`` = 8..64 rows per CTA), so a few tokens
never pad a 64-row MMA. The accumulator is ``out^T`` [weight rows, tokens].

**Schedule.** One TMA ring of ``stages`` K-tiles of 128: each stage holds the
weight's e4m3 [rows, 128] tile, its 512-byte swizzled scale block (the 128x4
layout keeps a 128-row x 4-group block contiguous: one box), the activation's
e4m3 [tokens, 128] tile and its scale block, all on one transaction barrier.
Per K-tile the consumer warpgroups (1) upcast the activation tile into one of
two BF16 tiles in the wgmma B layout (``x * 2^(s-127)``, exact), (2) load
their weight fragment (the register A operand of ``wgmma ... RS``) from the
e4m3 tile and upcast it likewise in registers, (3) run its 8 wgmma k16 steps.
Two register fragments and two BF16 activation tiles alternate, so the upcast
of tile k overlaps the MMAs of tile k-1; a stage is released as soon as its
bytes are upcast (no MMA reads the ring itself), and warp 0 refills it.

**Split-K across a cluster.** With ``split_k`` S > 1 the S CTAs of a cluster
(grid y) take consecutive K-slices of one output block. Each writes its FP32
accumulator to its shared memory; after a cluster barrier CTA j reduces the
j-th of S slices of the block, reading every CTA's partial through
distributed shared memory in rank order 0..S-1 (fixed: the bits do not depend
on timing), and writes it. A second cluster barrier keeps each CTA's shared
memory alive until every peer has read it. No atomics, no workspace.

**Numerics.** e4m3 times a power-of-two scale is a BF16 number (4 significant
bits; scale bytes 10..246 keep it normal), so the BF16 operands are exact, the
products are exact in the FP32 accumulation, and the only roundings are the FP32
sums, in an order fixed by (N, K, the tactic's split and tile of 128): the
row count and the batch-mates never change a row's bits (the tokens are the
MMA's N side: an output element is its own chain over K).

**PDL.** Before ``griddepcontrol.wait`` the kernel issues only the weight and
weight-scale loads of the first ``stages`` K-tiles (no kernel in flight
writes weights); the activation loads, every store and the split-K exchange
come after it. It launches its dependents after the wait, so a dependent
kernel must read ``out`` only after its own grid wait (which returns once
this grid has completed).

**Layout contract** (``launcher.py`` checks it; the kernel assumes it): weight
e4m3 [N, K] K-contiguous and its 1-D 128x4-swizzled scales over (N, K/32);
activation e4m3 [M, G*K] contiguous and its swizzled scales over
(M, G*K/32); out BF16 [M, N] contiguous; K % 128 == 0, (K / 128) % split_k ==
0, (N / groups) % (64 * warpgroups) == 0; 16-byte aligned pointers; M >= 1.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from decode_boundary.mxfp8.format import GROUP

from .tactics import K_TILE, SCALE_BLOCK


class Mxfp8WgmmaGemm:
    """One compiled variant: (N, K, groups) and the tactic's (warpgroups,
    tokens, split_k, stages) are compile-time; M is a run-time size."""

    def __init__(self, n: int, k: int, groups: int, warpgroups: int, tokens: int,
                 split_k: int, stages: int, use_pdl: bool):
        self.n, self.k, self.groups = n, k, groups
        self.warpgroups, self.tokens, self.split_k = warpgroups, tokens, split_k
        self.stages, self.use_pdl = stages, use_pdl
        self.rows = 64 * warpgroups  # weight rows per CTA
        self.threads = 128 * warpgroups
        self.k_tiles = k // K_TILE // split_k  # K-tiles per CTA
        self.w_k_tiles = k // K_TILE  # 4-group scale tiles along one group's K
        self.a_k_tiles = groups * k // K_TILE  # along the activation's G*K

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, w: cute.Tensor, w_scale: cute.Tensor, a: cute.Tensor,
                 a_scale: cute.Tensor, out: cute.Tensor, stream):
        """``w`` e4m3 [N, K]; ``w_scale`` uint8 [N/128 * K/128 * 2, 256] (the
        swizzled buffer, two 256-byte rows per 512-byte block); ``a`` e4m3
        [M, G*K]; ``a_scale`` uint8 [ceil(M/128) * G*K/128 * 2, 256]; ``out``
        BF16 [M, N] (M, a run-time size, read off ``a``)."""
        m = a.shape[0]
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K, cutlass.Float32, (self.warpgroups, 1, 1),
            tiler_mn=(64, self.tokens), a_source=warpgroup.OperandSource.RMEM)
        tile_mnk = (self.rows, self.tokens, K_TILE)
        k_major = utils.LayoutEnum.ROW_MAJOR  # K-contiguous A and B
        w_smem = sm90_utils.make_smem_layout_a(k_major, tile_mnk, cutlass.Float8E4M3FN,
                                               self.stages)
        a_smem = sm90_utils.make_smem_layout_b(k_major, tile_mnk, cutlass.Float8E4M3FN,
                                               self.stages)
        b_smem = sm90_utils.make_smem_layout_b(k_major, tile_mnk, cutlass.BFloat16, 2)
        s_smem = cute.make_layout((2, 256, self.stages), stride=(256, 1, SCALE_BLOCK))
        tma_w, g_w = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), w, cute.slice_(w_smem, (None, None, 0)),
            (self.rows, K_TILE))
        tma_a, g_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), a, cute.slice_(a_smem, (None, None, 0)),
            (self.tokens, K_TILE))
        s_one = cute.slice_(s_smem, (None, None, 0))
        tma_ws, g_ws = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), w_scale, s_one, (2, 256))
        tma_as, g_as = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), a_scale, s_one, (2, 256))
        reduce_floats = self.rows * self.tokens if self.split_k > 1 else 1

        @cute.struct
        class Storage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sw: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN,
                                                       cute.cosize(w_smem)], 1024]
            sa: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN,
                                                       cute.cosize(a_smem)], 1024]
            sb: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16,
                                                       cute.cosize(b_smem)], 1024]
            sws: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8,
                                                        SCALE_BLOCK * self.stages], 128]
            sas: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8,
                                                        SCALE_BLOCK * self.stages], 128]
            red: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, reduce_floats], 128]

        self.storage = Storage
        m_tiles = (m + self.tokens - 1) // self.tokens
        self.kernel(self.tiled_mma, tma_w, g_w, tma_ws, g_ws, tma_a, g_a, tma_as, g_as, out,
                    m, w_smem, a_smem, b_smem, s_smem).launch(
            grid=(self.n // self.rows, self.split_k, m_tiles),
            block=(self.threads, 1, 1), cluster=(1, self.split_k, 1), stream=stream,
            use_pdl=self.use_pdl)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_w: cute.CopyAtom, g_w: cute.Tensor,
               tma_ws: cute.CopyAtom, g_ws: cute.Tensor, tma_a: cute.CopyAtom,
               g_a: cute.Tensor, tma_as: cute.CopyAtom, g_as: cute.Tensor,
               out: cute.Tensor, m: cutlass.Int32, w_smem: cute.ComposedLayout,
               a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
               s_smem: cute.Layout):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        block_n, split, block_m = cute.arch.block_idx()
        if warp == 0:
            cpasync.prefetch_descriptor(tma_w)
            cpasync.prefetch_descriptor(tma_a)

        n0 = block_n * self.rows  # first weight row (output column) of this CTA
        group = n0 // (self.n // self.groups)
        kt0 = split * self.k_tiles  # first K-tile of this CTA's slice
        row_tile = n0 // 128  # 128-row scale tile of the weight rows
        m0 = block_m * self.tokens

        smem = utils.SmemAllocator()
        st = smem.allocate(self.storage)
        stage_bytes = (self.rows + self.tokens) * K_TILE + 2 * SCALE_BLOCK
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.barriers.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.threads // 32),
            tx_count=stage_bytes, defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, self.split_k), is_relaxed=True)

        sw = st.sw.get_tensor(w_smem.outer, swizzle=w_smem.inner)
        sa = st.sa.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sb = st.sb.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sws = st.sws.get_tensor(s_smem)
        sas = st.sas.get_tensor(s_smem)
        flat = cute.make_layout((SCALE_BLOCK, self.stages), stride=(1, SCALE_BLOCK))
        sws_flat = cute.make_tensor(sws.iterator, flat)  # byte offset, stage
        sas_flat = cute.make_tensor(sas.iterator, flat)

        # TMA partitions: (tile bytes, K-tile index) of each operand.
        gw = cute.local_tile(g_w, (self.rows, K_TILE), (block_n, None))
        ga = cute.local_tile(g_a, (self.tokens, K_TILE), (block_m, None))
        gws = cute.local_tile(g_ws, (2, 256), (None, 0))
        gas = cute.local_tile(g_as, (2, 256), (None, 0))
        one = cute.make_layout(1)
        tws, tgw = cpasync.tma_partition(tma_w, 0, one, cute.group_modes(sw, 0, 2),
                                         cute.group_modes(gw, 0, 2))
        tas, tga = cpasync.tma_partition(tma_a, 0, one, cute.group_modes(sa, 0, 2),
                                         cute.group_modes(ga, 0, 2))
        twss, tgws = cpasync.tma_partition(tma_ws, 0, one, cute.group_modes(sws, 0, 2),
                                           cute.group_modes(gws, 0, 2))
        tass, tgas = cpasync.tma_partition(tma_as, 0, one, cute.group_modes(sas, 0, 2),
                                           cute.group_modes(gas, 0, 2))

        loads = (tma_w, tgw, tws, tma_ws, tgws, twss, tma_a, tga, tas, tma_as, tgas, tass)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, self.split_k))
        prefetch = min(self.stages, self.k_tiles)
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                self.stages)
        if warp == 0:
            # Weights first, before the grid wait: no kernel in flight writes them.
            for i in cutlass.range_constexpr(prefetch):
                ring.producer_acquire(producer)
                self.load_weight(ring, producer, kt0 + i, row_tile, loads)
                producer.advance()
        if cutlass.const_expr(self.use_pdl):
            cute.arch.griddepcontrol_wait()
        a_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.stages)
        a_kt0 = group * self.w_k_tiles + kt0  # the activation's K-tile of kt0
        a_row_tile = m0 // 128
        if warp == 0:
            for i in cutlass.range_constexpr(prefetch):
                self.load_activation(ring, a_state, a_kt0 + i, a_row_tile, loads)
                a_state.advance()
        if cutlass.const_expr(self.use_pdl):
            cute.arch.griddepcontrol_launch_dependents()

        # MMA partitions: this thread's weight fragment (registers), the BF16
        # activation tiles, the accumulator out^T [rows, tokens].
        thr_mma = tiled_mma.get_slice(tidx)
        frag_w = [tiled_mma.make_fragment_A(thr_mma.partition_shape_A((self.rows, K_TILE)))
                  for _ in range(2)]
        tcsw = thr_mma.partition_A(sw)  # e4m3 view with the fragment's layout
        tccw = thr_mma.partition_A(cute.make_identity_tensor((self.rows, K_TILE)))
        frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(sb))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.rows, self.tokens)),
                                    cutlass.Float32)
        acc.fill(0.0)
        # Every wgmma adds to the accumulator (the atom's default overwrites it).
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)

        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.stages)
        operands = (tiled_mma, tcsw, tccw, frag_b, sa, sas_flat, sws_flat, sb, loads)
        where = (kt0, a_kt0, row_tile, a_row_tile, warp, tidx, m0, n0)
        # Pairs of K-tiles alternate the two register fragments and BF16 tiles
        # (static indices), then an odd tail.
        for _pair in cutlass.range(self.k_tiles // 2, unroll=1):
            consumer, producer = self.k_tile(ring, consumer, producer, 0, frag_w[0], acc,
                                             operands, where)
            consumer, producer = self.k_tile(ring, consumer, producer, 1, frag_w[1], acc,
                                             operands, where)
        if cutlass.const_expr(self.k_tiles % 2 == 1):
            consumer, producer = self.k_tile(ring, consumer, producer, 0, frag_w[0], acc,
                                             operands, where)
        warpgroup.wait_group(0)

        self.epilogue(acc, thr_mma, st, out, m, n0, m0, tidx)

    @cute.jit
    def k_tile(self, ring, consumer, producer, half: cutlass.Constexpr, frag, acc, operands,
               where):
        """One K-tile (module docstring's schedule); returns the ring states.

        Ordering: barrier 1 before the upcast: every thread has passed its
        ``wait_group(1)`` of the previous tile, so the MMAs that read BF16 tile
        ``half`` (two tiles back, in every warpgroup) have completed. Barrier 2
        after it (and the proxy fence): the BF16 tile is complete and visible to
        wgmma. The stage is released right after: its e4m3 bytes are in
        registers and the BF16 tile, and no MMA reads the stage itself. A
        register fragment is rewritten two tiles after the MMAs that read it,
        past this thread's ``wait_group(1)``."""
        tiled_mma, tcsw, tccw, frag_b, sa, sas, sws, sb, loads = operands
        kt0, a_kt0, row_tile, a_row_tile, warp, tidx, m0, n0 = where
        ring.consumer_wait(consumer)
        stage = consumer.index
        cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
        self.upcast_activation(sa, sas, sb, stage, half, tidx, m0)
        # Weight fragment: e4m3 from the stage's tile, times its group's scale, as BF16.
        src = tcsw[(None, None, None, stage)]
        raw = cute.make_fragment_like(src, cutlass.Float8E4M3FN)
        cute.autovec_copy(src, raw)
        scaled = cute.make_fragment_like(frag, cutlass.Float32)
        scaled.store(raw.load().to(cutlass.Float32))
        for i in cutlass.range_constexpr(cute.size(scaled)):
            r, c = tccw[i]
            scaled[i] = scaled[i] * _exp2(sws[_block_offset(n0 + r, c // GROUP), stage])
        frag.store(scaled.load().to(cutlass.BFloat16))
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=2, number_of_threads=self.threads)
        ring.consumer_release(consumer)
        consumer.advance()
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(frag, mode=[2])):
            cute.gemm(tiled_mma, acc, frag[(None, None, kb)],
                      frag_b[(None, None, kb, half)], acc)
        warpgroup.commit_group()
        if warp == 0 and producer.count < self.k_tiles:
            ring.producer_acquire(producer)
            self.load_weight(ring, producer, kt0 + producer.count, row_tile, loads)
            self.load_activation(ring, producer, a_kt0 + producer.count, a_row_tile, loads)
            producer.advance()
        warpgroup.wait_group(1)
        return consumer, producer

    @cute.jit
    def load_weight(self, ring, state, kt, row_tile, loads):
        """TMA of K-tile ``kt``'s weight tile and its scale block into ``state``'s
        stage (issued before the grid wait too: no kernel in flight writes them)."""
        tma_w, tgw, tws, tma_ws, tgws, twss = loads[:6]
        bar = ring.producer_get_barrier(state)
        cute.copy(tma_w, tgw[(None, kt)], tws[(None, state.index)], tma_bar_ptr=bar)
        cute.copy(tma_ws, tgws[(None, row_tile * self.w_k_tiles + kt)],
                  twss[(None, state.index)], tma_bar_ptr=bar)

    @cute.jit
    def load_activation(self, ring, state, a_kt, a_row_tile, loads):
        """TMA of the activation's K-tile ``a_kt`` and its scale block into
        ``state``'s stage, on the barrier its weight tile's bytes also count on."""
        tma_a, tga, tas, tma_as, tgas, tass = loads[6:]
        bar = ring.producer_get_barrier(state)
        cute.copy(tma_a, tga[(None, a_kt)], tas[(None, state.index)], tma_bar_ptr=bar)
        cute.copy(tma_as, tgas[(None, a_row_tile * self.a_k_tiles + a_kt)],
                  tass[(None, state.index)], tma_bar_ptr=bar)

    @cute.jit
    def upcast_activation(self, sa, sas, sb, stage, half, tidx, m0):
        """BF16 tile ``half`` = the stage's e4m3 activation tile times its scales:
        8 consecutive K per thread and step (one scale each)."""
        chunks = self.tokens * K_TILE // 8
        for step in cutlass.range_constexpr((chunks + self.threads - 1) // self.threads):
            c = tidx + step * self.threads
            if c < chunks:
                t = c // (K_TILE // 8)
                k = (c % (K_TILE // 8)) * 8
                s = _exp2(sas[_block_offset(m0 + t, k // GROUP), stage])
                for j in cutlass.range_constexpr(8):
                    x = sa[(t, k + j, stage)].to(cutlass.Float32) * s
                    sb[(t, k + j, half)] = x.to(cutlass.BFloat16)

    @cute.jit
    def epilogue(self, acc, thr_mma, st, out, m, n0, m0, tidx):
        """out[m0 + t, n0 + r] = bf16(acc), after the split-K exchange."""
        coords = thr_mma.partition_C(cute.make_identity_tensor((self.rows, self.tokens)))
        size = cute.size(acc)
        if cutlass.const_expr(self.split_k == 1):
            for i in cutlass.range_constexpr(size):
                r, t = coords[i]
                if m0 + t < m:
                    out[m0 + t, n0 + r] = acc[i].to(cutlass.BFloat16)
        else:
            red = st.red.get_tensor(cute.make_layout((size, self.threads),
                                                     stride=(self.threads, 1)))
            for i in cutlass.range_constexpr(size):
                red[i, tidx] = acc[i]
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            rank = cute.arch.block_idx_in_cluster()
            share = size // self.split_k
            for j in cutlass.range_constexpr(share):
                i = rank * share + j
                total = cutlass.Float32(0.0)
                where = red.iterator + (i * self.threads + tidx)
                for peer in cutlass.range_constexpr(self.split_k):
                    total = total + _load_peer_f32(where, peer)
                r, t = coords[i]
                if m0 + t < m:
                    out[m0 + t, n0 + r] = total.to(cutlass.BFloat16)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()


@cute.jit
def _block_offset(row, group):
    """Byte of (``row``, 32-group ``group`` of the tile) in a 512-byte block of the
    128x4-swizzled scales: ``mxfp8.format.swizzled_scale_offset`` within one block."""
    r = row % 128
    return (r % 32) * 16 + r // 32 * 4 + group


@cute.jit
def _exp2(byte) -> cutlass.Float32:
    """2^(byte - 127) as FP32, by its bits (byte 0 reads 0, as the twin's)."""
    bits = cute.make_rmem_tensor(cute.make_layout(1), cutlass.Int32)
    bits[0] = (cutlass.Int32(byte) & 0xFF) << 23  # the byte is unsigned: no sign extension
    return cute.recast_tensor(bits, cutlass.Float32)[0]


@dsl_user_op
def _load_peer_f32(ptr: cute.Pointer, peer, *, loc=None, ip=None) -> cutlass.Float32:
    """The FP32 at this CTA's shared-memory address ``ptr`` in cluster CTA
    ``peer`` (``mapa`` + ``ld.shared::cluster``; ordered by the cluster barrier
    before it, hence the side effect: it must not move above that barrier)."""
    addr = cutlass.Int32(ptr.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip)
    value = llvm.inline_asm(
        T.f32(), [addr, cutlass.Int32(peer).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 ra;\n\tmapa.shared::cluster.u32 ra, $1, $2;\n\t"
        "ld.shared::cluster.f32 $0, [ra];\n\t}",
        "=f,r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return cutlass.Float32(value)
