"""An optimizer's choice of capture implementation and side stream.

``capture`` picks how the statistics and the factor update are computed (``"auto"``:
the CUDA kernels where they can run, else the torch ops; ``"kernels"``: the kernels
or an error; ``"torch"``: always the torch ops).  ``capture_stream`` puts the
statistics on a side CUDA stream beside the backward pass (``True``), on the
current stream (``False``), or on whichever made this model's capture steps faster
(``"auto"``: ``capture/stream_choice.py`` times a few capture steps each way).  ``None``
leaves the process default: what
``capture.kernels.set_impl`` / ``capture.streams.set_enabled`` set, else the
environment variables ``LIGHTNING_CAFIN_CAPTURE`` / ``LIGHTNING_CAFIN_CAPTURE_STREAM``,
else ``"auto"`` for both.

The hooks read these settings where the statistics are computed (in the forward and
backward pass, outside the optimizer), so an explicit value is applied to the process
setting when this optimizer's capture begins (its first hooked forward of a capture
step, or its factor update) and stays until something else sets it: two optimizers
capturing in the same forward/backward with different explicit values share the one
applied last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from .capture import kernels as capture_kernels
from .capture import streams as capture_streams


#: the optimizer's ``capture_stream`` argument
StreamOption = Optional[Union[bool, Literal["auto"]]]


@dataclass(frozen=True)
class CaptureOptions:
    impl: Optional[str] = None
    stream: StreamOption = None

    @classmethod
    def checked(cls, capture: Optional[str], capture_stream: StreamOption) -> "CaptureOptions":
        """Validate the optimizer's arguments (errors name the argument and its values)."""
        impl = None if capture is None else capture_kernels.check_impl(capture, "capture")
        if capture_stream is not None and not isinstance(capture_stream, bool) and capture_stream != "auto":
            raise TypeError(f"capture_stream must be True, False, 'auto' or None (the default), got {capture_stream!r}")
        return cls(impl, capture_stream)

    @property
    def chooses_stream(self) -> bool:
        """Whether the stream is chosen by timing capture steps: ``"auto"``, given or (``None``)
        the process setting."""
        return self.stream == "auto" or (self.stream is None and capture_streams.setting() == "auto")

    def apply(self, chosen_side: bool = False) -> None:
        """Make the explicit choices the process settings (``None`` ones are left alone);
        ``chosen_side``: the stream of ``"auto"`` for this capture step."""
        if self.impl is not None and capture_kernels.get_impl() != self.impl:
            capture_kernels.set_impl(self.impl)
        if self.stream is not None and capture_streams.setting() != self.stream:
            capture_streams.set_enabled(self.stream)
        if self.chooses_stream:
            capture_streams.use(chosen_side)
