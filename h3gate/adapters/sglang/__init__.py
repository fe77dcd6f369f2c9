"""SGLang's MiniMax-H3 DiT (sglang 0.5.23, ``make install-sglang``) as a candidate under h3gate's gate.

* :mod:`.runtime` - the pinned version, SGLang's process groups and server arguments, request quality, the record of
  what ran; :mod:`.tvshim` - torchvision for SGLang's import chain where no torchvision wheel works here;
* :mod:`.build` - ``MiniMaxH3DiTModel`` loaded by SGLang's loader from a diffusers-layout folder of the run's weights;
* :mod:`.inputs` - h3gate's model inputs as SGLang's forward kwargs (one request, or several packed with cu_seqlens
  and padding) and its outputs back;
* :mod:`.capture` - the node map: SGLang's values at h3gate's model-graph node names, through forward hooks;
* :mod:`.block` - one ``MiniMaxH3DiTBlock`` on h3gate's block inputs, captured at the 17 block-graph nodes;
* :mod:`.forcing` - teacher forcing: each point overwritten in place by the provider's value (the capture's
  transforms inverted), so one forward yields every node's isolated value;
* :mod:`.candidate` - ``SglangCandidate``: chained, repeat, isolated and batch-placed node values for the gate engines.
* :mod:`.strict_bind` - ``bind_strict(model, mode, device, merge)``: h3gate's strict operators bound into SGLang's
  own modules at operator level (:mod:`.strict_layers` linears and norms, :mod:`.strict_forwards` blocks, attention,
  embeddings; :mod:`.strict_ops` the traced calls, per-forward metadata, TP merge group; :mod:`.strict_checks`
  what is refused or reported).

Nothing here imports sglang at module level: ``import h3gate.adapters.sglang`` works without it, and every entry
point that needs it raises one-line ``InputError`` naming ``make install-sglang``.
"""
