"""The paged-KV attention kernels as iree-turbine CustomOps.

Each formulation is a `CustomOp` whose `select` declares the arguments and
which of their dims are static, and whose `generate` renders the matching
Jinja template from the repo's `mlir/` directory into the kernel module.
`render_variant` drives the same machinery for ahead-of-time builds: it makes
a `KernelSelection` from meta tensors shaped like the variant and returns
the MLIR module text that `turbine_fmha.build` hands to iree-compile.
`PagedKVAppend` / `render_append` do the same for the in-place append
kernel of device-resident page pools.

Imports torch and iree-turbine: build-time only. The runtime does not need
this module.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from iree.compiler.ir import Location
from iree.turbine.runtime.op_reg import (
    CustomOp,
    KernelBuilder,
    KernelSelection,
)
from iree.turbine.runtime.op_reg.base import (
    ALL_CUSTOM_OP_REGS,
    EagerKernelSelection,
    FreeFuncKernelBuilder,
)
from iree.turbine.runtime.op_reg.impl_helper import TemplateLoader, call_function

from .variants import FP8_DTYPES, UNBOUNDED, AppendKernel, Variant, bias_shape_of


def mlir_dir() -> Path:
    env = os.environ.get("TURBINE_FMHA_MLIR_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "mlir"


class RepoJinjaLoader(TemplateLoader):
    """Loads `<name>.mlir.jinja` from the repo's top-level mlir/ directory."""

    def __init__(self, directory: Path | None = None):
        from jinja2 import Environment, FileSystemLoader, StrictUndefined

        self.directory = directory or mlir_dir()
        self.env = Environment(
            loader=FileSystemLoader(str(self.directory)),
            undefined=StrictUndefined,
            keep_trailing_newline=True,
        )

    def render(self, name: str, **kwargs) -> str:
        return self.env.get_template(f"{name}.mlir.jinja").render(**kwargs)

    def load_template(self, kb: KernelBuilder, name: str, **kwargs):
        return self._parse_module_asm(kb, self.render(name, **kwargs))


_TEMPLATES = RepoJinjaLoader()

_TORCH_DTYPE = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
# fp8 tensors travel as int8 (the templates decode and encode the bytes).
_DTYPE_NAME = {v: k for k, v in _TORCH_DTYPE.items()} | {torch.int8: "i8"}

# The argument list shared by both formulations (see the templates):
#   seqlen_q, seqlen_k, kv_shift: [batch] int32 (kv_shift: gappy KV, key t
#     of sequence b is gathered row kv_shift[b] + t)
#   fparams = [scale, logits_soft_cap, out_mult, scale_p]    (f32; see the
#     templates' prologue)
#   iparams = [q_start, window_left, window_right, sink_size] (i32)
#   alibi_slopes [batch, nhead_q] f32, bias [b|1, h|1, rows, keys] f32 and
#   sinks [nhead_q] f32 are present only in variants that use them.
_SIGNATURE_ARGS = (
    "Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
    "Tensor seqlen_q, Tensor seqlen_k, Tensor kv_shift, Tensor fparams, Tensor iparams, "
    "Tensor? alibi_slopes, Tensor? bias, Tensor? sinks, str mask, int softcap, str v_layout, str kv_dtype, "
    "int v_guard"
)
# Results: out [b, rows, hq, dv], then [b, hq, rows] f32 each: LSE, the row
# max score and the row sum of exp(score - max) (the split-KV merge's
# weights; see the templates' split_stats).
_RESULTS = "(Tensor, Tensor, Tensor, Tensor)"
_N_FIXED = 9  # tensors every variant takes
_OPTIONAL = (9, 10, 11)  # alibi_slopes, bias, sinks


