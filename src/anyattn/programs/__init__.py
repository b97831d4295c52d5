"""Programmable attention: user-written score and mask functions, traced into an
expression graph (``trace``, ``graph``, ``ops``), differentiated symbolically
(``derive``), checked (``bounds``: capture indices in range), bound to a call's captures
and sizes and evaluated densely or per tile (``bound``, ``evaluate``); ``compose`` turns
mask terms into one function (``|``), ``bands`` lowers band-shaped conjuncts to the band
term; ``mods`` holds the public ``ScoreMod`` and ``MaskMod``.  See docs/programmable.md."""
