"""Engine integrations: hylinker inside serving engines.

* :mod:`hylinker.integrations.sglang` — ``HylinkerLinker``, SGLang 0.5.23's external cache
  linker (imports SGLang; load it through SGLang's dynamic linker factory).
* :mod:`hylinker.integrations.sglang_config` — its ``linker_extra_config`` keys (no SGLang import).
* :mod:`hylinker.integrations.sglang_pools` — views over SGLang's device pools and the codec
  that moves page and state objects between them and staging frames.
* :mod:`hylinker.integrations.page_mover` — the plugin's data path: verified, retried loads
  and pipelined offloads of those objects through the store bridge.
* :mod:`hylinker.integrations.store_bridge` — the synchronous bridge from an engine thread to
  hylinker's async stores.
* :mod:`hylinker.integrations.config` — ``PluginConfig``: the shared ``extra_config`` keys
  (``store``, ``master``, ``segment_mb``, ``capacity_mb``, ``salt``, ``faults``, ...) and the
  store they open, with the engine's key named in errors; imports no engine. The vLLM
  connector uses it.
* :mod:`hylinker.integrations.vllm` — ``HylinkerConnector``, vLLM 0.32's KV connector for hybrid
  and plain attention models (imports vLLM; load it with ``--kv-transfer-config``), with
  ``vllm_plan`` (its scheduler-side rules), ``vllm_pages`` (its worker-side page transfers on the
  data plane) and ``store_host`` (one store per process for both of vLLM's roles).
"""
