"""The next mixes a ``BoundaryAllReduce`` call left unfinished, owned by that
instance: those the mixes kernel computes on the side stream
(``mixes_placement="side_stream"``: an event the calling stream must join before it
reads them or launches the next consumer, whose scratch that kernel reads) and
those whose combine it left to the next GEMM (``mixes_placement="next_gemm"``: the
:class:`~decode_boundary.mixes.handoff.NextMixes` it returned, which the
instance's next call refuses to pass while no GEMM launched with it)."""

from __future__ import annotations

import torch

from ..mixes.handoff import NextMixes


class MixesInFlight:
    """The side stream (created on first use), the event of the mixes the last
    call left on it with whether it was recorded under a graph capture, and
    the hand-off the last call left to the next GEMM."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: torch.cuda.Stream | None = None
        self.pending: tuple[torch.cuda.Event, bool] | None = None
        self.left_to_gemm: NextMixes | None = None

    def side_stream(self):
        """The stream the mixes kernel runs on aside (on a CPU device, where it
        runs inline, a stand-in)."""
        if self.device.type != "cuda":
            return "inline"
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        return self.stream

    def record_aside(self, capturing: bool) -> None:
        """After a call that ran the mixes aside: remember its event."""
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(self.stream)
            self.pending = (event, capturing)

    def join(self, capturing: bool) -> None:
        """Make the current stream wait for the mixes left aside (none: nothing)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        event, captured = pending
        if captured and not capturing:
            return  # that capture has ended; CUDA made it join (or refused it)
        if capturing and not captured:
            self.pending = pending  # still to be joined, outside the capture
            raise RuntimeError(
                "BoundaryAllReduce: an eager call's next mixes are still pending on the side "
                "stream (mixes_placement='side_stream') and a CUDA graph is being captured; call "
                "join_mixes() before the capture begins")
        torch.cuda.current_stream(self.device).wait_event(event)

    def refuse_unfinished(self) -> None:
        """``RuntimeError`` while the last call's combine, left to the next GEMM,
        has not been launched (its pre, post and comb are unwritten); then
        forget it."""
        left = self.left_to_gemm
        if left is not None and left.unfinished:
            # Refused like a bad argument (the step aborts on every rank); the hand-off
            # stays valid (nothing rewrote its shares), so it can still be launched.
            raise RuntimeError(
                "the previous call left its next mixes to the GEMM after it "
                "(mixes_placement='next_gemm'), but no GEMM launched with them, so their pre, "
                "post and comb are unwritten: launch mxfp8_mm(layer, x, finish_mixes=result.mixes) "
                "right after such a call (or call with mixes_placement='consumer')")
        self.left_to_gemm = None

    def forget(self, device_synced: bool) -> None:
        """Drop the hand-off, and the event where ``device_synced`` or it was
        recorded in a capture that never joined it (it raised)."""
        self.left_to_gemm = None
        if device_synced or (self.pending is not None and self.pending[1]):
            self.pending = None
