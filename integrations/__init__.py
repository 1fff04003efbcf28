"""Engine integrations: hylinker as a cache linker inside serving engines.

* :mod:`hylinker.integrations.sglang` — ``HylinkerLinker``, SGLang 0.5.23's external cache
  linker (imports SGLang; load it through SGLang's dynamic linker factory).
* :mod:`hylinker.integrations.sglang_config` — its ``linker_extra_config`` keys (no SGLang import).
* :mod:`hylinker.integrations.sglang_pools` — views over SGLang's device pools and the codec
  that moves page and state objects between them and staging frames.
* :mod:`hylinker.integrations.page_mover` — the plugin's data path: verified, retried loads
  and pipelined offloads of those objects through the store bridge.
* :mod:`hylinker.integrations.store_bridge` — the synchronous bridge from an engine thread to
  hylinker's async stores.
"""