class _PagedKVFwd(CustomOp):
    template: str = ""
    # Extra static dims beyond heads/head dims/page size (online: batch, rows).
    static_rows: bool = False

    def select(self, ksel: KernelSelection):
        q, kc, vc, bt, sq_t, sk_t, ks_t, fparams, iparams = (ksel.arg_tensor(i) for i in range(_N_FIXED))
        alibi, bias, sinks = (ksel.arg_optional_tensor(i) for i in _OPTIONAL)
        ksel.attr_str(12)
        ksel.attr_int(13)
        ksel.attr_str(14)
        ksel.attr_str(15)
        ksel.attr_int(16)
        torch._check(q.t.dtype in _DTYPE_NAME, lambda: f"unsupported dtype {q.t.dtype}")
        # fp8 travels as int8; attr 15 names the format (of K/V, and of Q and
        # the output when q is int8: static quantization).
        torch._check(q.t.dtype != torch.int8 or bool(ksel.arg_descs[15].v), lambda: "int8 q needs an fp8 format")
        kv_t = torch.int8 if ksel.arg_descs[15].v else q.t.dtype
        torch._check(kc.t.dtype == kv_t and vc.t.dtype == kv_t, lambda: "dtype mismatch")
        torch._check(q.t.shape[3] == kc.t.shape[3], lambda: "hdim_q mismatch")
        torch._check(q.t.shape[2] % kc.t.shape[2] == 0, lambda: "nhead_q % nhead_k != 0")
        q.specialize_dims(2, 3)
        kc.specialize_dims(1, 2, 3)
        vc.specialize_dims(1, 2, 3)
        fparams.specialize_all_dims()
        iparams.specialize_all_dims()
        if alibi is not None:
            alibi.specialize_dims(1)
        if bias is not None:
            # The head axis is static (1 or nhead_q); a size-1 batch axis is
            # a static broadcast, a full one follows q's dynamic batch.
            bias.specialize_dims(1)
            if bias.t.shape[0] == 1:
                bias.specialize_dims(0)
        if sinks is not None:
            sinks.specialize_all_dims()
        b, sq, hq, _ = q.t.shape
        dv = vc.t.shape[2] if ksel.arg_descs[14].v == "col" else vc.t.shape[3]
        out = ksel.return_new_tensor([b, sq, hq, dv], q.t.dtype)
        stats = [ksel.return_new_tensor([b, hq, sq], torch.float32) for _ in range(3)]
        if self.static_rows:
            q.specialize_dims(0, 1)
            bt.specialize_dims(0)
            for per_batch in (sq_t, sk_t, ks_t):
                per_batch.specialize_all_dims()
            if alibi is not None:
                alibi.specialize_all_dims()
            if bias is not None:
                bias.specialize_dims(0, 1, 2)
            out.specialize_all_dims()
            for r in stats:
                r.specialize_all_dims()
        else:
            out.specialize_dims(2, 3)
            for r in stats:
                r.specialize_dims(1)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        q, kc, vc = (ksel.arg_descs[i].t for i in range(3))
        alibi, bias, sinks = (ksel.arg_descs[i].maybe_tensor_value for i in _OPTIONAL)
        p = dict(
            dt=_DTYPE_NAME[q.dtype],
            HQ=q.shape[2],
            HK=kc.shape[2],
            D=q.shape[3],
            DV=vc.shape[2] if ksel.arg_descs[14].v == "col" else vc.shape[3],
            VCOL=ksel.arg_descs[14].v == "col",
            KV_DT=FP8_DTYPES.get(ksel.arg_descs[15].v, ""),
            QF8=q.dtype == torch.int8,
            V_GUARD=bool(ksel.arg_descs[16].v),
            PAGE=kc.shape[1],
            mask=ksel.arg_descs[12].v,
            SOFTCAP=bool(ksel.arg_descs[13].v),
            ALIBI=alibi is not None,
            BIAS_SHAPE=bias_shape_of(bias),
            SINKS=sinks is not None,
            BT=q.shape[0],
            MQ=q.shape[1],
            UNBOUNDED=UNBOUNDED,
        )
        func_name = (
            f"{self.template}_{p['dt']}_d{p['D']}x{p['DV']}_h{p['HQ']}x{p['HK']}"
            f"_pg{p['PAGE']}_{p['mask']}"
            + ("_alibi" if p["ALIBI"] else "")
            + (f"_bias{p['BIAS_SHAPE']}" if p["BIAS_SHAPE"] else "")
            + ("_softcap" if p["SOFTCAP"] else "")
            + ("_sink" if p["SINKS"] else "")
            + ("_vcol" if p["VCOL"] else "")
            + (f"_{'sq' if p['QF8'] else 'kv'}{ksel.arg_descs[15].v}" if p["KV_DT"] else "")
        )
        if self.static_rows:
            func_name += f"_b{p['BT']}_q{p['MQ']}"
        if not p["V_GUARD"]:
            func_name += "_nvguard"
        func = _TEMPLATES.inline_template_function(
            kb, self.template, func_name, func_name=func_name, **p
        )
        # Absent optional tensors are not kernel arguments, and the builder
        # numbers only the arguments that are present.
        n_optional = sum(t is not None for t in (alibi, bias, sinks))
        args = [kb.arg_value(i) for i in range(_N_FIXED + n_optional)]
        kb.yield_results(*call_function(func, *args))


