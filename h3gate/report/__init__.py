"""``h3gate report``: evidence as a page a person can read.

``loader`` finds and classifies evidence files (their provenance and seal status), ``extract`` turns each kind into
plain series (no plotting), ``plan`` decides which figures each document gets (ids, titles, what is missing),
``figures`` draws them with matplotlib (an optional extra, imported lazily, Agg canvas only), ``page`` assembles one
self-contained HTML page, and ``build`` writes it with the PNGs atomically. This room reads evidence only: it never
imports an engine.
"""
