"""RFC section 6 ablations: named perturbations of the strict arm (``probes``, ``checks``), the arms and their
named-tensor streams (``arms``), and the engine that localises first drift and judges each row (``engine``)."""
