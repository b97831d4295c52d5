"""Shared checks of the webgpu tests."""


def assert_backward_trips_within_model(call, head_dim: int) -> None:
    """Run a backward Call's dQ and dK/dV launches (built with ``debug_trips``) and check
    every invocation's counted loop trips against ``TileConfig.trips_per_unit``: at most
    the model (the llvmpipe loop limit is budgeted on it), at least half of it.
    ``head_dim``: the problem's D."""
    for lch in call.launches:
        if lch.kernel in ("bwd_dq", "bwd_dkdv"):
            call.run.run([lch])
            n = call.trip_count if lch.kernel == "bwd_dq" else \
                lch.grid[0] * lch.grid[1] * lch.grid[2] * call.cfg.NT
            got = int(call.run.read(lch.buffers[9], n).max())
            model = call.cfg.trips_per_unit(lch.kernel, head_dim) * \
                (call.nkt if lch.kernel == "bwd_dq" else call.nqt * 2)
            assert 0.5 * model <= got <= model, (lch.kernel, got, model)
