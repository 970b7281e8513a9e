"""The paged-KV attention kernels as iree-turbine CustomOps.

Each op is derived from its declaration in turbine_fmha.signature: the
CustomOp signature string, `select` (argument kinds and which dims are
static), the example arguments and the MLIR function header. `select` and
`generate` read the variant back from the arguments (`variant_of`), so the
template parameters and the kernel's name come from the Variant itself.
`render_variant` drives the same machinery for ahead-of-time builds and
returns the MLIR module text that `turbine_fmha.build` hands to iree-compile.

The templates live in the repository's top-level mlir/ (one copy): a wheel
ships them as package data, mapped into the package as turbine_fmha/mlir/
(pyproject.toml). `mlir_dir` finds either; TURBINE_FMHA_MLIR_DIR overrides
it.

Imports torch and iree-turbine: build-time only. The runtime does not need
this module.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from iree.compiler.ir import Location
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection
from iree.turbine.runtime.op_reg.base import ALL_CUSTOM_OP_REGS, EagerKernelSelection, FreeFuncKernelBuilder
from iree.turbine.runtime.op_reg.impl_helper import TemplateLoader, call_function

from ..core import env
from . import signature as sig
from .append_kernel import AppendKernel
from .tiles_kernel import TilesKernel
from .variants import FP8_DTYPES, UNBOUNDED, Variant

_TORCH_DTYPE = {
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f32": torch.float32,
    "i8": torch.int8,
    "i32": torch.int32,
    "i64": torch.int64,
}
# The element types a kernel's q and caches may have.
_DTYPE_NAME = {v: k for k, v in _TORCH_DTYPE.items() if k != "i64"}


# A file every template directory holds (mlir_dir tells them by it).
_SKELETON = "pagedkv_fwd_online.mlir.jinja"


def mlir_dir() -> Path:
    """The templates' directory: TURBINE_FMHA_MLIR_DIR, else the package
    data of an installed wheel (turbine_fmha/mlir/), else the source
    checkout's top-level mlir/ (the same files: pyproject.toml maps them
    into the package)."""
    override = env.directory(env.MLIR_DIR)
    if override:
        return override
    package = Path(__file__).resolve().parent.parent
    for d in (package / "mlir", package.parent / "mlir"):
        if (d / _SKELETON).is_file():
            return d
    raise FileNotFoundError(
        f"no kernel templates next to {package} (mlir/ or ../mlir/); ${env.MLIR_DIR} names a directory of them"
    )


class PackageJinjaLoader(TemplateLoader):
    """Loads `<name>.mlir.jinja` from `directory`, by default mlir_dir()
    (the package's templates or the TURBINE_FMHA_MLIR_DIR override)."""

    def __init__(self, directory: Path | None = None):
        from jinja2 import Environment, FileSystemLoader, StrictUndefined

        self.directory = directory or mlir_dir()
        self.env = Environment(
            loader=FileSystemLoader(str(self.directory)), undefined=StrictUndefined, keep_trailing_newline=True
        )

    def render(self, name: str, **kwargs) -> str:
        return self.env.get_template(f"{name}.mlir.jinja").render(**kwargs)

    def load_template(self, kb: KernelBuilder, name: str, **kwargs):
        return self._parse_module_asm(kb, self.render(name, **kwargs))


_TEMPLATES = PackageJinjaLoader()


def _bind(kernel: sig.Kernel, tensors: list, layout: str = sig.layout_key()) -> dict:
    """Symbol -> size from the argument tensors (None where absent), checking
    that every use of a symbol agrees. A size-1 "B|1" / "HQ|1" axis is a
    broadcast one; its symbol then binds to the string "1"."""
    sym: dict = {}
    for arg, t in zip(kernel.args, tensors):
        if t is None:
            continue
        for i, (d, n) in enumerate(zip(arg.dims_for(layout), t.shape)):
            if "|" in str(d):
                sym[d] = "1" if n == 1 else d.split("|")[0]
                d = None if n == 1 else d.split("|")[0]
            if isinstance(d, int):
                torch._check(n == d, lambda: f"{arg.name} dim {i} must be {d}, got {n}")
            elif d is not None:
                torch._check(sym.setdefault(d, n) == n, lambda: f"{arg.name}: {d} is {sym[d]} elsewhere, got {n}")
    return sym


def variant_of(kernel_formulation: str, tensors: list, attrs: dict) -> Variant:
    """The Variant a call of the attention kernel with these arguments
    (FWD.args order; None for absent optional ones) and attributes runs."""
    q = tensors[0]
    torch._check(q.dtype in _DTYPE_NAME, lambda: f"unsupported dtype {q.dtype}")
    # An i8 q is fp8 static quantization: kv_dtype names the format.
    torch._check(q.dtype != torch.int8 or bool(attrs["kv_dtype"]), lambda: "int8 q needs an fp8 format")
    sym = _bind(sig.FWD, tensors, sig.layout_key(attrs["kv_layout"], attrs["v_layout"]))
    names = [a.name for a in sig.FWD.args]
    online = kernel_formulation == "online"
    v = Variant(
        dtype=attrs["kv_dtype"] if q.dtype == torch.int8 else _DTYPE_NAME[q.dtype],
        hdim_q=sym["D"],
        hdim_v=sym["DV"],
        page_block_size=0 if attrs["runtime_page"] else sym["PG"],
        nhead_q=0 if attrs["runtime_heads"] else sym["HQ"],
        nhead_k=0 if attrs["runtime_heads"] else sym["HK"],
        group=attrs["group"],
        mask=attrs["mask"],
        bias="alibi"
        if tensors[names.index("alibi_slopes")] is not None
        else ("elementwise" if tensors[names.index("bias")] is not None else "none"),
        bias_shape="".join((c if sym[s] != "1" else "1") for s, c in (("B|1", "b"), ("HQ|1", "h")) if s in sym),
        softcap=bool(attrs["softcap"]),
        sinks=tensors[names.index("sinks")] is not None,
        kv_layout=attrs["kv_layout"],
        v_layout=attrs["v_layout"],
        kv_dtype="" if q.dtype == torch.int8 else attrs["kv_dtype"],
        formulation=kernel_formulation,
        v_guard=bool(attrs["v_guard"]),
        batch_tile=sym["B"] if online else 0,
        seqlen_q_tile=sym["S"] if online else 0,
        group_rows=attrs["group_rows"],
        # -1: any count (signature.fwd_attrs).
        merge_splits=max(0, attrs["merge_splits"]),
        merge_any=attrs["merge_splits"] < 0,
    )
    if v.merge_any:
        torch._check(
            sym["B"] % sym["BO"] == 0 and sym["B"] // sym["BO"] >= 2,
            lambda: (
                f"q has {sym['BO']} sequences; the block table's {sym['B']} entries must be a multiple (2 or more) of it"
            ),
        )
    else:
        torch._check(
            sym["B"] == sym["BO"] * max(1, v.merge_splits),
            lambda: (
                f"q has {sym['BO']} sequences; the block table must have {max(1, v.merge_splits)} "
                f"entries per sequence, got {sym['B']}"
            ),
        )
    for arg, t in zip(sig.FWD.args, tensors):
        want = _TORCH_DTYPE[sig.fwd_types(v).dtypes[arg.dtype]]
        torch._check(t is None or t.dtype == want, lambda: f"{arg.name} must be {want}, got {t.dtype}")
    return v


def _static_dims(t: sig.Tensor, sym: dict, layout: str) -> list[int]:
    return [i for i, n in enumerate(sig.shape_of(t, sym, layout)) if n != "?"]


def _ksel_values(kernel: sig.Kernel, ksel: KernelSelection) -> tuple[list, dict]:
    n = len(kernel.args)
    tensors = [ksel.arg_descs[i].maybe_tensor_value for i in range(n)]
    attrs = {a.name: ksel.arg_descs[n + i].v for i, a in enumerate(kernel.attrs)}
    return tensors, attrs


def _select(kernel: sig.Kernel, ksel: KernelSelection, types: sig.Types) -> None:
    """Declares `kernel`'s arguments and results to `ksel`, with the dims
    that `types` (the variant's symbols, "?" for dynamic) fixes static."""
    descs = [ksel.arg_descs[i] for i in range(len(kernel.args))]
    for t, desc in zip(kernel.args, descs):
        if desc.maybe_tensor_value is not None:
            desc.specialize_dims(*_static_dims(t, types.sym, types.layout))
    tensors = [d.maybe_tensor_value for d in descs]
    bound = _bind(kernel, tensors, types.layout)
    for r in kernel.results:
        shape = [bound[d] if isinstance(d, str) else d for d in r.dims]
        out = ksel.return_new_tensor(shape, _TORCH_DTYPE[types.dtypes[r.dtype]])
        out.specialize_dims(*_static_dims(r, types.sym, types.layout))


def _declare_args(kernel: sig.Kernel, ksel: KernelSelection) -> None:
    for i, a in enumerate(kernel.args):
        (ksel.arg_optional_tensor if a.optional else ksel.arg_tensor)(i)
    for i, a in enumerate(kernel.attrs):
        getattr(ksel, f"attr_{a.kind}")(len(kernel.args) + i)


def _generate(kb: KernelBuilder, template: str, func_name: str, n_args: int, **params) -> None:
    func = _TEMPLATES.inline_template_function(kb, template, func_name, func_name=func_name, **params)
    # Absent optional tensors are not kernel arguments, and the builder
    # numbers only the arguments that are present.
    kb.yield_results(*call_function(func, *(kb.arg_value(i) for i in range(n_args))))


class _PagedKVFwd(CustomOp):
    formulation: str = ""

    def select(self, ksel: KernelSelection):
        _declare_args(sig.FWD, ksel)
        v = variant_of(self.formulation, *_ksel_values(sig.FWD, ksel))
        _select(sig.FWD, ksel, sig.fwd_types(v))

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        tensors, attrs = _ksel_values(sig.FWD, ksel)
        v = variant_of(self.formulation, tensors, attrs)
        _generate(
            kb,
            f"pagedkv_fwd_{v.formulation}",
            f"{v.name}_impl",
            sum(t is not None for t in tensors),
            **template_params(v),
        )


def template_params(v: Variant) -> dict:
    """What the forward templates specialize on, for variant `v`: the
    shapes, types and layouts, the score terms (TERMS, each a file
    mlir/terms/<term>.mlir.jinja whose hooks the skeletons call) and
    `operands`, which generates the operand lists and block arguments of
    the elementwise generics from the signature's declarations
    (signature.operands). The few structural decisions of the online
    skeleton are taken here, from the variant and its operands."""
    types = sig.fwd_types(v)
    args = [a for a in sig.FWD.args if sig.present(v, a)]
    heads = head_params(v)
    # The terms' tensors read per score: the online kernels' mask carries
    # them (an additive f32 mask, else the i1 visibility), and one with a
    # query-head axis makes them loop over query heads (one mask per head).
    terms_read = [
        o for o in sig.operands(types, args, "scores", B="b", HQ="h", S="m", N="n") if o.name in sig.OPTIONAL_ARGS
    ]
    bt, mq, gp = v.batch_tile, v.seqlen_q_tile, v.padded_group
    return dict(
        # Without merged splits, q's sequences are the entries.
        sig=sig.mlir_header(sig.FWD, args, types, same={} if v.merge_splits or v.merge_any else {"BO": "B"}),
        **heads,
        dt=types.dtypes["Q"],
        KDT=types.dtypes["KV"],
        D=v.hdim_q,
        DV=v.hdim_v,
        # The page size in types ("?": any) and as a value (common.page_size).
        PAGE="?" if v.runtime_page else v.page_block_size,
        PAGEV="%c_page" if v.runtime_page else v.page_block_size,
        HND=v.kv_layout == "HND",
        VCOL=v.v_layout == "col",
        KV_DT=FP8_DTYPES.get(sig.fwd_attrs(v)["kv_dtype"], ""),
        V_GUARD=v.v_guard,
        mask=v.mask,
        UNBOUNDED=UNBOUNDED,
        TERMS=sig.score_terms(v),
        operands=functools.partial(sig.operands, types, args),
        operand=sig.Operand,
        # The probabilities' type at the PV product (explicit): f16 under
        # static quantization, whose fp8 values it holds exactly.
        PDT="f16" if v.static_quant else types.dtypes["Q"],
        # Online: batch tile, query rows, the split-KV merge (BO query
        # sequences of MERGE splits each), the group padded to GP query
        # heads per KV head (PAD; dynamic for any group) and the per-head loop.
        BT=bt,
        MQ=mq,
        GP=gp,
        MERGE="?" if v.merge_any else v.merge_splits,
        MERGE_ANY=v.merge_any,
        BO="?" if v.merge_any else (bt // v.merge_splits if v.merge_splits else bt),
        BOV="%bo" if v.merge_any else (bt // v.merge_splits if v.merge_splits else bt),
        PAD=heads["G"] == "?" or gp > heads["G"],
        PER_HEAD=any(o.heads for o in terms_read),
        MASK_ET="f32" if terms_read else "i1",
    )


def head_params(v: Variant) -> dict:
    """The head counts and GQA group as the templates write them: HQ, HK, G
    in types (a size, or "?" where run-time), and HQV, HKV, GV as values
    (the size, or the SSA value that the templates' head_counts() defines
    from the arguments' shapes)."""
    if not v.runtime_heads:
        hq, hk, g = v.nhead_q, v.nhead_k, v.group_size
        return dict(HQ=hq, HK=hk, G=g, HQV=hq, HKV=hk, GV=g)
    return dict(HQ="?", HK="?", G=v.group or "?", HQV="%nhq", HKV="%nhk", GV=v.group or "%ng")


class PagedKVFwdExplicit(_PagedKVFwd):
    """QK^T contraction, masked softmax pieces and PV contraction (CPU)."""

    formulation = "explicit"
    signature = sig.custom_op_signature(sig.FWD, "turbine_fmha_pagedkv_fwd_explicit")


class PagedKVFwdOnline(_PagedKVFwd):
    """Fused gather + iree_linalg_ext.online_attention (GPU; runs on CPU too)."""

    formulation = "online"
    signature = sig.custom_op_signature(sig.FWD, "turbine_fmha_pagedkv_fwd_online")


def _dtype_name(t: torch.Tensor) -> str:
    torch._check(t.dtype in _DTYPE_NAME, lambda: f"unsupported dtype {t.dtype}")
    return _DTYPE_NAME[t.dtype]


def _check_dtypes(kernel: sig.Kernel, tensors: list, types: sig.Types) -> None:
    """Every tensor of a call of `kernel` has its declared dtype."""
    for arg, t in zip(kernel.args, tensors):
        want = _TORCH_DTYPE[types.dtypes[arg.dtype]]
        torch._check(t.dtype == want, lambda: f"{arg.name} must be {want}, got {t.dtype}")


def _append_of(kernel: sig.Kernel, tensors: list, attrs: dict) -> AppendKernel:
    """The AppendKernel a call of `kernel` (APPEND or APPEND_ROTARY) with
    these arguments runs; every tensor must have its declared dtype."""
    sym = _bind(kernel, tensors)
    dt = _dtype_name(tensors[3])
    a = AppendKernel(dt, sym["HK"], sym["D"], sym["DV"], sym["PG"], attrs.get("rotary", "none"))
    _check_dtypes(kernel, tensors, sig.append_types(a))
    return a


class _PagedKVAppendOp(CustomOp):
    kernel: sig.Kernel

    def select(self, ksel: KernelSelection):
        _declare_args(self.kernel, ksel)
        a = _append_of(self.kernel, *_ksel_values(self.kernel, ksel))
        _select(self.kernel, ksel, sig.append_types(a))

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        a = _append_of(self.kernel, *_ksel_values(self.kernel, ksel))
        types = sig.append_types(a)
        _generate(
            kb,
            "pagedkv_append",
            f"{a.name}_impl",
            len(self.kernel.args),
            sig=sig.mlir_header(self.kernel, list(self.kernel.args), types),
            dt=a.dtype,
            ROTARY="" if a.rotary == "none" else a.rotary,
        )


class PagedKVAppend(_PagedKVAppendOp):
    """Scatters new tokens' K/V into their pages, returning the updated
    caches."""

    kernel = sig.APPEND
    signature = sig.custom_op_signature(sig.APPEND, "turbine_fmha_pagedkv_append")


class PagedKVAppendRotary(_PagedKVAppendOp):
    """The append that rotates the new K rows first, and returns q rotated
    too (ck_tile appendkv with RoPE)."""

    kernel = sig.APPEND_ROTARY
    signature = sig.custom_op_signature(sig.APPEND_ROTARY, "turbine_fmha_pagedkv_append_rotary")


def _tiles_of(kernel: sig.Kernel, tensors: list, classes: int) -> TilesKernel:
    """The TilesKernel a call of `kernel` (tiles_declaration(classes)) with
    these arguments runs; every tensor must have its declared dtype."""
    sym = _bind(kernel, tensors)
    k = TilesKernel(_dtype_name(tensors[0]), sym["HQ"], sym["HK"], sym["D"], sym["PG"], sym["TR"], classes)
    _check_dtypes(kernel, tensors, sig.tiles_types(k))
    return k


class _PrefillTilesOp(CustomOp):
    """The contiguous-tile prefill of one class count (tiles_op)."""

    kernel: sig.Kernel
    classes: int

    def select(self, ksel: KernelSelection):
        _declare_args(self.kernel, ksel)
        k = _tiles_of(self.kernel, _ksel_values(self.kernel, ksel)[0], self.classes)
        _select(self.kernel, ksel, sig.tiles_types(k))

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        k = _tiles_of(self.kernel, _ksel_values(self.kernel, ksel)[0], self.classes)
        types = sig.tiles_types(k)
        _generate(
            kb,
            "prefill_tiles",
            f"{k.name}_impl",
            len(self.kernel.args),
            sig=sig.mlir_header(self.kernel, list(self.kernel.args), types),
            dt=k.dtype,
            HQ=k.nhead_q,
            HK=k.nhead_k,
            G=k.group,
            D=k.hdim,
            PG=k.page_block_size,
            T=k.tile,
            NC=k.classes,
        )


_TILES_OPS: dict = {}


def tiles_op(classes: int) -> type:
    """The CustomOp class of the tile prefill with `classes` chunk classes
    (one per count: the count sets the argument list)."""
    cls = _TILES_OPS.get(classes)
    if cls is None:
        kernel = sig.tiles_declaration(classes)
        cls = _TILES_OPS[classes] = type(
            f"PrefillTiles{classes}",
            (_PrefillTilesOp,),
            {
                "kernel": kernel,
                "classes": classes,
                "signature": sig.custom_op_signature(kernel, f"turbine_fmha_prefill_tiles_c{classes}"),
            },
        )
    return cls


class _Guard(CustomOp):
    """An exported program's run-time size checks (signature.GUARD_PAGED,
    GUARD_WRITE), lowered into the program before the call they guard."""

    kernel: sig.Kernel

    def _types(self, tensors: list) -> sig.Types:
        # The first tensor's dtype is the queries' (GUARD_PAGED) or the
        # tokens' (GUARD_WRITE); the caches' follows the declaration.
        names = {v: k for k, v in _TORCH_DTYPE.items()}
        by_rule = {}
        for arg, t in zip(self.kernel.args, tensors):
            torch._check(t.dtype in names, lambda: f"{arg.name}: unsupported dtype {t.dtype}")
            by_rule.setdefault(arg.dtype, names[t.dtype])
        return sig.guard_types(by_rule.get("Q", by_rule["KV"]), by_rule["KV"])

    def select(self, ksel: KernelSelection):
        _declare_args(self.kernel, ksel)
        tensors, _ = _ksel_values(self.kernel, ksel)
        _select(self.kernel, ksel, self._types(tensors))

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        tensors, attrs = _ksel_values(self.kernel, ksel)
        types = self._types(tensors)
        name = "_".join(["turbine_fmha", self.kernel.name, types.dtypes["Q"], types.dtypes["KV"]])
        name += "".join(f"_{k}{v}" for k, v in attrs.items())
        _generate(
            kb,
            self.kernel.name,
            name,
            len(self.kernel.args),
            sig=sig.mlir_header(self.kernel, list(self.kernel.args), types),
            PAGE_AXIS=attrs.get("page_axis", 0),
        )


class GuardPaged(_Guard):
    kernel = sig.GUARD_PAGED
    signature = sig.custom_op_signature(sig.GUARD_PAGED, "turbine_fmha_guard_paged")


class GuardWrite(_Guard):
    kernel = sig.GUARD_WRITE
    signature = sig.custom_op_signature(sig.GUARD_WRITE, "turbine_fmha_guard_write")


def _registered(cls) -> CustomOp:
    fq = f"turbine.{cls.signature.split('(')[0]}"
    if fq not in ALL_CUSTOM_OP_REGS:
        CustomOp.register(cls)
    return ALL_CUSTOM_OP_REGS[fq]


def torch_op(cls):
    """The torch op of CustomOp class `cls` (registered on first use): what
    traced code calls, since dynamo does not trace CustomOp instances.
    Exported (iree.turbine.aot.export), the op is lowered into the program
    through the class's select and generate."""
    _registered(cls)
    return getattr(torch.ops.turbine, cls.signature.split("(")[0])


def torch_dtype_name(dtype: torch.dtype) -> str | None:
    """The kernels' name of a torch dtype ("f16", ...), None if none."""
    return _DTYPE_NAME.get(dtype)


def _meta(t: sig.Tensor, types: sig.Types) -> torch.Tensor:
    """A meta tensor of `t`'s declared shape; dynamic dims get size 2, so a
    size-1 axis always means a broadcast axis."""
    sym = {k: (2 if n == "?" else n) for k, n in types.sym.items()}
    shape = sig.shape_of(t, sym, types.layout)
    return torch.empty(*shape, dtype=_TORCH_DTYPE[types.dtypes[t.dtype]], device="meta")


def example_args(v: Variant) -> list:
    """Meta tensors (None for absent optional ones) and attribute values
    shaped like a call of `v`, in the op's argument order."""
    types = sig.fwd_types(v)
    tensors = [_meta(a, types) if sig.present(v, a) else None for a in sig.FWD.args]
    return tensors + list(sig.fwd_attrs(v).values())


def _module(op: CustomOp, args: list, name: str, finish=None) -> str:
    ksel = EagerKernelSelection(op, args)
    op.select(ksel)
    kb = FreeFuncKernelBuilder.create_module(ksel, func_name=name)
    with kb.ip, Location.unknown():
        op.generate(ksel, kb)
        if finish:
            finish(kb)
    kb.module_op.verify()
    return kb.module_op.get_asm()


def _caches_are_outputs(kernel: sig.Kernel):
    """A `_module` finish that marks the two cache arguments of `kernel` as
    its first two outputs too (iree.abi.output): IREE writes the results
    into the caller's cache buffers."""

    def finish(kb: KernelBuilder) -> None:
        from iree.compiler.ir import ArrayAttr, DictAttr, IndexType, IntegerAttr

        func = next(o for o in kb.module_op.body.operations if o.operation.name == "func.func")
        names = [a.name for a in kernel.args]
        attrs = [DictAttr.get({}) for _ in names]
        for result, arg in enumerate(("k_cache", "v_cache")):
            attrs[names.index(arg)] = DictAttr.get({"iree.abi.output": IntegerAttr.get(IndexType.get(), result)})
        func.operation.attributes["arg_attrs"] = ArrayAttr.get(attrs)

    return finish


def render_append(a: AppendKernel) -> str:
    """MLIR module text for `a`, with public entry point `a.name` whose two
    cache arguments are also its outputs."""
    kernel, types = sig.append_kernel(a), sig.append_types(a)
    op = _registered(PagedKVAppend if kernel is sig.APPEND else PagedKVAppendRotary)
    args = [_meta(t, types) for t in kernel.args] + list(sig.append_attrs(a).values())
    return _module(op, args, a.name, _caches_are_outputs(kernel))


def render_tiles(k: TilesKernel) -> str:
    """MLIR module text for `k`, with public entry point `k.name`."""
    kernel, types = sig.tiles_declaration(k.classes), sig.tiles_types(k)
    return _module(_registered(tiles_op(k.classes)), [_meta(t, types) for t in kernel.args], k.name)


def render_variant(v: Variant | AppendKernel | TilesKernel) -> str:
    """MLIR module text for `v`, with public entry point `v.name`."""
    if isinstance(v, AppendKernel):
        return render_append(v)
    if isinstance(v, TilesKernel):
        return render_tiles(v)
    cls = PagedKVFwdOnline if v.formulation == "online" else PagedKVFwdExplicit
    return _module(_registered(cls), example_args(v), v.name)
