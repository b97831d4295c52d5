"""Shared checks of the webgpu tests."""


def run_probe(dev, pipe, entries, out_buffer):
    """Bind `entries` (group 0) to the compute pipeline `pipe`, dispatch one workgroup,
    wait, and return the bytes of `out_buffer` (a probe kernel's whole run)."""
    bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=entries)
    enc = dev.create_command_encoder()
    cp = enc.begin_compute_pass()
    cp.set_pipeline(pipe)
    cp.set_bind_group(0, bg)
    cp.dispatch_workgroups(1)
    cp.end()
    dev.queue.submit([enc.finish()])
    return dev.queue.read_buffer(out_buffer)


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
