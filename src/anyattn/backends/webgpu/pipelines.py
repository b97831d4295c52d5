"""WGSL assembly and the compute-pipeline cache.

Kernels live in ``shaders/*.wgsl`` with a few preprocessor lines of our own:

* ``//@include NAME``   -> the text of ``shaders/NAME.wgsl``
* ``//@define X [val]`` / ``//@undef X`` / ``//@if X`` (``//@ifn X``: if not defined)
  ... ``//@endif X``; ``$X$`` -> val.  ``HALF`` is defined for the f16-math kernels
  (constant ``HALF`` = 1: workgroup tiles ``SV`` = vec4<f16>, packed f16 products).
* ``//@for n COUNT`` ... ``//@end n``  -> the block COUNT times (a number or a
  constant name), ``{n}`` -> ``0u, 1u, ..`` and ``{n#}`` -> ``0, 1, ..``.  Unrolled
  blocks give register indices and are no loops for llvmpipe's trip limit.
* ``//@loaders`` -> loaders ``lds_q/k/v/g`` of 4 consecutive elements as one ``SV``
  (bounds-checked over D; vec4<f32>, or vec4<f16> in HALF mode, read as one vec4<f16>
  when aligned) and ``ld4_out``/``st4_out`` for the f32 output buffer.
* ``SOFTCAP`` / ``ALIBI`` / ``SINKS`` (constants = 1) are defined for kernels with
  those score modifiers, ``DROPOUT`` for kernels that apply anyattn's dropout mask;
  without them the kernels are the plain ones, text for text.
* ``STAGE`` (kernel variant): ``sq[i]``, ``sk[i]``, ``sg[i]``, ``sv[i]`` become
  ``stg[SOFF_X + i]``, regions of one workgroup array (an update's staged rows may run
  across the idle tiles that follow its first one).  ``ALIAS`` (variant wide): ``su[i]``
  (an update's staged rows), ``st[i]`` / ``sp[i]`` (the backward's P^T, dS^T / dS) become
  ``stg[SOFF_U/T/P + i]`` too, over the S/dP staging tiles idle by then.  ``PREFETCH`` /
  ``SUBGROUPS``: the other variant defines (launch.VARIANTS).
* ``VDIM`` (constant = 1 where v's head dim differs from q's and k's): the uniform
  ``U.DV`` is v's head dim (the struct names it only here, uniforms.DEFINE_FIELDS);
  ``$VD$`` is the value head dim (``U.DV``; ``U.D`` without VDIM), ``$VOUT$`` names the
  output helpers of a value-dim result (``ld4_vout`` / ``st4_vout``, bounded by ``U.DV``;
  ``ld4_out`` / ``st4_out`` without VDIM); ``lds_v`` / ``lds_g`` are bounded by ``U.DV``.
  Without VDIM the kernels are the plain ones, text for text.
* ``PAGED`` (the forward over a paged key/value cache): key rows through the block
  table (``pg_row``), per-sequence key counts (``$SKB$``: ``skb``; ``U.SK`` without
  PAGED) and bands.  Without PAGED the kernels are the plain ones, text for text.
  ``PGSTART`` (with PAGED): key j of a sequence is its position start + j (``pg_row``
  reads the start from the word before the sequence's table row); without it the
  PAGED kernels are as they were, text for text.
* ``//@# text``: a comment of the source that the assembled kernel does not carry.
* ``TRIP`` -> ``trips += 1u;`` in debug builds (the per-invocation loop count,
  written by ``DEBUG_TRIPS`` to dsb) and nothing otherwise.

The cache key is the final source text (constants and element type included)
plus the bind-group layout name, so one specialization compiles once per device.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Dict, Mapping

from .uniforms import wgsl_struct

__all__ = ["build_source", "PipelineCache", "KernelError", "LAYOUTS", "MOD_DEFINES", "EW_DEFINES",
           "VARIANT_DEFINES", "DELTA_DEFINES", "OUTB_DEFINES", "DSQ_DEFINES", "VDIM_DEFINES",
           "PROG_DEFINES", "PAGED_DEFINES", "DCAP_DEFINES"]

#: constants that, when 1, also become ``//@define`` names (score modifiers)
MOD_DEFINES = ("SOFTCAP", "ALIBI", "SINKS", "DROPOUT")
#: the same for the kernel variants (launch.VARIANTS): PREFETCH, STAGE, SUBGROUPS
VARIANT_DEFINES = ("PREFETCH", "STAGE", "SUBGROUPS", "ALIAS")
#: STAGE: the staged tiles sq/sk/sg/sv are regions of one workgroup array ``stg``
_STAGED_TILE = re.compile(r"\bs([qkgv])\[")
#: ALIAS (variant wide): also su (the updates' staged rows), st / sp (P^T, dS^T / dS)
_ALIASED_TILE = re.compile(r"\bs([qkgvupt])\[")
#: the same for the element-wise kernel of device arrays (``ew``: f16 source /
#: destination, the add and refine operations)
EW_DEFINES = ("SRC16", "DST16", "OP_ADD", "OP_REFINE")
#: the same for the delta kernel: OUT16 (an f16 out read where it lies)
DELTA_DEFINES = ("OUT16",)
#: the tiled kernels' output buffer ``outb`` as vec4<f16> (the f16 dQ written in the
#: dQ pass's epilogue, one launch instead of dQ + a cast; D a multiple of 4, one
#: piece: a split launch keeps its partial sums in f32)
OUTB_DEFINES = ("OUTB16",)
#: the 5-product backward (variants ``*-dsq``): DSQ_OUT, the dK/dV pass also stores dS
#: [B, HQ, SQ, SK] (f32) into ``dsb``; DSQ_IN, the dQ pass reads dS from ``dsb`` instead
#: of recomputing S and dP (dQ = dS.K as a plain product); DSQ_PF (with DSQ_IN, the
#: prefetching bases): the next key tile's dS rows loaded into registers before the
#: current tile's update
DSQ_DEFINES = ("DSQ_OUT", "DSQ_IN", "DSQ_PF")
#: v's head dim differs from q's / k's (the uniform U.DV; see the module doc)
VDIM_DEFINES = ("VDIM",)
#: the forward over a paged key/value cache (anyattn.paged): key rows through the block
#: table in ``aux``, per-sequence key counts and bands (common.wgsl); the uniforms
#: ``U.pg_off`` / ``U.pg_p`` are named only here (uniforms.DEFINE_FIELDS); PGSTART (with
#: PAGED): sequences whose keys start past position 0 (``Pages(starts=)``)
PAGED_DEFINES = ("PAGED", "PGSTART")
#: a generated score function (SCOREMOD: smod_v / smod_vd after softcap) or mask
#: function (MASKFN: mfn_all in keep_ij); either defines PROGS (the captures' binding
#: 10 and the generated text at ``//@progfns``), SOFTCAP or SCOREMOD defines DSCHAIN
#: (dS times the chain factor, the plain dS kept for dbias)
PROG_DEFINES = ("SCOREMOD", "MASKFN")
#: the dK/dV pass with capture gradients (with SCOREMOD): pds stores the terms of the
#: DCNG capture reads into the workgroup tile ``sdc``, the kernel sums the tile's
#: diagonals into its slot of ``dcs`` (binding 11, layout ``tile_dcap``); the generated
#: text then also holds ``dcap_d`` / ``dcap_put`` (programs.dcap_source).  Without it
#: the kernels are the plain ones, text for text.  DCRC (with DCAP): some reads are
#: summed along the tile's query rows or key columns (TileConfig.dcap_consts); without
#: it the DCAP kernels are the diagonal-only ones, text for text.  DCPR (with DCAP and
#: DCRC): pair reads, whose terms ``dcap_put`` stores itself into ``dcs`` (column slice
#: 0 only); DCPO: pair reads only (no tile ``sdc``, no sums).  Without them the DCAP
#: kernels are as they were, text for text
DCAP_DEFINES = ("DCAP", "DCRC", "DCPR", "DCPO")

SHADER_DIR = Path(__file__).resolve().parent / "shaders"


class KernelError(RuntimeError):
    """A WGSL kernel failed to compile or to run; the message names the kernel."""


def _read(name: str) -> str:
    return (SHADER_DIR / f"{name}.wgsl").read_text()


def _loaders(half: bool, outb16: bool = False, vdim: bool = False) -> str:
    """The loaders (``//@loaders``); ``vdim``: v and dout (and the ``*_vout`` output
    helpers) bounded by U.DV, q and k (and ``*_out``) by U.D."""
    out = []
    for name, buf in (("q", "qb"), ("k", "kb"), ("v", "vb"), ("g", "gb")):
        lim = "U.DV" if vdim and name in ("v", "g") else "U.D"
        if half:    # buf: array<vec4<f16>>; element e is buf[e / 4][e % 4]
            out.append(f"""
