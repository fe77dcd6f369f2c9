"""SGLang's MiniMax-H3 DiT (sglang 0.5.23, ``make install-sglang``) as a candidate under h3gate's gate.

* :mod:`.runtime` - the pinned version, SGLang's process groups and server arguments, request quality, the record of
  what ran; :mod:`.tvshim` - torchvision for SGLang's import chain where no torchvision wheel works here;
* :mod:`.build` - ``MiniMaxH3DiTModel`` loaded by SGLang's loader from a diffusers-layout folder of the run's weights;
* :mod:`.inputs` - h3gate's model inputs as SGLang's forward kwargs (one request, or several packed with cu_seqlens
  and padding) and its outputs back;
* :mod:`.capture` - the node map: SGLang's values at h3gate's model-graph node names, through forward hooks;
* :mod:`.strict_bind` - ``bind_strict(model, mode, device, merge)``: h3gate's strict operators bound into SGLang's
  own modules at operator level (:mod:`.strict_layers` linears and norms, :mod:`.strict_forwards` blocks, attention,
  embeddings; :mod:`.strict_ops` the traced calls, per-forward metadata, TP merge group; :mod:`.strict_checks`
  what is refused or reported).

Nothing here imports sglang at module level: ``import h3gate.adapters.sglang`` works without it, and every entry
point that needs it raises one-line ``InputError`` naming ``make install-sglang``.
"""
