"""hylinker inside vLLM 0.32: ``HylinkerConnector``, a KV connector for hybrid and plain
attention models (``--kv-transfer-config`` with ``"kv_connector_module_path":
"hylinker.integrations.vllm"``).

* :mod:`.connector`: ``HylinkerConnector`` (imports vLLM), both of vLLM's roles;
* :mod:`.config`: its ``kv_connector_extra_config`` keys (no vLLM import);
* :mod:`.plan`: the scheduler side's rules: block keys, hits, load and save plans;
* :mod:`.request_keys`: the isolation keys (LoRA, multimodal, ``cache_salt``) of a request;
* :mod:`.index`: which block keys the store holds;
* :mod:`.pages` and :mod:`.block_layout`: the worker side's page transfers on the data plane;
* :mod:`.metrics`: its Prometheus families under vLLM's ``vllm:`` prefix.

``HylinkerConnector`` is resolved on first access, so the vLLM-free modules import without vLLM.
"""

from __future__ import annotations

from .. import lazy_export

__all__ = ["HylinkerConnector"]

__getattr__ = lazy_export(__name__, "HylinkerConnector", ".connector")
