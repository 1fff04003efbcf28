"""hylinker inside SGLang 0.5.23: ``HylinkerLinker``, an external cache linker for SGLang's
dynamic linker factory (``"linker_module_path": "hylinker.integrations.sglang"``).

* :mod:`.linker`: ``HylinkerLinker`` (imports SGLang), its data path the project's one
  (:class:`~hylinker.runtime.dataplane.sync_plane.SyncDataPlane` over a ``ResilientStore``);
* :mod:`.config`: its ``linker_extra_config`` keys (no SGLang import);
* :mod:`.pools`: SGLang's device pools as the data plane's pool views;
* :mod:`.loads`: a load batch's device events;
* :mod:`.load_ends`: how a load ends (restored keys remembered, bad objects condemned and removed);
* :mod:`.transfers`: SGLang's transfers as object keys and rows of this rank's pools;
* :mod:`.store_probe`: a lookup's store calls within its time budget, and the touch of a hit;
* :mod:`.metrics`: its Prometheus families under SGLang's ``sglang:`` prefix.

``HylinkerLinker`` is resolved on first access, so the SGLang-free modules import without SGLang.
"""

from __future__ import annotations

from .. import lazy_export

__all__ = ["HylinkerLinker"]

__getattr__ = lazy_export(__name__, "HylinkerLinker", ".linker")