class PagedKVFwdExplicit(_PagedKVFwd):
    """QK^T contraction, masked softmax pieces and PV contraction (CPU)."""

    template = "pagedkv_fwd_explicit"
    signature = f"turbine_fmha_pagedkv_fwd_explicit({_SIGNATURE_ARGS}) -> {_RESULTS}"


class PagedKVFwdOnline(_PagedKVFwd):
    """Fused gather + iree_linalg_ext.online_attention (GPU; runs on CPU too)."""

    template = "pagedkv_fwd_online"
    signature = f"turbine_fmha_pagedkv_fwd_online({_SIGNATURE_ARGS}) -> {_RESULTS}"
    static_rows = True


class PagedKVAppend(CustomOp):
    """Scatters new tokens' K/V into their pages, returning the updated
    caches."""

    signature = (
        "turbine_fmha_pagedkv_append(Tensor k_new, Tensor v_new, Tensor slots, "
        "Tensor k_cache, Tensor v_cache) -> (Tensor, Tensor)"
    )

    def select(self, ksel: KernelSelection):
        kn, vn, slots, kc, vc = (ksel.arg_tensor(i) for i in range(5))
        torch._check(kc.t.dtype in _DTYPE_NAME, lambda: f"unsupported dtype {kc.t.dtype}")
        torch._check(kn.t.dtype == kc.t.dtype and vn.t.dtype == vc.t.dtype == kc.t.dtype, lambda: "dtype mismatch")
        kn.specialize_dims(1, 2)
        vn.specialize_dims(1, 2)
        slots.specialize_dims(1)
        kc.specialize_dims(1, 2, 3)
        vc.specialize_dims(1, 2, 3)
        ksel.return_new_tensor(list(kc.t.shape), kc.t.dtype).specialize_dims(1, 2, 3)
        ksel.return_new_tensor(list(vc.t.shape), vc.t.dtype).specialize_dims(1, 2, 3)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        kc, vc = ksel.arg_descs[3].t, ksel.arg_descs[4].t
        p = dict(dt=_DTYPE_NAME[kc.dtype], HK=kc.shape[2], D=kc.shape[3], DV=vc.shape[3], PAGE=kc.shape[1])
        func_name = f"pagedkv_append_impl_{p['dt']}_h{p['HK']}_d{p['D']}x{p['DV']}_pg{p['PAGE']}"
        func = _TEMPLATES.inline_template_function(kb, "pagedkv_append", func_name, func_name=func_name, **p)
        kb.yield_results(*call_function(func, *(kb.arg_value(i) for i in range(5))))


