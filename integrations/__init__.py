"""Engine integrations: hylinker inside serving engines.

* :mod:`hylinker.integrations.sglang` — ``HylinkerLinker``, SGLang 0.5.23's external cache
  linker (imports SGLang; load it through SGLang's dynamic linker factory).
  Its data path is the project's one: ``runtime.sync_data_plane.SyncDataPlane`` (verify-all-
  then-land loads) over a ``stores.resilient.ResilientStore``.
* :mod:`hylinker.integrations.sglang_config` — its ``linker_extra_config`` keys: ``PluginConfig``
  plus the SGLang-only ones (no SGLang import).
* :mod:`hylinker.integrations.sglang_pools` — SGLang's device pools as the data plane's pool
  views (``components.pool_view``), and what is not supported yet.
* :mod:`hylinker.integrations.config` — ``PluginConfig``: the shared ``extra_config`` keys
  (``store``, ``master``, ``segment_mb``, ``capacity_mb``, ``salt``, ``faults``, ...) and the
  store they open, with the engine's key named in errors; imports no engine. The vLLM
  connector uses it.
* :mod:`hylinker.integrations.vllm` — ``HylinkerConnector``, vLLM 0.32's KV connector for hybrid
  and plain attention models (imports vLLM; load it with ``--kv-transfer-config``), with
  ``vllm_plan`` (its scheduler-side rules), ``vllm_pages`` (its worker-side page transfers on the
  data plane) and ``store_host`` (one store per process for both of vLLM's roles).
"""
