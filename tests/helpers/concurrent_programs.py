"""Run the programs of a Triton-interpreter launch concurrently, for the tests.

The interpreter runs a grid's programs one after another, so programs that
wait for each other (the consumer's cooperative RMSNorm hand-off) cannot meet
there, and ``consume`` refuses such tactics in the interpreter. Inside
:func:`concurrent_programs` every launch instead starts one thread per program
and joins them all: each program runs the same interpreted code as before on
the same (CPU) memory, with its own ``tl.program_id`` (the interpreter keeps
the program index in one builder attribute, made thread-local here), and a
program that polls memory another program writes sees that write once it is
made, as co-resident programs on a GPU do. The GIL interleaves the threads;
it does not make any multi-step exchange atomic, so the hand-off logic is
exercised for real. A volatile load (a poll) yields the GIL first, so a
spinning program lets the others run instead of holding it for its whole
switch interval.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import threading
import time

import triton.runtime.interpreter as interpreter


def _threaded_call(self, *args_dev, **kwargs):
    """``GridExecutor.__call__`` (Triton 3.6) with the grid loop replaced by one
    thread per program."""
    argspec = inspect.getfullargspec(self.fn)
    kwargs = {k: v for k, v in kwargs.items() if k in argspec.args}
    args_hst, kwargs_hst = self._init_args_hst(args_dev, kwargs)
    for hook in self.pre_run_hooks:
        hook(*args_hst, **kwargs_hst)
    patch_scope = interpreter._patch_lang(self.fn)
    builder = interpreter.interpreter_builder
    try:
        args = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
        args = {name: arg if name in self.constexprs else interpreter._implicit_cvt(arg)
                for name, arg in args.items()}
        grid = self.grid(args) if callable(self.grid) else self.grid
        grid = tuple(grid) + (1,) * (3 - len(grid))
        builder.set_grid_dim(*grid)
        errors = []

        def program(idx):
            try:
                builder.set_grid_idx(*idx)
                self.fn(**args)
            except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller
                errors.append(e)

        threads = [threading.Thread(target=program, args=(idx,), daemon=True)
                   for idx in itertools.product(*(range(n) for n in grid))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise interpreter.InterpreterError(repr(errors[0])) from errors[0]
    finally:
        patch_scope.restore()
    self._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)


@contextlib.contextmanager
def concurrent_programs():
    """Within the block, every interpreter launch runs its programs concurrently."""
    builder_cls = type(interpreter.interpreter_builder)
    local = threading.local()

    def get(self):
        return local.idx

    def put(self, value):
        local.idx = value

    masked_load = builder_cls.create_masked_load

    def polite_load(self, ptrs, mask, other, cache_modifier, eviction_policy, is_volatile):
        if is_volatile:
            time.sleep(0)  # a poll: let the other programs run
        return masked_load(self, ptrs, mask, other, cache_modifier, eviction_policy, is_volatile)

    # A device function's first call rewrites it, which adds the interpreter's names to
    # its module's globals, while another program's call may be iterating over those
    # globals (``_patch_lang``): "dictionary changed size during iteration", now and
    # then. Both under one lock (they touch no memory a program waits for).
    lock = threading.RLock()
    patch_lang, rewrite = interpreter._patch_lang, interpreter.InterpretedFunction.rewrite

    def locked_patch_lang(fn):
        with lock:
            return patch_lang(fn)

    def locked_rewrite(self):
        with lock:
            return rewrite(self)

    original = interpreter.GridExecutor.__call__
    builder_cls.grid_idx = property(get, put)  # a data descriptor: beats the instance dict
    builder_cls.create_masked_load = polite_load
    interpreter.GridExecutor.__call__ = _threaded_call
    interpreter._patch_lang = locked_patch_lang
    interpreter.InterpretedFunction.rewrite = locked_rewrite
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = original
        interpreter._patch_lang = patch_lang
        interpreter.InterpretedFunction.rewrite = rewrite
        builder_cls.create_masked_load = masked_load
        del builder_cls.grid_idx
