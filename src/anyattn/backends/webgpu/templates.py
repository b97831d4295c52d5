"""Launch lists of device-array calls cached per signature (less host work per call).

Two device-array calls with one signature (sizes, dtypes, element strides and offsets,
mask / bias / modifier / dropout description, wrt, tile config and variant, which
inputs share a buffer: ``resident._key``) build the same launches but for the buffers
they bind.  ``Template.record`` keeps a built call with every buffer replaced by a
*slot*:

- ``("in", name)``: an input of the call (q, k, v, dout, out, the statistics, bias,
  slopes, sinks): the caller's buffer, given again on every call;
- ``("role", role, nbytes)``: pooled scratch (launch.Runner.buffer, grown when too small);
- ``("res", i)``: the call's i-th result buffer (pool.ResultPool, acquired per call);
- a buffer object: what the template owns (uniform blocks, written once and never
  again; its ``aux`` table of mask data; with dropout, private copies of the DROPOUT
  kernels' uniform blocks, see below).

Dropout: the seed is no field of the key (a training loop draws a fresh one per step).
The uniform blocks the DROPOUT kernels read it from (``Call.seeded``) are copied into
buffers of the template's own at ``record``; ``submit(seed=...)`` writes a new seed's
8 bytes into them (``queue.write_buffer``, ordered after every earlier submission on
the queue, so earlier calls read the seed they were given), never into the runner's
content-keyed uniform blocks, which others share.

``Template.submit`` resolves the slots for this call's buffers, takes their bind groups
from the runner's cache (keyed by buffer ids: a repeat with the same buffers creates
none) and submits.  The first call of a signature is submitted through its fresh
template too, so a cache hit runs exactly the launches of the uncached path.

Bound sets: a template also keeps, for the last ``MAX_BOUND`` distinct sets
of buffers it was called with (inputs, results, pooled roles, in slot order), the
resolved launches (pipelines, bind groups, grids; clears and copies are resolved per call
so that no set holds a buffer).  A call whose
buffers are *the same objects* (checked by identity through weak references, never by
id alone) submits that list as it is: no slot resolution, no bind-group lookups.  A
set whose buffer dies is dropped at once (a weakref callback), and a pooled role grown
into a new buffer, a new input or result buffer is simply another set, so a cached
bind group never serves a buffer it was not made for.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

from .clears import Clear, clear_map

__all__ = ["Template", "TemplateCache", "ResultSpec"]

#: (name, result buffer index, shape, dtype, element offset, element strides): one
#: returned array
ResultSpec = Tuple[str, int, Tuple[int, ...], object, int, Tuple[int, ...]]


class Template:
    """A recorded launch list with slots instead of per-call buffers."""

    def __init__(self, launches, clears, copies, copies_before, result_sizes, results,
                 pieces, seeded=(), seed=None):
        self.launches = launches            # [(pipeline, layout, slots, grid, kernel)]
        self.clears = clears                # [slot or Clear(slot, bytes)]
        self.copies = copies                # [(slot, byte off, slot, byte off, bytes)]
        self.copies_before = copies_before
        self.result_sizes = result_sizes    # [(bytes, label)] per result buffer
        self.results: List[ResultSpec] = results
        self.pieces = pieces
        #: per result slot, weak refs to the buffers it had in the last calls (latest first)
        self._recent: List[List[object]] = [[] for _ in result_sizes]
        #: the template's own uniform blocks holding the dropout seed, and the seed in them
        self.seeded = list(seeded)
        self.seed = seed
        #: a backward with capture gradients (DCAP): (the slot of its ``dcs`` buffer, its
        #: f32 words, capture_grads.SlotLayout, BQ, BK), read back after each submit by
        #: the caller (resident.py); None for every other call
        self.dcap = None
        # the distinct slots of the launches, clears and copies, in a fixed order:
        # ("in", name) / ("res", i) / ("role", role, nbytes) (``_slots``), and the bound
        # sets: id-tuple of the resolved buffers -> (weak refs, resolved submit args)
        self._slots = self._slot_order()
        self._bound: "OrderedDict[tuple, tuple]" = OrderedDict()
        self.stats = {"bound_hits": 0, "bound_misses": 0}

    @classmethod
    def record(cls, run, call, inputs: Dict[str, object], result_bufs: Sequence[object],
               result_labels: Sequence[str], results: List[ResultSpec]) -> "Template":
        """The launches, clears and copies a built ``call`` holds (before its submit),
        every buffer mapped to a slot: inputs first (in ``inputs`` order: buffers shared
        by several inputs take the first name; the cache key records the sharing), then
        result buffers, then the runner's pooled roles; anything else stays itself."""
        slot = {}
        for name, buf in inputs.items():
            if buf is not None:
                slot.setdefault(id(buf), ("in", name))
        for i, buf in enumerate(result_bufs):
            slot.setdefault(id(buf), ("res", i))
        for role, buf in run.role_buffers.items():
            slot.setdefault(id(buf), ("role", role, buf.size))

        seeded = getattr(call, "seeded", {})
        own = {}                   # id(content-keyed uniform block) -> the template's copy
        if seeded:
            from .uniforms import pack

            usage = run.wgpu.BufferUsage.UNIFORM | run.wgpu.BufferUsage.COPY_DST
            for key, vals in seeded.items():
                data = pack(vals)
                buf = run.device.create_buffer(label="anyattn.seeded_uniform",
                                               size=len(data), usage=usage)
                run.device.queue.write_buffer(buf, 0, data)
                own[key] = buf

        def to_slot(buf):
            return own.get(id(buf)) or slot.get(id(buf), buf)

        launches = []
        for l in call.launches:
            if 0 in l.grid:
                continue
            for n, what in zip(l.grid, "xyz"):
                if n > run.max_groups:
                    raise ValueError(f"webgpu kernel {l.kernel!r}: {n} workgroups along {what} "
                                     f"> this adapter's limit {run.max_groups}")
            launches.append((l.pipeline, l.layout, tuple(map(to_slot, l.buffers)), l.grid,
                             l.kernel))
        copies = [(to_slot(s), so, to_slot(d), do, n) for s, so, d, do, n in call.copies]
        before = [(to_slot(s), so, to_slot(d), do, n) for s, so, d, do, n in call.copies_before]
        sizes = [(int(b.size), lab) for b, lab in zip(result_bufs, result_labels)]
        seed = None
        if own:
            vals = next(iter(seeded.values()))
            seed = int(vals["drop_k0"]) | int(vals["drop_k1"]) << 32
        tpl = cls(launches, [clear_map(c, to_slot) for c in call.clears], copies, before, sizes,
                  results, dict(call.pieces), own.values(), seed)
        if getattr(call, "dcap", None) is not None:
            tpl.dcap = (to_slot(call.dcs_buf), call.dcap_floats(), call.dcap[3],
                        call.cfg.BQ, call.cfg.BK)
        tpl._remember(result_bufs)
        call.launches, call.clears, call.copies, call.copies_before = [], [], [], []
        return tpl

    #: buffers remembered per result slot (a caller that keeps a step's results while
    #: the next step runs alternates between two sets)
    RECENT = 3

    def acquire_results(self, run) -> List[object]:
        """This call's result buffers from the pool, each preferring one its slot had in
        the last calls (then a repeat binds known buffers: cached bind groups)."""
        bufs = []
        for (n, lab), recent in zip(self.result_sizes, self._recent):
            bufs.append(run.results.acquire(n, lab, [b for b in (r() for r in recent)
                                                     if b is not None]))
        self._remember(bufs)
        return bufs

    def _remember(self, bufs) -> None:
        for recent, b in zip(self._recent, bufs):
            recent[:] = ([weakref.ref(b)] + [r for r in recent if r() is not b])[:self.RECENT]

    def submit(self, run, inputs: Dict[str, object], result_bufs: Sequence[object],
               seed: Optional[int] = None) -> None:
        """Bind this call's buffers and submit (one command buffer); ``seed``: this
        call's dropout seed, written into the template's seeded uniform blocks when it
        differs from the one they hold."""
        if self.seeded and seed != self.seed:
            if seed is None:
                raise ValueError("webgpu: a dropout launch template needs the call's seed")
            from .uniforms import SEED_OFFSET, seed_bytes

            data = seed_bytes(seed)
            for buf in self.seeded:
                run.device.queue.write_buffer(buf, SEED_OFFSET, data)
            self.seed = seed
        bufs = []                      # this call's buffer per slot (``_slots`` order)
        for s in self._slots:
            if s[0] == "in":
                bufs.append(inputs[s[1]])
            elif s[0] == "res":
                bufs.append(result_bufs[s[1]])
            else:
                bufs.append(run.buffer(s[1], s[2]))
        key = tuple(map(id, bufs))
        hit = self._bound.get(key)
        if hit is not None and all(r() is b for r, b in zip(hit[0], bufs)):
            self._bound.move_to_end(key)
            self.stats["bound_hits"] += 1
            run.cache_stats["bound_hits"] += 1
            encoded = hit[1]
        else:
            self.stats["bound_misses"] += 1
            run.cache_stats["bound_misses"] += 1
            encoded = self._encode(run, dict(zip(self._slots, bufs)))
            bound = self._bound

            def drop(_ref, key=key):   # a buffer of the set died: its id may be reused
                bound.pop(key, None)
            # the set keeps weak refs and the encoded launches (bind groups hold no
            # Python reference to their buffers): no buffer is kept alive by it
            bound[key] = (tuple(weakref.ref(b, drop) for b in bufs), encoded)
            while len(bound) > self.MAX_BOUND:
                bound.popitem(last=False)
        if self.clears or self.copies or self.copies_before:
            at = dict(zip(self._slots, bufs))

            def resolve(s):
                return at[s] if type(s) is tuple else s
            run.submit(encoded, [clear_map(s, resolve) for s in self.clears], 1,
                       [(resolve(s), so, resolve(d), do, n) for s, so, d, do, n in self.copies],
                       [(resolve(s), so, resolve(d), do, n)
                        for s, so, d, do, n in self.copies_before])
        else:
            run.submit(encoded)

    #: bound sets kept per template (a loop alternating result sets uses two or three)
    MAX_BOUND = 4

    def _slot_order(self) -> list:
        """The distinct tuple slots of launches, clears and copies, first use first."""
        seen = {}
        for _, _, slots, _, _ in self.launches:
            for s in slots:
                if type(s) is tuple:
                    seen.setdefault(s, None)
        for c in self.clears:
            s = c.buf if isinstance(c, Clear) else c
            if type(s) is tuple:
                seen.setdefault(s, None)
        for s, _, d, _, _ in list(self.copies) + list(self.copies_before):
            for x in (s, d):
                if type(x) is tuple:
                    seen.setdefault(x, None)
        return list(seen)

    def _encode(self, run, at: Dict[tuple, object]) -> list:
        """[(pipeline, bind group, grid, kernel)] with every slot replaced by its buffer
        in ``at`` (bind groups from the runner's cache)."""
        return [(pipe, run.bind_group(layout, [at[s] if type(s) is tuple else s
                                               for s in slots], kernel), grid, kernel)
                for pipe, layout, slots, grid, kernel in self.launches]


class TemplateCache:
    """LRU of templates by signature key (``MAX`` entries)."""

    MAX = 64

    def __init__(self):
        self._d: "OrderedDict[tuple, Template]" = OrderedDict()
        self.stats = {"hits": 0, "misses": 0}

    def get(self, key) -> Optional[Template]:
        if key is None:
            return None
        t = self._d.get(key)
        if t is None:
            self.stats["misses"] += 1
            return None
        self._d.move_to_end(key)
        self.stats["hits"] += 1
        return t

    def put(self, key, tpl: Template) -> None:
        if key is None:
            return
        self._d[key] = tpl
        while len(self._d) > self.MAX:
            self._d.popitem(last=False)

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)