def render_append(a: AppendKernel) -> str:
    """MLIR module text for `a`, with public entry point `a.name` whose two
    cache arguments are also its outputs (iree.abi.output): IREE writes the
    results into the caller's cache buffers instead of new ones."""
    from iree.compiler.ir import ArrayAttr, DictAttr, IntegerAttr, IndexType

    if "turbine.turbine_fmha_pagedkv_append" not in ALL_CUSTOM_OP_REGS:
        CustomOp.register(PagedKVAppend)
    op = ALL_CUSTOM_OP_REGS["turbine.turbine_fmha_pagedkv_append"]
    dt = torch.int8 if a.dtype == "i8" else _TORCH_DTYPE[a.dtype]

    def t(*shape, dtype=dt):
        return torch.empty(*shape, dtype=dtype, device="meta")

    idx = torch.int32
    args = [t(2, a.nhead_k, a.hdim), t(2, a.nhead_k, a.hdim_v), t(2, 2, dtype=idx),
            t(3, a.page_block_size, a.nhead_k, a.hdim), t(3, a.page_block_size, a.nhead_k, a.hdim_v)]
    ksel = EagerKernelSelection(op, args)
    op.select(ksel)
    kb = FreeFuncKernelBuilder.create_module(ksel, func_name=a.name)
    with kb.ip, Location.unknown():
        op.generate(ksel, kb)
        func = next(o for o in kb.module_op.body.operations if o.operation.name == "func.func")
        attrs = [DictAttr.get({}) for _ in range(5)]
        for arg, result in ((3, 0), (4, 1)):
            attrs[arg] = DictAttr.get({"iree.abi.output": IntegerAttr.get(IndexType.get(), result)})
        func.operation.attributes["arg_attrs"] = ArrayAttr.get(attrs)
    kb.module_op.verify()
    return kb.module_op.get_asm()


_OPS: dict[str, _PagedKVFwd] = {}


def _op(formulation: str) -> _PagedKVFwd:
    if not _OPS:
        for cls, key in ((PagedKVFwdExplicit, "explicit"), (PagedKVFwdOnline, "online")):
            CustomOp.register(cls)
            fq = f"turbine.{cls.signature.split('(')[0]}"
            _OPS[key] = ALL_CUSTOM_OP_REGS[fq]
    return _OPS[formulation]


def example_args(v: Variant) -> list:
    """Meta tensors shaped like a call of `v` (dynamic dims get size 2, so a
    size-1 axis always means a broadcast axis)."""
    dt = torch.int8 if v.static_quant else _TORCH_DTYPE[v.dtype]
    kvt = torch.int8 if v.kv_dtype else dt
    b = v.batch_tile or 2
    sq = v.seqlen_q_tile or 2
    f32 = torch.float32

    def t(*shape, dtype=f32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    bias = None
    if v.bias == "elementwise":
        bb = b if v.bias_shape[0] == "b" else 1
        bh = v.nhead_q if v.bias_shape[1] == "h" else 1
        bias = t(bb, bh, sq, 2)
    return [
        t(b, sq, v.nhead_q, v.hdim_q, dtype=dt),
        t(2, v.page_block_size, v.nhead_k, v.hdim_q, dtype=kvt),
        t(2, v.nhead_k, v.hdim_v, v.page_block_size, dtype=kvt)
        if v.v_layout == "col"
        else t(2, v.page_block_size, v.nhead_k, v.hdim_v, dtype=kvt),
        t(b, 2, dtype=torch.int32),
        t(b, dtype=torch.int32),
        t(b, dtype=torch.int32),
        t(b, dtype=torch.int32),
        t(4),
        t(4, dtype=torch.int32),
        t(b, v.nhead_q) if v.bias == "alibi" else None,
        bias,
        t(v.nhead_q) if v.sinks else None,
        v.mask,
        int(v.softcap),
        v.v_layout,
        v.dtype if v.static_quant else v.kv_dtype,
        int(v.v_guard),
    ]


def render_variant(v: Variant | AppendKernel) -> str:
    """MLIR module text for `v`, with public entry point `v.name`."""
    if isinstance(v, AppendKernel):
        return render_append(v)
    op = _op(v.formulation)
    ksel = EagerKernelSelection(op, example_args(v))
    op.select(ksel)
    kb = FreeFuncKernelBuilder.create_module(ksel, func_name=v.name)
    with kb.ip, Location.unknown():
        op.generate(ksel, kb)
    kb.module_op.verify()
    return kb.module_op.get_asm()
