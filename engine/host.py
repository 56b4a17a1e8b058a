"""Copies between the host and the device that do not wait for the device's queue to drain.

On CUDA a plain host-to-device copy (`torch.tensor(data, device=...)`, `.to(device)`) synchronises the stream
after it, so every kernel queued before it must finish first; a step built while the previous one runs
(Scheduler's `overlap`) would wait for that step at each such copy. The step's small host tensors (row ids,
slots, masks' lengths) go through `to_device` instead: staged in pinned memory, copied asynchronously, in
stream order. Back the other way, `ToHost` starts the copy of a step's sampled tokens at once and waits, when
read, for that copy alone, not for the work queued after it. On CPU both are plain tensors.
"""

import torch


def to_device(data, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`data` (a list, or a host tensor) as a tensor on `device`, without waiting for the device's queue."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    if isinstance(data, torch.Tensor):
        host = data.to(dtype).pin_memory() if cuda else data.to(dtype)
    else:
        host = torch.tensor(data, dtype=dtype, pin_memory=cuda)
    return host.to(device, non_blocking=True)  # (pinned memory is kept until the copy is done: torch's host cache)


class ToHost:
    """A device tensor's values on their way to the host: the copy is queued now, `values` waits for it alone."""

    def __init__(self, x: torch.Tensor):
        self.event = None
        if x.device.type == "cuda":
            self.host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self.host.copy_(x, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(x.device))
        else:
            self.host = x

    def values(self) -> list:
        """The values (a list), once the copy has landed: the device's one read of a step."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
