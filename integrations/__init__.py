"""Engine integrations: hylinker inside serving engines, one package per engine.

* :mod:`hylinker.integrations.sglang`: ``HylinkerLinker``, SGLang 0.5.23's external cache linker;
* :mod:`hylinker.integrations.vllm`: ``HylinkerConnector``, vLLM 0.32's KV connector;
* :mod:`hylinker.integrations.config`: ``PluginConfig``, the ``extra_config`` keys both engines
  share and the store they open (imports no engine);
* :mod:`hylinker.integrations.store_host`: one store per engine process.
"""
