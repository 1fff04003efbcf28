"""The staging index: which objects a pool's draining frames hold, and who is reading them.

Between stage 1 of a two-stage offload (the rows copied into sealed host frames,
``runtime/dataplane/drain_route.py``) and the store's answer, an object's bytes may exist only
in host staging: the device may have evicted its rows already. :class:`FrameIndex` maps each
such object's store key to its sealed frame, from the moment the frames were sealed until the
drain ended the job (stored, refused or dropped), so a lookup sees the object and a load can
copy it from the frame (``runtime/dataplane/frame_restore.py``).

A reader pins the frames it copies from (:meth:`FrameIndex.pin`). A job whose drain ends while
its frames are pinned leaves the index at once, but its bytes stay charged to the host staging
budget (:meth:`HostStaging.hold`) until the last reader unpins: the budget never counts memory
that is still read as free. Frames cut from the plane's region (``frame_region.py``) go back to
it at the same moment: retired with no reader, or at the last unpin. A frame that failed
verification leaves the index (never read again); the drain still ends its job as usual.

Only sealed frames enter the index. Where the store sets the checksum as it copies
(``StoreCalls.checksums``) a staged frame carries none; a read from it checks the header (key,
layout, length: ``framing.verify_own_array``), and the payload is trusted as a copy this process
made and still owns.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from .host_staging import HostStaging


@attrs.define(eq=False)
class DrainingFrames:
    """One job's sealed frames while they drain: ``grid[i, :size]`` is object ``keys[i]``."""

    keys: list[str]
    grid: torch.Tensor  # [n, stride] uint8, sealed
    size: int  # frame bytes of one object (header and payload)
    nbytes: int  # what the budget charged for them
    readers: int = 0  # loads copying from these frames now
    retired: bool = False  # the drain ended the job: no longer in the index
    held: bool = False  # retired while pinned: the budget holds nbytes until the last unpin


#: one pinned object: (its position in the load's job, its frames, its row in them)
Pinned = tuple[int, DrainingFrames, int]


class FrameIndex:
    """Store key → sealed, draining frame of one pool actor. See the module doc."""

    def __init__(self, staging: HostStaging) -> None:
        self.staging = staging
        #: key -> the live frames holding it, oldest first (one entry per sealed job that staged it)
        self._by_key: dict[str, list[tuple[DrainingFrames, int]]] = {}
        self.dropped = 0  # frames that failed verification, out of the index

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, keys: Sequence[str], grid: torch.Tensor, size: int, nbytes: int) -> DrainingFrames:
        """Index a job's frames, sealed. A key already indexed is read from its older frame
        (equal keys mean equal bytes) and from this one once the older frame retires."""
        frames = DrainingFrames(list(keys), grid, size, nbytes)
        for row, key in enumerate(frames.keys):
            self._by_key.setdefault(key, []).append((frames, row))
        return frames

    def _unindex(self, key: str, frames: DrainingFrames) -> bool:
        """Take ``frames``' entry for ``key`` out of the index; False if it had none."""
        holders = self._by_key.get(key)
        if holders is None:
            return False
        kept = [h for h in holders if h[0] is not frames]
        if len(kept) == len(holders):
            return False
        if kept:
            self._by_key[key] = kept
        else:
            del self._by_key[key]
        return True

    def holds(self, key: str) -> bool:
        return key in self._by_key

    def pin(self, keys: Sequence[str]) -> list[Pinned]:
        """Pin the indexed objects among ``keys`` (one pin per object; :meth:`unpin` each)."""
        out: list[Pinned] = []
        for i, key in enumerate(keys):
            holders = self._by_key.get(key)
            if holders:
                frames, row = holders[0]
                frames.readers += 1
                out.append((i, frames, row))
        return out

    def unpin(self, frames: DrainingFrames) -> None:
        frames.readers -= 1
        assert frames.readers >= 0, "a staging frame was unpinned more often than pinned"
        if frames.readers == 0 and frames.held:
            frames.held = False
            self.staging.release(frames.nbytes)
            self._give(frames)

    def _give(self, frames: DrainingFrames) -> None:
        if self.staging.region is not None:
            self.staging.region.give(frames.grid)

    def drop(self, key: str, frames: DrainingFrames) -> None:
        """``frames``' object ``key`` failed verification: that copy leaves the index (another
        live frame of the same key stays readable, and is verified on its own read)."""
        if self._unindex(key, frames):
            self.dropped += 1

    def retire(self, frames: DrainingFrames) -> None:
        """The drain ended ``frames``' job: they leave the index; pinned, their bytes stay
        charged until the last reader unpins."""
        if frames.retired:
            return
        frames.retired = True
        for key in frames.keys:
            self._unindex(key, frames)
        if frames.readers > 0:
            frames.held = True
            self.staging.hold(frames.nbytes)
        else:
            self._give(frames)


__all__ = ["DrainingFrames", "FrameIndex", "Pinned"]