fn h1_{name}(e: u32) -> f16 {{ return {buf}[e >> 2u][e & 3u]; }}
fn lds_{name}(base: u32, d: u32) -> vec4<f16> {{
  let e = base + d;
  if (d + 3u < {lim}) {{
    if ((e & 3u) == 0u) {{ return {buf}[e >> 2u]; }}
    return vec4<f16>(h1_{name}(e), h1_{name}(e + 1u), h1_{name}(e + 2u), h1_{name}(e + 3u));
  }}
  var r = vec4<f16>(0.0h);
  if (d < {lim}) {{ r.x = h1_{name}(e); }}
  if (d + 1u < {lim}) {{ r.y = h1_{name}(e + 1u); }}
  if (d + 2u < {lim}) {{ r.z = h1_{name}(e + 2u); }}
  return r;
}}""")
            continue
        out.append(f"""
fn lds_{name}(base: u32, d: u32) -> vec4<f32> {{
  if (d + 3u < {lim}) {{
    return vec4<f32>(f32({buf}[base + d]), f32({buf}[base + d + 1u]), f32({buf}[base + d + 2u]),
                     f32({buf}[base + d + 3u]));
  }}
  var r = vec4<f32>(0.0);
  if (d < {lim}) {{ r.x = f32({buf}[base + d]); }}
  if (d + 1u < {lim}) {{ r.y = f32({buf}[base + d + 1u]); }}
  if (d + 2u < {lim}) {{ r.z = f32({buf}[base + d + 2u]); }}
  return r;
}}""")
    bounds = (("out", "U.D"), ("vout", "U.DV")) if vdim else (("out", "U.D"),)
    for fn, lim in bounds:
        if outb16:     # outb: array<vec4<f16>>, base + d a multiple of 4 (D % 4 == 0)
            out.append(f"""
