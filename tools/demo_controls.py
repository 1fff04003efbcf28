"""The demo's negative controls: a restore with a corrupted state must move the output by more
than a stated margin, or the demo's proof of exactness proves nothing.

On CPU in fp32 a recompute on the same chunk schedule is deterministic, so the noise between a
restore and its recompute is exactly 0; a control is *detected* only when its corrupted restore
moves the restored turn's logprobs by at least :data:`MARGIN` (both figures). A control below
the margin says the tiny model ignores (that part of) its state: the run fails, it is not
counted as detected.

Each control replaces part of the state read from the pools at COMMIT with the same part of
the state of *another prefix* of the same length (what restoring the wrong slot or object
would give): a state the model cannot tell from a real one by its scale, unlike zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from .harness.reference.boundary_pools import kl_divergence, max_abs_diff
from .harness.reference.engine import (
    BoundaryState,
    CacheGeometry,
    ReferenceEngine,
)


@attrs.frozen
class ControlMargin:
    """What a detected control moves, at least, over the restored turn's computed tokens."""

    max_abs_logprob_diff: float
    kl: float

    def met(self, max_abs: float, kl: float) -> bool:
        return max_abs >= self.max_abs_logprob_diff and kl >= self.kl


#: the margin every control must pass (fp32 CPU noise is 0; float rounding of KL is ~1e-8)
MARGIN = ControlMargin(max_abs_logprob_diff=1e-3, kl=1e-6)


@attrs.frozen
class StateControl:
    """One corruption of the restored state: which parts come from another prefix."""

    name: str
    description: str
    conv: bool  # the conv states (every linear layer)
    temporal: bool  # the recurrent ("temporal") states

    def applies(self, geometry: CacheGeometry) -> bool:
        """Whether the model has the parts this control corrupts (and others it keeps, for a
        control of one part only)."""
        has_temporal = any(s.temporal_shape is not None for s in geometry.linear)
        return bool(geometry.linear) and (has_temporal or not self.temporal or self.conv)

    def corrupt(self, engine: ReferenceEngine, other: Sequence[int]
                ) -> Callable[[BoundaryState], BoundaryState]:
        """A function replacing this control's parts of a state of length ``L`` with those of
        ``other[:L]`` (prefilled on the same chunk grid)."""

        def apply(state: BoundaryState) -> BoundaryState:
            if len(other) < state.length:
                raise ValueError(f"the other prefix has {len(other)} tokens, the state {state.length}")
            seq = engine.new_sequence()
            engine.extend(seq, list(other[: state.length]))
            foreign = engine.export(seq)
            return attrs.evolve(state, conv=foreign.conv if self.conv else state.conv,
                                temporal=foreign.temporal if self.temporal else state.temporal)

        return apply


#: the controls the demo runs: the whole state, and the recurrent state alone (so a restore
#: that got the conv state right and the recurrent state wrong is caught too)
CONTROLS = (
    StateControl("state", "the whole state (conv and recurrent) from another prefix", conv=True, temporal=True),
    StateControl("recurrent state", "the recurrent states alone from another prefix (conv states kept)",
                 conv=False, temporal=True),
)


@attrs.frozen
class ControlResult:
    name: str
    description: str
    restored_tokens: int
    kl: float | None  # None: nothing was restored, the control could not run
    max_abs_logprob_diff: float | None
    detected: bool

    def line(self) -> str:
        if self.kl is None or self.max_abs_logprob_diff is None:
            return f"negative control ({self.description}): nothing was restored, so it could not run"
        verdict = "detected" if self.detected else (
            f"BELOW THE MARGIN (max|Δ| >= {MARGIN.max_abs_logprob_diff:g} and KL >= {MARGIN.kl:g}): "
            "the model barely reads this state, so the restores above prove nothing about it")
        return (f"negative control ({self.description}, {self.restored_tokens} tokens restored): "
                f"KL = {self.kl:.3e}, max|Δ logprob| = {self.max_abs_logprob_diff:.3e} -> {verdict}")

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def measure(control: StateControl, restored_tokens: int, want: torch.Tensor | None,
            got: torch.Tensor | None) -> ControlResult:
    """Compare a control's logprobs ``got`` with the real ones ``want`` (same positions)."""
    if not restored_tokens or want is None or got is None:
        return ControlResult(control.name, control.description, restored_tokens, None, None, False)
    kl = kl_divergence(want, got)
    diff = max_abs_diff(want, got)
    return ControlResult(control.name, control.description, restored_tokens, kl, diff,
                         MARGIN.met(diff, kl))


def other_prefix(n: int, vocab: int, seed: int) -> list[int]:
    """``n`` tokens of a prefix the conversation never uses (a different seed)."""
    gen = torch.Generator().manual_seed(20_000 + seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()