fn ld4_{fn}(base: u32, d: u32) -> vec4<f32> {{
  if (d < {lim}) {{ return vec4<f32>(outb[(base + d) >> 2u]); }}
  return vec4<f32>(0.0);
}}
fn st4_{fn}(base: u32, d: u32, x: vec4<f32>) {{
  if (d < {lim}) {{ outb[(base + d) >> 2u] = vec4<f16>(x); }}
}}""")
            continue
        out.append(f"""
fn ld4_{fn}(base: u32, d: u32) -> vec4<f32> {{
  var r = vec4<f32>(0.0);
  if (d < {lim}) {{ r.x = outb[base + d]; }}
  if (d + 1u < {lim}) {{ r.y = outb[base + d + 1u]; }}
  if (d + 2u < {lim}) {{ r.z = outb[base + d + 2u]; }}
  if (d + 3u < {lim}) {{ r.w = outb[base + d + 3u]; }}
  return r;
}}
fn st4_{fn}(base: u32, d: u32, x: vec4<f32>) {{
  if (d < {lim}) {{ outb[base + d] = x.x; }}
  if (d + 1u < {lim}) {{ outb[base + d + 1u] = x.y; }}
  if (d + 2u < {lim}) {{ outb[base + d + 2u] = x.z; }}
  if (d + 3u < {lim}) {{ outb[base + d + 3u] = x.w; }}
}}""")
    return "\n".join(out) + "\n"


def _expand_includes(text: str, depth: int = 0) -> str:
    if depth > 8:
        raise KernelError("WGSL include nesting too deep")
    return re.sub(r"^[ \t]*//@include (\w+)[ \t]*$",
                  lambda m: _expand_includes(_read(m.group(1)), depth + 1), text, flags=re.M)


def _conditionals(text: str) -> str:
    defs: Dict[str, str] = {}
    out, skip = [], []
    for line in text.split("\n"):
        st = line.strip()
        if st.startswith("//@#"):      # a source comment the kernel does not carry
            continue
        m = re.match(r"//@(define|undef|ifn|if|endif) (\w+)(?: (\S+))?$", st)
        if m:
            kind, name, val = m.groups()
            if kind == "if":
                skip.append(name not in defs)
            elif kind == "ifn":
                skip.append(name in defs)
            elif kind == "endif":
                skip.pop()
            elif not any(skip):
                if kind == "define":
                    defs[name] = val if val is not None else "1"
                else:
                    defs.pop(name, None)
            continue
        if any(skip):
            continue
        out.append(re.sub(r"\$(\w+)\$", lambda mm: defs[mm.group(1)], line))
    if skip:
        raise KernelError("unbalanced //@if in WGSL source")
    return "\n".join(out)


_FOR = re.compile(r"^[ \t]*//@for (\w+) (\w+)[ \t]*\n(.*?)^[ \t]*//@end \1[ \t]*\n",
                  flags=re.M | re.S)


def _unroll(text: str, consts: Mapping[str, int]) -> str:
    while True:
        m = _FOR.search(text)
        if not m:
            return text
        name, count, body = m.groups()
        n = int(count) if count.isdigit() else int(consts[count])
        rep = "".join(body.replace("{%s}" % name, f"{k}u").replace("{%s#}" % name, str(k))
                      for k in range(n))
        text = text[:m.start()] + rep + text[m.end():]


_VAR = re.compile(r"^([ \t]+)var (\w+)(?:: ([^=;]+?))?(?: = ([^;]+))?;[ \t]*(?://.*)?$",
                  flags=re.M)


def _reinit_vars(text: str) -> str:
    """Re-initialise every function-scope ``var`` where it is declared.

    naga hoists a local variable's (zero or constant) initializer to the function
    entry, so a ``var`` declared inside a loop keeps the previous iteration's value.
    WGSL says it is initialised at each declaration; an explicit store restores that.
    (A trailing ``//`` comment on the declaration is dropped.)
    """
    def fix(m):
        ind, name, ty, init = m.groups()
        if init is None:
            return f"{ind}var {name}: {ty}; {name} = {ty.strip()}();"
        decl = f"{ind}var {name}: {ty.strip()}" if ty else f"{ind}var {name}"
        return f"{decl} = {init}; {name} = {init};"
    return _VAR.sub(fix, text)


def build_source(kernel: str, consts: Mapping[str, int], elem: str = "f32",
                 debug: bool = False, progs: str = "") -> str:
    """The complete WGSL of ``shaders/<kernel>.wgsl`` for these constants
    (``consts["HALF"]`` = 1 with elem f16: the f16-math variant); ``progs``: the
    generated functions of SCOREMOD / MASKFN kernels (programs.py)."""
    half = bool(consts.get("HALF", 0))
    if kernel == "forward" and consts.get("RM", 4) != 4:
        raise KernelError(f"webgpu kernel 'forward': RM={consts['RM']} query rows per "
                          "invocation is a backward-only tile (the wide variant's forward "
                          "uses RM = 4)")
    if half and elem != "f16":
        raise KernelError(f"webgpu kernel {kernel!r}: HALF needs f16 elements, got {elem}")
    if consts.get("OUTB16", 0) and elem != "f16":
        raise KernelError(f"webgpu kernel {kernel!r}: OUTB16 (an f16 output) needs f16 "
                          f"elements, got {elem}")
    text = _expand_includes(_read(kernel))
    if half:
        text = "//@define HALF\n" + text
    vdim = bool(consts.get("VDIM", 0))      # v's head dim U.DV differs from U.D
    if vdim:
        text = "//@define VD U.DV\n//@define VOUT vout\n" + text
    else:
        text = "//@define VD U.D\n//@define VOUT out\n" + text
    for name in (MOD_DEFINES + EW_DEFINES + VARIANT_DEFINES + DELTA_DEFINES
                 + OUTB_DEFINES + DSQ_DEFINES + VDIM_DEFINES + PROG_DEFINES
                 + PAGED_DEFINES + DCAP_DEFINES):  # only where used
        if consts.get(name, 0):
            text = f"//@define {name}\n" + text
    has_prog = any(consts.get(n, 0) for n in PROG_DEFINES)
    if has_prog != bool(progs):
        raise KernelError(f"webgpu kernel {kernel!r}: generated functions go with the "
                          f"{PROG_DEFINES} defines, and only with them")
    if has_prog:
        text = "//@define PROGS\n" + text
    if consts.get("SOFTCAP", 0) or consts.get("SCOREMOD", 0):
        text = "//@define DSCHAIN\n" + text
    text = _conditionals(text)
    text = _unroll(text, consts)
    if consts.get("STAGE", 0):
        tiles = _ALIASED_TILE if consts.get("ALIAS", 0) else _STAGED_TILE
        text = tiles.sub(lambda m: f"stg[SOFF_{m.group(1).upper()} + ", text)
    text = _reinit_vars(text)
    text = text.replace("//@loaders", _loaders(half, bool(consts.get("OUTB16", 0)), vdim))
    if has_prog:
        text = text.replace("//@progfns", progs.rstrip("\n"))
    text = re.sub(r"\bTRIP\b", "trips += 1u;" if debug else "", text)
    dbg = ("dsb[((wid.z * nwg.y + wid.y) * nwg.x + wid.x) * NT + lid] = f32(trips);"
           if debug else "")
    text = text.replace("DEBUG_TRIPS1", "").replace("DEBUG_TRIPS", dbg)
    head = ["enable f16;"] if elem == "f16" else []
    head.append(f"alias T = {elem};")
    head.append(f"alias TB = {'vec4<f16>' if half else elem};")   # q/k/v/dout binding element
    head.append(f"alias SV = {'vec4<f16>' if half else 'vec4<f32>'};")  # workgroup tile element
    head += [f"const {k}: u32 = {int(v)}u;" for k, v in sorted(consts.items())]
    named = tuple(n for n in ("VDIM", "PAGED") if consts.get(n, 0))
    return "\n".join(head) + "\n" + wgsl_struct(named) + text


# binding kinds per layout: 'u' uniform, 'r' read-only storage, 'w' read-write storage
LAYOUTS = {
    "tile": "urrrrrrwww",     # U q k v dout bias aux | stats out ds
    "tile_prog": "urrrrrrwwwr",   # the same | captures of score / mask functions
    "tile_dcap": "urrrrrrwwwrw",  # the same | capture gradient slots (DCAP)
    "delta": "urrwr",         # U dout out stats vmean
    "reduce": "urw",          # U ds out
    "vmean": "urw",           # U v out
    "scatter": "urw",         # U src arena
    "ew": "urrw",             # U src src2 dst (device arrays: gather, cast, add, refine)
    "dsinks": "urrw",         # U stats aux dsinks
}


class PipelineCache:
    """Compiled pipelines of one device, keyed by (source, layout)."""

    def __init__(self, device):
        import wgpu

        self._wgpu = wgpu
        self.device = device
        self._pipes: Dict[str, object] = {}      # sha1(layout, source) -> pipeline
        self._by_args: Dict[tuple, object] = {}  # (kernel, layout, consts, elem, debug) -> same
        self.layouts: Dict[str, object] = {}
        most = int(dict(device.limits).get("max-storage-buffers-per-shader-stage", 8))
        for name, kinds in LAYOUTS.items():
            if name == "tile_dcap" and len(kinds) - kinds.count("u") > most:
                continue        # the adapter binds fewer storage buffers: no DCAP kernel
            entries = []
            for i, k in enumerate(kinds):
                ty = {"u": wgpu.BufferBindingType.uniform,
                      "r": wgpu.BufferBindingType.read_only_storage,
                      "w": wgpu.BufferBindingType.storage}[k]
                entries.append({"binding": i, "visibility": wgpu.ShaderStage.COMPUTE,
                                "buffer": {"type": ty}})
            bgl = device.create_bind_group_layout(entries=entries)
            self.layouts[name] = (bgl, device.create_pipeline_layout(bind_group_layouts=[bgl]))

    def __len__(self) -> int:
        return len(self._pipes)

    def get(self, kernel: str, layout: str, consts: Mapping[str, int], elem: str = "f32",
            debug: bool = False, progs=None):
        """``progs``: (key, WGSL) of generated score / mask functions (programs.py),
        the key a digest of the text (a new graph compiles, new captured values do not)."""
        fast = (kernel, layout, tuple(sorted(consts.items())), elem, debug,
                progs[0] if progs else None)
        pipe = self._by_args.get(fast)
        if pipe is not None:       # skip re-assembling the source on every launch
            return pipe
        src = build_source(kernel, consts, elem, debug, progs[1] if progs else "")
        key = hashlib.sha1((layout + "\0" + src).encode()).hexdigest()
        pipe = self._pipes.get(key)
        if pipe is None:
            try:
                mod = self.device.create_shader_module(label=kernel, code=src)
                pipe = self.device.create_compute_pipeline(
                    label=kernel, layout=self.layouts[layout][1],
                    compute={"module": mod, "entry_point": "main"})
            except Exception as e:  # wgpu raises GPUValidationError and friends
                raise KernelError(f"webgpu kernel {kernel!r} ({elem}, {dict(consts)}) failed "
                                  f"to compile: {e}") from e
            self._pipes[key] = pipe
        self._by_args[fast] = pipe
        return pipe
